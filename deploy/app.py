"""The Ray Serve application: an OpenAI-compatible HTTP ingress in front of LLM servers.

Owns :class:`OpenAIIngress` (the FastAPI deployment: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models`` and ``/v1/models/{id}``, vLLM's ``/tokenize``,
``/detokenize``, ``/tokenizer_info`` (``deploy.tokenizer_api``) and ``/version``,
``/health``, ``/metrics``, and the gRPC ``Generate`` of ``deploy.grpc_service`` on
its own listener) in front of the LLM servers (deploy/llm_server.py), :func:`build_app`
(the ``import_path`` of ``deploy/configs/*.yaml``: AppArgs of deploy/app_args.py to a
Serve application), and :func:`run_app`, ``serve.run`` with a deadline.

What the ingress accepts (:class:`IngressOptions`): with an API key, every ``/v1``
route and the gRPC call need it (``Authorization: Bearer KEY``, compared in constant
time; 401 otherwise), ``/health`` and ``/metrics`` too unless they are public (the
default); a POST body must be ``application/json`` (415 otherwise: a ``text/plain``
body is what a cross-site form may send without asking) and at most
``limits.max_body_bytes`` (413, refused before it is read whole), then it is parsed
within ``limits`` (``deploy.openai_api.parse_body``). Every answer other than 200 has
the OpenAI error shape (unknown routes and methods included); a failure that is not
the request's is a generic 500 naming Serve's request id (``X-Request-ID``), the
details logged under it.

Overload is Serve's: each deployment has ``max_ongoing_requests`` and
``max_queued_requests``; a full LLM server queue answers 429 with ``Retry-After``, a
full ingress queue is answered 503 by Serve's proxy. Replicas scale through Serve's
``autoscaling_config`` on ongoing requests; a replica is a whole engine.

Faults: a request that fails is answered in the OpenAI error shape (a stream: an
error event, then ``[DONE]``, as vLLM does), including when the replica serving it
dies (the ingress answers 503); replicas are replaced by Serve (deploy/llm_server.py).

Resources: an LLM server replica reserves what ``ray_actor_options`` asks (Serve's
default: one CPU, which its engine's step loop uses); the ingress, which only relays,
reserves no CPU unless ``ingress_ray_actor_options`` says so. With Serve's default of a
whole CPU for it, an application on a 2-CPU node held both CPUs, and a second
application's replicas waited forever to be placed.

Must not import at module level: ``torch`` or ``actors``. Must not be imported by
``model``, ``cache``, ``cluster``, ``actors``.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime.
import importlib.metadata
import logging
import time
import uuid
from typing import Any, AsyncIterator, Mapping

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, TaskCancelledError
from ray.serve.exceptions import BackPressureError
from ray.serve.schema import ApplicationStatus
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from dsv41.deploy.app_args import RETRY_AFTER_S, AppArgs, IngressOptions
from dsv41.deploy.grpc_service import STOP_GRACE_S, GenerateServicer, start_generate_server
from dsv41.deploy.llm_server import LLMServer, llm_server_placement
from dsv41.deploy.heap import IdleHeapTrim, idle_heap_trim, serving
from dsv41.deploy.memory_probe import probe_for, read_probe
from dsv41.deploy.metrics import METRICS_CONTENT_TYPE
from dsv41.deploy.openai_api import parse_body
from dsv41.deploy.openai_errors import (
    OpenAIError,
    bearer_matches,
    internal_error,
    model_not_found,
    payload_too_large,
    replica_lost,
    unauthorized,
    unsupported_media_type,
)
from dsv41.deploy.openai_responses import SSE_DONE, now, sse

logger = logging.getLogger(__name__)

# -- the HTTP ingress ---------------------------------------------------------------------

api = FastAPI(title="dsv41", description="DeepSeek-V4.1 on a paged runtime: OpenAI-compatible API")


def _error_response(error: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status in (429, 503) else None
    if error.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _overloaded() -> OpenAIError:
    return OpenAIError(
        429, "the server is overloaded: every LLM server queue is full; retry later", error_type="server_error", code="overloaded"
    )


def _request_id(request: Request) -> str:
    """Serve's id of the request (its proxy sets ``x-request-id`` and answers it as
    ``X-Request-ID``), under which its logs and ours file the request."""
    return request.headers.get("x-request-id") or uuid.uuid4().hex


# Registered before the ingress class copies the app (serve.ingress freezes it).
@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Unknown routes, wrong methods: the OpenAI error shape, not FastAPI's."""
    error = OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=None)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


@api.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """Anything a route did not answer: logged with its traceback, answered generically
    (a call Serve cancelled because its client went away is no failure: nobody reads
    the answer)."""
    request_id = _request_id(request)
    if isinstance(exc, TaskCancelledError):
        logger.debug("request %s: cancelled (the client went away)", request_id)
    else:
        logger.error("request %s failed", request_id, exc_info=exc)
    return _error_response(internal_error(request_id))


def _is_json(content_type: str | None) -> bool:
    """``application/json``, with no charset or UTF-8's."""
    if content_type is None:
        return False
    media_type, *parameters = (part.strip().lower() for part in content_type.split(";"))
    charsets = [value.strip('"') for name, _, value in (p.partition("=") for p in parameters) if name.strip() == "charset"]
    return media_type == "application/json" and all(charset in ("utf-8", "utf8") for charset in charsets)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it passes ``limit`` bytes: by its declared
    length before any byte is read, else while it streams in."""
    declared = request.headers.get("content-length")  # the HTTP server refused a malformed one
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise payload_too_large(limit)
    chunks, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise payload_too_large(limit)
        chunks.append(piece)
    return b"".join(chunks)


async def _forward(first: str, events: Any, request_id: str, heap_trim: IdleHeapTrim | None) -> AsyncIterator[str]:
    """The LLM server's events (a request in flight for ``heap_trim``); a client that
    goes away cancels the call, which aborts the request and frees its cache. A failure
    past the status line ends the stream with an error event and ``[DONE]``: a replica
    that died mid-stream with ``replica_lost``, anything else with a generic error (the
    details go to the log)."""
    with serving(heap_trim):
        try:
            yield first
            async for event in events:
                yield event
        except RayActorError:
            logger.exception("request %s: the LLM server replica of a stream died", request_id)
            yield sse(replica_lost(request_id).body())
            yield SSE_DONE
        except Exception:  # noqa: BLE001 - the client gets the generic error, the log the details
            logger.exception("request %s failed while streaming", request_id)
            yield sse(internal_error(request_id).body())
            yield SSE_DONE
        finally:
            events.cancel()


@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    """The OpenAI-compatible HTTP surface and, when ``options.grpc_port`` is set, the
    gRPC ``Generate`` call on a listener of its own (``deploy.grpc_service``); every
    request is answered by an LLMServer replica through ``llm`` (streams through
    ``.options(stream=True)``). What it accepts: the module docstring."""

    async def __init__(self, llm: DeploymentHandle, model_name: str, options: IngressOptions) -> None:
        self.llm = llm
        self.model_name = model_name
        self.options = options
        self._grpc: grpc.aio.Server | None = None
        self._grpc_address: str | None = None
        self._heap_trim = idle_heap_trim(options.heap_trim_idle_s, name="dsv41-ingress-heap-trim")
        self._memory_probe = probe_for(options.memory_probe)
        if options.grpc_port is not None:
            servicer = GenerateServicer(llm, options.api_key)
            self._grpc, port = await start_generate_server(
                servicer, options.grpc_host, options.grpc_port, options.limits.max_body_bytes
            )
            self._grpc_address = f"{options.grpc_host}:{port}"

    async def __del__(self) -> None:
        if self._heap_trim is not None:
            self._heap_trim.close()
        if self._grpc is not None:
            await self._grpc.stop(grace=STOP_GRACE_S)
        # Serve's ASGI wrapper (next in the deployment class's bases) ends the app's lifespan.
        await super().__del__()

    def grpc_address(self) -> str | None:
        """``host:port`` the gRPC listener bound (None: no gRPC)."""
        return self._grpc_address

    async def memory_report(self, trim: bool = False) -> dict[str, Any]:
        """This replica's memory (``deploy.memory_probe``), for a handle's caller only
        (no route); refused unless the application was built with ``memory_probe``."""
        return read_probe(self._memory_probe, trim=trim)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._answer(request, "completions", "completions_stream")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, "chat", "chat_stream")

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error_response(unauthorized())
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    @api.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, request: Request, model_id: str) -> Response:
        if not self._authorized(request):
            return _error_response(unauthorized())
        if model_id != self.model_name:
            return _error_response(model_not_found(model_id, self.model_name))
        return JSONResponse(self._model_card())

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, "tokenize")

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, "detokenize")

    @api.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error_response(unauthorized())
        return JSONResponse(await self.llm.tokenizer_info.remote())

    @api.get("/version")
    async def version(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error_response(unauthorized())
        return JSONResponse({"version": importlib.metadata.version("dsv41")})

    @api.get("/health")
    async def health(self, request: Request) -> Response:
        """200 while the LLM server replica that answers can serve (its health check
        passes); 503 in the OpenAI error shape otherwise."""
        if not self._authorized(request):
            return _error_response(unauthorized())
        try:
            error = await self.llm.health.remote()
        except RayActorError:
            error = replica_lost(_request_id(request))
        return Response(status_code=200) if error is None else _error_response(error)

    @api.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error_response(unauthorized())
        return Response(content=await self.llm.metrics_text.remote(), media_type=METRICS_CONTENT_TYPE)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": now(), "owned_by": "dsv41"}

    def _authorized(self, request: Request) -> bool:
        key = self.options.api_key
        if key is None or request.url.path in self.options.public_routes:
            return True
        return bearer_matches(request.headers.get("authorization"), key)

    async def _answer(self, request: Request, method: str, stream_method: str | None = None) -> Response:
        with serving(self._heap_trim):
            return await self._respond(request, method, stream_method)

    async def _respond(self, request: Request, method: str, stream_method: str | None) -> Response:
        request_id = _request_id(request)
        try:
            if not self._authorized(request):
                raise unauthorized()
            if not _is_json(request.headers.get("content-type")):
                raise unsupported_media_type(request.headers.get("content-type"))
            limits = self.options.limits
            body = parse_body(await _read_body(request, limits.max_body_bytes), limits)
            if stream_method is not None and body.get("stream") is True:
                events = getattr(self.llm.options(stream=True), stream_method).remote(body, request_id)
                first = await anext(events)
                if isinstance(first, OpenAIError):
                    return _error_response(first)
                stream = _forward(first, events, request_id, self._heap_trim)
                return StreamingResponse(stream, media_type="text/event-stream")
            result = await getattr(self.llm, method).remote(body, request_id)
        except OpenAIError as error:
            return _error_response(error)
        except BackPressureError:
            return _error_response(_overloaded())
        except RayActorError:
            logger.exception("request %s: the LLM server replica of a request died", request_id)
            return _error_response(replica_lost(request_id))
        return _error_response(result) if isinstance(result, OpenAIError) else JSONResponse(result)


def build_app(args: Mapping[str, Any] | AppArgs) -> serve.Application:
    """The application (``import_path: dsv41.deploy.app:build_app``): the ingress bound to
    the LLM servers, each deployment with its own queue limits."""
    parsed = args if isinstance(args, AppArgs) else AppArgs.from_dict(args)
    sizing: dict[str, Any] = (
        {"autoscaling_config": dict(parsed.autoscaling_config)}
        if parsed.autoscaling_config is not None
        else {"num_replicas": parsed.num_replicas}
    )
    llm = LLMServer.options(
        max_ongoing_requests=parsed.max_ongoing_requests,
        max_queued_requests=parsed.max_queued_requests,
        ray_actor_options=parsed.llm_server_actor_options(),
        health_check_period_s=parsed.health_check_period_s,
        health_check_timeout_s=parsed.health_check_timeout_s,
        **llm_server_placement(parsed),
        **sizing,
    ).bind(parsed)
    return OpenAIIngress.options(
        num_replicas=parsed.ingress_num_replicas,
        max_ongoing_requests=parsed.ingress_max_ongoing_requests,
        max_queued_requests=parsed.ingress_max_queued_requests,
        ray_actor_options=parsed.ingress_actor_options(),
    ).bind(llm, parsed.model_name, parsed.ingress_options())


# Serve's own wait for an application polls its controller at this pace.
APP_STATUS_POLL_S = 0.1


class AppStartTimeout(TimeoutError):
    """An application whose deployments were not all running in time."""


class AppStartFailed(RuntimeError):
    """An application that failed to deploy (a replica's constructor raised, say) or
    was withdrawn while it started."""


def run_app(application: serve.Application, *, name: str, route_prefix: str | None, timeout_s: float) -> DeploymentHandle:
    """``serve.run(application, name=..., route_prefix=...)`` that gives up after
    ``timeout_s`` seconds. Serve waits without limit for replicas it cannot place (a
    deployment asking for more CPUs than the cluster has free stays pending, said only
    in the controller's log); this raises :class:`AppStartTimeout` instead, naming each
    deployment not yet healthy with Serve's status message, which states the resources
    it waits for, and :class:`AppStartFailed` when the deploy fails or the application
    is withdrawn meanwhile. The deploy itself goes on after a timeout: ``serve.delete(name)``
    or ``serve.shutdown()`` withdraws it.

    The wait polls ``serve.status()`` in the caller's thread: a waiting thread left
    behind after a timeout would touch Ray after the caller's ``ray.shutdown()``, which
    exits the process."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: {timeout_s!r} (allowed: > 0)")
    deadline = time.monotonic() + timeout_s
    serve.run_many(
        [serve.RunTarget(application, name=name, route_prefix=route_prefix)],
        wait_for_ingress_deployment_creation=False,
        wait_for_applications_running=False,
    )
    while True:
        application_status = serve.status().applications.get(name)
        if application_status is None:
            raise AppStartFailed(f"application {name!r} was withdrawn while it started")
        if application_status.status == ApplicationStatus.RUNNING:
            return serve.get_app_handle(name)
        if application_status.status == ApplicationStatus.DEPLOY_FAILED:
            raise AppStartFailed(f"application {name!r} failed to deploy: {_unready_deployments(name)}")
        if time.monotonic() >= deadline:
            raise AppStartTimeout(f"application {name!r} not running after {timeout_s} s: {_unready_deployments(name)}")
        time.sleep(APP_STATUS_POLL_S)


def _unready_deployments(app_name: str) -> str:
    application = serve.status().applications.get(app_name)
    if application is None:
        return "not deployed"
    unready = [
        f"{deployment} {status.status.value} {dict(status.replica_states)}: {status.message}"
        for deployment, status in application.deployments.items()
        if status.status != "HEALTHY"
    ]
    return "; ".join(unready) or f"{application.status.value}: {application.message}"
