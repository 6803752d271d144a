"""What an OpenAI request asks its output to match, as the engine's StructuredOutputs.

Owns the reading of ``response_format`` (``json_object``, ``json_schema``), of vLLM's
extra ``structured_outputs`` field (``json``, ``json_object``, ``regex``, ``choice``,
``grammar``), and of ``tool_choice`` ``required`` / a named function and
``parallel_tool_calls: false``, into one ``cluster.request.StructuredOutputs``
(:func:`chat_structured_outputs`, :func:`completion_structured_outputs`), each parsed by
the grammar engine before the request is queued so an invalid schema, regex or grammar
is a 400 naming its field (``ChatRequestError``).

Tool calls are written in PROTOCOL.md's DSML syntax exactly as ``deploy.chat_protocol``
writes them and ``deploy.chat_parser`` reads them (:func:`tool_call_format`): the call
block ``\\n\\n<｜DSML｜ calls>``, each invoke ``\\n<｜DSML｜ invoke name="NAME">\\n``
with its parameters in the schema's order joined by ``\\n`` (a plain string raw with
``string="true"``, anything else JSON following its schema with ``string="false"``),
``\\n</｜DSML｜ invoke>``, then ``\\n</｜DSML｜ calls>`` and EOS. (xgrammar's own
``deepseek_v4_1`` tag lets whitespace vary around the tags, which the parser refuses.)

Thinking mode: the generation starts inside the reasoning, so every constraint is put
after ``</think>`` (:func:`after_reasoning`, as vLLM's reasoning parser gates the
mask): the reasoning is free text without ``<think>`` / ``</think>``.

The formats are xgrammar's structural-tag JSON, written here as plain dicts.

Must not import: ``ray``, ``torch``, ``xgrammar``, ``model``, ``cache``, ``actors``,
``deploy.app``. From ``cluster`` only ``cluster.request`` and
``cluster.structured_output``'s check; from ``deploy`` ``deploy.chat_protocol``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from dsv41.cluster.sampling_params import SamplingParamsError, StructuredOutputs, short_repr
from dsv41.cluster.structured_output import StructuredOutputError, check_structured_outputs, choice_ebnf
from dsv41.deploy.chat_protocol import (
    CALL_BLOCK_START,
    CALLS_END_TAG,
    INVOKE_END_TAG,
    INVOKE_TAG_START,
    PARAMETER_END_TAG,
    PARAMETER_TAG_START,
    THINK_END,
    THINK_START,
    ChatRequestError,
    read_response_format,
    read_tool_choice,
    read_tools,
)

# vLLM's structured_outputs keys this server runs (its backend-specific ones are refused).
STRUCTURED_OUTPUT_KEYS = ("json", "json_object", "regex", "choice", "grammar")
# Keys of a string parameter's schema that raw text (string="true") satisfies as it is
# (a length bound is not one: xgrammar's free text counts bytes that need not decode).
_RAW_STRING_KEYS = frozenset({"type", "description", "title"})
# What no parameter value may contain: it would end the value, the invoke or the block
# early for the parser.
_VALUE_EXCLUDES = (PARAMETER_END_TAG, INVOKE_END_TAG, CALLS_END_TAG)


def _checked(spec: StructuredOutputs, field: str) -> StructuredOutputs:
    try:
        check_structured_outputs(spec)
    except StructuredOutputError as exc:
        raise ChatRequestError(field, str(exc).partition(": ")[2]) from None
    return spec


def _spec(field: str, **kwargs: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**kwargs)
    except SamplingParamsError as exc:
        raise ChatRequestError(field, str(exc).partition(": ")[2]) from None


def read_structured_outputs(value: Any) -> StructuredOutputs | None:
    """vLLM's ``structured_outputs`` object (``json`` a schema object or its text)."""
    if value is None:
        return None
    field = "structured_outputs"
    if not isinstance(value, Mapping):
        raise ChatRequestError(field, f"{short_repr(value)} (allowed: an object with one of {', '.join(STRUCTURED_OUTPUT_KEYS)})")
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUT_KEYS))
    if unknown:
        raise ChatRequestError(f"{field}.{unknown[0]}", f"unknown (allowed: {', '.join(STRUCTURED_OUTPUT_KEYS)})")
    given = {k: v for k, v in value.items() if v not in (None, False)}
    if len(given) != 1:
        raise ChatRequestError(field, f"give exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}, got {sorted(given) or 'none'}")
    kind, spec_value = next(iter(given.items()))
    field = f"{field}.{kind}"
    if kind == "json":
        if isinstance(spec_value, Mapping):
            spec_value = json.dumps(spec_value)
        elif not isinstance(spec_value, str):
            raise ChatRequestError(field, f"{short_repr(spec_value)} (allowed: a JSON Schema object or its text)")
    if kind == "json_object" and spec_value is not True:
        raise ChatRequestError(field, f"{short_repr(spec_value)} (allowed: true)")
    if kind == "choice" and isinstance(spec_value, list):
        spec_value = tuple(spec_value)
    return _checked(_spec(field, **{kind: spec_value}), field)


def after_reasoning(content: Mapping[str, Any]) -> dict[str, Any]:
    """A structural-tag format: the reasoning (free text ending at ``</think>``), then
    ``content``."""
    reasoning = {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": [THINK_START, THINK_END]}, "end": THINK_END}
    return {"type": "sequence", "elements": [reasoning, dict(content)]}


def _structural_tag(fmt: Mapping[str, Any], field: str) -> StructuredOutputs:
    return _checked(_spec(field, structural_tag=json.dumps({"type": "structural_tag", "format": fmt})), field)


def _as_format(spec: StructuredOutputs) -> dict[str, Any]:
    """The structural-tag format of a spec (for the thinking-mode wrapper)."""
    if spec.kind == "json":
        return {"type": "json_schema", "json_schema": json.loads(spec.json)}
    if spec.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.regex}
    if spec.kind == "choice":
        return {"type": "grammar", "grammar": choice_ebnf(spec.choice)}
    return {"type": "grammar", "grammar": spec.grammar}


def _const(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


def _parameter_format(key: str, schema: Any, defs: Mapping[str, Any]) -> dict[str, Any]:
    raw = isinstance(schema, Mapping) and schema.get("type") == "string" and set(schema) <= _RAW_STRING_KEYS
    if raw:
        content: dict[str, Any] = {"type": "any_text", "excludes": list(_VALUE_EXCLUDES)}
    else:
        value_schema = {**defs, **schema} if isinstance(schema, Mapping) else schema
        content = {"type": "json_schema", "json_schema": value_schema}
        # xgrammar drops a string's length bounds where it filters substrings, so a
        # schema with bounds keeps them (and then relies on them: a string shorter
        # than the tags cannot hold one) rather than the filter.
        text = json.dumps(value_schema)
        if "minLength" not in text and "maxLength" not in text:
            content["excludes"] = list(_VALUE_EXCLUDES)
    begin = f'{PARAMETER_TAG_START}{key}" string="{"true" if raw else "false"}">'
    return {"type": "tag", "begin": "\n" + begin, "content": content, "end": PARAMETER_END_TAG}


def _invoke_format(function: Mapping[str, Any], field: str) -> dict[str, Any]:
    """One invoke of ``function``: its parameters in the schema's order, the required
    ones always, the others optionally, each after a newline; with none at all the
    body is the one empty line the parser reads as no parameters."""
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping):
        raise ChatRequestError(f"{field}.parameters.properties", f"{short_repr(properties)} (allowed: an object)")
    required = schema.get("required", [])
    if not isinstance(required, list) or not set(required) <= set(properties):
        raise ChatRequestError(
            f"{field}.parameters.required", f"{short_repr(required)} (allowed: a list of the declared properties)"
        )
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    items = []
    for key, value_schema in properties.items():
        if '"' in key or "\n" in key or not key:
            raise ChatRequestError(
                f"{field}.parameters.properties", f"{key!r} cannot be a DSML parameter name (no quote, no newline)"
            )
        items.append((key in required, _parameter_format(key, value_schema, defs)))
    end = "\n" + INVOKE_END_TAG
    begin = "\n" + INVOKE_TAG_START + function["name"] + '">'
    if any(is_required for is_required, _ in items):
        body: dict[str, Any] = {
            "type": "sequence",
            "elements": [fmt if is_required else {"type": "optional", "content": fmt} for is_required, fmt in items],
        }
    else:
        # At least one optional parameter, the first present one at i, or the empty line.
        choices: list[dict[str, Any]] = [_const("\n")]
        for i, (_, fmt) in enumerate(items):
            rest = [{"type": "optional", "content": later} for _, later in items[i + 1 :]]
            choices.append({"type": "sequence", "elements": [fmt, *rest]})
        body = {"type": "or", "elements": choices}
    return {"type": "tag", "begin": begin, "content": body, "end": end}


def tool_call_format(functions: tuple[dict[str, Any], ...], *, parallel: bool, fields: Mapping[str, str]) -> dict[str, Any]:
    """The call block over ``functions`` (one call at least; exactly one unless
    ``parallel``); ``fields`` names each function's request field for refusals."""
    invokes = [_invoke_format(f, fields[f["name"]]) for f in functions]
    calls = {"type": "tags_with_separator", "tags": invokes, "separator": "", "at_least_one": True, "stop_after_first": not parallel}
    return {"type": "sequence", "elements": [_const(CALL_BLOCK_START), calls, _const("\n" + CALLS_END_TAG)]}


def completion_structured_outputs(body: Mapping[str, Any]) -> StructuredOutputs | None:
    return read_structured_outputs(body.get("structured_outputs"))


def chat_structured_outputs(body: Mapping[str, Any], *, thinking: bool) -> StructuredOutputs | None:
    """The one constraint a chat body asks for (``response_format``, ``structured_outputs``,
    or tool calls that ``tool_choice`` / ``parallel_tool_calls`` require), put after the
    reasoning in thinking mode; None when the output is free. More than one is refused."""
    schema = read_response_format(body.get("response_format"))
    functions = read_tools(body.get("tools"))
    choice = read_tool_choice(body.get("tool_choice", "auto"), functions)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ChatRequestError("parallel_tool_calls", f"{short_repr(parallel)} (allowed: true, false)")
    asked: dict[str, Any] = {}
    if schema is not None:
        kind = "json_object" if body["response_format"].get("type") == "json_object" else "json"
        field = "response_format" if kind == "json_object" else "response_format.json_schema.schema"
        value = True if kind == "json_object" else json.dumps(dict(schema))
        asked[field] = _checked(_spec(field, **{kind: value}), field)
    structured = read_structured_outputs(body.get("structured_outputs"))
    if structured is not None:
        asked["structured_outputs"] = structured
    tools_forced = choice not in ("auto", "none")
    if functions and choice != "none" and (tools_forced or not parallel):
        asked["tool_choice"] = None
    if len(asked) > 1:
        names = sorted(asked)
        raise ChatRequestError(names[1], f"cannot be combined with {names[0]} (each constrains the whole output)")
    if not asked:
        return None
    field, spec = next(iter(asked.items()))
    if field != "tool_choice":
        return _structural_tag(after_reasoning(_as_format(spec)), field) if thinking else spec
    fields = {f["name"]: f"tools[{k}].function" for k, f in enumerate(functions)}
    forced = [f for f in functions if f["name"] == choice] if choice not in ("auto", "required") else list(functions)
    block = tool_call_format(tuple(forced), parallel=parallel, fields=fields)
    if choice == "auto":
        # parallel_tool_calls false alone: free text, then at most one call.
        trigger = CALL_BLOCK_START
        block = {
            "type": "triggered_tags",
            "triggers": [trigger],
            "tags": [{"type": "tag", "begin": trigger, "content": block["elements"][1], "end": block["elements"][2]["value"]}],
            "excludes": [THINK_START, THINK_END],
            "stop_after_first": True,
        }
    return _structural_tag(after_reasoning(block) if thinking else block, "tool_choice")

