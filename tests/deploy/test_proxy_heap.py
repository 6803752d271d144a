"""deploy/proxy_heap.py: the middleware holds the proxy's trim off for as long as a
request (a streamed one included) is served, and lets it trim once idle; lifespan is not
work; the controller options name a callback that Serve's own loader and validators
accept, and that builds the middleware with the idle time they carry."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from ray.serve._private.http_util import validate_http_proxy_callback_return
from ray.serve._private.utils import call_function_from_import_path
from ray.serve.config import ControllerOptions

from dsv41.deploy.heap import IdleHeapTrim
from dsv41.deploy.heap import PYTHON_ALLOCATOR_ENV
from dsv41.deploy.proxy_heap import PROXY_CALLBACK_ENV, PROXY_IDLE_ENV, HeapTrimMiddleware, controller_options, proxy_middlewares

# Small, so a test waits for an idle spell in well under a second.
IDLE_S = 0.2
CHUNKS = 4


async def _noop_receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


def test_middleware_holds_the_trim_until_a_streamed_response_ends() -> None:
    """While a streamed response is sent (for longer than idle_s) the request is in
    flight and nothing is trimmed; once the app returns, the trim comes after idle_s; a
    lifespan call running meanwhile is not in flight."""
    trimmer = IdleHeapTrim(IDLE_S, name="test-proxy-trim")
    seen_in_flight: list[int] = []
    sent: list[dict[str, Any]] = []

    async def streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            seen_in_flight.append(trimmer.in_flight)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for index in range(CHUNKS):
            await asyncio.sleep(IDLE_S / 2)
            seen_in_flight.append(trimmer.in_flight)
            await send({"type": "http.response.body", "body": b"x", "more_body": index < CHUNKS - 1})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    middleware = HeapTrimMiddleware(streaming_app, trimmer=trimmer)
    try:
        asyncio.run(middleware({"type": "lifespan"}, _noop_receive, send))
        asyncio.run(middleware({"type": "http", "path": "/v1/completions"}, _noop_receive, send))
        ended = time.monotonic()
        assert seen_in_flight == [0] + [1] * CHUNKS and trimmer.trims == 0
        assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * CHUNKS
        deadline = ended + 5.0
        while trimmer.trims == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert trimmer.trims == 1 and time.monotonic() - ended >= IDLE_S
        assert trimmer.in_flight == 0
    finally:
        trimmer.close()


def test_controller_options_name_the_callback_serve_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve's controller options validator accepts the options; with their environment,
    Serve's own callback loader calls the named function, whose one middleware (valid for
    Serve) trims after the idle seconds the options carry."""
    options = controller_options(2.5, "malloc")
    ControllerOptions.model_validate(options)
    env = options["runtime_env"]["env_vars"]
    assert env[PYTHON_ALLOCATOR_ENV] == "malloc"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    middlewares = validate_http_proxy_callback_return(call_function_from_import_path(env[PROXY_CALLBACK_ENV]))
    assert [m.cls for m in middlewares] == [HeapTrimMiddleware]
    trimmer = middlewares[0].kwargs["trimmer"]
    try:
        assert isinstance(trimmer, IdleHeapTrim) and trimmer.idle_s == 2.5
    finally:
        trimmer.close()


def test_no_idle_time_no_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    """heap_trim_idle_s null sets only the Python allocator in the controller's
    environment; a proxy without the idle variable adds no middleware."""
    assert controller_options(None, "pymalloc") == {"runtime_env": {"env_vars": {PYTHON_ALLOCATOR_ENV: "pymalloc"}}}
    monkeypatch.delenv(PROXY_IDLE_ENV, raising=False)
    assert proxy_middlewares() == []


@pytest.mark.parametrize("text, named", [("soon", PROXY_IDLE_ENV), ("0", "idle_s"), ("-3", "idle_s"), ("nan", "idle_s")])
def test_a_bad_idle_time_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, text: str, named: str) -> None:
    """An idle time in the proxy's environment that is not a positive number fails the
    proxy's start with an error naming it."""
    monkeypatch.setenv(PROXY_IDLE_ENV, text)
    with pytest.raises(ValueError, match=named):
        proxy_middlewares()
