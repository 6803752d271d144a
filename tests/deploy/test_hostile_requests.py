"""Hostile and malformed requests against a live app on the tiny model: every one is
answered fast with a 4xx in the OpenAI error shape naming the field and the bound it
broke, nothing is left running, and the server keeps serving.

One application for the module, with small configured limits (so that each bound is
reached by a small request) and a small context; each bound has its own case, then a
Hypothesis fuzz over the request schema (seeded, derandomized) checks that no request
of any shape gets a 5xx or a slow answer, and that /health answers 200 and no request is
running or waiting afterwards."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import requests
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dsv41.cluster.sampling_params import MAX_INT64, MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from dsv41.model.tiny import SPECIAL_TOKENS

# Room for a prompt declaring tools (their section is ~750 tiny-tokenizer tokens).
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 4
VOCAB = 512
LIMITS = {"max_body_bytes": 64 << 10, "max_json_depth": 24, "max_messages": 16, "max_tools": 8, "max_schema_depth": 8}
# A refusal must come back within this; any answer (at most MAX_MODEL_LEN tokens of
# MAX_NUM_SEQS sequences on the tiny model, on a loaded 2-core box) within ANSWER_S.
REFUSAL_S = 5.0
ANSWER_S = 30.0
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def base_url(tiny_dir: Path, serve_app: Callable[..., str]) -> str:
    args = {
        "model": str(tiny_dir),
        "served_model_name": "tiny",
        "engine": {
            "block_size": 32,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS,
            "cache_memory_bytes": 64 << 20,
        },
        "ray_actor_options": {"num_cpus": 1},
        "limits": LIMITS,
    }
    return serve_app(args, name="hostile")


def _send(base_url: str, path: str, body: Any, timeout: float = ANSWER_S) -> tuple[int, Any, float]:
    """(status, the JSON answer or the SSE text, seconds); ``body`` bytes go as they are."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.monotonic()
    response = requests.post(f"{base_url}{path}", data=data, headers={"Content-Type": "application/json"}, timeout=timeout)
    elapsed = time.monotonic() - start
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return response.status_code, response.text, elapsed
    return response.status_code, response.json(), elapsed


def _is_openai_error(answer: Any) -> bool:
    error = answer.get("error") if isinstance(answer, dict) else None
    return (
        isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and isinstance(error["message"], str)
        and isinstance(error["type"], str)
    )


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def _tool(name: str = "f", **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


def _nested(depth: int) -> dict[str, Any]:
    """A JSON schema whose nesting of objects is ``depth`` (each level is 2: an
    object and its ``properties``)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range((depth - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _raw(prefix: str, literal: str) -> bytes:
    """A completion body whose last field is written as raw JSON text."""
    body = json.dumps(_completion())[:-1]
    return f'{body}, "{prefix}": {literal}}}'.encode()


def _lone_surrogate(body: dict[str, Any]) -> bytes:
    """``body`` with every "SURROGATE" string replaced by the escape of U+D800 alone."""
    return json.dumps(body).replace("SURROGATE", "\\ud800").encode()


_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

# (id, path, body, status, the param named, words the message carries)
BOUNDS: list[tuple[str, str, Any, int, str | None, str]] = [
    ("n over its bound", COMPLETIONS, _completion(n=MAX_N + 1), 400, "n", f"1..{MAX_N}"),
    ("n = 2**63", COMPLETIONS, _completion(n=2**63), 400, "n", f"1..{MAX_N}"),
    ("prompts x n", COMPLETIONS, _completion(prompt=["a", "b", "c"], n=MAX_N // 2), 400, "prompt", f"at most {MAX_N}"),
    ("best_of", COMPLETIONS, _completion(best_of=2), 400, "best_of", "not supported"),
    ("top_k over the vocabulary", COMPLETIONS, _completion(temperature=0.7, top_k=VOCAB + 1), 400, "top_k", f"1..{VOCAB}"),
    ("top_k = 2**63", COMPLETIONS, _completion(temperature=0.7, top_k=2**63), 400, "top_k", f"1..{MAX_INT64}"),
    ("logprobs 21", COMPLETIONS, _completion(logprobs=21), 400, "logprobs", "0..20"),
    ("top_logprobs 21", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "0..20"),
    ("max_tokens over the context", COMPLETIONS, _completion(max_tokens=MAX_MODEL_LEN), 400, "max_tokens", f"max_model_len={MAX_MODEL_LEN}"),
    ("max_tokens of 5,000 digits", COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, "max_tokens", "at most 24"),
    ("chat max_tokens over the context", CHAT, _chat(max_tokens=MAX_MODEL_LEN), 400, "max_tokens", f"max_model_len={MAX_MODEL_LEN}"),
    ("token ids over the context", COMPLETIONS, _completion(prompt=[5] * MAX_MODEL_LEN), 400, "max_tokens", f"max_model_len={MAX_MODEL_LEN}"),
    ("token id outside the vocabulary", COMPLETIONS, _completion(prompt=[5, VOCAB]), 400, "prompt", "vocabulary"),
    ("a long text prompt", COMPLETIONS, _completion(prompt="x" * 60_000), 400, "prompt", f"at most {MAX_MODEL_LEN - 1}"),
    ("a long chat message", CHAT, _chat(messages=[{"role": "user", "content": "x" * 60_000}]), 400, "messages", f"at most {MAX_MODEL_LEN - 1}"),
    ("stop strings", COMPLETIONS, _completion(stop=["x"] * (MAX_STOP_STRINGS + 1)), 400, "stop", f"at most {MAX_STOP_STRINGS}"),
    ("a long stop string", COMPLETIONS, _completion(stop="x" * (MAX_STOP_STRING_CHARS + 1)), 400, "stop", f"at most {MAX_STOP_STRING_CHARS}"),
    ("stop token ids", COMPLETIONS, _completion(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), 400, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}"),
    ("stop token id outside the vocabulary", COMPLETIONS, _completion(stop_token_ids=[VOCAB]), 400, "stop_token_ids", "vocabulary"),
    ("tools", CHAT, _chat(tools=[_tool(f"f{i}") for i in range(LIMITS["max_tools"] + 1)]), 400, "tools", f"at most {LIMITS['max_tools']}"),
    ("5,000 tools", CHAT, _chat(tools=[_tool(f"f{i}") for i in range(5000)]), 413, None, str(LIMITS["max_body_bytes"])),
    ("a deep tool schema", CHAT, _chat(tools=[_tool(parameters=_nested(LIMITS["max_schema_depth"] + 1))]), 400, "tools[0].function.parameters", f"at most {LIMITS['max_schema_depth']}"),
    ("a response format schema", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": _nested(LIMITS["max_schema_depth"] + 1)}}), 400, "response_format.json_schema.schema", f"at most {LIMITS['max_schema_depth']}"),
    ("messages", CHAT, _chat(messages=[{"role": "user", "content": "hi"}] * (LIMITS["max_messages"] + 1)), 400, "messages", f"at most {LIMITS['max_messages']}"),
    ("50,000 [", COMPLETIONS, b"[" * 50_000, 400, None, f"at most {LIMITS['max_json_depth']}"),
    ("5,000 {", COMPLETIONS, b'{"a":' * 5000 + b"1" + b"}" * 5000, 400, None, f"at most {LIMITS['max_json_depth']}"),
    ("call arguments nested 100,000 deep", CHAT, _chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": "[" * 100_000}}]}, {"role": "tool", "tool_call_id": "c1", "content": "r"}]), 413, None, str(LIMITS["max_body_bytes"])),
    ("call arguments nested 100 deep", CHAT, _chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": "[" * 100 + "]" * 100}}]}, {"role": "tool", "tool_call_id": "c1", "content": "r"}]), 400, "messages[1].tool_calls[0].function.arguments", "at most 64"),
    ("a body over the size limit", COMPLETIONS, _completion(prompt="x" * (LIMITS["max_body_bytes"] + 1)), 413, None, str(LIMITS["max_body_bytes"])),
    ("temperature 1e999", COMPLETIONS, _raw("temperature", "1e999"), 400, "temperature", "finite"),
    ("top_p NaN", COMPLETIONS, _raw("top_p", "NaN"), 400, "top_p", "finite"),
    ("seed -Infinity", COMPLETIONS, _raw("seed", "-Infinity"), 400, "seed", "finite"),
    ("not UTF-8", COMPLETIONS, b'{"prompt": "\xff"}', 400, None, "UTF-8"),
    ("lone surrogate: prompt", COMPLETIONS, _lone_surrogate(_completion(prompt="SURROGATE")), 400, "prompt", "surrogate"),
    ("lone surrogate: system", CHAT, _lone_surrogate(_chat(messages=[{"role": "system", "content": "SURROGATE"}, {"role": "user", "content": "hi"}])), 400, "messages", "surrogate"),
    ("lone surrogate: user part", CHAT, _lone_surrogate(_chat(messages=[{"role": "user", "content": [{"type": "text", "text": "SURROGATE"}]}])), 400, "messages", "surrogate"),
    ("lone surrogate: assistant", CHAT, _lone_surrogate(_chat(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "SURROGATE"}, {"role": "user", "content": "b"}])), 400, "messages", "surrogate"),
    ("lone surrogate: tool result", CHAT, _lone_surrogate(_chat(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [_CALL]}, {"role": "tool", "tool_call_id": "c1", "content": "SURROGATE"}])), 400, "messages", "surrogate"),
    ("lone surrogate: call arguments", CHAT, _lone_surrogate(_chat(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": '{"k": "SURROGATE"}'}}]}, {"role": "tool", "tool_call_id": "c1", "content": "r"}])), 400, "messages", "surrogate"),
    ("lone surrogate: tool description", CHAT, _lone_surrogate(_chat(tools=[_tool(description="SURROGATE")])), 400, "tools", "surrogate"),
    ("lone surrogate: a key", CHAT, _lone_surrogate(_chat(tools=[_tool(parameters={"type": "object", "properties": {"SURROGATE": {}}})])), 400, "tools", "surrogate"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), [case[1:] for case in BOUNDS], ids=[case[0] for case in BOUNDS])
def test_each_bound_is_a_fast_4xx_naming_the_field(
    base_url: str, path: str, body: Any, status: int, param: str | None, words: str
) -> None:
    """A request past one bound gets its 4xx within REFUSAL_S in the OpenAI error
    shape, ``param`` naming the field and the message stating the bound."""
    got, answer, elapsed = _send(base_url, path, body)
    assert (got, answer["error"]["param"] if _is_openai_error(answer) else answer) == (status, param)
    assert words in answer["error"]["message"]
    assert elapsed < REFUSAL_S


def test_chat_without_max_tokens_stops_at_the_context(base_url: str) -> None:
    """A chat request without max_tokens may use the rest of the context and no more:
    prompt + completion tokens end at max_model_len (a prompt near it keeps this short)."""
    body = _chat(ignore_eos=True, messages=[{"role": "user", "content": "a " * (MAX_MODEL_LEN - 24)}])
    del body["max_tokens"]
    status, answer, _ = _send(base_url, CHAT, body)
    assert status == 200
    used = answer["usage"]
    assert used["total_tokens"] == MAX_MODEL_LEN and answer["choices"][0]["finish_reason"] == "length"


# -- the fuzz -------------------------------------------------------------------------------

# Text a client may send: any Unicode but lone surrogates (a JSON encoder writes those as
# escapes, which the server refuses), special-token strings included.
_PLAIN = st.text(st.characters(exclude_categories=("Cs",)), max_size=12) | st.sampled_from(SPECIAL_TOKENS)
_TEXT = _PLAIN | st.sampled_from(["\ud800", "\udfff", "", "\x00", "\u202e"])
_NUMBER = (
    st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, 10**24, 10**40])
    | st.floats(allow_nan=True, allow_infinity=True)
)
_ANY = st.recursive(
    st.none() | st.booleans() | _NUMBER | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=6,
)
_SMALL = st.integers(1, 4)


def _mostly(valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` two times in three, else ``hostile``: most requests then get past
    validation to the engine, the rest probe it."""
    return st.integers(0, 2).flatmap(lambda draw: hostile if draw == 0 else valid)


# Each field in range (so the request reaches the engine) ...
_VALID_SAMPLING = {
    "temperature": st.sampled_from([0, 0.7, 1.0]),
    "top_p": st.sampled_from([0.5, 1.0]),
    "top_k": st.sampled_from([-1, 1, 40, VOCAB]),
    "n": _SMALL,
    "seed": st.integers(-(2**63), 2**64),
    "stop": st.lists(_PLAIN.filter(bool), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "user": _PLAIN,
}
# ... or anything at all. max_tokens is always there: a chat request without it runs to
# the context's end (test_chat_without_max_tokens_stops_at_the_context), too slow here.
_HOSTILE_SAMPLING = {**{k: v | _ANY for k, v in _VALID_SAMPLING.items()}, "presence_penalty": _ANY, "unknown": _ANY}
_SAMPLING = _mostly(
    st.fixed_dictionaries({"max_tokens": _SMALL}, optional=_VALID_SAMPLING),
    st.fixed_dictionaries({"max_tokens": _SMALL | _ANY.filter(lambda v: v is not None)}, optional=_HOSTILE_SAMPLING),
)
_COMPLETION_BODY = st.builds(
    lambda prompt, fields, logprobs: {"model": "tiny", "prompt": prompt, **fields, **logprobs},
    _mostly(_PLAIN.filter(bool) | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), _ANY),
    _SAMPLING,
    st.fixed_dictionaries({}, optional={"logprobs": st.integers(0, 5) | _ANY}),
)
_VALID_TOOL = st.builds(
    lambda name, description, parameters: {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}},
    st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
    _PLAIN,
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(_PLAIN, st.fixed_dictionaries({"description": _PLAIN}), max_size=2)}),
)
_CALL_ARGUMENTS = st.dictionaries(_PLAIN, _PLAIN | st.integers() | st.lists(_PLAIN, max_size=2), max_size=2).map(json.dumps)
_CONVERSATION = st.builds(
    lambda system, user, past, result, content: [
        *([{"role": "system", "content": system}] if system is not None else []),
        {"role": "user", "content": user},
        *(
            [
                {"role": "assistant", "content": content, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": past}}]},
                {"role": "tool", "tool_call_id": "c1", "content": result},
            ]
            if past is not None
            else []
        ),
    ],
    st.none() | _PLAIN,
    _PLAIN | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _PLAIN}), min_size=1, max_size=2),
    st.none() | _CALL_ARGUMENTS,
    _PLAIN,
    _PLAIN,
)
_VALID_CHAT = {
    "tools": st.lists(_VALID_TOOL, max_size=2, unique_by=lambda tool: tool["function"]["name"]),
    "tool_choice": st.sampled_from(["auto", "none"]),
    "chat_template_kwargs": st.fixed_dictionaries({"thinking": st.booleans()}),
    "response_format": st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"name": st.just("r"), "schema": st.fixed_dictionaries({"description": _PLAIN})})}),
    "logprobs": st.booleans(),
}
_HOSTILE_CHAT = {
    **{k: v | _ANY for k, v in _VALID_CHAT.items()},
    "reasoning_effort": st.sampled_from(["low", "high", 50]) | _ANY,
    "top_logprobs": st.integers(0, 21) | _ANY,
}
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | _TEXT},
    optional={"content": _TEXT | _ANY, "tool_calls": _ANY, "tool_call_id": _TEXT, "reasoning_content": _ANY},
)
_CHAT_BODY = st.builds(
    lambda messages, fields, chat: {"model": "tiny", "messages": messages, **fields, **chat},
    _mostly(_CONVERSATION, st.lists(_MESSAGE, min_size=1, max_size=4) | _ANY),
    _SAMPLING,
    _mostly(st.fixed_dictionaries({}, optional=_VALID_CHAT), st.fixed_dictionaries({}, optional=_HOSTILE_CHAT)),
)
_REQUEST = (
    st.tuples(st.just(COMPLETIONS), _COMPLETION_BODY)
    | st.tuples(st.just(CHAT), _CHAT_BODY)
    | st.tuples(st.sampled_from([COMPLETIONS, CHAT]), st.binary(max_size=64) | _ANY)
)


@settings(
    max_examples=200,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(request=_REQUEST)
def test_no_request_of_any_shape_gets_a_5xx_or_a_slow_answer(base_url: str, request: tuple[str, Any]) -> None:
    """Any body the request schema allows, in range or not, and any bytes: the answer is
    a 200 (a complete response, or a whole stream with no error event) or a 4xx in the
    OpenAI error shape, within ANSWER_S (a refusal within REFUSAL_S)."""
    path, body = request
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer, elapsed = _send(base_url, path, data)
    event(f"{path} {status}")  # --hypothesis-show-statistics: how many reach the engine
    assert status == 200 or 400 <= status < 500, (status, answer)
    if status != 200:
        assert _is_openai_error(answer), answer
        assert elapsed < REFUSAL_S, (elapsed, answer)
    elif isinstance(answer, str):  # a stream: refusals come before it starts, so none inside
        assert 'data: {"error"' not in answer and answer.endswith("data: [DONE]\n\n"), answer[-300:]
    assert elapsed < ANSWER_S


def test_after_everything_the_server_is_healthy_and_holds_nothing(
    base_url: str, metric: Callable[[str, str], float]
) -> None:
    """Once the hostile requests are answered, /health is 200, no request is running or
    waiting, no PAGE is held, and a plain request is served."""
    assert requests.get(f"{base_url}/health", timeout=30).status_code == 200
    deadline = time.monotonic() + 30
    while metric(base_url, "dsv41:num_requests_running") + metric(base_url, "dsv41:num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "requests still held"
        time.sleep(0.2)
    assert metric(base_url, "dsv41:cache_pages_used") == 0
    status, answer, _ = _send(base_url, COMPLETIONS, _completion(temperature=0))
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1
