"""The Serve application's declarations: its arguments and the ingress's options.

Owns :class:`AppArgs` (the application's arguments, the same from Python and from a
Serve YAML's ``args:``; every field validated where it is declared, the engine
options by ``cluster.options``) and :class:`IngressOptions` (what the HTTP ingress
accepts: the API key, its open routes, the request limits), with the defaults a
deployment gets (backend, dtypes, health-check period, the served name of the
embedded model, ingress and replica CPUs).

Must not import at module level: ``torch`` or ``actors``. Must not be imported by
``model``, ``cache``, ``cluster``, ``actors``.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime.
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from dsv41.cluster.options import engine_options
from dsv41.deploy.heap import (
    DEFAULT_HEAP_TRIM_IDLE_S,
    DEFAULT_PYTHON_ALLOCATOR,
    PYTHON_ALLOCATOR_ENV,
    PYTHON_ALLOCATORS,
    python_allocator_env,
)
from dsv41.deploy.memory_probe import ProbeOptions
from dsv41.deploy.metrics import DEFAULT_METRICS_PREFIX
from dsv41.deploy.openai_api import RequestLimits
from dsv41.deploy.ray_metrics import check_metrics_options
from dsv41.model.tiny import embedded_model_dir

if TYPE_CHECKING:
    from dsv41.actors.group import GroupOptions

logger = logging.getLogger(__name__)

T = TypeVar("T")

BACKENDS = ("local", "process", "ray")
# The backends whose one engine runs in a process the replica owns (no Ray actors).
SINGLE_ENGINE_BACKENDS = ("local", "process")
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
    ``backend``: ``local`` (the engine on a thread of the replica's own process),
    ``process`` (the engine in a child process the replica starts and owns, so its step
    loop shares no GIL with the replica's Serve threads: deploy/engine_process.py) or
    ``ray`` (an engine group of ``dp`` RankActors, experts split ``expert_mode``). Either
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
    ``heap_trim_idle_s``: each ingress and LLM server replica collects its garbage and
    returns its C heap's free pages to the OS (``gc.collect()``, ``malloc_trim(0)``)
    once it has had no request in flight for this many seconds after serving
    (deploy/heap.py); so does Serve's HTTP proxy when ``dsv41 serve`` starts Serve
    (deploy/proxy_heap.py); None: never.
    ``python_allocator``: the Python object allocator the ingress and LLM server
    replicas and Serve's proxy start with (``PYTHONMALLOC``): "pymalloc" (the default,
    CPython's arenas, which return to the OS only when empty) or "malloc" (small
    objects in glibc's heap, which the idle trim returns: about half the RSS left after
    a load, at some speed); deploy/heap.py.
    ``memory_probe`` (a diagnostic, off by default): ``deploy.memory_probe.ProbeOptions``
    fields; when set (``{}`` for the defaults), each ingress and LLM server replica
    answers ``memory_report`` through its deployment handle (no HTTP route): what its
    process's memory is, Python's and the allocator's (bench/soak.py reads it).
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
    heap_trim_idle_s: float | None = DEFAULT_HEAP_TRIM_IDLE_S
    python_allocator: str = DEFAULT_PYTHON_ALLOCATOR
    memory_probe: Mapping[str, Any] | None = None

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
        if self.backend in SINGLE_ENGINE_BACKENDS and self.dp != 1:
            raise ValueError(f"dp: {self.dp} needs backend 'ray' (allowed with {self.backend!r}: 1)")
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
            if not _is_seconds(getattr(self, name)):
                raise ValueError(f"{name}: {getattr(self, name)!r} (allowed: a positive number of seconds)")
        if self.heap_trim_idle_s is not None and not _is_seconds(self.heap_trim_idle_s):
            raise ValueError(f"heap_trim_idle_s: {self.heap_trim_idle_s!r} (allowed: a positive number of seconds, or null for never)")
        python_allocator_env(self.python_allocator)
        for name in ("ray_actor_options", "ingress_ray_actor_options"):
            if PYTHON_ALLOCATOR_ENV in _env_vars(getattr(self, name)):
                raise ValueError(
                    f"{name}: sets {PYTHON_ALLOCATOR_ENV} in its runtime_env (allowed: python_allocator, one of "
                    f"{', '.join(PYTHON_ALLOCATORS)}, which sets it for the replicas and Serve's proxy)"
                )
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
        if self.memory_probe is not None:
            if not isinstance(self.memory_probe, Mapping):
                raise ValueError(f"memory_probe: {self.memory_probe!r} (allowed: a mapping of ProbeOptions fields, or null)")
            self.probe_options()
        # Refuse bad engine options here, before Serve starts a replica that would die on them.
        options = engine_options(self.engine_options())
        if options.speculative_method is not None and self.backend not in SINGLE_ENGINE_BACKENDS:
            raise ValueError(
                f"engine.speculative_method: {options.speculative_method!r} with backend {self.backend!r} (allowed "
                "with speculation: backend 'local' or 'process'; the Ray engine group's wires carry no drafts yet)"
            )
        if options.async_scheduling and self.backend not in SINGLE_ENGINE_BACKENDS:
            raise ValueError(
                f"engine.async_scheduling: True with backend {self.backend!r} (allowed with async scheduling: backend "
                "'local' or 'process'; the Ray engine group's rank actors run each step to its result)"
            )

    @classmethod
    def from_dict(cls, args: Mapping[str, Any]) -> "AppArgs":
        return _declared(cls, args, "args")

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

        return _declared(GroupOptions, self.group, "group")

    def llm_server_actor_options(self) -> dict[str, Any]:
        """An LLM server replica's Ray actor options: ``ray_actor_options`` with the
        Python allocator in its runtime environment."""
        return _with_allocator(self.ray_actor_options, self.python_allocator)

    def ingress_actor_options(self) -> dict[str, Any]:
        """The ingress replica's: :data:`INGRESS_NUM_CPUS` unless
        ``ingress_ray_actor_options`` says otherwise, with the Python allocator."""
        return _with_allocator({"num_cpus": INGRESS_NUM_CPUS, **self.ingress_ray_actor_options}, self.python_allocator)

    def model_dir(self) -> Path:
        return Path(self.model) if self.model is not None else embedded_model_dir()

    def request_limits(self) -> RequestLimits:
        return RequestLimits.from_dict(self.limits)

    def probe_options(self) -> ProbeOptions | None:
        """``memory_probe`` as ``deploy.memory_probe.ProbeOptions`` (None: off)."""
        return None if self.memory_probe is None else _declared(ProbeOptions, self.memory_probe, "memory_probe")

    def ingress_options(self) -> "IngressOptions":
        return IngressOptions(
            api_key=self.api_key,
            public_routes=self.public_routes,
            limits=self.request_limits(),
            grpc_host=self.grpc_host,
            grpc_port=self.grpc_port,
            heap_trim_idle_s=self.heap_trim_idle_s,
            memory_probe=self.probe_options(),
        )


def read_serve_config(path: str | Path) -> tuple[Any, Any]:
    """The Serve YAML at ``path`` (a ``ray.serve.schema.ServeDeploySchema``) and its one
    application; refused (ValueError) when it declares another number of them."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(Path(path).read_text()))
    if len(config.applications) != 1:
        raise ValueError(f"{path} declares {len(config.applications)} applications (allowed: 1)")
    return config, config.applications[0]


@dataclass(frozen=True)
class IngressOptions:
    """What the ingress accepts, where it listens for gRPC, when it trims its heap and
    whether it answers ``memory_report`` (AppArgs' fields)."""

    api_key: str | None = field(default=None, repr=False)
    public_routes: tuple[str, ...] = OPEN_ROUTES
    limits: RequestLimits = RequestLimits()
    grpc_host: str = LOOPBACK_HOST
    grpc_port: int | None = None
    heap_trim_idle_s: float | None = DEFAULT_HEAP_TRIM_IDLE_S
    memory_probe: ProbeOptions | None = None


def _declared(declaration: type[T], values: Mapping[str, Any], name: str) -> T:
    """``declaration(**values)``, a key it does not declare refused naming ``name``."""
    known = sorted(declaration.__dataclass_fields__)  # type: ignore[attr-defined]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{name}: unknown {unknown} (allowed: {known})")
    return declaration(**values)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _env_vars(ray_actor_options: Mapping[str, Any]) -> Mapping[str, Any]:
    runtime_env = ray_actor_options.get("runtime_env") or {}
    return runtime_env.get("env_vars") or {}


def _with_allocator(ray_actor_options: Mapping[str, Any], allocator: str) -> dict[str, Any]:
    """``ray_actor_options`` whose runtime environment also sets the Python allocator
    (Ray merges an actor's env_vars with the job's)."""
    runtime_env = dict(ray_actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**_env_vars(ray_actor_options), **python_allocator_env(allocator)}
    return {**ray_actor_options, "runtime_env": runtime_env}


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
