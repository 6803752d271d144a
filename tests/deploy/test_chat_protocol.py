"""Tests of deploy.chat_protocol: OpenAI chat requests rendered as DeepSeek-V4.1 prompts.

The expected prompts are written out by hand from PROTOCOL.md (every marker, newline and
DSML tag spelled literally), so a change of the protocol's bytes fails here. Token ids
come from the tiny model's tokenizer, looked up by string. Every special token of
PROTOCOL.md written into every field of a request that carries text is tokenized as
text: only the renderer places special tokens."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from dsv41.deploy.chat_protocol import (
    PROMPT_MARKERS,
    ChatRequestError,
    PromptEncoder,
    render_chat,
    render_pieces,
    text_tokenizer,
)
from dsv41.model.tiny import SPECIAL_TOKENS, TINY, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer(TINY)


@pytest.fixture(scope="module")
def encoder(tokenizer: Tokenizer) -> PromptEncoder:
    return PromptEncoder(tokenizer)


EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK_TOOL = {"type": "function", "function": {"name": "now", "description": "The time", "strict": True}}

TOOLS_SECTION = (
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<｜DSML｜ calls>" block like the following:\n'
    "\n"
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME">\n'
    '<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>\n'
    "...\n"
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    '{"name": "get_weather", "description": "Current weather of a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}\n'
    '{"name": "now", "description": "The time"}\n'
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# A tool conversation with everything PROTOCOL.md names: a system message, text parts,
# reasoning, two calls answered out of order, a user text joining the results' turn,
# a second assistant turn, a developer message and a mid-conversation system message.
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"}, {"type": "text", "text": "and Oslo?"}]},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Two cities.",
        "tool_calls": [
            _call("c1", "get_weather", {"city": "Paris", "days": 2}),
            _call("c2", "get_weather", {"city": "Oslo", "units": ["C"], "alerts": True, "note": None}),
        ],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "Oslo: -3"},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "Paris: 18"}]},
    {"role": "user", "content": "Which is warmer?"},
    {"role": "assistant", "content": "Paris.", "reasoning_content": "Compare."},
    {"role": "developer", "content": "Answer in French from now on."},
    {"role": "system", "content": "Be formal."},
]
CALL_BLOCK = (
    "\n\n<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Oslo</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="units" string="false">["C"]</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="alerts" string="false">true</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="note" string="false">null</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>"
)
TOOL_RESULTS_TURN = (
    "<｜User｜><tool_result>Paris: 18</tool_result>\n\n<tool_result>Oslo: -3</tool_result>\n\nWhich is warmer?"
)

# (name, render_chat arguments, the prompt written out by hand from PROTOCOL.md)
CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "chat mode: system and user",
        {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]},
        "<｜begin▁of▁sentence｜><｜System｜>You are terse.<｜User｜>Hi<｜Assistant｜></think>",
    ),
    (
        "thinking mode without a system message: the effort line still opens a system block",
        {"messages": [{"role": "user", "content": "Hi"}], "thinking": True},
        "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT.format(75) + "<｜User｜>Hi<｜Assistant｜><think>",
    ),
    (
        "thinking multi-turn: past reasoning dropped, only the current turn opens <think>",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                {"role": "user", "content": "q2"},
            ],
            "thinking": True,
            "reasoning_effort": "max",
        },
        "<｜begin▁of▁sentence｜><｜System｜>"
        + EFFORT.format(100)
        + "Be brief.<｜User｜>q1<｜Assistant｜></think>a1<｜end▁of▁sentence｜><｜User｜>q2<｜Assistant｜><think>",
    ),
    (
        "chat multi-turn: no reasoning anywhere",
        {
            "messages": [
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                {"role": "user", "content": "q2"},
            ]
        },
        "<｜begin▁of▁sentence｜><｜User｜>q1<｜Assistant｜></think>a1<｜end▁of▁sentence｜><｜User｜>q2<｜Assistant｜></think>",
    ),
    (
        "thinking tool conversation: tools declared, so all reasoning is kept",
        {
            "messages": TOOL_CONVERSATION,
            "tools": [WEATHER_TOOL, CLOCK_TOOL],
            "thinking": True,
            "reasoning_effort": "low",
        },
        "<｜begin▁of▁sentence｜><｜System｜>"
        + EFFORT.format(50)
        + "You are a weather bot.\n\n"
        + TOOLS_SECTION
        + "<｜User｜>Weather in Paris\n\nand Oslo?<｜Assistant｜><think>Two cities.</think>Let me check."
        + CALL_BLOCK
        + "<｜end▁of▁sentence｜>"
        + TOOL_RESULTS_TURN
        + "<｜Assistant｜><think>Compare.</think>Paris.<｜end▁of▁sentence｜>"
        + "<｜User｜>Answer in French from now on.<｜System｜>Be formal.<｜Assistant｜><think>",
    ),
    (
        "tool_choice none: no tools section, so past reasoning is dropped; past calls stay",
        {"messages": TOOL_CONVERSATION, "tools": [WEATHER_TOOL], "tool_choice": "none", "thinking": True},
        "<｜begin▁of▁sentence｜><｜System｜>"
        + EFFORT.format(75)
        + "You are a weather bot.<｜User｜>Weather in Paris\n\nand Oslo?<｜Assistant｜></think>Let me check."
        + CALL_BLOCK
        + "<｜end▁of▁sentence｜>"
        + TOOL_RESULTS_TURN
        + "<｜Assistant｜></think>Paris.<｜end▁of▁sentence｜>"
        + "<｜User｜>Answer in French from now on.<｜System｜>Be formal.<｜Assistant｜><think>",
    ),
    (
        "chat tool conversation ending with tool results",
        {"messages": TOOL_CONVERSATION[1:5], "tools": [WEATHER_TOOL, CLOCK_TOOL]},
        "<｜begin▁of▁sentence｜><｜System｜>\n\n"
        + TOOLS_SECTION
        + "<｜User｜>Weather in Paris\n\nand Oslo?<｜Assistant｜></think>Let me check."
        + CALL_BLOCK
        + "<｜end▁of▁sentence｜>"
        + "<｜User｜><tool_result>Paris: 18</tool_result>\n\n<tool_result>Oslo: -3</tool_result><｜Assistant｜></think>",
    ),
    (
        "response format in the system block, after the tools",
        {
            "messages": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Hi"}],
            "tools": [WEATHER_TOOL, CLOCK_TOOL],
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "reply",
                    "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
                },
            },
        },
        "<｜begin▁of▁sentence｜><｜System｜>Be exact.\n\n"
        + TOOLS_SECTION
        + "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        + '{"type": "object", "properties": {"ok": {"type": "boolean"}}}'
        + "<｜User｜>Hi<｜Assistant｜></think>",
    ),
    (
        "thinking, response format and no system message: an empty leading system block carries it",
        {
            "messages": [{"role": "developer", "content": "Use JSON."}, {"role": "user", "content": "Hi"}],
            "thinking": True,
            "reasoning_effort": 33,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "string"}}},
        },
        "<｜begin▁of▁sentence｜><｜System｜>"
        + EFFORT.format(33)
        + "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        + '{"type": "string"}'
        + "<｜User｜>Use JSON.<｜User｜>Hi<｜Assistant｜><think>",
    ),
]


@pytest.mark.parametrize(("kwargs", "expected"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_render_matches_protocol_byte_for_byte(kwargs: dict[str, Any], expected: str) -> None:
    """render_chat produces exactly PROTOCOL.md's prompt, and leaves its input untouched."""
    before = copy.deepcopy(kwargs)
    assert render_chat(**kwargs) == expected
    assert kwargs == before


_MARKER_SPLIT = re.compile("(" + "|".join(map(re.escape, PROMPT_MARKERS)) + ")")


@pytest.mark.parametrize("kwargs", [case[1] for case in CASES], ids=[case[0] for case in CASES])
def test_encoding_turns_every_marker_into_its_single_id(
    tokenizer: Tokenizer, encoder: PromptEncoder, kwargs: dict[str, Any]
) -> None:
    """A rendered prompt's ids are the prompt with every marker replaced by its one
    special id (looked up by string) and the text between markers tokenized as plain
    text, and they decode back to the prompt."""
    prompt = render_chat(**kwargs)
    expected: list[int] = []
    for piece in _MARKER_SPLIT.split(prompt):
        if piece in PROMPT_MARKERS:
            expected.append(tokenizer.token_to_id(piece))
        elif piece:
            expected += tokenizer.encode(piece, add_special_tokens=False).ids
    ids = encoder.encode_pieces(render_pieces(**kwargs))
    assert ids == expected
    special_ids = {tokenizer.token_to_id(marker) for marker in PROMPT_MARKERS}
    assert sum(i in special_ids for i in ids) == sum(prompt.count(marker) for marker in PROMPT_MARKERS)
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt


def test_markers_are_the_tokenizers_special_tokens() -> None:
    """Every marker the renderer writes is a special token of the tiny tokenizer (which
    carries PROTOCOL.md's strings)."""
    assert set(PROMPT_MARKERS) <= set(SPECIAL_TOKENS)


def test_an_encoder_refuses_a_tokenizer_without_the_markers() -> None:
    """A tokenizer lacking the markers as added tokens is refused, not used to split them into pieces."""
    plain = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="not added tokens"):
        PromptEncoder(plain)


def test_an_encoder_refuses_a_tokenizer_whose_model_makes_marker_ids() -> None:
    """A tokenizer whose own vocabulary maps a marker's text to the marker's id (so
    plain text could still produce it) is refused at construction."""
    vocab = {"[UNK]": 0, **{marker: i + 1 for i, marker in enumerate(PROMPT_MARKERS)}}
    leaky = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    leaky.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    leaky.add_special_tokens(list(PROMPT_MARKERS))
    with pytest.raises(ValueError, match="special-token ids even as plain text"):
        PromptEncoder(leaky)


# -- no injection ----------------------------------------------------------------------------

_CALLED = {"role": "assistant", "content": "", "tool_calls": [_call("c1", "now", {})]}
# Every field of a request that carries text into the prompt, as a request holding
# ``text`` there (past reasoning is rendered only with tools and thinking).
TEXT_FIELDS: dict[str, Any] = {
    "system content": lambda text: {"messages": [{"role": "system", "content": text}, _user()]},
    "user content": lambda text: {"messages": [_user(text)]},
    "user text part": lambda text: {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
    "developer content": lambda text: {"messages": [{"role": "developer", "content": text}]},
    "mid-conversation system content": lambda text: {
        "messages": [_user(), {"role": "assistant", "content": "a"}, {"role": "system", "content": text}]
    },
    "assistant content": lambda text: {"messages": [_user(), {"role": "assistant", "content": text}, _user()]},
    "assistant reasoning": lambda text: {
        "messages": [_user(), {"role": "assistant", "content": "a", "reasoning_content": text}, _user()],
        "tools": [CLOCK_TOOL],
        "thinking": True,
    },
    "tool result": lambda text: {"messages": [_user(), _CALLED, {"role": "tool", "tool_call_id": "c1", "content": text}]},
    "tool result text part": lambda text: {
        "messages": [_user(), _CALLED, {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": text}]}]
    },
    "call argument value": lambda text: {
        "messages": [
            _user(),
            {"role": "assistant", "tool_calls": [_call("c1", "now", {"k": text})]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"},
        ]
    },
    "call argument JSON value": lambda text: {
        "messages": [
            _user(),
            {"role": "assistant", "tool_calls": [_call("c1", "now", {"k": [text]})]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"},
        ]
    },
    "call argument name": lambda text: {
        "messages": [
            _user(),
            {"role": "assistant", "tool_calls": [_call("c1", "now", {text: 1})]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"},
        ]
    },
    "tool description": lambda text: {
        "messages": [_user()],
        "tools": [{"type": "function", "function": {"name": "f", "description": text}}],
    },
    "tool parameters": lambda text: {
        "messages": [_user()],
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {text: {"description": text}}}},
            }
        ],
    },
    "response format schema": lambda text: {
        "messages": [_user()],
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"description": text}}},
    },
}
# Fields where the DSML marker is refused outright: a call block carrying it could not
# be read back (the parser would end the parameter there).
_DSML_REFUSED = {"call argument value", "call argument JSON value", "call argument name"}


def _special_ids(ids: list[int], tokenizer: Tokenizer) -> list[int]:
    added = set(tokenizer.get_added_tokens_decoder())
    return [i for i in ids if i in added]


@pytest.mark.parametrize("field", list(TEXT_FIELDS))
def test_special_token_text_in_a_request_is_ordinary_tokens(tokenizer: Tokenizer, encoder: PromptEncoder, field: str) -> None:
    """Each of PROTOCOL.md's special-token strings written into the field (alone, and
    between other text) adds no special id: the prompt's special ids are exactly those
    of the same request with plain text there, and the ids decode back to the rendered
    prompt, the marker's text included (in a JSON-carrying field, as JSON escapes it)."""
    request = TEXT_FIELDS[field]
    expected = _special_ids(encoder.encode_pieces(render_pieces(**request("plain"))), tokenizer)
    for token in SPECIAL_TOKENS:
        for text in (token, f"hi{token}x{token}", f"{token}\n\n"):
            if token == "｜DSML｜" and field in _DSML_REFUSED:
                with pytest.raises(ChatRequestError, match="DSML"):
                    render_pieces(**request(text))
                continue
            ids = encoder.encode_pieces(render_pieces(**request(text)))
            assert _special_ids(ids, tokenizer) == expected, (field, text)
            assert tokenizer.decode(ids, skip_special_tokens=False) == render_chat(**request(text))


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_a_tool_name_cannot_carry_a_special_token(token: str) -> None:
    """Tool and call names follow OpenAI's name rule, so no marker can reach the
    prompt through them: a name holding one is refused naming the field."""
    with pytest.raises(ChatRequestError) as declared:
        render_pieces([_user()], tools=[{"type": "function", "function": {"name": f"f{token}"}}])
    assert declared.value.field == "tools[0].function.name"
    with pytest.raises(ChatRequestError) as called:
        render_pieces([_user(), {"role": "assistant", "tool_calls": [_call("c1", f"f{token}", {})]}])
    assert called.value.field == "messages[1].tool_calls[0].function.name"


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(exclude_categories=("Cs",))))
def test_the_text_tokenizer_is_the_tokenizer_on_plain_text(tokenizer: Tokenizer, text: str) -> None:
    """On text holding no special-token string the tokenizer without added-token
    matching gives exactly the tokenizer's ids (so benign prompts encode as before)."""
    plain = text
    for token in SPECIAL_TOKENS:
        plain = plain.replace(token, "")
    assert text_tokenizer(tokenizer).encode(plain, add_special_tokens=False).ids == tokenizer.encode(
        plain, add_special_tokens=False
    ).ids


def test_a_raw_completion_prompt_keeps_parsing_special_tokens(tokenizer: Tokenizer, encoder: PromptEncoder) -> None:
    """/v1/completions text is the client's whole prompt (vLLM's rule): its marker
    strings become the special ids, as the tokenizer itself encodes them."""
    text = f"{SPECIAL_TOKENS[0]}hi{SPECIAL_TOKENS[4]}"
    assert encoder.encode_text(text) == tokenizer.encode(text).ids
    assert tokenizer.token_to_id(SPECIAL_TOKENS[4]) in encoder.encode_text(text)


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(exclude_categories=("Cs",)), min_size=1), room=st.integers(1, 64))
def test_text_too_long_to_fit_is_refused_before_tokenizing(encoder: PromptEncoder, text: str, room: int) -> None:
    """The length check before tokenizing never refuses text that fits: text refused
    for ``room`` tokens really tokenizes to more than ``room``; and text over ``room``
    times the longest token's bytes is refused, naming the field."""
    fits = len(encoder.encode_text(text)) <= room
    try:
        encoder.encode_text(text, max_tokens=room)
    except ChatRequestError as refused:
        assert not fits and refused.field == "prompt"
    longest = encoder.longest_token_bytes
    assert longest is not None
    with pytest.raises(ChatRequestError, match=f"at most {room}"):
        encoder.encode_pieces(render_pieces([_user("x" * (room * longest + 1))]), max_tokens=room)


@settings(max_examples=40, deadline=None)
@given(order=st.permutations(["c1", "c2", "c3"]), joined=st.booleans())
def test_tool_results_follow_the_call_order(order: list[str], joined: bool) -> None:
    """Tool messages in any order render as the same single user turn, results in the
    order of the assistant's calls, joined by a blank line, with a following user text
    in the same turn."""
    calls = [_call(call_id, "now", {}) for call_id in ("c1", "c2", "c3")]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    messages += [{"role": "tool", "tool_call_id": call_id, "content": f"result {call_id}"} for call_id in order]
    if joined:
        messages.append({"role": "user", "content": "next"})
    prompt = render_chat(messages)
    turn = "<｜User｜>" + "\n\n".join(f"<tool_result>result {c}</tool_result>" for c in ("c1", "c2", "c3"))
    assert prompt.endswith("<｜end▁of▁sentence｜>" + turn + ("\n\nnext" if joined else "") + "<｜Assistant｜></think>")


@settings(max_examples=50, deadline=None)
@given(
    effort=st.one_of(st.integers(1, 100), st.sampled_from(["low", "high", "max"])),
    leading_system=st.booleans(),
    turns=st.integers(1, 3),
)
def test_reasoning_effort_line_once_in_message_zero(effort: int | str, leading_system: bool, turns: int) -> None:
    """In thinking mode the effort line (README presets low 50, high 75, max 100; ints as
    given) appears exactly once, right after BOS and <｜System｜>; in chat mode never."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "S"}] if leading_system else []
    for k in range(turns):
        messages.append({"role": "user", "content": f"u{k}"})
        if k + 1 < turns:
            messages.append({"role": "assistant", "content": f"a{k}"})
    budget = {"low": 50, "high": 75, "max": 100}.get(effort, effort) if isinstance(effort, str) else effort
    thinking_prompt = render_chat(messages, thinking=True, reasoning_effort=effort)
    assert thinking_prompt.startswith("<｜begin▁of▁sentence｜><｜System｜>" + EFFORT.format(budget))
    assert thinking_prompt.count("Reasoning Effort:") == 1
    assert thinking_prompt.count("<｜begin▁of▁sentence｜>") == 1
    assert thinking_prompt.count("<｜System｜>") == 1
    chat_prompt = render_chat(messages)
    assert "Reasoning Effort" not in chat_prompt
    assert chat_prompt.count("<｜System｜>") == int(leading_system)


def _user(text: str = "Hi") -> dict[str, Any]:
    return {"role": "user", "content": text}


def _raw_call(arguments: str) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": "now", "arguments": arguments}}


_ANSWERED = [_user(), {"role": "assistant", "content": "", "tool_calls": [_call("c1", "now", {})]}]

# (name, render_chat arguments, the field the error must name)
BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("empty messages", {"messages": []}, "messages"),
    ("unknown role", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ("message not an object", {"messages": ["Hi"]}, "messages[0]"),
    ("user content missing", {"messages": [{"role": "user"}]}, "messages[0].content"),
    (
        "image part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0].type",
    ),
    ("unknown part", {"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
    (
        "part text not a string",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
    ),
    (
        "tool without a call",
        {"messages": [_user(), {"role": "tool", "tool_call_id": "c1", "content": "r"}]},
        "messages[1]",
    ),
    (
        "tool id mismatch",
        {"messages": [*_ANSWERED, {"role": "tool", "tool_call_id": "c9", "content": "r"}]},
        "messages[2].tool_call_id",
    ),
    (
        "tool answered twice",
        {"messages": [*_ANSWERED, *[{"role": "tool", "tool_call_id": "c1", "content": "r"}] * 2]},
        "messages[3].tool_call_id",
    ),
    ("call left unanswered", {"messages": [*_ANSWERED, _user()]}, "messages[1].tool_calls"),
    ("ends with the assistant", {"messages": [_user(), {"role": "assistant", "content": "a"}]}, "messages"),
    ("only a system message", {"messages": [{"role": "system", "content": "S"}]}, "messages"),
    ("assistant first", {"messages": [{"role": "assistant", "content": "a"}, _user()]}, "messages[0]"),
    (
        "two assistants in a row",
        {"messages": [_user(), {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}, _user()]},
        "messages[2]",
    ),
    (
        "call arguments not JSON",
        {"messages": [_user(), {"role": "assistant", "tool_calls": [_raw_call("{x")]}]},
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "call arguments not an object",
        {"messages": [_user(), {"role": "assistant", "tool_calls": [_raw_call("[1]")]}]},
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "call argument value carrying the DSML marker",
        {"messages": [_user(), {"role": "assistant", "tool_calls": [_call("c1", "now", {"k": "a｜DSML｜b"})]}]},
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "call argument name with a quote",
        {"messages": [_user(), {"role": "assistant", "tool_calls": [_call("c1", "now", {'k"': 1})]}]},
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "call name not a function name",
        {"messages": [_user(), {"role": "assistant", "tool_calls": [_call("c1", "no w", {})]}]},
        "messages[1].tool_calls[0].function.name",
    ),
    (
        "duplicate call ids",
        {"messages": [_user(), {"role": "assistant", "tool_calls": [_call("c1", "now", {}), _call("c1", "now", {})]}]},
        "messages[1].tool_calls[1].id",
    ),
    ("tools not a list", {"messages": [_user()], "tools": WEATHER_TOOL}, "tools"),
    ("tool type", {"messages": [_user()], "tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type"),
    (
        "tool without a name",
        {"messages": [_user()], "tools": [{"type": "function", "function": {}}]},
        "tools[0].function.name",
    ),
    (
        "tool parameters not an object",
        {"messages": [_user()], "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools[0].function.parameters",
    ),
    (
        "tool with an unknown key",
        {"messages": [_user()], "tools": [{"type": "function", "function": {"name": "f", "examples": []}}]},
        "tools[0].function",
    ),
    ("tool declared twice", {"messages": [_user()], "tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
    ("tool_choice required without tools", {"messages": [_user()], "tool_choice": "required"}, "tool_choice"),
    (
        "tool_choice naming an undeclared function",
        {"messages": [_user()], "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "now"}}},
        "tool_choice.function.name",
    ),
    ("tool_choice of an unknown shape", {"messages": [_user()], "tool_choice": {"type": "any"}}, "tool_choice"),
    ("effort zero", {"messages": [_user()], "thinking": True, "reasoning_effort": 0}, "reasoning_effort"),
    ("effort 101", {"messages": [_user()], "thinking": True, "reasoning_effort": 101}, "reasoning_effort"),
    ("effort medium", {"messages": [_user()], "thinking": True, "reasoning_effort": "medium"}, "reasoning_effort"),
    ("effort a bool", {"messages": [_user()], "thinking": True, "reasoning_effort": True}, "reasoning_effort"),
    ("effort without thinking", {"messages": [_user()], "reasoning_effort": "low"}, "reasoning_effort"),
    ("thinking not a bool", {"messages": [_user()], "thinking": "yes"}, "thinking"),
    (
        "response format of an unknown type",
        {"messages": [_user()], "response_format": {"type": "yaml"}},
        "response_format.type",
    ),
    (
        "response format without a schema",
        {"messages": [_user()], "response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize(
    ("kwargs", "field"), [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS]
)
def test_bad_requests_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    """Every malformed request raises ChatRequestError (a ValueError, for a 400) whose
    field is the offending request path and whose message starts with it."""
    with pytest.raises(ChatRequestError) as raised:
        render_chat(**kwargs)
    assert isinstance(raised.value, ValueError)
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}: ")


def test_images_are_refused_with_a_clear_reason() -> None:
    """An image part is refused as unsupported, not rendered or skipped."""
    with pytest.raises(ChatRequestError, match="images are not supported"):
        parts = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "u"}}]
        render_chat([{"role": "user", "content": parts}])


def test_a_generated_slices_tokenizer_is_one_a_server_accepts() -> None:
    """The prompt encoder accepts the generated slices' tokenizer (so `dsv41 serve`
    serves `generated:...`): typed as plain text, every special token's string falls
    apart into ordinary ids, while the tokenizer as is still matches it as its id and
    keeps every word's own id."""
    from dsv41.model.reference_slice import slice_tokenizer
    from dsv41.model.tiny import SPECIAL_TOKENS

    tokenizer = slice_tokenizer(1000)
    PromptEncoder(tokenizer)
    plain = text_tokenizer(tokenizer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.encode(f"w500 {token}", add_special_tokens=False).ids == [500, token_id]
        assert all(i >= len(SPECIAL_TOKENS) for i in plain.encode(token, add_special_tokens=False).ids), token
