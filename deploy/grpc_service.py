"""The gRPC ingress: ``dsv41.GenerateService/Generate`` served through Ray Serve's gRPC proxy.

Owns :class:`GenerateServicer` (the ``Generate`` method Serve's gRPC proxy calls by
name on the application's ingress), :func:`request_body` (a ``GenerateRequest`` as the
completions body the LLM servers validate), :func:`response_for` (a token delta as a
``GenerateResponse``), :func:`grpc_code` (the one mapping of an ``OpenAIError``'s HTTP
status onto a gRPC status code) and :data:`GRPC_SERVICER_FUNCTIONS` (what
``gRPCOptions(grpc_servicer_functions=...)`` must register in the proxy).

Serve sends every HTTP and gRPC call of an application to its single ingress
deployment, so the servicer is a base class of ``deploy.app.OpenAIIngress`` rather than
a deployment of its own: both protocols then share one set of LLM servers (one engine
per replica). The request is validated by ``LLMServer.generate_stream``, the same code
that validates ``/v1/completions``, so both protocols refuse the same requests with the
same messages.

Must not import: ``torch``, ``model``, ``cache``, ``cluster``, ``actors``, ``fastapi``,
or ``deploy.app`` (which imports this module).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Mapping, NoReturn

import grpc
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from deploy.openai_api import OpenAIError, bad_request, replica_lost
from deploy.proto.generate_pb2 import GenerateRequest, GenerateResponse, Usage

GRPC_SERVICER_FUNCTIONS = ("deploy.proto.generate_pb2_grpc.add_GenerateServiceServicer_to_server",)

# The HTTP statuses the LLM servers answer with, as gRPC codes (the usual HTTP <-> gRPC
# correspondence, as in grpc-gateway).
_GRPC_CODES: Mapping[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")


class GenerateRefused(Exception):
    """Ends a ``Generate`` call whose status code is already set on the gRPC context.

    Serve's proxy copies a context's code to the caller only with a streamed message
    or with an exception raised after the code was set, so a refusal is raised."""


def grpc_code(error: OpenAIError) -> grpc.StatusCode:
    if error.status not in _GRPC_CODES:
        raise ValueError(f"status: {error.status} has no gRPC code (allowed: {sorted(_GRPC_CODES)})")
    return _GRPC_CODES[error.status]


def request_body(request: GenerateRequest) -> dict[str, Any]:
    """The completions body of a request: unset optional fields are left out, so they
    take the HTTP API's defaults; an empty ``model`` means the served model."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise bad_request("prompt", "prompt: required (allowed: text or token_ids)")
    body: dict[str, Any] = {"prompt": request.text if kind == "text" else list(request.token_ids.ids)}
    if request.model:
        body["model"] = request.model
    for name in _SAMPLING_FIELDS:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.ignore_eos:
        body["ignore_eos"] = True
    return body


def response_for(delta: Mapping[str, Any]) -> GenerateResponse:
    """The message of one ``LLMServer.generate_stream`` delta."""
    response = GenerateResponse(token_ids=delta["token_ids"], text=delta["text"], finish_reason=delta["finish_reason"] or "")
    if delta["usage"] is not None:
        response.usage.CopyFrom(Usage(**delta["usage"]))
    return response


class GenerateServicer:
    """``dsv41.GenerateService``'s methods for an ingress holding ``llm``, a handle to
    the LLM server deployment. A refused request ends the call with the status code of
    :func:`grpc_code` and the refusal's message as the details."""

    llm: DeploymentHandle

    async def Generate(  # noqa: N802 - Serve calls the method named like the RPC
        self, request: GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[GenerateResponse]:
        try:
            body = request_body(request)
        except OpenAIError as error:
            _refuse(grpc_context, error)
        deltas = self.llm.options(stream=True).generate_stream.remote(body)
        try:
            async for delta in deltas:
                if isinstance(delta, OpenAIError):
                    _refuse(grpc_context, delta)
                yield response_for(delta)
        except BackPressureError as exc:
            _end(grpc_context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"every LLM server queue is full; retry later ({exc})")
        except RayActorError:
            _refuse(grpc_context, replica_lost())
        finally:
            # A caller that goes away cancels this call; the LLM server then aborts the
            # request and frees its cache.
            deltas.cancel()


def _refuse(grpc_context: RayServegRPCContext, error: OpenAIError) -> NoReturn:
    _end(grpc_context, grpc_code(error), error.message)


def _end(grpc_context: RayServegRPCContext, code: grpc.StatusCode, details: str) -> NoReturn:
    grpc_context.set_code(code)
    grpc_context.set_details(details)
    raise GenerateRefused(details)
