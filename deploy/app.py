"""The Ray Serve application: an OpenAI-compatible HTTP ingress in front of LLM servers.

Owns :class:`AppArgs` (the application's arguments, the same from Python and from a
Serve YAML's ``args:``), :func:`make_engine` (the one place a replica's engine is built:
``backend: local`` in process, ``backend: ray`` an ``actors.group`` engine group),
:class:`LLMServer` (the deployment whose every replica owns one engine, driven by an
``AsyncEngine``), :class:`OpenAIIngress` (the FastAPI deployment: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models`` and ``/v1/models/{id}``, vLLM's ``/tokenize``,
``/detokenize``, ``/tokenizer_info`` (``deploy.tokenizer_api``) and ``/version``,
``/health``, ``/metrics``, and the gRPC ``Generate`` of ``deploy.grpc_service`` on its own listener), :func:`build_app`, the
``import_path`` of ``deploy/configs/*.yaml``, and :func:`run_app`, ``serve.run`` with a
deadline.

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

Faults: a replica is the unit Serve replaces. Its health check fails once its engine
cannot serve (the step loop died, or a ``backend: ray`` group's SchedulerActor is
gone), and Serve starts a new replica. A ``backend: ray`` replica runs its group in the
replica's own placement group (``placement_group_bundles``: the replica's resources,
then one bundle per rank), which Serve creates with the replica and removes when the
replica stops or dies; the group's actors are owned by the replica, so they die with it
too, and its actor names carry the replica's id. A request that fails is answered in
the OpenAI error shape (a stream: an error event, then ``[DONE]``, as vLLM does),
including when the replica serving it dies (the ingress answers 503).

Resources: an LLM server replica reserves what ``ray_actor_options`` asks (Serve's
default: one CPU, which its engine's step loop uses); the ingress, which only relays,
reserves no CPU unless ``ingress_ray_actor_options`` says so. With Serve's default of a
whole CPU for it, an application on a 2-CPU node held both CPUs, and a second
application's replicas waited forever to be placed.

Must not import at module level: ``torch`` or ``actors`` (``make_engine`` imports the
backend it builds). Must not be imported by ``model``, ``cache``, ``cluster``, ``actors``.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime.
import asyncio
import importlib.metadata
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Callable, Mapping

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, TaskCancelledError
from ray.serve.exceptions import BackPressureError
from ray.serve.schema import ApplicationStatus
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from dsv41.cluster.interface import EngineClient
from dsv41.cluster.options import engine_options
from dsv41.cluster.request import MAX_N, CumulativeOutputs, RequestOutput, SamplingParams
from dsv41.deploy.async_engine import AsyncEngine, EngineDeadError, parent_request_id
from dsv41.deploy.chat_parser import OUTPUT_MARKERS
from dsv41.deploy.chat_protocol import PromptEncoder, render_pieces
from dsv41.deploy.grpc_service import STOP_GRACE_S, GenerateServicer, start_generate_server
from dsv41.deploy.metrics import DEFAULT_METRICS_PREFIX, METRICS_CONTENT_TYPE
from dsv41.deploy.ray_metrics import check_metrics_options, replica_metrics
from dsv41.deploy.tokenizer_api import TokenizerEndpoints
from dsv41.deploy.openai_api import (
    REFUSALS,
    SSE_DONE,
    ChatCompletionRequest,
    ChatStreamWriter,
    CompletionRequest,
    OpenAIError,
    RequestLimits,
    bad_request,
    bearer_matches,
    chat_completion_response,
    CompletionWriter,
    error_for,
    internal_error,
    model_not_found,
    now,
    parse_body,
    payload_too_large,
    replica_lost,
    sse,
    unauthorized,
    unsupported_media_type,
    usage,
)
from dsv41.model.tiny import embedded_model_dir

if TYPE_CHECKING:
    from dsv41.actors.engine_group import EngineGroup
    from dsv41.actors.group import GroupOptions

logger = logging.getLogger(__name__)

BACKENDS = ("local", "ray")
EXPERT_MODES = ("ep", "tp")
DTYPES = ("float32", "bfloat16")
TINY_MODEL_NAME = "dsv41-tiny"
# Seconds a client is told to wait when the LLM servers' queues are full.
RETRY_AFTER_S = 1
# The ingress parses JSON and relays: like Serve's own proxy it reserves no CPU, so
# every CPU of a node is left to the engines.
INGRESS_NUM_CPUS = 0
# Serve's are 10 s and 30 s. An LLM server's check is one call to its engine, and a
# replica whose engine died is replaced only once a check sees it.
DEFAULT_HEALTH_CHECK_PERIOD_S = 2.0
DEFAULT_HEALTH_CHECK_TIMEOUT_S = 30.0
# Serve's default for a replica's ray_actor_options.
SERVE_REPLICA_NUM_CPUS = 1
# Routes an API key may leave open (probes and scrapers rarely carry one).
OPEN_ROUTES = ("/health", "/metrics")
LOOPBACK_HOST = "127.0.0.1"


@dataclass(frozen=True)
class AppArgs:
    """The application's arguments (YAML ``args:`` or a dict), checked on construction.

    ``model``: checkpoint directory (None: the embedded tiny checkpoint, made on first
    use). ``engine``: EngineOptions fields (``dtype`` as ``"float32"``/``"bfloat16"``).
    ``backend``: ``local`` (the replica's ranks in its own process) or ``ray`` (an
    engine group of ``dp`` RankActors, experts split ``expert_mode``). Either
    ``num_replicas`` or ``autoscaling_config`` (Serve's) sizes the LLM servers.
    ``ray_actor_options`` are an LLM server replica's (Serve's defaults: one CPU);
    ``ingress_ray_actor_options`` the ingress's, ``num_cpus`` defaulting to
    :data:`INGRESS_NUM_CPUS`. ``group`` (``backend: ray`` only): the engine group's
    ``actors.group.GroupOptions`` fields (a rank's CPUs and GPUs, deadlines, the step
    transport). ``health_check_period_s`` / ``health_check_timeout_s``: Serve's health
    check of an LLM server replica, which fails once its engine cannot serve.

    ``api_key``: when set, required on every route but ``public_routes`` (a subset of
    :data:`OPEN_ROUTES`, all of them by default) and on the gRPC call. ``limits``:
    ``RequestLimits`` fields. ``grpc_port``: where the ingress serves
    ``dsv41.GenerateService`` (None: no gRPC), on ``grpc_host`` (loopback by default).
    ``metrics_prefix``, ``ray_metrics``: the metrics' names and Ray export (deploy/ray_metrics.py).
    """

    model: str | None = None
    served_model_name: str | None = None
    backend: str = "local"
    dp: int = 1
    expert_mode: str = "ep"
    engine: Mapping[str, Any] = field(default_factory=dict)
    num_replicas: int | None = None
    autoscaling_config: Mapping[str, Any] | None = None
    max_ongoing_requests: int = 64
    max_queued_requests: int = 256
    ray_actor_options: Mapping[str, Any] = field(default_factory=dict)
    ingress_num_replicas: int = 1
    ingress_max_ongoing_requests: int = 512
    ingress_max_queued_requests: int = 1024
    ingress_ray_actor_options: Mapping[str, Any] = field(default_factory=dict)
    group: Mapping[str, Any] = field(default_factory=dict)
    health_check_period_s: float = DEFAULT_HEALTH_CHECK_PERIOD_S
    health_check_timeout_s: float = DEFAULT_HEALTH_CHECK_TIMEOUT_S
    api_key: str | None = field(default=None, repr=False)
    public_routes: tuple[str, ...] = OPEN_ROUTES
    limits: Mapping[str, Any] = field(default_factory=dict)
    grpc_host: str = LOOPBACK_HOST
    grpc_port: int | None = None
    metrics_prefix: str = DEFAULT_METRICS_PREFIX
    ray_metrics: bool = True

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model: {self.model!r} (allowed: a checkpoint directory, or null for the tiny model)")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str) or not self.served_model_name):
            raise ValueError(f"served_model_name: {self.served_model_name!r} (allowed: a non-empty string or null)")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: {self.backend!r} (allowed: {', '.join(BACKENDS)})")
        if self.expert_mode not in EXPERT_MODES:
            raise ValueError(f"expert_mode: {self.expert_mode!r} (allowed: {', '.join(EXPERT_MODES)})")
        if not _is_count(self.dp):
            raise ValueError(f"dp: {self.dp!r} (allowed: an integer >= 1)")
        if self.backend == "local" and self.dp != 1:
            raise ValueError(f"dp: {self.dp} needs backend 'ray' (allowed with 'local': 1)")
        if not isinstance(self.engine, Mapping):
            raise ValueError(f"engine: {self.engine!r} (allowed: a mapping of EngineOptions fields)")
        dtype = self.engine.get("dtype", "float32")
        if dtype not in DTYPES:
            raise ValueError(f"engine.dtype: {dtype!r} (allowed: {', '.join(DTYPES)})")
        if (self.num_replicas is None) == (self.autoscaling_config is None):
            if self.num_replicas is not None:
                raise ValueError("num_replicas, autoscaling_config: give one, not both")
            object.__setattr__(self, "num_replicas", 1)
        if self.num_replicas is not None and not _is_count(self.num_replicas):
            raise ValueError(f"num_replicas: {self.num_replicas!r} (allowed: an integer >= 1)")
        if self.autoscaling_config is not None and not isinstance(self.autoscaling_config, Mapping):
            raise ValueError(f"autoscaling_config: {self.autoscaling_config!r} (allowed: Serve's autoscaling_config)")
        for name in ("max_ongoing_requests", "ingress_num_replicas", "ingress_max_ongoing_requests"):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"{name}: {getattr(self, name)!r} (allowed: an integer >= 1)")
        for name in ("max_queued_requests", "ingress_max_queued_requests"):
            value = getattr(self, name)
            if not (_is_count(value) or value == -1):
                raise ValueError(f"{name}: {value!r} (allowed: an integer >= 1, or -1 for no limit)")
        for name in ("ray_actor_options", "ingress_ray_actor_options"):
            if not isinstance(getattr(self, name), Mapping):
                raise ValueError(f"{name}: {getattr(self, name)!r} (allowed: Ray actor options)")
        for name in ("health_check_period_s", "health_check_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: {value!r} (allowed: a positive number of seconds)")
        if not isinstance(self.group, Mapping):
            raise ValueError(f"group: {self.group!r} (allowed: a mapping of GroupOptions fields)")
        if self.group and self.backend != "ray":
            raise ValueError(f"group: {dict(self.group)!r} needs backend 'ray' (allowed with {self.backend!r}: empty)")
        if self.backend == "ray":
            self.group_options()
            if not _replica_bundle(self.ray_actor_options):
                raise ValueError(
                    f"ray_actor_options: {dict(self.ray_actor_options)!r} reserves nothing (allowed with backend "
                    "'ray': some CPU, GPU or resource, the first bundle of the replica's placement group)"
                )
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key: (allowed: a non-empty string, or null for none)")
        if not isinstance(self.public_routes, (list, tuple)) or not set(self.public_routes) <= set(OPEN_ROUTES):
            raise ValueError(f"public_routes: {self.public_routes!r} (allowed: a list of {', '.join(OPEN_ROUTES)})")
        object.__setattr__(self, "public_routes", tuple(self.public_routes))
        if not isinstance(self.limits, Mapping):
            raise ValueError(f"limits: {self.limits!r} (allowed: a mapping of RequestLimits fields)")
        RequestLimits.from_dict(self.limits)
        if not isinstance(self.grpc_host, str) or not self.grpc_host:
            raise ValueError(f"grpc_host: {self.grpc_host!r} (allowed: an address to listen on)")
        if self.grpc_port is not None and not (isinstance(self.grpc_port, int) and 0 <= self.grpc_port <= 65535):
            raise ValueError(f"grpc_port: {self.grpc_port!r} (allowed: a port 0..65535, 0 for any free one, or null)")
        check_metrics_options(self.metrics_prefix, self.ray_metrics)
        # Refuse bad engine options here, before Serve starts a replica that would die on them.
        options = engine_options(self.engine_options())
        if options.speculative_method is not None and self.backend != "local":
            raise ValueError(
                f"engine.speculative_method: {options.speculative_method!r} with backend {self.backend!r} (allowed "
                "with speculation: backend 'local'; the Ray engine group's wires carry no drafts yet)"
            )

    @classmethod
    def from_dict(cls, args: Mapping[str, Any]) -> "AppArgs":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"args: unknown {unknown} (allowed: {sorted(known)})")
        return cls(**args)

    @property
    def model_name(self) -> str:
        if self.served_model_name is not None:
            return self.served_model_name
        return Path(self.model).name if self.model is not None else TINY_MODEL_NAME

    def engine_options(self) -> dict[str, Any]:
        """The engine options with ``dtype`` as a torch dtype."""
        import torch

        options = dict(self.engine)
        options["dtype"] = {"float32": torch.float32, "bfloat16": torch.bfloat16}[options.get("dtype", "float32")]
        return options

    def group_options(self) -> "GroupOptions":
        """``group`` as ``actors.group.GroupOptions``."""
        from dsv41.actors.group import GroupOptions

        unknown = sorted(set(self.group) - set(GroupOptions.__dataclass_fields__))
        if unknown:
            raise ValueError(f"group: unknown {unknown} (allowed: {sorted(GroupOptions.__dataclass_fields__)})")
        return GroupOptions(**self.group)

    def model_dir(self) -> Path:
        return Path(self.model) if self.model is not None else embedded_model_dir()

    def request_limits(self) -> RequestLimits:
        return RequestLimits.from_dict(self.limits)

    def ingress_options(self) -> "IngressOptions":
        return IngressOptions(
            api_key=self.api_key,
            public_routes=self.public_routes,
            limits=self.request_limits(),
            grpc_host=self.grpc_host,
            grpc_port=self.grpc_port,
        )


@dataclass(frozen=True)
class IngressOptions:
    """What the ingress accepts and where it listens for gRPC (AppArgs' fields)."""

    api_key: str | None = field(default=None, repr=False)
    public_routes: tuple[str, ...] = OPEN_ROUTES
    limits: RequestLimits = RequestLimits()
    grpc_host: str = LOOPBACK_HOST
    grpc_port: int | None = None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _replica_bundle(ray_actor_options: Mapping[str, Any]) -> dict[str, float]:
    """The first bundle of a ``backend: ray`` replica's placement group: what the
    replica actor itself reserves (Serve places it there), as Ray Serve LLM builds it."""
    bundle = {
        "CPU": ray_actor_options.get("num_cpus", SERVE_REPLICA_NUM_CPUS),
        "GPU": ray_actor_options.get("num_gpus", 0),
        "memory": ray_actor_options.get("memory", 0),
        **ray_actor_options.get("resources", {}),
    }
    return {name: amount for name, amount in bundle.items() if amount}


def llm_server_placement(args: AppArgs) -> dict[str, Any]:
    """The LLM server's Serve options that give each ``backend: ray`` replica a
    placement group of its own, made and removed by Serve with the replica: bundle 0
    the replica's resources (and its group's zero-resource actors), bundles 1..dp the
    ranks', STRICT_PACK (the ranks and their driver share a node); none for ``local``."""
    if args.backend != "ray":
        return {}
    ranks = [args.group_options().rank_bundle()] * args.dp
    return {
        "placement_group_bundles": [_replica_bundle(args.ray_actor_options), *ranks],
        "placement_group_strategy": "STRICT_PACK",
    }


def make_engine(args: AppArgs) -> EngineClient:
    """The engine of this replica: ``local`` loads it in this process; ``ray`` (inside
    a Serve replica deployed with :func:`llm_server_placement`) starts an engine group
    in the replica's placement group, its actors named after the replica
    (``dsv41-{app}-{replica id}``), so that any number of replicas share a cluster."""
    model_dir = args.model_dir()
    options = args.engine_options()
    if args.backend == "local":
        from dsv41.cluster.engine import Engine

        return Engine.from_pretrained(model_dir, **options)
    import ray

    from dsv41.actors.engine_group import EngineGroup
    from dsv41.actors.group import GroupPlacement

    placement_group = ray.util.get_current_placement_group()
    if placement_group is None:
        raise RuntimeError("backend 'ray': the replica has no placement group (deploy it with llm_server_placement)")
    context = serve.get_replica_context()
    placement = GroupPlacement(placement_group, tuple(range(1, args.dp + 1)), 0)
    group = EngineGroup(
        str(model_dir),
        dp=args.dp,
        expert_mode=args.expert_mode,
        group_options=args.group_options(),
        name=f"dsv41-{context.app_name}-{context.replica_tag}",
        placement=placement,
        **options,
    )
    return group.__enter__()


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The items of several streams as they come, tagged with the stream's index. When
    the consumer stops, every stream is cancelled (which aborts its request)."""
    items: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                items.put_nowait((index, item))
            items.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            items.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await items.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _whole_outputs(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> dict[int, RequestOutput]:
    """Each choice's whole output, its deltas added up (a non-streaming answer)."""
    whole = CumulativeOutputs()
    finals: dict[int, RequestOutput] = {}
    async for index, output in outputs:
        cumulative = whole.add(output)
        if output.finished:
            finals[index] = cumulative
    return finals


def _sample_index(output: RequestOutput) -> int:
    parent = parent_request_id(output.request_id)
    return 0 if parent == output.request_id else int(output.request_id[len(parent) + 1 :])


@serve.deployment
class LLMServer:
    """One engine per replica; the ingress calls it through a DeploymentHandle. Every
    method answers a refused request with an :class:`OpenAIError` value (not raised:
    the ingress turns it into the HTTP answer); the endpoints take the ingress's
    ``request_id`` (Serve's), under which a refusal that hides its reason from the
    client (a dead engine) is logged."""

    def __init__(self, args: AppArgs) -> None:
        self.args = args
        self.model_name = args.model_name
        engine = make_engine(args)
        # An engine group (backend ray) has processes of its own to watch and release.
        self._group: "EngineGroup | None" = engine if args.backend == "ray" else None
        self.tokenizer = engine.tokenizer
        self.prompts = PromptEncoder(engine.tokenizer)
        added = {token.content: token_id for token_id, token in engine.tokenizer.get_added_tokens_decoder().items()}
        self.chat_marker_ids = tuple(added[marker] for marker in OUTPUT_MARKERS if marker in added)
        self.limits = args.request_limits()
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.config.vocab_size
        self.metrics = replica_metrics(self.model_name, self.max_model_len, args.metrics_prefix, args.ray_metrics)
        self.engine = AsyncEngine(engine, self.metrics)
        config = engine.config
        self.tokenizer_endpoints = TokenizerEndpoints(
            engine.tokenizer,
            self.prompts,
            max_model_len=self.max_model_len,
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )

    # -- Serve hooks ------------------------------------------------------------------

    async def check_health(self) -> None:
        """Serve's replica health check (and ``/health``'s): raises EngineDeadError once
        the step loop has died or the engine group cannot serve (its SchedulerActor is
        gone, or its ranks could not be started again), and Serve replaces the replica.
        A group that restarts after a rank failure is healthy: it recovers in place."""
        self.engine.check_health()
        if self._group is not None:
            from dsv41.actors.group import RankGroupDead

            try:
                await self._group.check_alive()
            except RankGroupDead as exc:
                raise EngineDeadError("the engine group cannot serve") from exc

    def __del__(self) -> None:
        """Serve's shutdown hook: stops the step loop, then the engine group."""
        engine = getattr(self, "engine", None)
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            group = getattr(self, "_group", None)
            if group is not None:
                group.close()

    # -- endpoints --------------------------------------------------------------------

    async def health(self) -> OpenAIError | None:
        try:
            await self.check_health()
        except REFUSALS as exc:
            return error_for(exc)
        return None

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def tokenize(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any] | OpenAIError:
        return self._tokenizer_answer(self.tokenizer_endpoints.tokenize, body, request_id)

    def detokenize(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any] | OpenAIError:
        return self._tokenizer_answer(self.tokenizer_endpoints.detokenize, body, request_id)

    def tokenizer_info(self) -> dict[str, Any]:
        return self.tokenizer_endpoints.tokenizer_info()

    async def completions(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any] | OpenAIError:
        try:
            request, prompts, params = self._completion_request(body)
            finals = await _whole_outputs(self._run(prompts, params))
        except REFUSALS as exc:
            return error_for(exc, request_id)
        return CompletionWriter(request, prompts, _response_id("cmpl"), self.model_name, now(), self.tokenizer).response(finals)

    async def completions_stream(self, body: dict[str, Any], request_id: str | None = None) -> AsyncIterator[str | OpenAIError]:
        """SSE events; the first item is an OpenAIError instead when refused."""
        try:
            request, prompts, params = self._completion_request(body)
            outputs = self._run(prompts, params)
            first = await anext(outputs)
        except REFUSALS as exc:
            yield error_for(exc, request_id)
            return
        writer = CompletionWriter(request, prompts, _response_id("cmpl"), self.model_name, now(), self.tokenizer)
        try:
            async for index, output in _starting_with(first, outputs):
                for event in writer.events(index, output):
                    yield event
        except REFUSALS as exc:
            # The status line is already sent: the error ends the stream as an event.
            yield sse(error_for(exc, request_id).body())
            yield SSE_DONE
            return
        for event in writer.closing():
            yield event

    async def generate_stream(
        self, body: dict[str, Any], request_id: str | None = None
    ) -> AsyncIterator[dict[str, Any] | OpenAIError]:
        """The token deltas of one prompt (a completions body with one prompt, ``n`` 1, no
        logprobs, no echo), for the gRPC ingress and ``deploy.client``: ``{"token_ids", "text",
        "finish_reason", "usage"}`` per step, the last with ``finish_reason`` and
        ``usage`` set. An OpenAIError item ends the stream (the first item when refused)."""
        try:
            # The served model is implied: a token stream's callers address a deployment.
            request, prompts, params = self._completion_request({"model": self.model_name, **body})
            if len(prompts) != 1:
                raise bad_request("prompt", f"prompt: {len(prompts)} prompts (allowed: one per token stream)")
            asked = {"n": params.n != 1, "logprobs": params.logprobs is not None, "echo": request.echo}
            asked["prompt_logprobs"] = params.prompt_logprobs is not None
            name = next((field for field, given in asked.items() if given), None)
            if name is not None:
                raise bad_request(name, f"{name}: {body[name]!r} (allowed: absent on a token stream)")
            outputs = self._run(prompts, params)
            first = await anext(outputs)
        except REFUSALS as exc:
            yield error_for(exc, request_id)
            return
        try:
            async for _, output in _starting_with(first, outputs):
                if not output.token_ids and not output.text and not output.finished:
                    continue
                yield {
                    "token_ids": list(output.token_ids),
                    "text": output.text,
                    "finish_reason": None if output.finish_reason is None else output.finish_reason.value,
                    "usage": usage(len(prompts[0]), output.num_output_tokens) if output.finished else None,
                }
        except REFUSALS as exc:
            yield error_for(exc, request_id)

    async def chat(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any] | OpenAIError:
        try:
            request, prompt, params = self._chat_request(body)
            finals = await _whole_outputs(self._run([prompt], params))
        except REFUSALS as exc:
            return error_for(exc, request_id)
        return chat_completion_response(
            request, _response_id("chatcmpl"), self.model_name, now(), finals, len(prompt), self.tokenizer
        )

    async def chat_stream(self, body: dict[str, Any], request_id: str | None = None) -> AsyncIterator[str | OpenAIError]:
        """SSE events; the first item is an OpenAIError instead when refused."""
        try:
            request, prompt, params = self._chat_request(body)
            outputs = self._run([prompt], params)
            first = await anext(outputs)
        except REFUSALS as exc:
            yield error_for(exc, request_id)
            return
        writer = ChatStreamWriter(request, _response_id("chatcmpl"), self.model_name, now(), self.tokenizer)
        for event in writer.opening():
            yield event
        try:
            async for index, output in _starting_with(first, outputs):
                for event in writer.events(index, output):
                    yield event
        except REFUSALS as exc:
            # The status line is already sent: the error ends the stream as an event.
            yield sse(error_for(exc, request_id).body())
            yield SSE_DONE
            return
        for event in writer.closing(len(prompt)):
            yield event

    # -- internals --------------------------------------------------------------------

    def _tokenizer_answer(
        self, endpoint: Callable[[Mapping[str, Any]], dict[str, Any]], body: dict[str, Any], request_id: str | None
    ) -> dict[str, Any] | OpenAIError:
        try:
            self._check_model(body)
            return endpoint(body)
        except REFUSALS as exc:
            return error_for(exc, request_id)

    def _check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if isinstance(model, str) and model and model != self.model_name:
            raise model_not_found(model, self.model_name)

    def _completion_request(self, body: dict[str, Any]) -> tuple[CompletionRequest, list[tuple[int, ...]], SamplingParams]:
        self._check_model(body)
        request = CompletionRequest.from_json(body)
        params = request.params()
        sequences = len(request.prompts) * params.n
        # (n alone past the bound is SamplingParams', naming n.)
        if sequences > MAX_N:
            raise bad_request(
                "prompt",
                f"prompt: {len(request.prompts)} prompts x n={params.n} = {sequences} choices "
                f"(allowed: at most {MAX_N} per request)",
            )
        # A text prompt that cannot fit is refused before it is tokenized.
        room = self.max_model_len - 1
        prompts = [p if isinstance(p, tuple) else tuple(self.prompts.encode_text(p, max_tokens=room)) for p in request.prompts]
        for prompt in prompts:
            self._check_prompt(prompt, params)
        return request, prompts, params

    def _chat_request(self, body: dict[str, Any]) -> tuple[ChatCompletionRequest, tuple[int, ...], SamplingParams]:
        self._check_model(body)
        request = ChatCompletionRequest.from_json(body, self.limits)
        pieces = render_pieces(
            request.messages,
            tools=request.tools,
            tool_choice=request.tool_choice,
            thinking=request.thinking,
            reasoning_effort=request.reasoning_effort,
            response_format=request.response_format,
        )
        prompt = tuple(self.prompts.encode_pieces(pieces, max_tokens=self.max_model_len - 1))
        params = replace(request.params(len(prompt), self.max_model_len), kept_special_token_ids=self.chat_marker_ids)
        self._check_prompt(prompt, params)
        return request, prompt, params

    def _check_prompt(self, prompt: tuple[int, ...], params: SamplingParams) -> None:
        """What the engine would refuse, refused before anything streams (the cheap
        checks first: a prompt is at most a body's worth of ids)."""
        params.validate_for(self.vocab_size, self.max_model_len, len(prompt))
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(400, f"prompt: token ids {bad[:8]} outside the vocabulary 0..{self.vocab_size - 1}", param="prompt")

    def _run(
        self, prompts: list[tuple[int, ...]], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Every prompt's outputs; index = prompt * n + sample (OpenAI's choice order)."""
        request_id = uuid.uuid4().hex
        streams = [self.engine.generate(f"{request_id}-{i}", prompt, params) for i, prompt in enumerate(prompts)]

        async def indexed() -> AsyncGenerator[tuple[int, RequestOutput], None]:
            async with aclosing(_merged(streams)) as merged:
                async for prompt_index, output in merged:
                    yield prompt_index * params.n + _sample_index(output), output

        return indexed()


async def _starting_with(
    first: tuple[int, RequestOutput], rest: AsyncGenerator[tuple[int, RequestOutput], None]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item


def _response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


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


async def _forward(first: str, events: Any, request_id: str) -> AsyncIterator[str]:
    """The LLM server's events; a client that goes away cancels the call, which
    aborts the request and frees its cache. A failure past the status line ends the
    stream with an error event and ``[DONE]``: a replica that died mid-stream with
    ``replica_lost``, anything else with a generic error (the details go to the log)."""
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
        if options.grpc_port is not None:
            servicer = GenerateServicer(llm, options.api_key)
            self._grpc, port = await start_generate_server(
                servicer, options.grpc_host, options.grpc_port, options.limits.max_body_bytes
            )
            self._grpc_address = f"{options.grpc_host}:{port}"

    async def __del__(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=STOP_GRACE_S)
        # Serve's ASGI wrapper (next in the deployment class's bases) ends the app's lifespan.
        await super().__del__()

    def grpc_address(self) -> str | None:
        """``host:port`` the gRPC listener bound (None: no gRPC)."""
        return self._grpc_address

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
                return StreamingResponse(_forward(first, events, request_id), media_type="text/event-stream")
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
        ray_actor_options=dict(parsed.ray_actor_options),
        health_check_period_s=parsed.health_check_period_s,
        health_check_timeout_s=parsed.health_check_timeout_s,
        **llm_server_placement(parsed),
        **sizing,
    ).bind(parsed)
    return OpenAIIngress.options(
        num_replicas=parsed.ingress_num_replicas,
        max_ongoing_requests=parsed.ingress_max_ongoing_requests,
        max_queued_requests=parsed.ingress_max_queued_requests,
        ray_actor_options={"num_cpus": INGRESS_NUM_CPUS, **parsed.ingress_ray_actor_options},
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
