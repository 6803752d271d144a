"""The OpenAI API's error answers: every refusal and failure in one shape.

Owns :class:`OpenAIError` (an error answer: HTTP status and the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``), its constructors (a bad request
naming its field, an unknown model, 401, 413, 415, a failed request, a dead engine or
replica, an internal error), :func:`bearer_matches` (the API key compared in constant
time) and :func:`error_for`, the one mapping of every refusal (:data:`REFUSALS`: the
request readers', the chat protocol's, the sampling parameters', the engine's) onto
an answer.

Errors never carry internal text to a client: a dead engine is answered with a generic
503 and an internal failure with a generic 500, each naming the request id the server's
log files the details under.

Must not import: ``ray``, ``fastapi``, ``torch``, ``model``, ``cache``, ``actors``,
``deploy.app``, ``deploy.llm_server``.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from dsv41.cluster.options import EngineError
from dsv41.cluster.sampling_params import SamplingParamsError, short_repr
from dsv41.deploy.async_engine import EngineDeadError, RequestFailedError
from dsv41.deploy.chat_protocol import ChatRequestError

logger = logging.getLogger(__name__)

# An error message quotes what it refuses; past this many characters it is cut.
MAX_ERROR_MESSAGE_CHARS = 1024


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
