"""Structured outputs and the sampling fields over HTTP, driven by the official
``openai`` client against a live local Serve app on the random tiny model: every
answer of a ``response_format`` (json_schema strict, json_object), ``tool_choice``
(required, a named function, with ``parallel_tool_calls: false``: parallel calls are
walked at the grammar level in test_structured_request.py) or vLLM's
``structured_outputs`` (regex, choice, grammar) request parses against what it asked
for, streamed too and in thinking mode; an invalid schema, regex or grammar is a 400
naming its field; the penalties, min_p, min_tokens, logit_bias and stop_token_ids run."""

from __future__ import annotations

import json
import re
from typing import Any, Callable

import jsonschema
import openai
import pytest

from dsv41.deploy.chat_protocol import THINK_END

THINK_END_ID = 7  # the tiny tokenizer's </think>
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
TOOL_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "A forecast.", "parameters": TOOL_PARAMETERS}},
    {"type": "function", "function": {"name": "now", "description": "The time."}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris, as JSON?"}]


@pytest.fixture(scope="module")
def client(tiny_app: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_app}/v1", api_key="none", max_retries=0, timeout=300)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)


def _streamed_message(client: openai.OpenAI, **kwargs: Any) -> tuple[str, str, list[dict[str, Any]], str]:
    """(content, reasoning, tool calls, finish reason) of a streamed choice 0."""
    content, reasoning, calls, finish = [], [], [], None
    for chunk in _chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            calls.extend({"name": c.function.name, "arguments": c.function.arguments} for c in delta.tool_calls or [])
            finish = choice.finish_reason or finish
    return "".join(content), "".join(reasoning), calls, finish


def test_json_schema_answers_parse_and_validate(client: openai.OpenAI) -> None:
    """response_format json_schema (strict): three sampled seeded choices, and a
    streamed one, each a JSON document valid against the schema."""
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    answer = _chat(client, response_format=response_format, n=3, temperature=1.0, seed=3, max_tokens=200)
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    content, _, _, finish = _streamed_message(client, response_format=response_format, temperature=1.0, seed=4, max_tokens=200)
    assert finish == "stop"
    jsonschema.validate(json.loads(content), SCHEMA)


def test_json_object_answers_are_objects(client: openai.OpenAI) -> None:
    """response_format json_object: a JSON object whenever the answer ends ("stop");
    a budget cut leaves a prefix of one."""
    answer = _chat(client, response_format={"type": "json_object"}, n=3, temperature=1.0, seed=5, max_tokens=300)
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")


def _check_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["name"] in names
        arguments = json.loads(call["arguments"])
        jsonschema.validate(arguments, TOOL_PARAMETERS if call["name"] == "get_weather" else {"type": "object"})


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [("required", {"get_weather", "now"}), ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})],
    ids=["required", "named"],
)
def test_forced_tool_calls_parse_into_tool_calls(
    client: openai.OpenAI, tool_choice: Any, names: set[str], concurrently: Callable[[list[Callable[[], Any]]], list[Any]]
) -> None:
    """tool_choice required / a named function with parallel_tool_calls false: every
    sampled answer is exactly one call of an allowed function whose arguments validate
    against its schema, finish_reason tool_calls, no content; streamed the same."""
    kwargs = dict(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0, max_tokens=300)
    answer, (content, _, calls, finish) = concurrently(
        [lambda: _chat(client, n=2, seed=6, **kwargs), lambda: _streamed_message(client, seed=7, **kwargs)]
    )
    for choice in answer.choices:
        choice_calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
        assert choice.finish_reason == "tool_calls" and len(choice_calls) == 1 and not choice.message.content
        _check_calls(choice_calls, names)
    assert finish == "tool_calls" and len(calls) == 1 and not content
    _check_calls(calls, names)


def test_thinking_mode_puts_the_schema_after_the_reasoning(client: openai.OpenAI) -> None:
    """With thinking on the reasoning is free and the content after </think> follows
    the schema (a logit bias on </think> ends the random model's reasoning early)."""
    answer = _chat(
        client,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        temperature=1.0,
        seed=9,
        max_tokens=400,
        logit_bias={str(THINK_END_ID): 6},
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "stop"
    assert THINK_END not in message.reasoning_content
    jsonschema.validate(json.loads(message.content), SCHEMA)


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        ({"regex": r"[0-9]{3}-[a-c]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-c]{2}", t)),
        ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        ({"grammar": 'root ::= "(" [0-9] ("," [0-9]){0,3} ")"'}, lambda t: re.fullmatch(r"\([0-9](,[0-9]){0,3}\)", t)),
        ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ],
    ids=["regex", "choice", "grammar", "json"],
)
def test_vllm_structured_outputs_on_both_endpoints(client: openai.OpenAI, structured: dict, check: Callable[[str], Any]) -> None:
    """vLLM's extra structured_outputs field, on completions (batch and stream) and chat."""
    extra = {"structured_outputs": structured}
    completion = client.completions.create(model="tiny", prompt="An answer:", max_tokens=120, temperature=1.0, seed=2, n=2, extra_body=extra)
    for choice in completion.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text
    streamed = client.completions.create(model="tiny", prompt="An answer:", max_tokens=120, temperature=1.0, seed=3, stream=True, extra_body=extra)
    assert check("".join(c.choices[0].text for c in streamed if c.choices))
    chat = _chat(client, max_tokens=120, temperature=1.0, seed=4, extra_body=extra)
    assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content)


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}}, "response_format.json_schema.schema", "Type should be a string"),
        ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex", "Unclosed"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= nope"}}}, "structured_outputs.grammar", 'Rule "nope" is not defined'),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs", "exactly one"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "not a declared tool"),
        ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "tool_choice", "cannot be combined"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"logit_bias": {"5": 500}}, "logit_bias", r"\[-100.0, 100.0\]"),
        ({"presence_penalty": 3}, "presence_penalty", r"\[-2.0, 2.0\]"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "> 0"),
        ({"extra_body": {"min_p": 2}}, "min_p", r"\[0, 1\]"),
        ({"max_tokens": 4, "extra_body": {"min_tokens": 5}}, "min_tokens", "0..max_tokens"),
    ],
)
def test_invalid_fields_are_a_400_naming_them(client: openai.OpenAI, kwargs: dict, param: str, message: str) -> None:
    """Each invalid value is a 400 whose param names the field and whose message says why."""
    with pytest.raises(openai.BadRequestError) as raised:
        _chat(client, max_tokens=kwargs.pop("max_tokens", 4), **kwargs)
    error = raised.value.body
    assert error["param"] == param
    assert re.search(message, error["message"]), error["message"]


def test_sampling_fields_over_http(client: openai.OpenAI) -> None:
    """logit_bias forces a token; min_tokens keeps a stop token out until reached and
    then stop_token_ids stop on it; penalties change a greedy answer and a seeded
    penalised run reproduces."""
    biased = client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0, logit_bias={"77": 100}, logprobs=0)
    assert biased.choices[0].logprobs.tokens == [biased.choices[0].logprobs.tokens[0]] * 4
    stopped = client.completions.create(
        model="tiny", prompt="x", max_tokens=12, temperature=0, logit_bias={"77": 100},
        extra_body={"min_tokens": 3, "stop_token_ids": [77]},
    )
    assert stopped.usage.completion_tokens == 4 and stopped.choices[0].finish_reason == "stop"
    plain = client.completions.create(model="tiny", prompt="hello world", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    fields = dict(presence_penalty=1.5, frequency_penalty=1.0, extra_body={"repetition_penalty": 2.0, "min_p": 0.05, "ignore_eos": True})
    penalised = client.completions.create(model="tiny", prompt="hello world", max_tokens=24, temperature=0, **fields)
    assert penalised.choices[0].text != plain.choices[0].text
    seeded = [client.completions.create(model="tiny", prompt="hello world", max_tokens=16, temperature=1.0, seed=11, **fields).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
