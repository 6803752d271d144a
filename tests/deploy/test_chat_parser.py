"""Tests of deploy.chat_parser: DeepSeek-V4.1 output read back as an OpenAI message,
whole and streamed.

The properties: rendering an assistant message and parsing what the model would have
generated gives the message back; the streaming parser agrees with the batch parser
however the text is cut into deltas; a malformed call block comes back as text; the
stream holds back only what could still start a marker."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv41.deploy.chat_parser import ChatDelta, ParsedMessage, StreamingChatParser, ToolCall, parse_assistant_output
from dsv41.deploy.chat_protocol import render_chat
from dsv41.deploy.safe_json import MAX_INT_DIGITS

CallTuple = tuple[str, str]  # (name, arguments): a call without its generated id


def _calls(calls: tuple[ToolCall, ...]) -> list[CallTuple]:
    return [(call.name, call.arguments) for call in calls]


def _batch(text: str, thinking: bool, tools_enabled: bool) -> tuple[str, str | None, list[CallTuple]]:
    parsed = parse_assistant_output(text, thinking=thinking, tools_enabled=tools_enabled)
    return parsed.content, parsed.reasoning_content, _calls(parsed.tool_calls)


def _stream(chunks: list[str], thinking: bool, tools_enabled: bool) -> tuple[str, str | None, list[CallTuple]]:
    """The message the deltas of a chunked stream add up to; checks the deltas' own
    invariants on the way (no empty text, call indices 0, 1, ... in order, fresh ids)."""
    parser = StreamingChatParser(thinking=thinking, tools_enabled=tools_enabled)
    deltas: list[ChatDelta] = []
    for chunk in chunks:
        deltas += parser.feed(chunk)
    deltas += parser.finish()
    calls = [delta for delta in deltas if delta.tool_call is not None]
    assert [delta.tool_call_index for delta in calls] == list(range(len(calls)))
    assert len({delta.tool_call.id for delta in calls}) == len(calls)
    content = "".join(delta.content for delta in deltas if delta.content is not None)
    reasoning = "".join(delta.reasoning_content for delta in deltas if delta.reasoning_content is not None)
    return content, reasoning if thinking else None, [(d.tool_call.name, d.tool_call.arguments) for d in calls]


def _cut(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# -- texts the model might generate ---------------------------------------------------------

CALL_A = (
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>"
)
CALL_B = '<｜DSML｜ invoke name="now">\n\n</｜DSML｜ invoke>'
BLOCK = f"\n\n<｜DSML｜ calls>\n{CALL_A}\n{CALL_B}\n</｜DSML｜ calls>"
CALLS_AB = [("get_weather", '{"city": "Paris", "days": 2}'), ("now", "{}")]

# Blocks that break the grammar before any call completes: returned whole as text.
MALFORMED_BLOCKS = {
    "string=false value not JSON": BLOCK.replace('string="false">2<', 'string="false">2x<'),
    "NaN is not JSON": BLOCK.replace('string="false">2<', 'string="false">NaN<'),
    "unknown string attribute": BLOCK.replace('string="false">2', 'string="maybe">2'),
    "duplicate parameter": BLOCK.replace('name="days"', 'name="city"'),
    "invoke name not a function name": BLOCK.replace('name="get_weather"', 'name="get weather"'),
    "no newline after the calls tag": BLOCK.replace("calls>\n<", "calls><", 1),
    "stray text between parameters": BLOCK.replace("parameter>\n<", "parameter>\nx<", 1),
    "blank line between parameters": BLOCK.replace("parameter>\n<", "parameter>\n\n<", 1),
    "V4 tag bytes": BLOCK.replace("｜DSML｜ ", "｜DSML｜"),
    "closed with no call": "\n\n<｜DSML｜ calls>\n</｜DSML｜ calls>",
    "invoke never closes": BLOCK[: BLOCK.index("</｜DSML｜ invoke>")],
    "only the opening tag": "\n\n<｜DSML｜ calls>",
}


@pytest.mark.parametrize("block", MALFORMED_BLOCKS.values(), ids=list(MALFORMED_BLOCKS))
@pytest.mark.parametrize("thinking", [False, True])
def test_malformed_block_is_returned_as_text(block: str, thinking: bool) -> None:
    """A block that breaks the grammar before its first call completes is the message's
    text, byte for byte, with no tool calls; never an exception."""
    text = ("why</think>" if thinking else "") + "Sure." + block
    parsed = parse_assistant_output(text, thinking=thinking, tools_enabled=True)
    assert parsed == ParsedMessage("Sure." + block, "why" if thinking else None, ())


# (block, the text returned after "Sure.", how many calls completed before the fault)
COMMITTED_PREFIX = {
    "second invoke broken": (
        BLOCK.replace('name="now"', 'name="n w"'),
        "\n" + CALL_B.replace("now", "n w") + "\n</｜DSML｜ calls>",
        1,
    ),
    "text after the closing tag": (BLOCK + " and more", "\n</｜DSML｜ calls> and more", 2),
    "block cut after the first call": (BLOCK[: BLOCK.index(CALL_B)], "\n", 1),
}


@pytest.mark.parametrize(("block", "tail", "num_calls"), COMMITTED_PREFIX.values(), ids=list(COMMITTED_PREFIX))
def test_fault_after_a_complete_call_keeps_the_call(block: str, tail: str, num_calls: int) -> None:
    """A call whose invoke closed is kept (a stream has already emitted it); the text
    from the end of the last complete call on is returned as text."""
    parsed = parse_assistant_output("Sure." + block, thinking=False, tools_enabled=True)
    assert (parsed.content, _calls(parsed.tool_calls)) == ("Sure." + tail, CALLS_AB[:num_calls])


def test_tools_disabled_leaves_the_block_as_text() -> None:
    """With tools disabled (tool_choice "none") a well-formed block is plain text."""
    assert parse_assistant_output("Sure." + BLOCK, thinking=False, tools_enabled=False) == ParsedMessage(
        "Sure." + BLOCK, None, ()
    )


def test_well_formed_block_becomes_tool_calls() -> None:
    """The block after the text becomes OpenAI tool calls: string values raw, the
    others parsed as JSON, arguments a JSON object string; content is null in the
    OpenAI message when only calls came."""
    parsed = parse_assistant_output("think</think>" + BLOCK, thinking=True, tools_enabled=True)
    assert (parsed.content, parsed.reasoning_content, _calls(parsed.tool_calls)) == ("", "think", CALLS_AB)
    message = parsed.to_openai()
    assert message["content"] is None and message["reasoning_content"] == "think"
    assert [json.loads(call["function"]["arguments"]) for call in message["tool_calls"]] == [
        {"city": "Paris", "days": 2},
        {},
    ]
    assert all(call["type"] == "function" and call["id"].startswith("call_") for call in message["tool_calls"])


def test_unfinished_thinking_is_all_reasoning() -> None:
    """In thinking mode a text without </think> (cut by max_tokens) is all reasoning."""
    assert parse_assistant_output("still thinking" + BLOCK, thinking=True, tools_enabled=True) == ParsedMessage(
        "", "still thinking" + BLOCK, ()
    )


# -- streaming equals batch -------------------------------------------------------------------

STREAM_TEXTS: list[tuple[str, bool, bool]] = [
    ("plain answer\nwith < and \n\n and </thin", False, True),
    ("Sure." + BLOCK, False, True),
    ("Reasoning < / </thin k</think>Sure." + BLOCK, True, True),
    ("Sure." + BLOCK, False, False),
    ("r</think>a\n\n<｜DSML｜ cal", True, True),
    ("no end of thinking\n\n<｜DSML｜ calls>", True, True),
    *[("Sure." + block, False, True) for block in MALFORMED_BLOCKS.values()],
    *[("r</think>Sure." + block, True, True) for block, _, _ in COMMITTED_PREFIX.values()],
]
_STREAM_IDS = [f"text{k}" for k in range(len(STREAM_TEXTS))]


@pytest.mark.parametrize(("text", "thinking", "tools_enabled"), STREAM_TEXTS, ids=_STREAM_IDS)
def test_stream_equals_batch_at_every_split_point(text: str, thinking: bool, tools_enabled: bool) -> None:
    """Fed one character at a time (a cut at every boundary), or in two pieces split at
    each position in turn, the stream adds up to the batch parser's message."""
    expected = _batch(text, thinking, tools_enabled)
    assert _stream(list(text), thinking, tools_enabled) == expected
    for cut in range(len(text) + 1):
        assert _stream([text[:cut], text[cut:]], thinking, tools_enabled) == expected


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(STREAM_TEXTS), data=st.data())
def test_stream_equals_batch_for_random_chunkings(case: tuple[str, bool, bool], data: st.DataObject) -> None:
    """Any chunking of a text (random cut sets, empty deltas included) streams to the
    batch parser's message."""
    text, thinking, tools_enabled = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    chunks = _cut(text, cuts) + [""] * data.draw(st.integers(0, 2))
    assert _stream(chunks, thinking, tools_enabled) == _batch(text, thinking, tools_enabled)


# Pieces of DSML and text: their random sequences are mostly malformed blocks, sometimes
# well-formed ones, and exercise every partial-marker hold-back.
FRAGMENTS = [
    "a", " ", "\n", "\n\n", "<", ">", '"', "｜DSML｜", "</think>", "</thi",
    "<｜DSML｜ calls>", "</｜DSML｜ calls>", '<｜DSML｜ invoke name="f">', "</｜DSML｜ invoke>",
    '<｜DSML｜ parameter name="k" string="true">', '<｜DSML｜ parameter name="k" string="false">',
    "</｜DSML｜ parameter>", "1", "[", "\n" + CALL_A, "\n" + CALL_B, BLOCK,
]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=14),
    thinking=st.booleans(),
    tools_enabled=st.booleans(),
    data=st.data(),
)
def test_any_text_parses_and_streams_the_same(
    pieces: list[str], thinking: bool, tools_enabled: bool, data: st.DataObject
) -> None:
    """On arbitrary marker soup the parsers never raise, agree under random chunking, and
    lose nothing: without tool calls, the text is exactly reasoning + </think> + content
    (or the content alone)."""
    text = "".join(pieces)
    expected = _batch(text, thinking, tools_enabled)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert _stream(_cut(text, cuts), thinking, tools_enabled) == expected
    content, reasoning, calls = expected
    if not calls:
        rebuilt = content if not thinking else reasoning + ("</think>" + content if "</think>" in text else "")
        assert rebuilt == text


# -- round trip through the renderer --------------------------------------------------------

# Text without the markers' fullwidth bar (so it holds no DSML tag or special token) and
# without </think> (which would end reasoning early).
_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="｜"), max_size=20).filter(
    lambda s: "</think>" not in s
)
_KEY = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters='"｜'), max_size=8)
# Integers the server's JSON reader accepts in a request (deploy/safe_json.py).
_INTEGERS = st.integers(-(10**MAX_INT_DIGITS - 1), 10**MAX_INT_DIGITS - 1)
_JSON = st.recursive(
    st.none() | st.booleans() | _INTEGERS | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEY, inner, max_size=3),
    max_leaves=6,
)
_CALL = st.tuples(st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True), st.dictionaries(_KEY, _JSON, max_size=4))
_HEADER = {True: "<｜Assistant｜><think>", False: "<｜Assistant｜></think>"}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    content=_TEXT,
    reasoning=_TEXT,
    calls=st.lists(_CALL, max_size=3),
    thinking=st.booleans(),
    data=st.data(),
)
def test_rendered_assistant_message_parses_back(
    content: str, reasoning: str, calls: list[tuple[str, dict[str, Any]]], thinking: bool, data: st.DataObject
) -> None:
    """Rendering an assistant message (text, reasoning, tool calls) into a conversation
    and parsing what follows its header up to EOS (what the model generates) returns the
    message: same text, same reasoning in thinking mode, same calls with their arguments
    as the JSON the client sent. Streamed in random chunks it parses the same."""
    sent = [(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]
    tool_calls = [
        {"id": f"c{k}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for k, (name, arguments) in enumerate(sent)
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls},
    ]
    messages += [{"role": "tool", "tool_call_id": call["id"], "content": "r"} for call in tool_calls]
    messages.append({"role": "user", "content": "next"})
    # Declared tools keep past reasoning in thinking mode (PROTOCOL.md).
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    prompt = render_chat(messages, tools=tools, thinking=thinking)
    start = prompt.index(_HEADER[thinking]) + len(_HEADER[thinking])
    generated = prompt[start : prompt.index("<｜end▁of▁sentence｜>", start)]

    expected = (content, reasoning if thinking else None, sent)
    assert _batch(generated, thinking, True) == expected
    cuts = data.draw(st.lists(st.integers(0, len(generated)), max_size=8))
    assert _stream(_cut(generated, cuts), thinking, True) == expected


# -- what the stream holds back -----------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(pieces=st.lists(st.sampled_from([*"a \n</think>", "｜DSML｜"]), max_size=30))
def test_stream_holds_back_only_a_possible_marker_start(pieces: list[str]) -> None:
    """After every delta, what was fed but not yet emitted is a proper prefix of the
    marker the parser is watching for (</think> while reasoning, the call block start
    in content): text is never delayed for any other reason."""
    text = "".join(pieces)
    for thinking in (False, True):
        parser = StreamingChatParser(thinking=thinking, tools_enabled=True)
        emitted, fed = "", ""
        reasoning_done = not thinking
        for char in text:
            fed += char
            for delta in parser.feed(char):
                emitted += delta.reasoning_content or delta.content or ""
                reasoning_done = reasoning_done or delta.content is not None
            if thinking and "</think>" in fed:
                reasoning_done = True
                seen = fed.replace("</think>", "", 1)
            else:
                seen = fed
            held = seen[len(emitted) :]
            assert seen.startswith(emitted)
            marker = "\n\n<｜DSML｜ calls>" if reasoning_done else "</think>"
            assert len(held) < len(marker) and marker.startswith(held)


def test_each_call_is_emitted_when_its_invoke_closes() -> None:
    """Fed one character at a time, the delta carrying a call comes with the last
    character of its </｜DSML｜ invoke> tag, indexed in order; the closing of the block
    is held until finish."""
    text = "Sure." + BLOCK
    parser = StreamingChatParser(thinking=False, tools_enabled=True)
    emitted_at: list[tuple[int, int, str]] = []
    for position, char in enumerate(text):
        for delta in parser.feed(char):
            if delta.tool_call is not None:
                emitted_at.append((position + 1, delta.tool_call_index, delta.tool_call.name))
    ends = [text.index(call) + len(call) for call in (CALL_A, CALL_B)]
    assert emitted_at == [(ends[0], 0, "get_weather"), (ends[1], 1, "now")]
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_delta_shapes() -> None:
    """A delta carries exactly one non-empty thing, and maps to OpenAI's streaming delta."""
    call = ToolCall("call_1", "now", "{}")
    assert ChatDelta(content="hi").to_openai() == {"content": "hi"}
    assert ChatDelta(reasoning_content="hm").to_openai() == {"reasoning_content": "hm"}
    assert ChatDelta(tool_call=call, tool_call_index=0).to_openai() == {
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    }
    for bad in (
        {},
        {"content": ""},
        {"content": "a", "reasoning_content": "b"},
        {"tool_call": call},
        {"tool_call": call, "tool_call_index": -1},
    ):
        with pytest.raises(ValueError):
            ChatDelta(**bad)
