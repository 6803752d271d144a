"""The serving metrics of one LLM server replica, rendered in the Prometheus text format.

Owns :class:`ServingMetrics`: the metric families (requests running and waiting, PAGE
usage, prefix-cache hit rate, time to first token, inter-token latency, end-to-end
latency, prompt and generation tokens, finished, aborted and failed requests), kept in a
private ``prometheus_client.CollectorRegistry`` so that several replicas or tests in
one process never share or collide on a global registry, and :class:`EngineLoad`, the
snapshot of an engine's queues and cache the gauges show.

Must not import: ``ray``, ``torch``, ``model``, ``cache``, ``cluster``, ``actors``, or
other ``deploy`` modules. It is told what happened; it measures nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
METRIC_PREFIX = "dsv41_"

# Buckets in seconds. A CPU tiny model answers in milliseconds, a Flash replica's first
# token after a long prefill in seconds: the ranges cover both.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class EngineLoad:
    """An engine's queues and cache at one moment. ``pages_used`` counts PAGEs
    referenced by requests or STATE images (cached, unreferenced PAGEs are reusable
    and not counted); the lookup counters are cumulative over the engine's life."""

    requests_running: int
    requests_waiting: int
    num_pages: int
    pages_used: int
    prefix_lookup_tokens: int
    prefix_hit_tokens: int
    offload_fetched_pages: int = 0  # PAGEs of prefix hits restored from the offload store

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

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0


class ServingMetrics:
    """The metric families of one replica, labelled with the served model name.
    Every method is thread-safe (the engine thread records, the HTTP side renders)."""

    def __init__(self, model_name: str) -> None:
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name: {model_name!r} (allowed: a non-empty string)")
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name",)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(METRIC_PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(METRIC_PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(METRIC_PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.requests_running = gauge("num_requests_running", "Requests the scheduler is running (prefill or decode).")
        self.requests_waiting = gauge("num_requests_waiting", "Requests queued or preempted, waiting for PAGEs.")
        self.pages_total = gauge("cache_pages_total", "PAGEs in the replica's pools.")
        self.pages_used = gauge("cache_pages_used", "PAGEs referenced by requests or STATE images.")
        self.page_usage = gauge("cache_page_usage_ratio", "pages_used / pages_total (0..1).")
        self.prefix_hit_rate = gauge(
            "prefix_cache_hit_rate", "Fraction of looked-up prompt tokens served by the prefix cache."
        )
        self.prefix_lookup_tokens = gauge("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hit_tokens = gauge("prefix_cache_hits_tokens", "Prompt tokens served by the prefix cache.")
        self.offload_fetched_pages = gauge(
            "offload_fetched_pages", "PAGEs of prefix hits restored from the offload store (cumulative)."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.requests_finished = Counter(
            METRIC_PREFIX + "request_success",
            "Requests that finished, by finish reason.",
            ("model_name", "finished_reason"),
            registry=self.registry,
        )
        self._model_name = model_name
        self.requests_aborted = counter("requests_aborted", "Requests aborted (client gone or cancelled).")
        self.requests_failed = counter(
            "requests_failed", "Requests ended by an engine error (a dead engine, or a rank lost under them); never finished."
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between successive generated tokens.", ITL_BUCKETS
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to the last token of a finished request.", E2E_BUCKETS
        )

    def observe_load(self, load: EngineLoad) -> None:
        self.requests_running.set(load.requests_running)
        self.requests_waiting.set(load.requests_waiting)
        self.pages_total.set(load.num_pages)
        self.pages_used.set(load.pages_used)
        self.page_usage.set(load.page_usage)
        self.prefix_hit_rate.set(load.prefix_hit_rate)
        self.prefix_lookup_tokens.set(load.prefix_lookup_tokens)
        self.prefix_hit_tokens.set(load.prefix_hit_tokens)
        self.offload_fetched_pages.set(load.offload_fetched_pages)

    def observe_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_tokens(self, num_tokens: int, *, first_token_latency: float | None, gap: float | None) -> None:
        """``num_tokens`` new tokens of one sequence; ``first_token_latency`` when they
        include its first, else ``gap`` since its previous tokens (spread evenly over
        them, as one step can deliver several)."""
        if num_tokens <= 0:
            return
        self.generation_tokens.inc(num_tokens)
        if first_token_latency is not None:
            self.time_to_first_token.observe(first_token_latency)
        elif gap is not None:
            for _ in range(num_tokens):
                self.inter_token_latency.observe(gap / num_tokens)

    def observe_finished(self, finish_reason: str, e2e_latency: float) -> None:
        self.requests_finished.labels(self._model_name, finish_reason).inc()
        self.e2e_latency.observe(e2e_latency)

    def observe_aborted(self) -> None:
        self.requests_aborted.inc()

    def observe_failed(self) -> None:
        self.requests_failed.inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every family."""
        return generate_latest(self.registry)
