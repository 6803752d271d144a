"""Tests of deploy.structured_request: the grammars a chat body asks for, walked token
by token through their compiled masks by a uniformly random "model" over the tiny
vocabulary. Every walk that ends (EOS) is text the project's own parser reads as what
was asked: tool calls of the allowed functions (exactly one without parallel calls)
whose arguments validate against their schemas, with no content; JSON valid against
the schema; in thinking mode the same after free reasoning. And the refusals."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar
from tokenizers import Tokenizer

from dsv41.cluster.sampler import unpack_token_mask
from dsv41.cluster.structured_output import GrammarCache, grammar_tokenizer_info
from dsv41.deploy.chat_parser import parse_assistant_output
from dsv41.deploy.chat_protocol import PARAMETER_END_TAG, ChatRequestError
from dsv41.deploy.structured_request import chat_structured_outputs
from dsv41.model.tiny import TRAINED_TINY_DIR

EOS = 1
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
OPTIONAL = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}}}
NOTE = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
    {"type": "function", "function": {"name": "pick", "parameters": OPTIONAL}},
    {"type": "function", "function": {"name": "note", "parameters": NOTE}},
]
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "maxProperties": 0}, "pick": OPTIONAL, "note": NOTE}


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    tokenizer = Tokenizer.from_file(str(Path(TRAINED_TINY_DIR) / "tokenizer.json"))
    cache = GrammarCache(grammar_tokenizer_info(tokenizer, tokenizer.get_vocab_size(), [EOS]))
    cache.tokenizer = tokenizer
    return cache


def _walk(cache: GrammarCache, spec: Any, seed: int, budget: int, prefer: dict[int, float] | None = None) -> str | None:
    """Uniformly random allowed tokens until EOS (the text), or None past the budget."""
    matcher = xgrammar.GrammarMatcher(cache.get(spec))
    bitmask = xgrammar.allocate_token_bitmask(1, cache.vocab_size)
    rng = random.Random(seed)
    tokens: list[int] = []
    for _ in range(budget):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = torch.nonzero(unpack_token_mask(bitmask, cache.vocab_size)[0]).squeeze(1).tolist()
        preferred = [t for t in allowed if rng.random() < (prefer or {}).get(t, 0.0)]
        token = preferred[0] if preferred else rng.choice(allowed)
        assert matcher.accept_token(token)
        if token == EOS:
            assert matcher.is_terminated()
            return cache.tokenizer.decode(tokens, skip_special_tokens=False)
        tokens.append(token)
    return None


def _closing_tokens(cache: GrammarCache) -> list[int]:
    """Tokens that start the closing parameter tag (what ends a raw string value)."""
    vocab = cache.tokenizer.get_vocab()
    return [i for piece, i in vocab.items() if piece and PARAMETER_END_TAG.startswith(cache.tokenizer.decode([i], skip_special_tokens=False))]


def _calls(text: str, thinking: bool) -> tuple[list[tuple[str, dict]], str]:
    message = parse_assistant_output(text, thinking=thinking, tools_enabled=True)
    calls = [(c.name, json.loads(c.arguments)) for c in message.tool_calls]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls, message.content


CASES = [
    ("required", {"tool_choice": "required"}, set(SCHEMAS), True),
    ("required, one call", {"tool_choice": "required", "parallel_tool_calls": False}, set(SCHEMAS), False),
    ("named", {"tool_choice": {"type": "function", "function": {"name": "pick"}}}, {"pick"}, True),
    ("named, one call", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False}, {"get_weather"}, False),
]


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
@pytest.mark.parametrize(("name", "fields", "names", "parallel"), CASES, ids=[c[0] for c in CASES])
def test_forced_tool_grammars_yield_calls_the_parser_returns(cache, name, fields, names, parallel, thinking) -> None:
    """40 random walks: each that ends parses to one call or more (exactly one without
    parallel calls) of the allowed functions, arguments valid, no content; with
    parallel calls some walk makes several."""
    spec = chat_structured_outputs({"tools": TOOLS, **fields}, thinking=thinking)
    # Lean toward </think> so reasoning ends, and toward closing a raw string value.
    prefer = {7: 0.05, **dict.fromkeys(_closing_tokens(cache), 0.2)}
    ended, counts = 0, []
    for seed in range(40):
        text = _walk(cache, spec, seed, budget=1500, prefer=prefer)
        if text is None:
            continue
        ended += 1
        calls, content = _calls(text, thinking)
        assert calls and not content, text
        assert {n for n, _ in calls} <= names
        counts.append(len(calls))
    assert ended >= 20
    assert max(counts) > 1 if parallel else set(counts) == {1}


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
def test_auto_without_parallel_calls_allows_text_then_at_most_one_call(cache, thinking) -> None:
    """tool_choice auto with parallel_tool_calls false: free text, then at most one
    valid call, and nothing after it."""
    spec = chat_structured_outputs({"tools": TOOLS, "parallel_tool_calls": False}, thinking=thinking)
    for seed in range(30):
        text = _walk(cache, spec, seed, budget=300, prefer={1: 0.02, 7: 0.05})
        if text is not None:
            calls, _ = _calls(text, thinking)
            assert len(calls) <= 1


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
def test_response_format_json_validates_after_reasoning(cache, thinking) -> None:
    """response_format json_schema: every ended walk's content is valid JSON for the
    schema; in thinking mode the reasoning comes first and the parser splits it off."""
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}}
    spec = chat_structured_outputs(body, thinking=thinking)
    ended = 0
    for seed in range(30):
        text = _walk(cache, spec, seed, budget=800, prefer={7: 0.05})
        if text is None:
            continue
        ended += 1
        message = parse_assistant_output(text, thinking=thinking, tools_enabled=False)
        jsonschema.validate(json.loads(message.content), WEATHER)
        assert (message.reasoning_content is not None) == thinking
    assert ended >= 20


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {'a"b': {}}}}}], "tool_choice": "required"}, "tools[0].function.parameters.properties"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}, "required": ["x"]}}}], "tool_choice": "required"}, "tools[0].function.parameters.required"),
        ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "tool_choice"),
        ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ],
)
def test_what_cannot_run_is_refused_naming_the_field(body: dict, field: str) -> None:
    """Each refusal is a ChatRequestError (a 400) naming the request field."""
    with pytest.raises(ChatRequestError) as raised:
        chat_structured_outputs(body, thinking=False)
    assert raised.value.field == field


def test_free_chat_has_no_grammar() -> None:
    """No response_format, no structured_outputs, tool_choice auto with parallel calls
    (or none): the output is free."""
    assert chat_structured_outputs({"tools": TOOLS}, thinking=True) is None
    assert chat_structured_outputs({"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": False}, thinking=False) is None
    assert chat_structured_outputs({}, thinking=False) is None
