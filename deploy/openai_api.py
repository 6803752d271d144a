"""The OpenAI HTTP API's shapes: requests read and validated, responses and chunks written.

Owns :class:`OpenAIError` (an error answer: HTTP status and the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``), :func:`error_for` (the one
mapping of every refusal, :data:`REFUSALS`, onto it), :class:`CompletionRequest` and
:class:`ChatCompletionRequest` (a request body read field by field, every unknown or
unsupported field refused with a 400 that names it, turned into ``SamplingParams``),
and the writers of completion and chat responses, stream chunks, usage and logprobs:
:class:`CompletionWriter` assembles a completion answer (echo, prompt logprobs, whole
or streamed), :func:`chat_completion_response` and :class:`ChatStreamWriter` a chat answer
(reasoning, content, ``tool_calls``, finish reason) from the engine's outputs, read by
``deploy.chat_parser``. Nothing here runs a request.

Also owns :class:`RequestLimits` (what one request may hold before anything reads it:
body bytes, JSON nesting, messages, tools, schema nesting) and :func:`parse_body`, the
request body read through ``deploy.safe_json`` within them.

Errors never carry internal text to a client: a dead engine is answered with a generic
503 and an internal failure with a generic 500, each naming the request id the server's
log files the details under.

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

import functools
import hmac
import json
import logging
import re
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tokenizers import decoders

from dsv41.cluster.options import EngineError
from dsv41.cluster.request import (
    MAX_LOGPROBS,
    RequestOutput,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputs,
    short_repr,
)
from dsv41.deploy import safe_json
from dsv41.deploy.async_engine import EngineDeadError, RequestFailedError
from dsv41.deploy.chat_parser import ChatDelta, ParsedMessage, StreamingChatParser, parse_assistant_output
from dsv41.deploy.chat_protocol import ChatRequestError
from dsv41.deploy.structured_request import chat_structured_outputs, completion_structured_outputs

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16
SSE_DONE = "data: [DONE]\n\n"
# An error message quotes what it refuses; past this many characters it is cut.
MAX_ERROR_MESSAGE_CHARS = 1024

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


class OpenAIError(Exception):
    """An answer other than 200: ``status`` and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        error_type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        if len(message) > MAX_ERROR_MESSAGE_CHARS:
            message = message[: MAX_ERROR_MESSAGE_CHARS - 3] + "..."
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments do not survive the default pickling (Ray moves these).
        return (_rebuild_error, (self.status, self.message, self.param, self.error_type, self.code))


def _rebuild_error(status: int, message: str, param: str | None, error_type: str, code: str | None) -> OpenAIError:
    return OpenAIError(status, message, param=param, error_type=error_type, code=code)


def bad_request(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def model_not_found(model: str, served: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"model: {short_repr(model)} does not exist (served: {served!r})",
        param="model",
        code="model_not_found",
    )


def _named(request_id: str | None) -> str:
    return "" if request_id is None else f" (request id {request_id})"


def engine_unavailable(request_id: str | None) -> OpenAIError:
    """A 503 for a dead engine: another replica, or this one's replacement, can take
    the retry. Why it died is in the server's log, not here."""
    return OpenAIError(
        503, f"the engine is unavailable; retry later{_named(request_id)}", error_type="server_error", code="engine_dead"
    )


def internal_error(request_id: str | None) -> OpenAIError:
    """A 500 for a failure that is not the request's: what failed is in the server's log."""
    return OpenAIError(
        500,
        f"internal error; the server's log has the details{_named(request_id)}",
        error_type="server_error",
        code="internal_error",
    )


def unauthorized() -> OpenAIError:
    return OpenAIError(
        401,
        "missing or wrong API key (allowed: an Authorization: Bearer header with the server's key)",
        code="invalid_api_key",
    )


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether an ``Authorization`` value (HTTP header or gRPC metadata) is
    ``Bearer <key>``, compared in constant time (the scheme is case-insensitive, as
    HTTP's are)."""
    if authorization is None:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def payload_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413, f"the request body is larger than {limit} bytes (allowed: at most {limit})", code="request_too_large"
    )


def unsupported_media_type(content_type: str | None) -> OpenAIError:
    return OpenAIError(
        415,
        f"Content-Type: {short_repr(content_type)} (allowed: application/json, UTF-8)",
        code="unsupported_media_type",
    )


def request_failed(reason: str, request_id: str | None) -> OpenAIError:
    """A request the engine ended in error: a 500, as vLLM answers a finish reason of
    ``error`` (which is not one of OpenAI's). ``reason`` is the engine's own fixed
    message (``deploy.async_engine.REQUEST_FAILED_MESSAGE``), never an exception's."""
    return OpenAIError(
        500, f"Internal server error: {reason}{_named(request_id)}", error_type="server_error", code="request_failed"
    )


def replica_lost(request_id: str | None) -> OpenAIError:
    """The answer when the LLM server replica serving a call died (what a handle call
    then raises: RayActorError); Serve replaces it, so a retry can succeed."""
    return OpenAIError(
        503,
        f"the LLM server replica serving this request stopped; retry{_named(request_id)}",
        error_type="server_error",
        code="replica_lost",
    )


# Every exception error_for answers: a request refused (by this module, the chat
# protocol, the sampling parameters or the engine), one the engine failed, or an
# engine that died under it.
REFUSALS: tuple[type[Exception], ...] = (
    OpenAIError,
    ChatRequestError,
    SamplingParamsError,
    EngineError,
    EngineDeadError,
    RequestFailedError,
)


def error_for(exc: Exception, request_id: str | None = None) -> OpenAIError:
    """The answer to one of :data:`REFUSALS`: an OpenAIError is its own; a dead engine
    is a generic 503 ``engine_dead`` (the HTTP layer adds ``Retry-After``: another
    replica, or this one's replacement, can take the retry) and a failed request a 500
    ``request_failed``, each naming ``request_id``, the reason logged under it; anything
    the protocol, the sampling parameters or the engine refused is a 400 naming the
    field its message starts with."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        logger.error("request %s: the engine is unavailable: %s", request_id, exc)
        return engine_unavailable(request_id)
    if isinstance(exc, RequestFailedError):
        logger.error("request %s failed in the engine: %s", request_id, exc)
        return request_failed(str(exc), request_id)
    if isinstance(exc, ChatRequestError):
        return bad_request(exc.field, str(exc))
    if isinstance(exc, (SamplingParamsError, EngineError)):
        field, separator, _ = str(exc).partition(":")
        param = field if separator and field.isidentifier() else None
        if param == "prompt_token_ids":
            param = "prompt"
        return bad_request(param, str(exc))
    raise TypeError(f"error_for: {type(exc).__name__} is not a request error") from exc


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

    def params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        # (?) vLLM's rule: without max_tokens a chat answer may use the rest of the context.
        return build_params(self.sampling_fields, max(max_model_len - prompt_len, 1))


# -- writing a response -------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted (what ``tokenizers``' ByteLevel pre-tokenizer
    maps each byte to): a character of a ByteLevel token's string back to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(shifted)}}


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=8)
def _added_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's added tokens, read once per tokenizer (token_bytes
    runs for every logprob entry)."""
    return frozenset(tokenizer.get_added_tokens_decoder())


def token_bytes(tokenizer: Tokenizer, token_id: int) -> list[int]:
    """The token's own bytes (OpenAI's logprob ``bytes``): for a byte-level BPE token
    (DeepSeek's) the bytes its string stands for, which may be part of a character; a
    byte-fallback token ``<0xNN>`` its byte; an added token, or a token of any other
    tokenizer, the UTF-8 of its text."""
    piece = tokenizer.id_to_token(token_id)
    if piece is None or token_id in _added_token_ids(tokenizer):
        return list(token_text(tokenizer, token_id).encode())
    if isinstance(tokenizer.decoder, decoders.ByteLevel) and all(c in _BYTE_LEVEL_ALPHABET for c in piece):
        return [_BYTE_LEVEL_ALPHABET[c] for c in piece]
    fallback = _BYTE_FALLBACK_TOKEN.fullmatch(piece)
    if fallback is not None:
        return [int(fallback.group(1), 16)]
    return list(token_text(tokenizer, token_id).encode())


# OpenAI's stand-in for a logprob of -inf (JSON has no infinity), as vLLM writes it.
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _ranked(entry: Mapping[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    entries: Sequence[Mapping[int, float] | None],
    text_offset: int,
) -> dict[str, Any]:
    """OpenAI's completion ``logprobs`` object for these tokens; ``text_offset`` is
    where the first one starts in the choice's text. An entry of ``None`` (an echoed
    prompt's first token: nothing predicts it) has ``None`` for its logprob and its
    alternatives. Alternatives with the same text keep the best logprob."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    top_logprobs: list[dict[str, float] | None] = []
    for entry in entries:
        if entry is None:
            top_logprobs.append(None)
            continue
        alternatives: dict[str, float] = {}
        for alt, lp in _ranked(entry):
            alternatives.setdefault(token_text(tokenizer, alt), _logprob(lp))
        top_logprobs.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [None if entry is None else _logprob(entry[t]) for t, entry in zip(token_ids, entries)],
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def prompt_logprobs_field(
    tokenizer: Tokenizer, prompt: Sequence[int], entries: Sequence[Mapping[int, float] | None], top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a completion choice: per prompt token ``None`` (the
    first) or ``{token id: {"logprob", "rank", "decoded_token"}}`` for the top ``top``
    and the prompt's own token. ``rank`` (1 = the most likely) is known for the top
    ``top``; the prompt's token outside them has rank ``None`` (past ``top``, not counted)."""
    field: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(prompt, entries):
        if entry is None:
            field.append(None)
            continue
        ranked = _ranked(entry)
        outside = len(entry) > top  # the prompt's token is not among the top
        field.append(
            {
                str(alt): {
                    "logprob": _logprob(lp),
                    "rank": None if outside and alt == token_id else rank,
                    "decoded_token": token_text(tokenizer, alt),
                }
                for rank, (alt, lp) in enumerate(ranked, start=1)
            }
        )
    return field


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: tuple[int, ...], entries: tuple[dict[int, float], ...], top: int
) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object: per token its logprob, its own bytes and the
    ``top`` best."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(tokenizer, token_id), "logprob": _logprob(logprob), "bytes": token_bytes(tokenizer, token_id)}

    return {
        "content": [
            {
                **item(t, entry[t]),
                "top_logprobs": [item(alt, lp) for alt, lp in _ranked(entry)[:top]],
            }
            for t, entry in zip(token_ids, entries)
        ]
    }


class CompletionWriter:
    """One completion answer, whole (:meth:`response`) or streamed (:meth:`events`,
    :meth:`closing`), from the engine's outputs of each choice (index = prompt * n +
    sample, in any interleaving of the choices).

    With ``echo`` a choice starts with its prompt: the prompt's text (a text prompt as
    given, token ids decoded with special tokens), and with ``logprobs`` the prompt's
    tokens and entries before the completion's (a stream: on the choice's first chunk).
    A request that does not generate (``max_tokens`` 0) answers the prompt alone,
    finish reason ``length``, no completion tokens (?). With ``prompt_logprobs`` asked,
    a whole answer's choices carry vLLM's ``prompt_logprobs``."""

    _KIND = "text_completion"

    def __init__(
        self,
        request: CompletionRequest,
        prompts: Sequence[tuple[int, ...]],
        response_id: str,
        model: str,
        created: int,
        tokenizer: Tokenizer,
    ) -> None:
        self._request = request
        self._prompts = prompts
        self._response_id = response_id
        self._model = model
        self._created = created
        self._tokenizer = tokenizer
        self._echoed: set[int] = set()
        self._sent_text: dict[int, int] = {}
        self._sent_tokens: dict[int, int] = {}

    def response(self, finals: Mapping[int, RequestOutput]) -> dict[str, Any]:
        """The non-streamed answer from each choice's whole output."""
        sampling = self._request.sampling
        choices = []
        for index in sorted(finals):
            output = finals[index]
            text, token_ids, entries = self._piece(index, output)
            logprobs = None if entries is None else completion_logprobs(self._tokenizer, token_ids, entries, 0)
            choice = completion_choice(index, text, logprobs, self._finish_reason(output))
            if sampling.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_field(
                    self._tokenizer, self._prompt(index), output.prompt_logprobs or (), sampling.prompt_logprobs
                )
            choices.append(choice)
        return completion_response(
            self._response_id, self._model, self._created, choices, usage(self._prompt_tokens(), sum(self._sent_tokens.values()))
        )

    def events(self, index: int, output: RequestOutput) -> list[str]:
        """The chunk a delta of choice ``index`` adds (none while it adds no text, no
        logprobs and does not finish)."""
        text_from = self._sent_text.get(index, 0)
        text, token_ids, entries = self._piece(index, output)
        self._sent_text[index] = text_from + len(text)
        if not text and not output.finished and not (token_ids and entries is not None):
            return []
        logprobs = None if entries is None else completion_logprobs(self._tokenizer, token_ids, entries, text_from)
        choice = completion_choice(index, text, logprobs, self._finish_reason(output))
        return [chunk(self._KIND, self._response_id, self._model, self._created, [choice])]

    def closing(self) -> list[str]:
        """The usage chunk (with ``stream_options.include_usage``) and ``[DONE]``."""
        events = []
        if self._request.include_usage:
            counts = usage(self._prompt_tokens(), sum(self._sent_tokens.values()))
            events.append(chunk(self._KIND, self._response_id, self._model, self._created, [], counts))
        return [*events, SSE_DONE]

    def _prompt(self, index: int) -> tuple[int, ...]:
        return self._prompts[index // self._request.sampling.n]

    def _prompt_tokens(self) -> int:
        return sum(map(len, self._prompts))

    def _finish_reason(self, output: RequestOutput) -> str | None:
        if output.finish_reason is None:
            return None
        return output.finish_reason.value if self._request.generates else "length"

    def _piece(
        self, index: int, output: RequestOutput
    ) -> tuple[str, tuple[int, ...], tuple[Mapping[int, float] | None, ...] | None]:
        """The text, token ids and logprob entries a delta adds to choice ``index``'s
        answer (the echoed prompt first), counting its completion tokens."""
        want_logprobs = self._request.sampling.logprobs is not None
        if self._request.generates:
            text, token_ids, entries = output.text, output.token_ids, output.logprobs
        else:
            text, token_ids, entries = "", (), () if want_logprobs else None
        self._sent_tokens[index] = self._sent_tokens.get(index, 0) + len(token_ids)
        if self._request.echo and index not in self._echoed:
            self._echoed.add(index)
            prompt = self._prompt(index)
            given = self._request.prompts[index // self._request.sampling.n]
            prompt_text = given if isinstance(given, str) else self._tokenizer.decode(list(prompt), skip_special_tokens=False)
            text, token_ids = prompt_text + text, prompt + token_ids
            if entries is not None:
                prompt_entries = output.prompt_logprobs or ()
                if len(prompt_entries) != len(prompt):
                    raise RuntimeError(
                        f"request {output.request_id!r}: {len(prompt_entries)} prompt logprob entries for a prompt of "
                        f"{len(prompt)} tokens in its first output"
                    )
                entries = (*prompt_entries, *entries)
        return text, token_ids, entries


def completion_response(
    response_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_counts: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_counts,
    }


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(
    response_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_counts: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_counts,
    }


def chat_finish_reason(output: RequestOutput, message: ParsedMessage | None, called_tools: bool) -> str | None:
    """OpenAI's finish_reason: ``tool_calls`` when a stopped answer called tools."""
    if output.finish_reason is None:
        return None
    if output.finish_reason.value == "stop" and (called_tools or (message is not None and message.tool_calls)):
        return "tool_calls"
    return output.finish_reason.value


def chat_choice(
    index: int, message: ParsedMessage, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "message": message.to_openai(), "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk_choice(
    index: int, delta: ChatDelta | None, logprobs: dict[str, Any] | None, finish_reason: str | None, *, first: bool = False
) -> dict[str, Any]:
    content: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
    if delta is not None:
        content.update(delta.to_openai())
    return {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion_response(
    request: ChatCompletionRequest,
    response_id: str,
    model: str,
    created: int,
    finals: Mapping[int, RequestOutput],
    prompt_tokens: int,
    tokenizer: Tokenizer,
) -> dict[str, Any]:
    """The non-streamed chat answer from each choice's finished output: the text read
    back as an assistant message (reasoning, content, ``tool_calls``; a malformed call
    block stays content), ``finish_reason`` ``tool_calls`` when a stopped answer called
    tools, token logprobs when asked for, and usage."""
    top = request.top_logprobs
    choices = []
    for index in sorted(finals):
        output = finals[index]
        message = parse_assistant_output(output.text, thinking=request.thinking, tools_enabled=request.tools_enabled)
        logprobs = None if output.logprobs is None else chat_logprobs(tokenizer, output.token_ids, output.logprobs, top)
        choices.append(chat_choice(index, message, logprobs, chat_finish_reason(output, message, False)))
    generated = sum(len(o.token_ids) for o in finals.values())
    return chat_response(response_id, model, created, choices, usage(prompt_tokens, generated))


class ChatStreamWriter:
    """The SSE events of one streamed chat answer, written from the engine's cumulative
    output snapshots of each choice (in any interleaving of the choices).

    Per choice: :meth:`opening`'s role chunk, then reasoning and content deltas as the
    streaming parser makes them certain, each tool call whole (id, type, function name
    and JSON arguments) as its invoke closes, token logprobs on the first piece of
    their step, and a last chunk with the finish reason (``tool_calls`` when a stopped
    answer called tools). :meth:`closing` adds the usage chunk when asked for and
    ``[DONE]``. Joining the deltas gives :func:`chat_completion_response`'s message."""

    _KIND = "chat.completion.chunk"

    def __init__(self, request: ChatCompletionRequest, response_id: str, model: str, created: int, tokenizer: Tokenizer) -> None:
        self._request = request
        self._response_id = response_id
        self._model = model
        self._created = created
        self._tokenizer = tokenizer
        self._top = request.top_logprobs
        choices = range(request.n)
        self._parsers = {
            i: StreamingChatParser(thinking=request.thinking, tools_enabled=request.tools_enabled) for i in choices
        }
        self._sent_tokens = dict.fromkeys(choices, 0)
        self._called_tools = dict.fromkeys(choices, False)

    def opening(self) -> list[str]:
        """Each choice's first chunk: the assistant role with empty content."""
        return [self._chunk([chat_chunk_choice(i, None, None, None, first=True)]) for i in self._parsers]

    def events(self, index: int, output: RequestOutput) -> list[str]:
        """The chunks a delta of choice ``index`` adds (none while its new text could
        still start a marker and no logprobs are due)."""
        parser = self._parsers[index]
        deltas = parser.feed(output.text)
        if output.finished:
            deltas += parser.finish()
        logprobs = (
            None
            if output.logprobs is None or not output.token_ids
            else chat_logprobs(self._tokenizer, output.token_ids, output.logprobs, self._top)
        )
        self._sent_tokens[index] += len(output.token_ids)
        self._called_tools[index] |= any(d.tool_call is not None for d in deltas)
        # Token logprobs ride on the first piece of their step (or an empty delta).
        pieces: list[ChatDelta | None] = list(deltas) or ([None] if logprobs is not None else [])
        events = [
            self._chunk([chat_chunk_choice(index, delta, logprobs if position == 0 else None, None)])
            for position, delta in enumerate(pieces)
        ]
        if output.finished:
            finish = chat_finish_reason(output, None, self._called_tools[index])
            events.append(self._chunk([chat_chunk_choice(index, None, None, finish)]))
        return events

    def closing(self, prompt_tokens: int) -> list[str]:
        """The usage chunk (with ``stream_options.include_usage``) and ``[DONE]``."""
        events = []
        if self._request.include_usage:
            events.append(self._chunk([], usage(prompt_tokens, sum(self._sent_tokens.values()))))
        return [*events, SSE_DONE]

    def _chunk(self, choices: list[dict[str, Any]], usage_counts: dict[str, int] | None = None) -> str:
        return chunk(self._KIND, self._response_id, self._model, self._created, choices, usage_counts)


def chunk(kind: str, response_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_counts: dict[str, int] | None = None) -> str:
    """One SSE event of a stream: ``kind`` is ``text_completion`` or ``chat.completion.chunk``."""
    payload: dict[str, Any] = {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_counts is not None:
        payload["usage"] = usage_counts
    return sse(payload)


def sse(payload: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def now() -> int:
    return int(time.time())
