"""The OpenAI HTTP API's requests: read, validated and turned into SamplingParams.

Owns :class:`CompletionRequest` and :class:`ChatCompletionRequest` (a request body
read field by field, every unknown or unsupported field refused with a 400 that names
it, turned into the one ``SamplingParams`` of the request). Errors are
``deploy.openai_errors``'; answers are written by ``deploy.openai_responses``. Nothing
here runs a request.

Also owns :class:`RequestLimits` (what one request may hold before anything reads it:
body bytes, JSON nesting, messages, tools, schema nesting) and :func:`parse_body`, the
request body read through ``deploy.safe_json`` within them.

Must not import: ``ray``, ``fastapi``, ``torch``, ``model``, ``cache``, ``actors``,
``deploy.app``, ``deploy.llm_server``. From ``cluster`` only ``cluster.request`` and ``cluster.engine``'s error
type; from ``deploy.async_engine`` only its error types.

Choices where the docs are unsure, each made in one place (marked (?) where made):
- a chat request without ``max_tokens`` gets the rest of the context (vLLM's rule); a
  completion request gets OpenAI's 16.
- thinking mode is asked for with ``chat_template_kwargs.thinking`` (vLLM's and
  SGLang's way for DeepSeek models); ``reasoning_effort`` alone turns it on.
- completion text and chat content leave special tokens out unless
  ``skip_special_tokens`` is false (vLLM's default); a chat answer keeps the markers
  its parser reads (``deploy.chat_parser.OUTPUT_MARKERS``) either way. EOS is never
  decoded.
- an echoed prompt with ``max_tokens`` 0 reports no completion tokens and finish
  reason ``length`` (OpenAI's answer; vLLM counts the one token its engine ran and
  dropped).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from dsv41.cluster.sampling_params import (
    MAX_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputs,
    short_repr,
)
from dsv41.deploy import safe_json
from dsv41.deploy.openai_errors import bad_request, error_for, payload_too_large
from dsv41.deploy.structured_request import chat_structured_outputs, completion_structured_outputs

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16

# Fields the OpenAI API defines that this server does not implement: accepted only at
# the value that means "off", so a request never silently gets less than it asked for.
_OFF_VALUES: Mapping[str, tuple[Any, ...]] = {
    "suffix": (None,),
    "best_of": (None, 1),
}
_COMMON_FIELDS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "seed",
    "ignore_eos",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "structured_outputs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
COMPLETION_FIELDS = (
    *_COMMON_FIELDS,
    "prompt",
    "max_completion_tokens",
    "logprobs",
    "prompt_logprobs",
    "echo",
    "suffix",
    "best_of",
)
CHAT_FIELDS = (
    *_COMMON_FIELDS,
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "chat_template_kwargs",
    "response_format",
)
CHAT_TEMPLATE_KWARGS = ("thinking",)



# -- reading a request ------------------------------------------------------------------


@dataclass(frozen=True)
class RequestLimits:
    """What one request may hold, checked before it is parsed or queued (every bound
    that depends on the engine, such as the context, is the LLM server's).

    ``max_body_bytes``: a larger body is answered 413 before it is read whole.
    ``max_json_depth``: nesting of arrays and objects in the body (checked by a scan
    before the parser runs). ``max_messages``, ``max_tools``: list lengths of a chat
    request (128 tools is OpenAI's own limit). ``max_schema_depth``: nesting of a tool's
    ``parameters`` and of a ``response_format`` schema (the prompt carries them)."""

    max_body_bytes: int = 8 << 20
    max_json_depth: int = 64
    max_messages: int = 1024
    max_tools: int = 128
    max_schema_depth: int = 32

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"limits.{name}: {value!r} (allowed: an integer >= 1)")
        if self.max_schema_depth >= self.max_json_depth:
            raise ValueError(
                f"limits.max_schema_depth: {self.max_schema_depth} (allowed: below max_json_depth, "
                f"{self.max_json_depth}: a schema nests inside the body)"
            )

    @classmethod
    def from_dict(cls, limits: Mapping[str, Any]) -> "RequestLimits":
        unknown = sorted(set(limits) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"limits: unknown {unknown} (allowed: {sorted(cls.__dataclass_fields__)})")
        return cls(**limits)


def parse_body(raw: bytes, limits: RequestLimits) -> dict[str, Any]:
    """The JSON object of a request body: UTF-8 (RFC 8259's only encoding for JSON on
    the wire) read by ``deploy.safe_json`` within ``limits``; 413 past
    ``max_body_bytes``, 400 for anything else that is not a JSON object."""
    if len(raw) > limits.max_body_bytes:
        raise payload_too_large(limits.max_body_bytes)
    try:
        body = safe_json.loads(raw.decode("utf-8"), max_depth=limits.max_json_depth)
    except UnicodeDecodeError as exc:
        raise bad_request(None, f"the request body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except safe_json.JSONLimitError as exc:
        field = None if exc.path is None else re.split(r"[.\[ ]", exc.path, maxsplit=1)[0]
        raise bad_request(field, f"the request body: {exc}") from None
    except ValueError as exc:
        raise bad_request(None, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(None, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_fields(body: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise bad_request(unknown[0], f"{unknown[0]}: unknown field (allowed: {', '.join(sorted(allowed))})")
    for name, off in _OFF_VALUES.items():
        if name in body and body[name] not in off:
            raise bad_request(name, f"{name}: {short_repr(body[name])} is not supported (allowed: {off[-1]!r} or absent)")


def _optional(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int in Python, not in JSON.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        allowed = " or ".join(k.__name__ for k in kinds)
        raise bad_request(name, f"{name}: {short_repr(value)} (allowed: {allowed})")
    return value


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model", f"model: {short_repr(model)} (allowed: a served model name)")
    return model


def _include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    options = _optional(body, "stream_options", (dict,), {})
    if options and not stream:
        raise bad_request("stream_options", "stream_options: only allowed with stream: true")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise bad_request("stream_options", f"stream_options.{unknown[0]}: unknown (allowed: include_usage)")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("stream_options", f"stream_options.include_usage: {short_repr(include)} (allowed: true, false)")
    return include


# Body fields read as SamplingParams' fields of the same name, and the JSON types each
# may have (an absent one takes SamplingParams' default).
_NUMBERS = (int, float)
_SAMPLING_FIELDS: Mapping[str, tuple[type, ...]] = {
    "temperature": _NUMBERS,
    "top_p": _NUMBERS,
    "top_k": (int,),
    "n": (int,),
    "seed": (int,),
    "ignore_eos": (bool,),
    "presence_penalty": _NUMBERS,
    "frequency_penalty": _NUMBERS,
    "repetition_penalty": _NUMBERS,
    "min_p": _NUMBERS,
    "min_tokens": (int,),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
}


def _read_sampling(
    body: Mapping[str, Any],
    max_tokens_field: str,
    logprobs: int | None,
    structured: StructuredOutputs | None,
    prompt_logprobs: int | None = None,
) -> Mapping[str, Any]:
    """SamplingParams' keyword arguments from the body, each of the type JSON allows
    (``max_tokens`` only when given): what :func:`build_params` builds the request's
    one SamplingParams from, which checks the ranges."""
    fields: dict[str, Any] = {
        name: _optional(body, name, kinds, None) for name, kinds in _SAMPLING_FIELDS.items() if body.get(name) is not None
    }
    for name in ("stop", "stop_token_ids"):
        value = body.get(name)
        value = () if value is None else (value,) if name == "stop" and isinstance(value, str) else value
        if not isinstance(value, (list, tuple)):
            raise bad_request(name, f"{name}: {short_repr(body.get(name))} (allowed: a list)")
        fields[name] = tuple(value)
    max_tokens = body.get(max_tokens_field)
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise bad_request(max_tokens_field, f"{max_tokens_field}: {short_repr(max_tokens)} (allowed: an integer >= 1)")
        fields["max_tokens"] = max_tokens
    fields["logit_bias"] = _read_logit_bias(body.get("logit_bias"))
    fields["logprobs"] = logprobs
    fields["prompt_logprobs"] = prompt_logprobs
    fields["structured_outputs"] = structured
    return MappingProxyType(fields)


def _read_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token ids as JSON object keys (decimal strings)."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise bad_request("logit_bias", f"logit_bias: {short_repr(value)} (allowed: an object of token id -> bias)")
    items = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdecimal() and key.isascii()):
            raise bad_request("logit_bias", f"logit_bias: key {short_repr(key)} is not a token id (allowed: decimal integers)")
        if not isinstance(bias, _NUMBERS) or isinstance(bias, bool):
            raise bad_request("logit_bias", f"logit_bias: {short_repr(bias)} for token {key} (allowed: a number)")
        items.append((int(key), bias))
    return tuple(items)


def build_params(fields: Mapping[str, Any], default_max_tokens: int) -> SamplingParams:
    """The request's SamplingParams, built once (400 naming the field when out of range)."""
    try:
        return SamplingParams(**{"max_tokens": default_max_tokens, **fields})
    except SamplingParamsError as exc:
        raise error_for(exc) from None


Prompt = str | tuple[int, ...]


def _read_prompts(prompt: Any) -> tuple[Prompt, ...]:
    """``prompt`` as OpenAI allows it: a string, a list of strings, a list of token
    ids, or a list of token-id lists; one engine request per prompt."""

    def is_ids(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        )

    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif is_ids(prompt):
        prompts = [tuple(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt):
        prompts = [tuple(p) for p in prompt]
    else:
        raise bad_request(
            "prompt",
            "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists "
            "(none empty)",
        )
    if any(p == "" for p in prompts):
        raise bad_request("prompt", "prompt: an empty string (allowed: at least one token)")
    return tuple(prompts)


@dataclass(frozen=True)
class CompletionRequest:
    """A ``/v1/completions`` body. ``logprobs`` is OpenAI's integer (top alternatives).

    ``echo`` puts each prompt (its text, and with ``logprobs`` its tokens' entries,
    ``None`` for the first) before the choice's completion; ``max_tokens`` 0 is allowed
    with it and answers the prompt alone (``generates`` False: the engine runs one step
    for the prompt's logprobs, its token dropped). ``prompt_logprobs`` is vLLM's extra
    field (the choice's ``prompt_logprobs``); with ``echo``, ``logprobs`` asks for them."""

    model: str
    prompts: tuple[Prompt, ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False
    generates: bool = True

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "CompletionRequest":
        _check_fields(body, COMPLETION_FIELDS)
        stream = _optional(body, "stream", (bool,), False)
        logprobs = _optional(body, "logprobs", (int,), None)
        echo = _optional(body, "echo", (bool,), False)
        prompt_logprobs = _optional(body, "prompt_logprobs", (int,), None)
        if prompt_logprobs is not None and stream:
            raise bad_request(
                "prompt_logprobs", "prompt_logprobs: not available with stream: true (echo with logprobs streams them)"
            )
        if "prompt" not in body:
            raise bad_request("prompt", "prompt: required")
        if "max_tokens" in body and "max_completion_tokens" in body:
            raise bad_request("max_tokens", "max_tokens: give max_tokens or max_completion_tokens, not both")
        max_tokens_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = body.get(max_tokens_field)
        prompt_only = isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens == 0
        if prompt_only and not echo:
            raise bad_request(max_tokens_field, f"{max_tokens_field}: 0 needs echo: true (allowed: an integer >= 1)")
        if prompt_logprobs is None and echo:
            prompt_logprobs = logprobs
        return cls(
            model=_model(body),
            prompts=_read_prompts(body["prompt"]),
            sampling=build_params(
                _read_sampling(
                    {**body, max_tokens_field: 1} if prompt_only else body,
                    max_tokens_field,
                    logprobs,
                    completion_structured_outputs(body),
                    prompt_logprobs,
                ),
                DEFAULT_COMPLETION_MAX_TOKENS,
            ),
            stream=stream,
            include_usage=_include_usage(body, stream),
            echo=echo,
            generates=not prompt_only,
        )

    def params(self) -> SamplingParams:
        return self.sampling


def _check_chat_sizes(body: Mapping[str, Any], limits: RequestLimits) -> None:
    """The bounds on what a chat prompt is built from, checked before it is read."""
    for name, limit in (("messages", limits.max_messages), ("tools", limits.max_tools)):
        items = body.get(name)
        if isinstance(items, list) and len(items) > limit:
            raise bad_request(name, f"{name}: {len(items)} entries (allowed: at most {limit})")
    schemas: list[tuple[str, Any]] = []
    tools = body.get("tools")
    for k, tool in enumerate(tools if isinstance(tools, list) else ()):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and "parameters" in function:
            schemas.append((f"tools[{k}].function.parameters", function["parameters"]))
    response_format = body.get("response_format")
    json_schema = response_format.get("json_schema") if isinstance(response_format, Mapping) else None
    if isinstance(json_schema, Mapping) and "schema" in json_schema:
        schemas.append(("response_format.json_schema.schema", json_schema["schema"]))
    for field, schema in schemas:
        depth = safe_json.value_depth(schema)
        if depth > limits.max_schema_depth:
            raise bad_request(field, f"{field}: nested {depth} levels deep (allowed: at most {limits.max_schema_depth})")


@dataclass(frozen=True)
class ChatCompletionRequest:
    """A ``/v1/chat/completions`` body: the conversation and its protocol options
    (rendered by ``deploy.chat_protocol.render_pieces``) and the sampling fields."""

    model: str
    messages: list[Any]
    tools: list[Any] | None
    tool_choice: str | Mapping[str, Any]
    thinking: bool
    reasoning_effort: str | int | None
    response_format: Mapping[str, Any] | None
    # SamplingParams' fields as read; params() builds the one SamplingParams once the
    # prompt's length (the default max_tokens) is known.
    sampling_fields: Mapping[str, Any]
    stream: bool
    include_usage: bool

    @classmethod
    def from_json(cls, body: Mapping[str, Any], limits: RequestLimits = RequestLimits()) -> "ChatCompletionRequest":
        """The request read from ``body``; 400 naming the field for anything it cannot
        run, the list lengths and schema nesting of ``limits`` included."""
        _check_fields(body, CHAT_FIELDS)
        _check_chat_sizes(body, limits)
        stream = _optional(body, "stream", (bool,), False)
        if "max_tokens" in body and "max_completion_tokens" in body:
            raise bad_request("max_tokens", "max_tokens: give max_tokens or max_completion_tokens, not both")
        max_tokens_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        want_logprobs = _optional(body, "logprobs", (bool,), False)
        top_logprobs = _optional(body, "top_logprobs", (int,), None)
        if top_logprobs is not None and not want_logprobs:
            raise bad_request("top_logprobs", "top_logprobs: only allowed with logprobs: true")
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
            raise bad_request("top_logprobs", f"top_logprobs: {top_logprobs} (allowed: 0..{MAX_LOGPROBS})")
        kwargs = _optional(body, "chat_template_kwargs", (dict,), {})
        unknown = sorted(set(kwargs) - set(CHAT_TEMPLATE_KWARGS))
        if unknown:
            raise bad_request(
                "chat_template_kwargs",
                f"chat_template_kwargs.{unknown[0]}: unknown (allowed: {', '.join(CHAT_TEMPLATE_KWARGS)})",
            )
        reasoning_effort = body.get("reasoning_effort")
        # (?) reasoning_effort alone asks for thinking; an explicit thinking: false with
        # it is refused by the protocol (effort without thinking).
        thinking = kwargs.get("thinking", reasoning_effort is not None)
        if not isinstance(thinking, bool):
            raise bad_request(
                "chat_template_kwargs", f"chat_template_kwargs.thinking: {short_repr(thinking)} (allowed: true, false)"
            )
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise bad_request("messages", "messages: required, a non-empty list of messages")
        tool_choice = body.get("tool_choice", "auto")
        return cls(
            model=_model(body),
            messages=messages,
            tools=body.get("tools"),
            tool_choice=tool_choice,
            thinking=thinking,
            reasoning_effort=reasoning_effort,
            response_format=body.get("response_format"),
            sampling_fields=_read_sampling(
                body,
                max_tokens_field,
                (top_logprobs or 0) if want_logprobs else None,
                chat_structured_outputs(body, thinking=thinking),
            ),
            stream=stream,
            include_usage=_include_usage(body, stream),
        )

    @property
    def tools_enabled(self) -> bool:
        """Whether the output is read for tool calls (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def n(self) -> int:
        return self.sampling_fields.get("n", SamplingParams.n)

    @property
    def top_logprobs(self) -> int:
        return self.sampling_fields["logprobs"] or 0

    def params(self, prompt_len: int, max_model_len: int, kept_special_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """The request's SamplingParams, built once its prompt is rendered; a chat answer
        keeps ``kept_special_token_ids`` (its parser's markers) in its text."""
        # (?) vLLM's rule: without max_tokens a chat answer may use the rest of the context.
        fields = {**self.sampling_fields, "kept_special_token_ids": kept_special_token_ids}
        return build_params(fields, max(max_model_len - prompt_len, 1))
