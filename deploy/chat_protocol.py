"""The DeepSeek-V4.1 chat and tool protocol: an OpenAI chat request rendered as the
model's prompt (``/work/shared/PROTOCOL.md``, "Rendering a conversation" and "Tools").

Owns the protocol's strings (the special-token markers, the DSML call block's exact
bytes, the tools, response-format and reasoning-effort texts), the validation of
OpenAI-style messages, tools and options (:class:`ChatRequestError`, which names the
offending field: the HTTP layer answers it with a 400), :func:`render_chat`,
:func:`format_call_block` (the one writer of DSML, which the output parser,
``deploy/chat_parser.py``, inverts) and :class:`PromptEncoder`, where prompts become
token ids.

Only the renderer places special tokens. A prompt is built as a sequence of pieces:
:class:`Special` (a marker the renderer writes, one special-token id) or text; all text
that comes from a request (any message's content, reasoning, tool results, tool names,
descriptions, schemas, call arguments) is a text piece, tokenized with no special-token
matching, so a marker string inside it becomes ordinary tokens, never the marker's id.
``render_chat`` joins the pieces into the prompt's text.

Must not import: ``ray``, ``torch``, ``model``, ``cache``, ``cluster``, ``actors``, or
any other ``deploy`` module but ``deploy.safe_json``. The tokenizer is passed in;
special-token ids are looked up in it, never written here.

Choices where PROTOCOL.md is unsure, marked (?) where they are made, each in one place:
- :data:`REASONING_EFFORT_PRESETS`, :data:`DEFAULT_REASONING_EFFORT`: the model's README.
- :data:`DSML_TAG_SEPARATOR`: the space V4.1 writes after ``｜DSML｜`` in tag names.
- :data:`RESPONSE_FORMAT_INSTRUCTION`: the JSON schema object it carries.
- :func:`_system_addendum`: where tools and a response format go without a leading
  system message.
- :func:`render_chat`: what "any message declares tools" means for keeping past
  reasoning (the prompt declares them: tools given and tool_choice not "none").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from dsv41.deploy import safe_json

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# -- markers: single special tokens of the tokenizer (fullwidth U+FF5C, U+2581) ---------

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
# Every special token a rendered prompt can contain; PromptEncoder checks that the
# tokenizer carries each as an added token, so it becomes one id, never pieces.
PROMPT_MARKERS = (BOS, EOS, SYSTEM, USER, ASSISTANT, THINK_START, THINK_END, DSML)
_MARKER_SPLIT = re.compile("(" + "|".join(map(re.escape, PROMPT_MARKERS)) + ")")


@dataclass(frozen=True)
class Special:
    """A piece of a prompt that is one special token: a marker the renderer places."""

    marker: str


# A prompt piece: a special token, or text (tokenized as text, whatever it holds).
Piece = Special | str


def _protocol(text: str) -> tuple[Piece, ...]:
    """Text this module writes (never a request's), its markers as special tokens."""
    return tuple(Special(part) if part in PROMPT_MARKERS else part for part in _MARKER_SPLIT.split(text) if part)


def _join(pieces: Iterable[Piece]) -> str:
    return "".join(piece.marker if isinstance(piece, Special) else piece for piece in pieces)

# -- the DSML call block ------------------------------------------------------------------

# (?) V4.1's released encoder writes a space between ｜DSML｜ and the tag name
# ("<｜DSML｜ calls>"); V4 wrote none ("<｜DSML｜tool_calls>"). The tiny tokenizer carries
# "｜DSML｜" alone, so the space is ordinary text either way.
DSML_TAG_SEPARATOR = " "
CALLS_TAG = f"<{DSML}{DSML_TAG_SEPARATOR}calls>"
CALLS_END_TAG = f"</{DSML}{DSML_TAG_SEPARATOR}calls>"
INVOKE_TAG_START = f'<{DSML}{DSML_TAG_SEPARATOR}invoke name="'  # + NAME + '">'
INVOKE_END_TAG = f"</{DSML}{DSML_TAG_SEPARATOR}invoke>"
PARAMETER_TAG_START = f'<{DSML}{DSML_TAG_SEPARATOR}parameter name="'  # + KEY + '" string="true|false">'
PARAMETER_END_TAG = f"</{DSML}{DSML_TAG_SEPARATOR}parameter>"
# What separates an assistant message's text from its call block.
CALL_BLOCK_START = "\n\n" + CALLS_TAG

# OpenAI's rule for function names; the parser accepts the same names, so every call
# the renderer writes parses back.
TOOL_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")

TOOL_RESULT_START = "<tool_result>"
TOOL_RESULT_END = "</tool_result>"

# -- reasoning effort ---------------------------------------------------------------------

# (?) The model's own README: low 50, high 75, max 100, default 75. (One server maps
# low 25, high 50, xhigh 75, max 100; PROTOCOL.md says to follow the README.)
REASONING_EFFORT_PRESETS: Mapping[str, int] = MappingProxyType({"low": 50, "high": 75, "max": 100})
DEFAULT_REASONING_EFFORT = 75
REASONING_EFFORT_RANGE = range(1, 101)
REASONING_EFFORT_LINE = (
    "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)

# -- system-block sections ----------------------------------------------------------------

# The tools section of the system block, line by line; the schemas (one JSON function
# object per line) go between head and tail.
_TOOLS_SECTION_HEAD = "\n".join(
    (
        "## Tools",
        "",
        "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
        f'"{CALLS_TAG}" block like the following:',
        "",
        CALLS_TAG,
        f'{INVOKE_TAG_START}$TOOL_NAME">',
        f'{PARAMETER_TAG_START}$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_END_TAG}',
        "...",
        INVOKE_END_TAG,
        f'{INVOKE_TAG_START}$TOOL_NAME2">',
        "...",
        INVOKE_END_TAG,
        CALLS_END_TAG,
        "",
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
        'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.',
        "",
        f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
        f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.",
        "",
        f"Otherwise, output directly after {THINK_END} with tool calls or final response.",
        "",
        "### Available Tool Schemas",
        "",
        "",
    )
)
_TOOLS_SECTION_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
_TOOLS_SECTION_HEAD_PIECES = _protocol(_TOOLS_SECTION_HEAD)
_CALL_BLOCK_OPEN = _protocol(f"{CALL_BLOCK_START}\n")
_CALLS_CLOSE = _protocol(f"\n{CALLS_END_TAG}")
_INVOKE_OPEN = _protocol(INVOKE_TAG_START)
_INVOKE_CLOSE = _protocol(f"\n{INVOKE_END_TAG}")
_PARAMETER_OPEN = _protocol(PARAMETER_TAG_START)
_PARAMETER_CLOSE = _protocol(PARAMETER_END_TAG)

# (?) PROTOCOL.md: "an instruction carrying the JSON schema". The instruction carries
# the schema object itself (response_format.json_schema.schema) as the protocol's JSON.
RESPONSE_FORMAT_INSTRUCTION = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")
_IMAGE_PART_TYPES = ("image_url", "input_image", "image")
_TOOL_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


class ChatRequestError(ValueError):
    """A request this protocol cannot render or encode. ``field`` is the request path of
    the offending value (``messages[3].tool_call_id``, ``tools[0].function.name``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


# -- JSON ---------------------------------------------------------------------------------


def to_json(value: Any) -> str:
    """The protocol's JSON text: ``json.dumps`` defaults (", " and ": "), non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


# Nesting allowed in JSON text carried inside a string (call arguments, in a request or
# in the model's output): such text is not covered by the body's own depth scan.
MAX_EMBEDDED_JSON_DEPTH = 64


def parse_json(text: str) -> Any:
    """``deploy.safe_json.loads`` at :data:`MAX_EMBEDDED_JSON_DEPTH`: refuses (with a
    ValueError) NaN and Infinity, which are not JSON and which a client could not read
    back, deep nesting, huge integers and lone surrogates."""
    return safe_json.loads(text, max_depth=MAX_EMBEDDED_JSON_DEPTH)


# -- the call block -----------------------------------------------------------------------


def format_call_block(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The DSML block of ``(name, arguments)`` calls, from its leading ``\\n\\n`` to the
    closing tag: string values raw with ``string="true"``, every other value as JSON
    with ``string="false"``, in the arguments' own order."""
    return _join(_call_block_pieces(calls))


def _call_block_pieces(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Piece]:
    """format_call_block's pieces: the tags are the protocol's, names and values text."""
    pieces: list[Piece] = [*_CALL_BLOCK_OPEN]
    for i, (name, arguments) in enumerate(calls):
        if i:
            pieces.append("\n")
        pieces += [*_INVOKE_OPEN, name, '">\n']
        for j, (key, value) in enumerate(arguments.items()):
            if j:
                pieces.append("\n")
            raw = isinstance(value, str)
            text = value if raw else to_json(value)
            pieces += [*_PARAMETER_OPEN, key, f'" string="{"true" if raw else "false"}">', text, *_PARAMETER_CLOSE]
        pieces += [*_INVOKE_CLOSE]
    return [*pieces, *_CALLS_CLOSE]


# -- the conversation as turns ------------------------------------------------------------


@dataclass(frozen=True)
class _LeadingSystem:
    """Message 0 when it is a system message: the block that also hosts the tools."""

    text: str


@dataclass(frozen=True)
class _UserSideTurn:
    """A turn the assistant answers: a user or developer message, tool results merged
    with a following user text (``marker`` USER), or a mid-conversation system message
    (``marker`` SYSTEM)."""

    marker: str
    text: str


@dataclass(frozen=True)
class _AssistantTurn:
    content: str
    reasoning: str
    calls: tuple[tuple[str, Mapping[str, Any]], ...]


_Turn = _LeadingSystem | _UserSideTurn | _AssistantTurn


def _read_text(content: Any, field: str) -> str:
    """A message's content: a string, or text parts joined by a blank line."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatRequestError(field, f"{type(content).__name__} (allowed: a string or a list of text parts)")
    texts = []
    for j, part in enumerate(content):
        part_field = f"{field}[{j}]"
        if not isinstance(part, Mapping):
            raise ChatRequestError(part_field, f"{type(part).__name__} (allowed: an object with type 'text')")
        part_type = part.get("type")
        if part_type in _IMAGE_PART_TYPES:
            raise ChatRequestError(f"{part_field}.type", f"{part_type!r}: images are not supported (text only)")
        if part_type != "text":
            raise ChatRequestError(f"{part_field}.type", f"{part_type!r} (allowed: 'text')")
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatRequestError(f"{part_field}.text", f"{type(text).__name__} (allowed: a string)")
        texts.append(text)
    return "\n\n".join(texts)


def _read_call_arguments(arguments: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(arguments, str):
        raise ChatRequestError(field, f"{type(arguments).__name__} (allowed: a JSON object as a string)")
    try:
        parsed = parse_json(arguments)
    except ValueError as error:
        raise ChatRequestError(field, f"not valid JSON ({error})") from None
    if not isinstance(parsed, dict):
        raise ChatRequestError(field, f"a JSON {type(parsed).__name__} (allowed: a JSON object)")
    for key, value in parsed.items():
        # A quote would end the name attribute early; a DSML marker inside a value
        # would end the parameter early: either way the call could not be read back.
        if '"' in key or DSML in key:
            raise ChatRequestError(field, f"argument name {key!r} contains '\"' or {DSML!r}")
        if DSML in (value if isinstance(value, str) else to_json(value)):
            raise ChatRequestError(field, f"the value of {key!r} contains {DSML!r}")
    return parsed


def _read_assistant(message: Mapping[str, Any], field: str) -> tuple[_AssistantTurn, tuple[str, ...]]:
    """The assistant turn and its call ids in order."""
    content = message.get("content")
    text = "" if content is None else _read_text(content, f"{field}.content")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatRequestError(f"{field}.reasoning_content", f"{type(reasoning).__name__} (allowed: a string)")
    tool_calls = message.get("tool_calls")
    if tool_calls is None:
        tool_calls = []
    if not isinstance(tool_calls, list):
        raise ChatRequestError(f"{field}.tool_calls", f"{type(tool_calls).__name__} (allowed: a list of calls)")
    calls, ids = [], []
    for j, call in enumerate(tool_calls):
        call_field = f"{field}.tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ChatRequestError(call_field, f"{type(call).__name__} (allowed: an object)")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise ChatRequestError(f"{call_field}.id", f"{call_id!r} (allowed: a non-empty string)")
        if call_id in ids:
            raise ChatRequestError(f"{call_field}.id", f"{call_id!r} is used by an earlier call of this message")
        if call.get("type") != "function":
            raise ChatRequestError(f"{call_field}.type", f"{call.get('type')!r} (allowed: 'function')")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise ChatRequestError(f"{call_field}.function", f"{type(function).__name__} (allowed: an object)")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME_PATTERN.fullmatch(name):
            raise ChatRequestError(
                f"{call_field}.function.name", f"{name!r} (allowed: {TOOL_NAME_PATTERN.pattern}, OpenAI's rule)"
            )
        calls.append((name, _read_call_arguments(function.get("arguments"), f"{call_field}.function.arguments")))
        ids.append(call_id)
    return _AssistantTurn(text, reasoning or "", tuple(calls)), tuple(ids)


def _read_conversation(messages: Any) -> list[_Turn]:
    """The messages as turns: validated, tool results merged into one user-side turn
    in the order of the calls they answer."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages", "must be a non-empty list of messages")
    turns: list[_Turn] = []
    # The latest assistant's calls still collecting their tool messages.
    open_calls: tuple[str, ...] = ()
    open_calls_field = ""
    results: dict[str, str] = {}

    def close_results(joining_text: str | None) -> None:
        missing = [call_id for call_id in open_calls if call_id not in results]
        if missing:
            raise ChatRequestError(f"{open_calls_field}.tool_calls", f"no tool message answers the calls {missing}")
        blocks = [f"{TOOL_RESULT_START}{results[call_id]}{TOOL_RESULT_END}" for call_id in open_calls]
        if joining_text is not None:
            blocks.append(joining_text)
        turns.append(_UserSideTurn(USER, "\n\n".join(blocks)))

    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatRequestError(field, f"{type(message).__name__} (allowed: an object with a role)")
        role = message.get("role")
        if role not in ROLES:
            raise ChatRequestError(f"{field}.role", f"{role!r} (allowed: {', '.join(map(repr, ROLES))})")
        if role == "tool":
            if not open_calls:
                raise ChatRequestError(field, "a tool message must follow an assistant message with tool_calls")
            call_id = message.get("tool_call_id")
            if call_id not in open_calls:
                raise ChatRequestError(
                    f"{field}.tool_call_id",
                    f"{call_id!r} matches no call of {open_calls_field} (its ids: {list(open_calls)})",
                )
            if call_id in results:
                raise ChatRequestError(
                    f"{field}.tool_call_id", f"{call_id!r} is already answered by an earlier message"
                )
            results[call_id] = _read_text(message.get("content"), f"{field}.content")
            continue
        if role == "assistant":
            if open_calls:
                close_results(None)
            if not turns or not isinstance(turns[-1], _UserSideTurn):
                raise ChatRequestError(
                    field, "an assistant message must follow a user, developer, tool or (not leading) system message"
                )
            assistant, open_calls = _read_assistant(message, field)
            open_calls_field, results = field, {}
            turns.append(assistant)
            continue
        text = _read_text(message.get("content"), f"{field}.content")
        if open_calls:
            # A user text right after tool results joins their turn.
            close_results(text if role == "user" else None)
            open_calls = ()
            if role == "user":
                continue
        if role == "system":
            turns.append(_LeadingSystem(text) if i == 0 else _UserSideTurn(SYSTEM, text))
        else:  # user, developer: a developer message renders as a user turn
            turns.append(_UserSideTurn(USER, text))
    if open_calls:
        close_results(None)
    if not isinstance(turns[-1], _UserSideTurn):
        raise ChatRequestError(
            "messages", "must end with a user, developer, tool or (not leading) system message: the assistant is next"
        )
    return turns


# -- options ------------------------------------------------------------------------------


def read_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """The declared functions, each as the object its schema line shows (name,
    description, parameters; ``strict`` is an API flag the model does not see)."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ChatRequestError("tools", f"{type(tools).__name__} (allowed: a list of tools)")
    functions: list[dict[str, Any]] = []
    for k, tool in enumerate(tools):
        field = f"tools[{k}]"
        if not isinstance(tool, Mapping):
            raise ChatRequestError(field, f"{type(tool).__name__} (allowed: an object)")
        if tool.get("type") != "function":
            raise ChatRequestError(f"{field}.type", f"{tool.get('type')!r} (allowed: 'function')")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ChatRequestError(f"{field}.function", f"{type(function).__name__} (allowed: an object)")
        unknown = [key for key in function if key not in _TOOL_FUNCTION_KEYS]
        if unknown:
            raise ChatRequestError(
                f"{field}.function", f"unknown keys {unknown} (allowed: {list(_TOOL_FUNCTION_KEYS)})"
            )
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME_PATTERN.fullmatch(name):
            raise ChatRequestError(
                f"{field}.function.name", f"{name!r} (allowed: {TOOL_NAME_PATTERN.pattern}, OpenAI's rule)"
            )
        if any(declared["name"] == name for declared in functions):
            raise ChatRequestError(f"{field}.function.name", f"{name!r} is declared twice")
        declared: dict[str, Any] = {"name": name}
        if "description" in function:
            if not isinstance(function["description"], str):
                raise ChatRequestError(
                    f"{field}.function.description", f"{type(function['description']).__name__} (allowed: a string)"
                )
            declared["description"] = function["description"]
        if "parameters" in function:
            if not isinstance(function["parameters"], Mapping):
                raise ChatRequestError(
                    f"{field}.function.parameters",
                    f"{type(function['parameters']).__name__} (allowed: a JSON Schema object)",
                )
            declared["parameters"] = function["parameters"]
        if "strict" in function and not isinstance(function["strict"], bool):
            raise ChatRequestError(f"{field}.function.strict", f"{function['strict']!r} (allowed: true, false)")
        functions.append(declared)
    return tuple(functions)


def read_tool_choice(tool_choice: Any, functions: tuple[dict[str, Any], ...]) -> str:
    """``tool_choice`` as one of :data:`TOOL_CHOICES`, or the name of the one declared
    function a ``{"type": "function", "function": {"name": ...}}`` choice forces."""
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str) or set(tool_choice) != {"type", "function"}:
            raise ChatRequestError(
                "tool_choice", f"{_short(tool_choice)} (allowed: {{'type': 'function', 'function': {{'name': NAME}}}})"
            )
        declared = [f["name"] for f in functions]
        if name not in declared:
            raise ChatRequestError("tool_choice.function.name", f"{name!r} is not a declared tool (declared: {declared})")
        return name
    if tool_choice not in TOOL_CHOICES:
        raise ChatRequestError(
            "tool_choice", f"{_short(tool_choice)} (allowed: 'auto', 'none', 'required' or a named function)"
        )
    if tool_choice == "required" and not functions:
        raise ChatRequestError("tool_choice", "'required' needs at least one declared tool")
    return tool_choice


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reasoning_effort_budget(reasoning_effort: str | int | None) -> int:
    """The number the reasoning-effort line carries: a preset's value, an int in
    1..100 as given, or the default for None."""
    if reasoning_effort is None:
        return DEFAULT_REASONING_EFFORT
    if isinstance(reasoning_effort, str) and reasoning_effort in REASONING_EFFORT_PRESETS:
        return REASONING_EFFORT_PRESETS[reasoning_effort]
    if isinstance(reasoning_effort, int) and not isinstance(reasoning_effort, bool):
        if reasoning_effort in REASONING_EFFORT_RANGE:
            return reasoning_effort
    raise ChatRequestError(
        "reasoning_effort",
        f"{reasoning_effort!r} (allowed: {', '.join(map(repr, REASONING_EFFORT_PRESETS))} or an integer 1..100)",
    )


# The schema a json_object response follows (OpenAI: any JSON object).
JSON_OBJECT_SCHEMA: Mapping[str, Any] = MappingProxyType({"type": "object"})


def read_response_format(response_format: Any) -> Mapping[str, Any] | None:
    """The JSON schema a response must follow (:data:`JSON_OBJECT_SCHEMA` for
    ``json_object``), or None."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ChatRequestError("response_format", f"{type(response_format).__name__} (allowed: an object)")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise ChatRequestError("response_format.type", f"{kind!r} (allowed: 'text', 'json_object', 'json_schema')")
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, Mapping):
        raise ChatRequestError("response_format.json_schema", f"{type(json_schema).__name__} (allowed: an object)")
    schema = json_schema.get("schema")
    if not isinstance(schema, Mapping):
        raise ChatRequestError(
            "response_format.json_schema.schema", f"{type(schema).__name__} (allowed: a JSON Schema object)"
        )
    return schema


def _system_addendum(functions: tuple[dict[str, Any], ...], schema: Mapping[str, Any] | None) -> list[Piece]:
    """What follows the leading system message's content: the tools section, then the
    response-format instruction, each after a blank line.

    (?) Without a leading system message an empty one is put first to carry them (the
    released encoder's callers do that), so the addendum then starts right after
    ``<｜System｜>`` (or after the reasoning-effort line) with its blank line."""
    addendum: list[Piece] = []
    if functions:
        addendum += ["\n\n", *_TOOLS_SECTION_HEAD_PIECES, "\n".join(map(to_json, functions)), _TOOLS_SECTION_TAIL]
    if schema is not None:
        addendum += ["\n\n" + RESPONSE_FORMAT_INSTRUCTION, to_json(dict(schema))]
    return addendum


# -- rendering ----------------------------------------------------------------------------


def render_pieces(
    messages: list[Mapping[str, Any]],
    *,
    tools: list[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] = "auto",
    thinking: bool = False,
    reasoning_effort: str | int | None = None,
    response_format: Mapping[str, Any] | None = None,
) -> list[Piece]:
    """The prompt for an OpenAI-style chat request as pieces (the module docstring),
    ending with the assistant header after which the model generates. Raises
    :class:`ChatRequestError` naming the field of anything it cannot render.
    ``reasoning_effort`` applies to thinking mode only.

    ``tool_choice="none"`` leaves the tools out of the prompt (the parser then returns
    any call block as text); past calls in the messages are still rendered."""
    if not isinstance(thinking, bool):
        raise ChatRequestError("thinking", f"{thinking!r} (allowed: true, false)")
    functions = read_tools(tools)
    if read_tool_choice(tool_choice, functions) == "none":
        functions = ()
    if reasoning_effort is not None and not thinking:
        raise ChatRequestError("reasoning_effort", f"{reasoning_effort!r} is set but thinking is off")
    budget = reasoning_effort_budget(reasoning_effort)
    addendum = _system_addendum(functions, read_response_format(response_format))
    turns = _read_conversation(messages)
    if addendum and not isinstance(turns[0], _LeadingSystem):
        turns.insert(0, _LeadingSystem(""))
    # (?) "Any message declares tools" reads as: the prompt declares them (tools given
    # and tool_choice not "none"). Reasoning of turns before the last user-side turn is
    # dropped otherwise; a request ends with a user-side turn, so that is every past
    # assistant turn.
    keep_past_reasoning = thinking and bool(functions)

    pieces: list[Piece] = [Special(BOS)]
    if thinking:
        pieces += [Special(SYSTEM), REASONING_EFFORT_LINE.format(budget=budget)]
    for t, turn in enumerate(turns):
        if isinstance(turn, _LeadingSystem):
            if not thinking:  # in thinking mode the reasoning-effort line opened the block
                pieces.append(Special(SYSTEM))
            pieces += [turn.text, *addendum]
        elif isinstance(turn, _UserSideTurn):
            pieces += [Special(turn.marker), turn.text]
            if t + 1 == len(turns):
                pieces += [Special(ASSISTANT), Special(THINK_START if thinking else THINK_END)]
            elif isinstance(turns[t + 1], _AssistantTurn):
                pieces += [Special(ASSISTANT), Special(THINK_START if keep_past_reasoning else THINK_END)]
        else:
            if keep_past_reasoning:
                pieces += [turn.reasoning, Special(THINK_END)]
            pieces.append(turn.content)
            if turn.calls:
                pieces += _call_block_pieces(turn.calls)
            pieces.append(Special(EOS))
    return pieces


def render_chat(messages: list[Mapping[str, Any]], **options: Any) -> str:
    """The prompt of :func:`render_pieces` (same arguments) as text."""
    return _join(render_pieces(messages, **options))


# -- encoding -----------------------------------------------------------------------------


def text_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` that matches no added token: text goes through its
    normalizer, pre-tokenizer and model only, as if no special token existed.
    (``encode(..., add_special_tokens=False)`` only leaves out the post-processor's
    tokens: added tokens still match.) The copy marks every added token special and
    sets ``encode_special_tokens``, with which the tokenizer skips special tokens when
    it splits the input."""
    spec = json.loads(tokenizer.to_str())
    for token in spec.get("added_tokens", []):
        token["special"] = True
    copy = type(tokenizer).from_str(json.dumps(spec))
    copy.encode_special_tokens = True
    return copy


def longest_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most UTF-8 bytes one token of ``tokenizer`` stands for (its decoded text;
    a byte piece decodes to U+FFFD, which only overstates it), or None when a
    normalizer may change the text before tokenizing (then no bound holds)."""
    if tokenizer.normalizer is not None:
        return None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    return max(len(tokenizer.decode([i], skip_special_tokens=False).encode()) for i in range(size))


class PromptEncoder:
    """Where prompts become token ids, for one tokenizer.

    :meth:`encode_pieces` (a chat prompt from :func:`render_pieces`): every
    :class:`Special` piece its one added-token id, the text between them (adjacent text
    pieces joined, so the ids are those of the rendered text split at its markers)
    tokenized by :func:`text_tokenizer`'s copy, which matches no special token.
    :meth:`encode_text` (a raw completion prompt): the tokenizer as is, its
    post-processor included, special-token strings matched as vLLM does for a text
    prompt.

    Both refuse, before tokenizing, text too long to fit ``max_tokens`` whatever it
    holds: a tokenizer without a normalizer maps every token to at most
    :func:`longest_token_bytes` bytes of the text, so text of more than ``max_tokens``
    times that many bytes is longer than ``max_tokens`` tokens.

    A tokenizer that lacks a marker as an added token, or whose model turns a marker's
    text into the marker's id, is refused (ValueError: a server misconfiguration)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        added = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
        missing = [marker for marker in PROMPT_MARKERS if marker not in added]
        if missing:
            raise ValueError(f"tokenizer: the markers {missing} are not added tokens, so they would not be single ids")
        self._tokenizer = tokenizer
        self._text = text_tokenizer(tokenizer)
        self._marker_ids = {marker: added[marker] for marker in PROMPT_MARKERS}
        special_ids = set(added.values())
        leaking = [text for text in added if special_ids & set(self._text.encode(text, add_special_tokens=False).ids)]
        if leaking:
            raise ValueError(f"tokenizer: the text of {leaking} tokenizes to special-token ids even as plain text")
        self.longest_token_bytes = longest_token_bytes(tokenizer)

    def encode_pieces(self, pieces: Sequence[Piece], *, max_tokens: int | None = None, field: str = "messages") -> list[int]:
        texts = [piece for piece in pieces if not isinstance(piece, Special)]
        self._check_fits(sum(len(text.encode()) for text in texts), len(pieces) - len(texts), max_tokens, field)
        ids: list[int] = []
        pending: list[str] = []
        for piece in pieces:
            if isinstance(piece, Special):
                if pending:
                    ids += self._text.encode("".join(pending), add_special_tokens=False).ids
                    pending = []
                ids.append(self._marker_ids[piece.marker])
            else:
                pending.append(piece)
        if pending:
            ids += self._text.encode("".join(pending), add_special_tokens=False).ids
        return ids

    def encode_text(
        self, text: str, *, max_tokens: int | None = None, field: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        self._check_fits(len(text.encode()), 0, max_tokens, field)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def _check_fits(self, text_bytes: int, specials: int, max_tokens: int | None, field: str) -> None:
        if max_tokens is None or self.longest_token_bytes is None:
            return
        fewest = specials + -(-text_bytes // self.longest_token_bytes)
        if fewest > max_tokens:
            raise ChatRequestError(
                field,
                f"{text_bytes} bytes of text are at least {fewest} tokens (allowed: at most {max_tokens}, "
                "the context left for the prompt)",
            )
