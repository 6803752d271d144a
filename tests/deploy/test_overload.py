"""Overload over HTTP: a live local Serve app whose LLM server holds one request and
queues one (``max_ongoing_requests`` 1, ``max_queued_requests`` 1), the only
application on the package's shared 2-CPU Ray cluster. Every wait has a deadline, so a
Serve app that cannot start or a request that never ends fails here, not by hanging."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path
from typing import Any, Callable

import openai
import pytest
import ray
from ray import serve

from dsv41.deploy.app import AppStartFailed, AppStartTimeout, run_app
from dsv41.deploy.app_args import AppArgs
from dsv41.deploy.llm_server import LLMServer

REQUEST_TIMEOUT_S = 60
LLM_SERVER_CPUS = 1
# Long enough that the holder is still generating while the bursts arrive (a burst is
# a few HTTP round trips; this is dozens of engine steps).
HOLDER_TOKENS = 64
BURST_TOKENS = 4
# Far above what Serve takes to give up on a replica whose constructor raises.
APP_FAIL_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def base_url(tiny_dir: Path, serve_app: Callable[..., str]) -> str:
    args = {
        "model": str(tiny_dir),
        "served_model_name": "tiny",
        "engine": {"block_size": 32, "max_model_len": 256, "cache_memory_bytes": 64 << 20},
        "max_ongoing_requests": 1,
        "max_queued_requests": 1,
        "ray_actor_options": {"num_cpus": LLM_SERVER_CPUS},
    }
    return serve_app(args, name="overload")


def _request(url: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def _post(url: str, body: dict[str, Any]) -> tuple[int, Message, str]:
    """Status, headers (looked up case-blind) and the whole body text (an SSE stream
    read to its end)."""
    try:
        with urllib.request.urlopen(_request(url, body), timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


def _events(sse_text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in sse_text.splitlines() if line.startswith("data: {")]


def _completion(prompt: list[int], max_tokens: int, *, stream: bool) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body


def _answer(status: int, body: str, *, stream: bool) -> tuple[str, int]:
    """(text, completion tokens) of a 200 answer, streamed or not."""
    assert status == 200, body
    if not stream:
        payload = json.loads(body)
        return payload["choices"][0]["text"], payload["usage"]["completion_tokens"]
    events = _events(body)
    assert body.endswith("data: [DONE]\n\n")
    return "".join(e["choices"][0]["text"] for e in events if e["choices"]), events[-1]["usage"]["completion_tokens"]


def _assert_overloaded(status: int, headers: Message, body: str) -> None:
    assert status == 429, body
    assert int(headers["Retry-After"]) >= 1
    error = json.loads(body)["error"]
    assert error["code"] == "overloaded" and error["type"] == "server_error" and error["message"]


def test_the_app_reserves_only_its_engines_cpus(base_url: str) -> None:
    """The app holds exactly its LLM server's CPUs (the ingress reserves none), so on
    this 2-CPU cluster a second application with one engine would still be placed:
    with Serve's default of a CPU for the ingress, the second app waited forever."""
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0.0) != ray.cluster_resources()["CPU"] - LLM_SERVER_CPUS:
        assert time.monotonic() < deadline, f"CPUs free: {ray.available_resources().get('CPU', 0.0)}"
        time.sleep(0.2)


def test_a_full_queue_answers_429_and_admitted_requests_complete(base_url: str, metric: Callable[[str, str], float]) -> None:
    """While a streamed request holds the one slot, a burst of three plain requests
    fills the queue of one and the other two get 429 with ``Retry-After`` and an OpenAI
    error body; a second burst (streamed, raw and through the official client, which
    raises RateLimitError) is refused whole. Nothing is lost: the holder and the queued
    request complete with every token (the queued one with the text of the same
    request run alone), nothing is aborted and the engine ends holding no request and
    no PAGE."""
    url = f"{base_url}/v1/completions"
    aborted = metric(base_url, "dsv41:requests_aborted_total")
    holder = urllib.request.urlopen(_request(url, _completion([7, 8, 9], HOLDER_TOKENS, stream=True)), timeout=REQUEST_TIMEOUT_S)
    with holder, concurrent.futures.ThreadPoolExecutor(3) as pool:
        # The first event means the holder is running on the replica: its slot is taken.
        first_event = holder.readline().decode()
        assert first_event.startswith("data: {"), first_event
        plain = [[20 + i, 21, 22] for i in range(3)]
        burst = [pool.submit(_post, url, _completion(p, BURST_TOKENS, stream=False)) for p in plain]
        # Two answers come at once, refusals; the third request waits in the queue
        # until the holder is done.
        answered = concurrent.futures.as_completed(burst, timeout=REQUEST_TIMEOUT_S)
        for status, headers, body in (next(answered).result() for _ in range(2)):
            _assert_overloaded(status, headers, body)
        (queued,) = [(prompt, future) for prompt, future in zip(plain, burst) if not future.done()]
        for i in range(2):
            _assert_overloaded(*_post(url, _completion([30 + i, 31], BURST_TOKENS, stream=True)))
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        with pytest.raises(openai.RateLimitError) as limited:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True)
        assert int(limited.value.response.headers["retry-after"]) >= 1 and limited.value.body["code"] == "overloaded"
        _, held_tokens = _answer(200, first_event + holder.read().decode(), stream=True)
        assert held_tokens == HOLDER_TOKENS
        prompt, future = queued
        status, _, body = future.result(timeout=REQUEST_TIMEOUT_S)
    queued_answer = _answer(status, body, stream=False)
    assert queued_answer[1] == BURST_TOKENS
    alone_status, _, alone_body = _post(url, _completion(prompt, BURST_TOKENS, stream=False))
    assert queued_answer == _answer(alone_status, alone_body, stream=False)
    assert metric(base_url, "dsv41:requests_aborted_total") == aborted
    assert metric(base_url, "dsv41:num_requests_running") == 0
    assert metric(base_url, "dsv41:cache_pages_used") == 0


def test_an_app_the_cluster_cannot_place_fails_fast(base_url: str, tiny_dir: Path) -> None:
    """An LLM server asking for two CPUs while one is free cannot be placed:
    ``serve.run`` would wait forever, ``run_app`` raises AppStartTimeout after its
    timeout naming the pending deployment and leaving no thread of its own behind (one
    still waiting would touch Ray after the cluster's ``ray.shutdown()``, which exits the
    test process); withdrawn, it leaves the running app serving. (No graceful shutdown
    for the replica that never started: Serve would otherwise wait its default 20 s for
    it on withdrawal.)"""
    unplaceable = LLMServer.options(ray_actor_options={"num_cpus": 2}, graceful_shutdown_timeout_s=0)
    threads_before = set(threading.enumerate())
    try:
        with pytest.raises(AppStartTimeout, match="LLMServer"):
            run_app(unplaceable.bind(AppArgs(model=str(tiny_dir))), name="unplaceable", route_prefix=None, timeout_s=5)
        assert set(threading.enumerate()) <= threads_before
    finally:
        serve.delete("unplaceable")
    status, _, body = _post(f"{base_url}/v1/completions", _completion([5, 6], 2, stream=False))
    assert _answer(status, body, stream=False)[1] == 2


def test_an_app_whose_server_cannot_start_fails_with_its_cause(base_url: str, tmp_path: Path) -> None:
    """An LLM server whose checkpoint directory holds no model fails in its constructor:
    Serve marks the application DEPLOY_FAILED and ``run_app`` raises at once with Serve's
    message (the constructor's error) as AppStartFailed, not after its timeout; the
    running app still serves."""
    broken = LLMServer.options(ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=0)
    started = time.monotonic()
    try:
        with pytest.raises(AppStartFailed, match="failed to deploy") as failure:
            run_app(broken.bind(AppArgs(model=str(tmp_path))), name="broken", route_prefix=None, timeout_s=APP_FAIL_TIMEOUT_S)
    finally:
        serve.delete("broken")
    assert time.monotonic() - started < APP_FAIL_TIMEOUT_S
    assert str(tmp_path) in str(failure.value)
    status, _, body = _post(f"{base_url}/v1/completions", _completion([5, 6], 2, stream=False))
    assert _answer(status, body, stream=False)[1] == 2
