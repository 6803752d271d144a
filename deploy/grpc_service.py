"""The gRPC ingress: ``dsv41.GenerateService/Generate`` on a listener the ingress owns.

Owns :class:`GenerateServicer` (the ``Generate`` method, served by a ``grpc.aio``
server), :func:`start_generate_server` (that server, bound to the address it is given),
:func:`request_body` (a ``GenerateRequest`` as the completions body the LLM servers
validate), :func:`response_for` (a token delta as a ``GenerateResponse``) and
:func:`grpc_code` (the one mapping of an ``OpenAIError``'s HTTP status onto a gRPC
status code).

Why not Ray Serve's gRPC proxy: it listens on every interface (``[::]:port``, with no
option for the host), so a server meant for this machine only would be reachable from
the network. The ingress replica (``deploy.app.OpenAIIngress``) starts this server on
``grpc_host:grpc_port`` instead; both protocols still share one set of LLM servers (one
engine per replica), and the request is validated by ``LLMServer.generate_stream``, the
same code that validates ``/v1/completions``, so both refuse the same requests with the
same messages. With an API key, a call must carry ``authorization: Bearer KEY``
metadata (UNAUTHENTICATED otherwise).

Must not import: ``torch``, ``model``, ``cache``, ``cluster``, ``actors``, ``fastapi``,
``deploy.app`` or ``deploy.llm_server`` (which import this module).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, AsyncIterator, Mapping

import grpc
from google.protobuf.message import DecodeError
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from dsv41.deploy.openai_errors import (
    OpenAIError,
    bad_request,
    bearer_matches,
    internal_error,
    replica_lost,
    unauthorized,
)
from dsv41.deploy.proto.generate_pb2 import DESCRIPTOR, GenerateRequest, GenerateResponse, Usage

logger = logging.getLogger(__name__)

# The HTTP statuses the LLM servers answer with, as gRPC codes (the usual HTTP <-> gRPC
# correspondence, as in grpc-gateway).
_GRPC_CODES: Mapping[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")
# Seconds in-flight calls get to finish when the ingress stops.
STOP_GRACE_S = 5.0


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
    """``dsv41.GenerateService``'s method for ``llm``, a handle to the LLM server
    deployment. A refused request ends the call with the status code of
    :func:`grpc_code` and the refusal's message as the details; with ``api_key``, a
    call without ``authorization: Bearer <api_key>`` is refused UNAUTHENTICATED."""

    def __init__(self, llm: DeploymentHandle, api_key: str | None) -> None:
        self.llm = llm
        self.api_key = api_key

    async def Generate(  # noqa: N802 - gRPC calls the method named like the RPC
        self, request: GenerateRequest | DecodeError, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[GenerateResponse]:
        request_id = uuid.uuid4().hex
        if self.api_key is not None:
            metadata = dict(context.invocation_metadata() or ())
            if not bearer_matches(metadata.get("authorization"), self.api_key):
                await _refuse(context, unauthorized())
        if isinstance(request, DecodeError):
            await _refuse(context, bad_request(None, f"the request is not a GenerateRequest: {request}"))
        try:
            body = request_body(request)
        except OpenAIError as error:
            await _refuse(context, error)
        deltas = self.llm.options(stream=True).generate_stream.remote(body, request_id)
        try:
            async for delta in deltas:
                if isinstance(delta, OpenAIError):
                    await _refuse(context, delta)
                yield response_for(delta)
        except BackPressureError:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "every LLM server queue is full; retry later")
        except grpc.aio.AbortError:
            raise
        except RayActorError:
            logger.exception("gRPC request %s: the LLM server replica died", request_id)
            await _refuse(context, replica_lost(request_id))
        except Exception:  # noqa: BLE001 - the caller gets the generic error, the log the details
            logger.exception("gRPC request %s failed", request_id)
            await _refuse(context, internal_error(request_id))
        finally:
            # A caller that goes away cancels this call; the LLM server then aborts the
            # request and frees its cache.
            deltas.cancel()


async def _refuse(context: grpc.aio.ServicerContext, error: OpenAIError) -> None:
    """Ends the call (``abort`` raises) with the refusal's code and message."""
    await context.abort(grpc_code(error), error.message)


def _read_request(data: bytes) -> GenerateRequest | DecodeError:
    """A request off the wire, or why it is not one (invalid UTF-8 in a string, say):
    handed to ``Generate``, which answers INVALID_ARGUMENT; a deserializer that raised
    would end the call INTERNAL, a server error for a client's bytes."""
    try:
        return GenerateRequest.FromString(data)
    except DecodeError as exc:
        return exc


async def start_generate_server(
    servicer: GenerateServicer, host: str, port: int, max_message_bytes: int
) -> tuple[grpc.aio.Server, int]:
    """A started ``grpc.aio`` server of ``servicer`` on ``host:port`` (port 0: any free
    one) that takes messages of at most ``max_message_bytes``; returns it and the port
    it bound. Several ingress replicas of one node share the port (gRPC sets
    SO_REUSEPORT), the kernel spreading connections over them. The method is registered
    here rather than by the generated ``add_GenerateServiceServicer_to_server``, for
    :func:`_read_request`."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes)])
    generate = grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=_read_request, response_serializer=GenerateResponse.SerializeToString
    )
    service = DESCRIPTOR.services_by_name["GenerateService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {"Generate": generate}),))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    if not bound:
        raise RuntimeError(f"grpc_port: could not listen on {address}")
    await server.start()
    return server, bound
