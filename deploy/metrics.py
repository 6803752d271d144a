"""The serving metrics of one LLM server replica: vLLM's metric families under a chosen prefix.

Owns :data:`FAMILIES` (every metric a replica exports: vLLM's names, types, buckets
and labels, as vLLM v1's ``PrometheusStatLogger`` declares them, then dsv41's own
PAGE/STATE, image and offload families beside them), :class:`ServingMetrics` (records
them into a private ``prometheus_client.CollectorRegistry``, rendered by ``/metrics``,
and into any :class:`MetricsMirror`, such as Ray's metrics export in
``deploy.ray_metrics``), :class:`EngineLoad` (the snapshot of an engine's queues,
cache and cumulative counters the step loop hands over) and :class:`FinishedSequence`
(what a finished sequence's histograms observe).

The prefix (``metrics_prefix``, default :data:`DEFAULT_METRICS_PREFIX`) is put before
every name: with ``vllm:`` the names are vLLM's own and vLLM's Grafana dashboard reads
them unchanged. Every family carries vLLM's labels ``model_name`` and ``engine`` (the
replica's one engine: ``"0"``). The engine's cumulative counts (prefix-cache queries
and hits, preemptions, offload fetches) are exported as counters that grow by each
snapshot's increase; a count that went back (its ranks restarted with fresh
bookkeeping) counts from zero again, as Prometheus reads a counter reset.

Must not import: ``ray``, ``torch``, ``model``, ``cache``, ``cluster``, ``actors``, or
other ``deploy`` modules. It is told what happened; it measures nothing itself.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Protocol, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
DEFAULT_METRICS_PREFIX = "dsv41:"
# What Prometheus allows a metric name to start with and hold (an empty prefix too).
_PREFIX_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)?$")
LABELS = ("model_name", "engine")
ENGINE_LABEL = "0"

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
# The finish reasons a finished (not aborted, not failed) sequence counts under.
FINISHED_REASONS = (("stop",), ("length",))

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so that its dashboards' quantiles
# read the same boundaries.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class MetricFamily:
    """One exported family: its name after the prefix, type, help text, labels beyond
    :data:`LABELS`, and a histogram's buckets: ``buckets``, or with ``token_counts``
    the 1-2-5 series up to the context length (:func:`token_buckets`)."""

    name: str
    kind: str
    documentation: str
    buckets: tuple[float, ...] | None = None
    labels: tuple[str, ...] = ()
    token_counts: bool = False

    def __post_init__(self) -> None:
        if self.kind not in (COUNTER, GAUGE, HISTOGRAM):
            raise ValueError(f"MetricFamily.kind: {self.kind!r} (allowed: {COUNTER}, {GAUGE}, {HISTOGRAM})")
        if (self.kind == HISTOGRAM) != ((self.buckets is not None) != self.token_counts):
            raise ValueError(
                f"MetricFamily.buckets: {self.name} (allowed: a histogram has buckets or token_counts, one of them; "
                "other kinds neither)"
            )

FAMILIES: tuple[MetricFamily, ...] = (
    # vLLM's families.
    MetricFamily("num_requests_running", GAUGE, "Number of requests in model execution batches."),
    MetricFamily("num_requests_waiting", GAUGE, "Number of requests waiting to be processed."),
    MetricFamily("kv_cache_usage_perc", GAUGE, "KV-cache usage. 1 means 100 percent usage."),
    MetricFamily("prefix_cache_queries", COUNTER, "Prefix cache queries, in terms of number of queried tokens."),
    MetricFamily("prefix_cache_hits", COUNTER, "Prefix cache hits, in terms of number of cached tokens."),
    MetricFamily("num_preemptions", COUNTER, "Cumulative number of preemption from the engine."),
    MetricFamily("prompt_tokens", COUNTER, "Number of prefill tokens processed."),
    MetricFamily("generation_tokens", COUNTER, "Number of generation tokens processed."),
    MetricFamily("request_success", COUNTER, "Count of successfully processed requests.", labels=("finished_reason",)),
    MetricFamily("request_prompt_tokens", HISTOGRAM, "Number of prefill tokens processed.", token_counts=True),
    MetricFamily("request_generation_tokens", HISTOGRAM, "Number of generation tokens processed.", token_counts=True),
    MetricFamily("time_to_first_token_seconds", HISTOGRAM, "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    MetricFamily("inter_token_latency_seconds", HISTOGRAM, "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    MetricFamily(
        "e2e_request_latency_seconds", HISTOGRAM, "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
    ),
    MetricFamily(
        "request_queue_time_seconds",
        HISTOGRAM,
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    MetricFamily(
        "request_inference_time_seconds",
        HISTOGRAM,
        "Histogram of time spent in RUNNING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    MetricFamily(
        "request_prefill_time_seconds",
        HISTOGRAM,
        "Histogram of time spent in PREFILL phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    MetricFamily(
        "request_decode_time_seconds",
        HISTOGRAM,
        "Histogram of time spent in DECODE phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    # dsv41's own: requests that ended without finishing, and the PAGE/STATE cache.
    MetricFamily("requests_aborted", COUNTER, "Requests aborted (client gone or cancelled)."),
    MetricFamily(
        "requests_failed",
        COUNTER,
        "Requests ended by an engine error (a dead engine, or a rank lost under them); never finished.",
    ),
    MetricFamily("cache_pages", GAUGE, "PAGEs in the replica's pools (every DP rank's)."),
    MetricFamily("cache_pages_used", GAUGE, "PAGEs referenced by requests or STATE images."),
    MetricFamily("cache_pages_cached", GAUGE, "PAGEs unreferenced but in the prefix index (reclaimable)."),
    MetricFamily("state_slots", GAUGE, "STATE slots in the replica's pools."),
    MetricFamily("state_slots_used", GAUGE, "STATE slots held by running requests."),
    MetricFamily("prefix_images", GAUGE, "Checkpoint STATE images attached to the prefix index."),
    MetricFamily("prefix_image_pages", GAUGE, "PAGEs the attached checkpoint images occupy."),
    MetricFamily("prefix_cache_evictions", COUNTER, "Cached PAGEs evicted from the prefix index."),
    MetricFamily("prefix_image_evictions", COUNTER, "Checkpoint images dropped under pressure."),
    MetricFamily("offload_fetched_pages", COUNTER, "PAGEs of prefix hits restored from the offload store."),
    MetricFamily("offload_fetched_images", COUNTER, "Checkpoint images of prefix hits restored from the offload store."),
    MetricFamily(
        "prefix_replayed_tokens", COUNTER, "Cached prompt tokens of prefix hits computed again to rebuild their STATE."
    ),
)


def check_metrics_prefix(prefix: object) -> str:
    """``prefix`` when every family name it starts is a valid Prometheus name."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(
            f"metrics_prefix: {prefix!r} (allowed: letters, digits, '_' and ':', not starting with a digit; "
            f"e.g. {DEFAULT_METRICS_PREFIX!r}, or 'vllm:' for vLLM's dashboards)"
        )
    return prefix


@dataclass(frozen=True)
class EngineLoad:
    """An engine's queues, cache and cumulative counters at one moment, summed over
    its DP ranks. ``pages_used`` counts PAGEs referenced by requests or STATE images
    (cached, unreferenced PAGEs are reusable and not counted); ``prefix_*_tokens``,
    ``preemptions``, ``evictions``, ``image_evictions``, ``fetched_*`` and
    ``prefix_replayed_tokens`` are
    cumulative over the engine's bookkeeping's life."""

    requests_running: int
    requests_waiting: int
    num_pages: int
    pages_used: int
    prefix_lookup_tokens: int
    prefix_hit_tokens: int
    preemptions: int = 0
    pages_cached: int = 0
    num_slots: int = 0
    slots_used: int = 0
    images: int = 0
    image_pages: int = 0
    evictions: int = 0
    image_evictions: int = 0
    offload_fetched_pages: int = 0
    offload_fetched_images: int = 0
    prefix_replayed_tokens: int = 0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"EngineLoad.{name}: {value!r} (allowed: an integer >= 0)")
        if self.pages_used > self.num_pages:
            raise ValueError(f"EngineLoad.pages_used: {self.pages_used} exceeds num_pages={self.num_pages}")
        if self.prefix_hit_tokens > self.prefix_lookup_tokens:
            raise ValueError(
                f"EngineLoad.prefix_hit_tokens: {self.prefix_hit_tokens} exceeds "
                f"prefix_lookup_tokens={self.prefix_lookup_tokens}"
            )

    @property
    def page_usage(self) -> float:
        return self.pages_used / self.num_pages if self.num_pages else 0.0


@dataclass(frozen=True)
class FinishedSequence:
    """One finished sequence, as its histograms observe it (seconds; vLLM's intervals):
    ``queue_time`` arrival to first scheduled, ``prefill_time`` then to its first
    token, ``decode_time`` first to last token (all ``None`` for a sequence that
    finished with no token); ``e2e_latency`` arrival to finish."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None


class MetricsMirror(Protocol):
    """Another sink of the same records (Ray's metrics export: ``deploy.ray_metrics``).
    ``declare`` is called once per family, ``record`` per value: a counter's increase,
    a gauge's value or a histogram's observation, with the label values in
    ``LABELS + family.labels`` order."""

    def declare(self, family: MetricFamily, name: str, buckets: tuple[float, ...] | None) -> None: ...

    def record(self, family: MetricFamily, value: float, labels: tuple[str, ...]) -> None: ...


class ServingMetrics:
    """The metric families of one replica, labelled with the served model name.
    Every method is thread-safe (the engine thread records, the HTTP side renders)."""

    def __init__(
        self,
        model_name: str,
        *,
        max_model_len: int,
        prefix: str = DEFAULT_METRICS_PREFIX,
        mirrors: Sequence[MetricsMirror] = (),
    ) -> None:
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name: {model_name!r} (allowed: a non-empty string)")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len: {max_model_len!r} (allowed: an integer >= 1)")
        self.prefix = check_metrics_prefix(prefix)
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = (model_name, ENGINE_LABEL)
        self._mirrors = tuple(mirrors)
        self._families = {family.name: family for family in FAMILIES}
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}
        token_counts = token_buckets(max_model_len)
        for family in FAMILIES:
            buckets = token_counts if family.token_counts else family.buckets
            name = self.prefix + family.name
            labels = LABELS + family.labels
            if family.kind == COUNTER:
                metric = Counter(name, family.documentation, labels, registry=self.registry)
            elif family.kind == GAUGE:
                metric = Gauge(name, family.documentation, labels, registry=self.registry)
            else:
                metric = Histogram(name, family.documentation, labels, buckets=buckets, registry=self.registry)
            self._metrics[family.name] = metric
            # Every series exists from the start, at zero, as vLLM's do.
            for extra in (FINISHED_REASONS if family.labels else [()]):
                metric.labels(*self._labels, *extra)
            for mirror in self._mirrors:
                mirror.declare(family, name, buckets)
        # The last cumulative value each counter fed from a snapshot was advanced to.
        self._totals: dict[str, int] = {}
        self._lock = threading.Lock()

    def _record(self, name: str, value: float, *extra_labels: str) -> None:
        family = self._families[name]
        labels = self._labels + extra_labels
        child = self._metrics[name].labels(*labels)
        if family.kind == COUNTER:
            if value == 0:
                return
            child.inc(value)
        elif family.kind == GAUGE:
            child.set(value)
        else:
            child.observe(value)
        for mirror in self._mirrors:
            mirror.record(family, value, labels)

    def _advance(self, name: str, total: int) -> None:
        """Grows counter ``name`` to a snapshot's cumulative ``total`` (a total below
        the last one is a reset: it counts from zero)."""
        with self._lock:
            last = self._totals.get(name, 0)
            self._totals[name] = total
        self._record(name, total - last if total >= last else total)

    def observe_load(self, load: EngineLoad) -> None:
        for name, value in (
            ("num_requests_running", load.requests_running),
            ("num_requests_waiting", load.requests_waiting),
            ("kv_cache_usage_perc", load.page_usage),
            ("cache_pages", load.num_pages),
            ("cache_pages_used", load.pages_used),
            ("cache_pages_cached", load.pages_cached),
            ("state_slots", load.num_slots),
            ("state_slots_used", load.slots_used),
            ("prefix_images", load.images),
            ("prefix_image_pages", load.image_pages),
        ):
            self._record(name, value)
        for name, total in (
            ("prefix_cache_queries", load.prefix_lookup_tokens),
            ("prefix_cache_hits", load.prefix_hit_tokens),
            ("num_preemptions", load.preemptions),
            ("prefix_cache_evictions", load.evictions),
            ("prefix_image_evictions", load.image_evictions),
            ("offload_fetched_pages", load.offload_fetched_pages),
            ("offload_fetched_images", load.offload_fetched_images),
            ("prefix_replayed_tokens", load.prefix_replayed_tokens),
        ):
            self._advance(name, total)

    def observe_tokens(
        self, num_tokens: int, *, first_token_latency: float | None, gap: float | None, num_prompt_tokens: int = 0
    ) -> None:
        """``num_tokens`` new tokens of one sequence; ``first_token_latency`` when they
        include its first (its ``num_prompt_tokens`` then count as processed), else
        ``gap`` since its previous tokens (spread evenly over them, as one step can
        deliver several)."""
        if num_tokens <= 0:
            return
        self._record("generation_tokens", num_tokens)
        if first_token_latency is not None:
            self._record("prompt_tokens", num_prompt_tokens)
            self._record("time_to_first_token_seconds", first_token_latency)
        elif gap is not None:
            for _ in range(num_tokens):
                self._record("inter_token_latency_seconds", gap / num_tokens)

    def observe_finished(self, sequence: FinishedSequence) -> None:
        self._record("request_success", 1, sequence.finish_reason)
        self._record("e2e_request_latency_seconds", sequence.e2e_latency)
        self._record("request_prompt_tokens", sequence.num_prompt_tokens)
        self._record("request_generation_tokens", sequence.num_generation_tokens)
        if sequence.queue_time is not None:
            self._record("request_queue_time_seconds", sequence.queue_time)
        if sequence.prefill_time is not None and sequence.decode_time is not None:
            self._record("request_prefill_time_seconds", sequence.prefill_time)
            self._record("request_decode_time_seconds", sequence.decode_time)
            self._record("request_inference_time_seconds", sequence.prefill_time + sequence.decode_time)

    def observe_aborted(self) -> None:
        self._record("requests_aborted", 1)

    def observe_failed(self) -> None:
        self._record("requests_failed", 1)

    def value(self, name: str, *extra_labels: str) -> float:
        """A counter's or gauge's current value (``name`` after the prefix)."""
        family = self._families[name]
        sample = self.prefix + name + ("_total" if family.kind == COUNTER else "")
        labels = dict(zip(LABELS + family.labels, self._labels + extra_labels))
        value = self.registry.get_sample_value(sample, labels)
        return 0.0 if value is None else value

    def render(self) -> bytes:
        """The Prometheus text exposition of every family."""
        return generate_latest(self.registry)
