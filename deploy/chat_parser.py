"""The DeepSeek-V4.1 output stream read back as an OpenAI assistant message
(``/work/shared/PROTOCOL.md``, "Parsing the output stream"): reasoning, text and
tool calls, from the whole text (:func:`parse_assistant_output`) or delta by delta
(:class:`StreamingChatParser`).

Owns the grammar of the generated text and its two drivers; the protocol's strings and
the DSML writer it inverts are ``deploy/chat_protocol.py``'s. The text is the decoded
completion with special tokens kept and without the stop token (EOS ends generation
and is not decoded).

The grammar. In thinking mode the text up to the first ``</think>`` is the reasoning
(all of it while ``</think>`` has not come). With tools enabled, the rest up to the
first ``\\n\\n<｜DSML｜ calls>`` is the message text, and the block is
``("\\n" INVOKE)+ "\\n</｜DSML｜ calls>"`` ending the text, an INVOKE running from
``<｜DSML｜ invoke name="NAME">\\n`` to the first ``\\n</｜DSML｜ invoke>`` with its
parameters joined by ``\\n`` in between.

A malformed block is returned as text, never raised: from the end of its last complete
call, or the whole block when no call completed. The streaming parser emits each call
as its invoke closes and cannot take it back, so the batch parser keeps complete calls
before a fault too; both give the same message for the same text however it is cut.

Must not import: ``ray``, ``torch``, ``model``, ``cache``, ``cluster``, ``actors``;
from ``deploy`` only ``deploy.chat_protocol``.
"""

from __future__ import annotations

import enum
import re
import uuid
from dataclasses import dataclass
from typing import Any

from dsv41.deploy.chat_protocol import (
    CALL_BLOCK_START,
    CALLS_END_TAG,
    DSML,
    INVOKE_END_TAG,
    INVOKE_TAG_START,
    PARAMETER_END_TAG,
    PARAMETER_TAG_START,
    THINK_END,
    TOOL_NAME_PATTERN,
    parse_json,
    to_json,
)

# The special tokens this parser reads from an answer: a chat answer decodes them even
# when it skips special tokens (SamplingParams.kept_special_token_ids).
OUTPUT_MARKERS = (THINK_END, DSML)
_INVOKE_LEAD = "\n" + INVOKE_TAG_START
_INVOKE_END = "\n" + INVOKE_END_TAG
_BLOCK_END = "\n" + CALLS_END_TAG
_INVOKE_PATTERN = re.compile(
    re.escape(INVOKE_TAG_START) + r'([^"\n]*)">\n(.*)' + re.escape(_INVOKE_END), re.DOTALL
)
_PARAMETER_PATTERN = re.compile(
    re.escape(PARAMETER_TAG_START) + r'([^"]*)" string="(true|false)">(.*?)' + re.escape(PARAMETER_END_TAG),
    re.DOTALL,
)


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is a JSON object's text."""

    id: str
    name: str
    arguments: str

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("ToolCall.id: '' (allowed: a non-empty string)")
        if not TOOL_NAME_PATTERN.fullmatch(self.name):
            raise ValueError(f"ToolCall.name: {self.name!r} (allowed: {TOOL_NAME_PATTERN.pattern})")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedMessage:
    """An assistant message: ``reasoning_content`` is None outside thinking mode."""

    content: str
    reasoning_content: str | None
    tool_calls: tuple[ToolCall, ...]

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``message`` object (content null when only calls came)."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if self.tool_calls and not self.content else self.content,
        }
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


@dataclass(frozen=True)
class ChatDelta:
    """One streamed piece: exactly one of non-empty ``reasoning_content``, non-empty
    ``content``, or ``tool_call`` with its ``tool_call_index`` (0, 1, ... in order)."""

    reasoning_content: str | None = None
    content: str | None = None
    tool_call: ToolCall | None = None
    tool_call_index: int | None = None

    def __post_init__(self) -> None:
        kinds = [self.reasoning_content is not None, self.content is not None, self.tool_call is not None]
        if sum(kinds) != 1:
            raise ValueError("ChatDelta: set exactly one of reasoning_content, content, tool_call")
        if "" in (self.reasoning_content, self.content):
            raise ValueError("ChatDelta: reasoning_content / content must not be empty")
        if (self.tool_call is None) != (self.tool_call_index is None):
            raise ValueError("ChatDelta.tool_call_index: set exactly when tool_call is (allowed: an int >= 0)")
        if self.tool_call_index is not None and self.tool_call_index < 0:
            raise ValueError(f"ChatDelta.tool_call_index: {self.tool_call_index} (allowed: an int >= 0)")

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI streaming ``delta`` object."""
        if self.reasoning_content is not None:
            return {"reasoning_content": self.reasoning_content}
        if self.content is not None:
            return {"content": self.content}
        assert self.tool_call is not None
        return {"tool_calls": [{"index": self.tool_call_index, **self.tool_call.to_openai()}]}


# -- the grammar ----------------------------------------------------------------------------


def _parse_invoke(invoke: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one complete invoke, or None if malformed: string
    parameters taken raw, the others parsed as JSON."""
    match = _INVOKE_PATTERN.fullmatch(invoke)
    if match is None or not TOOL_NAME_PATTERN.fullmatch(match.group(1)):
        return None
    parameters, arguments, position = match.group(2), {}, 0
    while position < len(parameters):
        parameter = _PARAMETER_PATTERN.match(parameters, position)
        if parameter is None:
            return None
        key, is_string, raw = parameter.groups()
        if key in arguments:
            return None
        if is_string == "true":
            arguments[key] = raw
        else:
            try:
                arguments[key] = parse_json(raw)
            except ValueError:
                return None
        position = parameter.end()
        if position < len(parameters):
            if parameters[position] != "\n":
                return None
            position += 1
            if position == len(parameters):  # a trailing separator with no parameter after it
                return None
    return match.group(1), to_json(arguments)


class _Step(enum.Enum):
    CALL = "call"  # a complete, well-formed invoke
    CLOSED = "closed"  # the closing tag, and the text ends there
    MALFORMED = "malformed"
    NEED_MORE = "need more"


def _scan_block(pending: str, *, at_block_start: bool, final: bool) -> tuple[_Step, int, tuple[str, str] | None]:
    """The next step of a call block. ``pending`` starts at the block start (its
    ``\\n\\n<｜DSML｜ calls>``) or right after the last complete invoke; ``final`` says
    no more text comes. Returns the step, the characters it consumes, and for CALL the
    ``(name, arguments)``. A step other than NEED_MORE depends only on the characters it
    has seen, so a streamed text and the whole text take the same steps."""
    lead = len(CALL_BLOCK_START) if at_block_start else 0
    rest = pending[lead:]
    if rest.startswith(_INVOKE_LEAD):
        end = rest.find(_INVOKE_END, len(_INVOKE_LEAD))
        if end < 0:
            return (_Step.MALFORMED if final else _Step.NEED_MORE), 0, None
        end += len(_INVOKE_END)
        call = _parse_invoke(rest[1:end])
        if call is None:
            return _Step.MALFORMED, 0, None
        return _Step.CALL, lead + end, call
    # The block needs one call at least, so it can close only after one.
    if not at_block_start and rest.startswith(_BLOCK_END):
        if len(rest) > len(_BLOCK_END):
            return _Step.MALFORMED, 0, None
        return (_Step.CLOSED if final else _Step.NEED_MORE), len(pending), None
    could_continue = _INVOKE_LEAD.startswith(rest) or (not at_block_start and _BLOCK_END.startswith(rest))
    if could_continue and not final:
        return _Step.NEED_MORE, 0, None
    return _Step.MALFORMED, 0, None


def parse_assistant_output(text: str, *, thinking: bool, tools_enabled: bool) -> ParsedMessage:
    """The assistant message in a whole generated text (see the module docstring for
    the grammar). ``tools_enabled`` False (tool_choice "none") returns any call block
    as text. Never raises on model output."""
    reasoning: str | None = None
    if thinking:
        end = text.find(THINK_END)
        reasoning, text = (text, "") if end < 0 else (text[:end], text[end + len(THINK_END) :])
    start = text.find(CALL_BLOCK_START) if tools_enabled else -1
    if start < 0:
        return ParsedMessage(text, reasoning, ())
    content, pending, calls = text[:start], text[start:], []
    while True:
        step, consumed, call = _scan_block(pending, at_block_start=not calls, final=True)
        if step is _Step.CALL:
            assert call is not None
            calls.append(ToolCall(new_call_id(), *call))
            pending = pending[consumed:]
        elif step is _Step.CLOSED:
            return ParsedMessage(content, reasoning, tuple(calls))
        else:
            return ParsedMessage(content + pending, reasoning, tuple(calls))


class _Phase(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"  # message text, watching for the block start
    BLOCK = "block"
    TEXT = "text"  # after a malformed block, or with tools disabled: all text
    FINISHED = "finished"


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class StreamingChatParser:
    """:func:`parse_assistant_output` delta by delta. :meth:`feed` returns what is
    certain so far: reasoning and content as they arrive, holding back only trailing
    characters that could still start ``</think>`` or the call block, and each tool call
    when its invoke closes. :meth:`finish` flushes the rest. Concatenating the deltas
    gives the batch parser's message for the same text, however it is cut."""

    def __init__(self, *, thinking: bool, tools_enabled: bool) -> None:
        self._tools_enabled = tools_enabled
        self._phase = _Phase.REASONING if thinking else self._after_reasoning()
        self._pending = ""
        self._num_calls = 0

    def _after_reasoning(self) -> _Phase:
        return _Phase.CONTENT if self._tools_enabled else _Phase.TEXT

    def feed(self, delta_text: str) -> list[ChatDelta]:
        if self._phase is _Phase.FINISHED:
            raise RuntimeError("StreamingChatParser.feed: the stream is finished")
        self._pending += delta_text
        return self._drain(final=False)

    def finish(self) -> list[ChatDelta]:
        """The deltas held back until the end of the stream; the parser is then done."""
        if self._phase is _Phase.FINISHED:
            raise RuntimeError("StreamingChatParser.finish: the stream is finished")
        deltas = self._drain(final=True)
        self._phase = _Phase.FINISHED
        return deltas

    def _drain(self, *, final: bool) -> list[ChatDelta]:
        deltas: list[ChatDelta] = []

        def emit_text(length: int, *, reasoning: bool) -> None:
            piece, self._pending = self._pending[:length], self._pending[length:]
            if piece:
                deltas.append(ChatDelta(reasoning_content=piece) if reasoning else ChatDelta(content=piece))

        while True:
            if self._phase is _Phase.REASONING:
                end = self._pending.find(THINK_END)
                if end < 0:
                    held = 0 if final else _held_back(self._pending, THINK_END)
                    emit_text(len(self._pending) - held, reasoning=True)
                    return deltas
                emit_text(end, reasoning=True)
                self._pending = self._pending[len(THINK_END) :]
                self._phase = self._after_reasoning()
            elif self._phase is _Phase.CONTENT:
                start = self._pending.find(CALL_BLOCK_START)
                if start < 0:
                    held = 0 if final else _held_back(self._pending, CALL_BLOCK_START)
                    emit_text(len(self._pending) - held, reasoning=False)
                    return deltas
                emit_text(start, reasoning=False)
                self._phase = _Phase.BLOCK
            elif self._phase is _Phase.BLOCK:
                step, consumed, call = _scan_block(self._pending, at_block_start=self._num_calls == 0, final=final)
                if step is _Step.CALL:
                    assert call is not None
                    deltas.append(ChatDelta(tool_call=ToolCall(new_call_id(), *call), tool_call_index=self._num_calls))
                    self._num_calls += 1
                    self._pending = self._pending[consumed:]
                elif step is _Step.CLOSED:
                    self._pending = ""
                    return deltas
                elif step is _Step.MALFORMED:
                    self._phase = _Phase.TEXT
                else:
                    return deltas
            else:  # TEXT
                emit_text(len(self._pending), reasoning=False)
                return deltas
