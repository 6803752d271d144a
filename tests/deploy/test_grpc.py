"""The gRPC ingress end to end: the package's tiny application (tests/deploy/conftest.py,
deployed once for the modules on it), with both an HTTP proxy and the ingress's gRPC
listener, called with the generated stub."""

from __future__ import annotations

import io
import json
import urllib.request
from typing import Any, Iterator, Mapping

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv41.deploy.examples.grpc_client import generate, main
from dsv41.deploy.grpc_service import grpc_code, request_body, response_for
from dsv41.deploy.openai_errors import (
    OpenAIError,
    bad_request,
    engine_unavailable,
    model_not_found,
    replica_lost,
    request_failed,
)
from dsv41.deploy.proto.generate_pb2 import GenerateRequest, GenerateResponse, TokenIds
from dsv41.deploy.proto.generate_pb2_grpc import GenerateServiceStub


@pytest.fixture(scope="module")
def addresses(tiny_app: str, tiny_app_grpc_port: int) -> tuple[str, str]:
    """(HTTP base URL, gRPC address) of the running app."""
    return tiny_app, f"127.0.0.1:{tiny_app_grpc_port}"


@pytest.fixture(scope="module")
def stub(addresses: tuple[str, str]) -> Iterator[GenerateServiceStub]:
    with grpc.insecure_channel(addresses[1]) as channel:
        yield GenerateServiceStub(channel)


_TEXT = st.text(st.characters(exclude_categories=("Cs",)))
_INT32 = st.integers(-(2**31), 2**31 - 1)
_OPTIONAL = {
    "max_tokens": st.none() | _INT32,
    "temperature": st.none() | st.floats(allow_nan=False),
    "top_p": st.none() | st.floats(allow_nan=False),
    "top_k": st.none() | _INT32,
    "seed": st.none() | st.integers(-(2**63), 2**63 - 1),
}


@given(
    prompt=_TEXT | st.lists(_INT32, max_size=8),
    optional=st.fixed_dictionaries(_OPTIONAL),
    stop=st.lists(_TEXT, max_size=3),
    ignore_eos=st.booleans(),
    model=_TEXT,
)
def test_request_body_carries_exactly_the_set_fields(
    prompt: str | list[int], optional: dict[str, Any], stop: list[str], ignore_eos: bool, model: str
) -> None:
    """A GenerateRequest becomes the completions body with every set field at its value
    and no unset one (an unset field then takes the HTTP API's default); the prompt is
    the text or the token ids, whichever was set."""
    request = GenerateRequest(stop=stop, ignore_eos=ignore_eos, model=model)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.CopyFrom(TokenIds(ids=prompt))
    for name, value in optional.items():
        if value is not None:
            setattr(request, name, value)
    expected = {"prompt": prompt, **{k: v for k, v in optional.items() if v is not None}}
    expected |= ({"stop": stop} if stop else {}) | ({"ignore_eos": True} if ignore_eos else {}) | ({"model": model} if model else {})
    assert request_body(GenerateRequest.FromString(request.SerializeToString())) == expected


@given(
    token_ids=st.lists(_INT32, max_size=8),
    text=_TEXT,
    finish_reason=st.sampled_from([None, "stop", "length"]),
    counts=st.none() | st.tuples(_INT32, _INT32, _INT32),
)
def test_response_carries_the_delta(token_ids: list[int], text: str, finish_reason: str | None, counts: tuple[int, int, int] | None) -> None:
    """A token delta's ids, text, finish reason (empty for none) and usage (present
    exactly when the delta has one) survive the wire."""
    usage = None if counts is None else dict(zip(("prompt_tokens", "completion_tokens", "total_tokens"), counts))
    delta = {"token_ids": token_ids, "text": text, "finish_reason": finish_reason, "usage": usage}
    response = GenerateResponse.FromString(response_for(delta).SerializeToString())
    assert (list(response.token_ids), response.text, response.finish_reason) == (token_ids, text, finish_reason or "")
    assert response.HasField("usage") == (usage is not None)
    if usage is not None:
        assert {k: getattr(response.usage, k) for k in usage} == usage


def test_every_server_refusal_has_a_grpc_code() -> None:
    """The refusals the LLM servers answer with map to their gRPC codes; a status
    without one is an error, not a guess."""
    assert grpc_code(bad_request("max_tokens", "max_tokens: -1")) == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_code(model_not_found("nope", "tiny")) == grpc.StatusCode.NOT_FOUND
    assert grpc_code(engine_unavailable("stopped")) == grpc.StatusCode.UNAVAILABLE
    assert grpc_code(replica_lost("r")) == grpc.StatusCode.UNAVAILABLE
    assert grpc_code(request_failed("a rank failed", "r")) == grpc.StatusCode.INTERNAL
    with pytest.raises(ValueError, match="status: 418"):
        grpc_code(OpenAIError(418, "teapot"))


def _http_completion(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _stream(stub: GenerateServiceStub, request: GenerateRequest) -> list[GenerateResponse]:
    return list(stub.Generate(request, timeout=120))


def _refusal(stub: GenerateServiceStub, request: GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _stream(stub, request)
    return refused.value


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": "hello world", "max_tokens": 6},
        {"prompt": [267, 316, 89, 280, 276, 295], "max_tokens": 5, "ignore_eos": True},
        {"prompt": "abc", "max_tokens": 12, "stop": ["e"]},
    ],
    ids=["text", "token-ids", "stop"],
)
def test_stream_joins_to_the_http_completion(addresses: tuple[str, str], stub: GenerateServiceStub, fields: dict[str, Any]) -> None:
    """For a greedy request, the gRPC stream's text deltas concatenate to the
    non-streamed HTTP completion's text; its token deltas number the HTTP usage's
    completion tokens; only the last chunk carries the finish reason and the usage,
    equal to HTTP's; no chunk is empty."""
    base_url, _ = addresses
    whole = _http_completion(base_url, {"model": "tiny", "temperature": 0, **fields})
    request = GenerateRequest(
        max_tokens=fields["max_tokens"], temperature=0, stop=fields.get("stop", []), ignore_eos=fields.get("ignore_eos", False)
    )
    if isinstance(fields["prompt"], str):
        request.text = fields["prompt"]
    else:
        request.token_ids.CopyFrom(TokenIds(ids=fields["prompt"]))
    chunks = _stream(stub, request)
    assert "".join(c.text for c in chunks) == whole["choices"][0]["text"]
    assert sum(len(c.token_ids) for c in chunks) == whole["usage"]["completion_tokens"]
    assert all(c.token_ids or c.text or c.finish_reason for c in chunks)
    assert [c.finish_reason for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert not any(c.HasField("usage") for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == whole["choices"][0]["finish_reason"]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == tuple(
        whole["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    )


def test_refusals_map_to_grpc_status_codes(stub: GenerateServiceStub, tiny_app_engine: Mapping[str, Any]) -> None:
    """A request the HTTP API answers 400 ends with INVALID_ARGUMENT and the message
    naming the field (negative max_tokens, top_p out of range, no prompt, a prompt over
    the context limit); an unknown model ends with NOT_FOUND."""
    cases = [
        (GenerateRequest(text="x", max_tokens=-1), "max_tokens"),
        (GenerateRequest(text="x", max_tokens=4, top_p=2.0), "top_p"),
        (GenerateRequest(max_tokens=4), "prompt"),
        (GenerateRequest(token_ids=TokenIds(ids=[5] * tiny_app_engine["max_model_len"]), max_tokens=4), "max_model_len"),
    ]
    for request, named in cases:
        error = _refusal(stub, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, error)
        assert named in error.details()
    missing = _refusal(stub, GenerateRequest(text="x", max_tokens=4, model="nope"))
    assert missing.code() == grpc.StatusCode.NOT_FOUND and "nope" in missing.details()


def test_client_example_streams_the_http_completion(addresses: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """The example client prints exactly the completion's text on stdout (streamed) and
    the finish reason and counts on stderr; a refused request exits 2 with the status."""
    base_url, grpc_address = addresses
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    whole = _http_completion(base_url, body)
    argv = ["--address", grpc_address, "--prompt", "hello world", "--max-tokens", "7", "--temperature", "0", "--ignore-eos"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == whole["choices"][0]["text"] != ""
    assert f"completion_tokens={whole['usage']['completion_tokens']}" in err
    assert main(["--address", grpc_address, "--prompt", "hello", "--max-tokens", "-3"]) == 2
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    request = GenerateRequest(text="hello world", max_tokens=7, temperature=0, ignore_eos=True)
    last = generate(grpc_address, request, io.StringIO())
    assert last.usage.completion_tokens == whole["usage"]["completion_tokens"]
