"""What a live app exposes, and to whom: an application with an API key and a gRPC
listener on the tiny model (one for the module). Every /v1 route and the gRPC call
need the key (401 / UNAUTHENTICATED in the OpenAI shape otherwise), /health stays open;
only JSON bodies are read (415 for anything a cross-site form could send); unknown
routes get OpenAI-shaped errors; the gRPC listener binds loopback only; and a failure
inside the server (its LLM server replica killed mid-request) reaches the client as a
generic error naming the request id, never Ray's internal text."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
import ray
import requests

from dsv41.deploy.procfs import listening_addresses
from dsv41.deploy.proto.generate_pb2 import GenerateRequest, GenerateResponse
from dsv41.deploy.proto.generate_pb2_grpc import GenerateServiceStub

API_KEY = "test-key-0123456789"
APP = "exposure"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"Content-Type": "application/json"}
BODY = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
# What must never reach a client: Ray's exception text, tracebacks, terminal colours.
INTERNAL_TEXT = ("Ray", "Actor", "Traceback", "pid=", "\x1b[")


@pytest.fixture(scope="module")
def addresses(tiny_dir: Path, free_port: Callable[[], int], serve_app: Callable[..., str]) -> tuple[str, int]:
    """(HTTP base URL, gRPC port) of the running app."""
    grpc_port = free_port()
    args = {
        "model": str(tiny_dir),
        "served_model_name": "tiny",
        "engine": {"block_size": 32, "max_model_len": 512, "cache_memory_bytes": 64 << 20},
        "ray_actor_options": {"num_cpus": 1},
        "api_key": API_KEY,
        "public_routes": ["/health"],
    }
    return serve_app(args, name=APP, grpc_port=grpc_port), grpc_port


@pytest.fixture(scope="module")
def base_url(addresses: tuple[str, int]) -> str:
    return addresses[0]


def _assert_openai_error(response: requests.Response, status: int, code: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", BODY),
        ("POST", "/v1/chat/completions", BODY),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/tiny", None),
        ("POST", "/tokenize", b'{"prompt": "hi"}'),
        ("POST", "/detokenize", b'{"tokens": [5]}'),
        ("GET", "/tokenizer_info", None),
        ("GET", "/version", None),
        ("GET", "/metrics", None),
    ],
)
def test_routes_need_the_key(base_url: str, method: str, path: str, body: bytes | None) -> None:
    """Without the key, with a wrong one, or with another scheme, every /v1 route, the
    tokenizer routes and /version (and /metrics, not public here) answer 401 ``invalid_api_key`` with
    ``WWW-Authenticate: Bearer``, before reading the body; with the key it is served."""
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}, {"Authorization": API_KEY}):
        response = requests.request(method, f"{base_url}{path}", data=body, headers={**JSON, **headers}, timeout=60)
        _assert_openai_error(response, 401, "invalid_api_key")
        assert response.headers["WWW-Authenticate"] == "Bearer"
    served = requests.request(method, f"{base_url}{path}", data=body, headers={**JSON, **AUTH}, timeout=120)
    assert served.status_code in (200, 400), served.text  # the chat body is a completion's: 400, past the key


def test_an_unauthenticated_body_is_not_read(base_url: str) -> None:
    """A 100 MB body without the key is refused 401 at once: the key is checked first."""
    start = time.monotonic()
    response = requests.post(f"{base_url}/v1/completions", data=b"x" * (100 << 20), headers=JSON, timeout=60)
    _assert_openai_error(response, 401, "invalid_api_key")
    assert time.monotonic() - start < 10


def test_health_stays_open(base_url: str) -> None:
    """A public route answers without the key."""
    assert requests.get(f"{base_url}/health", timeout=60).status_code == 200


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        (None, 415),
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/json; charset=latin-1", 415),
        ("application/jsonp", 415),
        ("application/json", 200),
        ("Application/JSON; charset=UTF-8", 200),
    ],
)
def test_only_json_bodies_are_read(base_url: str, content_type: str | None, status: int) -> None:
    """A POST body is parsed only when it is declared application/json (UTF-8): the
    types a cross-site form or a simple fetch may send without a preflight get 415,
    even when the body is valid JSON."""
    headers = {**AUTH, **({} if content_type is None else {"Content-Type": content_type})}
    response = requests.post(f"{base_url}/v1/completions", data=BODY, headers=headers, timeout=120)
    if status == 200:
        assert response.status_code == 200, response.text
    else:
        _assert_openai_error(response, status, "unsupported_media_type")


def test_unknown_routes_and_methods_get_openai_errors(base_url: str) -> None:
    """404 for a route that does not exist, 405 for a wrong method: both in the OpenAI
    error shape."""
    _assert_openai_error(requests.get(f"{base_url}/v1/nope", headers=AUTH, timeout=60), 404, None)
    _assert_openai_error(requests.get(f"{base_url}/v1/completions", headers=AUTH, timeout=60), 405, None)


def test_grpc_needs_the_key_as_metadata(addresses: tuple[str, int]) -> None:
    """The gRPC call without ``authorization`` metadata, or with a wrong key, ends
    UNAUTHENTICATED; with ``Bearer KEY`` it streams."""
    _, grpc_port = addresses
    request = GenerateRequest(text="hi", max_tokens=2)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = GenerateServiceStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request, metadata=metadata, timeout=60))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        chunks = list(stub.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=120))
    assert chunks[-1].usage.completion_tokens == 2


def test_grpc_bytes_that_are_no_request_get_invalid_argument(addresses: tuple[str, int]) -> None:
    """A message that does not parse as a GenerateRequest (a text field of invalid
    UTF-8) ends INVALID_ARGUMENT, a client error, not INTERNAL."""
    _, grpc_port = addresses
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        call = channel.unary_stream("/dsv41.GenerateService/Generate", response_deserializer=GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            list(call(b"\x0a\x02\xed\xa0", metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in refused.value.details()


def test_the_grpc_listener_binds_loopback_only(addresses: tuple[str, int], non_loopback_ip: str | None) -> None:
    """Unless grpc_host says otherwise the gRPC listener is bound to 127.0.0.1 alone
    (Serve's own gRPC proxy would bind every interface): the kernel's socket table
    lists only that address, and the machine's other address refuses connections."""
    _, grpc_port = addresses
    assert listening_addresses(grpc_port) == [f"127.0.0.1:{grpc_port}"]
    if non_loopback_ip is not None:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((non_loopback_ip, grpc_port), timeout=5).close()


def _kill_llm_server() -> None:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{APP}#LLMServer" in a["name"]]
    assert names, "no LLMServer replica found"
    for name in names:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def _events(response: requests.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[len(b"data: ") :])


def test_an_internal_failure_reaches_the_client_as_a_generic_error(base_url: str) -> None:
    """Killing the LLM server replica while a stream and a whole completion are in
    flight: the stream ends with an error event (then ``[DONE]``), the completion with
    a 503 ``replica_lost``, each in the OpenAI shape, naming the request id (the
    response's X-Request-ID) and carrying none of Ray's text; Serve then replaces the
    replica and requests are served again. (Runs last: it costs the module its
    replica.)"""
    long = {"model": "tiny", "prompt": "hi", "max_tokens": 400, "ignore_eos": True}
    stream = requests.post(
        f"{base_url}/v1/completions", json={**long, "stream": True}, headers=AUTH, stream=True, timeout=120
    )
    events = _events(stream)
    assert "choices" in next(events)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(requests.post, f"{base_url}/v1/completions", json=long, headers=AUTH, timeout=120)
        time.sleep(1.0)
        _kill_llm_server()
        ended = [event for event in events if "error" in event]
        completion = whole.result()
    assert len(ended) == 1
    for error, request_id in ((ended[0], stream.headers["X-Request-ID"]), (completion.json(), completion.headers["X-Request-ID"])):
        message = error["error"]["message"]
        assert request_id in message and error["error"]["type"] == "server_error"
        assert not any(text in message for text in INTERNAL_TEXT), message
    assert completion.status_code == 503 and completion.json()["error"]["code"] == "replica_lost"
    deadline = time.monotonic() + 120
    while requests.get(f"{base_url}/health", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the replica was not replaced"
        time.sleep(1.0)
    served = requests.post(f"{base_url}/v1/completions", data=BODY, headers={**JSON, **AUTH}, timeout=120)
    assert served.status_code == 200
