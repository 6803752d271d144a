"""The serving benchmark's workload and report, shared by both of its drivers.

Owns what ``dsv41 bench`` replays and what it reports (deploy/bench.py drives it):
the workload (seeded random token-id prompts or a fixed text prompt, Poisson or
all-at-once arrivals, an optional concurrency cap), the per-request records a driver
produces, and the metrics computed from them (request and token throughput; TTFT,
TPOT, ITL and end-to-end latency mean / median / p99, by the definitions in
deploy/bench.py's docstring), printed as a table and written as JSON.

Must not import: ``ray``, ``actors``, ``cluster``, ``torch``, ``aiohttp``.
"""


from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np

Endpoint = Literal["completions", "chat"]
ENDPOINTS: tuple[str, ...] = ("completions", "chat")
# Finish reasons that say the server gave up on the request rather than completed it.
FAILED_FINISH_REASONS = frozenset({"abort", "error"})
DEFAULT_REQUEST_TIMEOUT_S = 6 * 60 * 60
# Progress lines are printed about this many times over a run.
PROGRESS_STEPS = 10
# Separate seed streams, so changing the arrival rate never changes the prompts.
_PROMPT_STREAM, _ARRIVAL_STREAM = 0, 1

Progress = Callable[[str], None]


class BenchError(ValueError):
    """A benchmark option that cannot run; the message names the option."""


# -- the workload ----------------------------------------------------------------------


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of a workload: token ids (length known) or text (length known only
    once a tokenizer or the server's usage counts it)."""

    prompt: tuple[int, ...] | str
    num_tokens: int | None

    def __post_init__(self) -> None:
        if isinstance(self.prompt, str):
            if not self.prompt:
                raise BenchError("prompt: empty text (allowed: a non-empty string or token ids)")
        elif not self.prompt or self.num_tokens != len(self.prompt):
            raise BenchError(
                f"prompt: token ids need num_tokens == len(prompt) >= 1, got {len(self.prompt)} ids and "
                f"num_tokens={self.num_tokens}"
            )


@dataclass(frozen=True)
class Workload:
    """What the benchmark sends: ``num_prompts`` requests whose prompts are either
    ``input_len`` token ids drawn uniformly from ``[0, vocab_size)`` with ``seed``, or
    ``prompt_text`` each time; each asks for ``output_len`` tokens (``ignore_eos``
    makes that length fixed). Requests arrive as a Poisson process of ``request_rate``
    per second (``math.inf``: all at once), at most ``max_concurrency`` in flight
    (``None``: no cap)."""

    endpoint: Endpoint
    num_prompts: int
    output_len: int
    input_len: int | None = None
    vocab_size: int | None = None
    prompt_text: str | None = None
    seed: int = 0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise BenchError(f"endpoint: {self.endpoint!r} (allowed: {', '.join(ENDPOINTS)})")
        for name in ("num_prompts", "output_len"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise BenchError(f"{name}: {value!r} (allowed: an integer >= 1)")
        if (self.input_len is None) == (self.prompt_text is None):
            raise BenchError(
                "input_len / prompt_text: both or neither given (allowed: exactly one, random token-id prompts "
                "or a fixed text)"
            )
        if self.input_len is not None:
            if not _is_int(self.input_len) or self.input_len < 1:
                raise BenchError(f"input_len: {self.input_len!r} (allowed: an integer >= 1)")
            if not _is_int(self.vocab_size) or self.vocab_size < 1:
                raise BenchError(
                    f"vocab_size: {self.vocab_size!r} (allowed: an integer >= 1; random token-id prompts need it)"
                )
            if self.endpoint == "chat":
                # (?) Chat messages carry text; decoding random ids to text would not
                # round-trip to input_len tokens, so the two are not combined.
                raise BenchError("endpoint: 'chat' takes a text prompt (allowed with input_len: 'completions')")
        if self.prompt_text is not None and not self.prompt_text:
            raise BenchError("prompt_text: empty (allowed: a non-empty string)")
        if not isinstance(self.request_rate, (int, float)) or not self.request_rate > 0:
            raise BenchError(f"request_rate: {self.request_rate!r} (allowed: a number > 0, or inf for all at once)")
        if self.max_concurrency is not None and (not _is_int(self.max_concurrency) or self.max_concurrency < 1):
            raise BenchError(f"max_concurrency: {self.max_concurrency!r} (allowed: None or an integer >= 1)")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            raise BenchError(f"temperature: {self.temperature!r} (allowed: a finite number >= 0)")
        if not isinstance(self.ignore_eos, bool):
            raise BenchError(f"ignore_eos: {self.ignore_eos!r} (allowed: True, False)")

    def prompts(self) -> list[BenchPrompt]:
        """The prompts, in send order; the same for the same seed, whatever the rate."""
        if self.prompt_text is not None:
            return [BenchPrompt(self.prompt_text, None) for _ in range(self.num_prompts)]
        rng = np.random.default_rng([self.seed, _PROMPT_STREAM])
        ids = rng.integers(0, self.vocab_size, size=(self.num_prompts, self.input_len))
        return [BenchPrompt(tuple(int(t) for t in row), self.input_len) for row in ids]

    def arrival_offsets(self) -> list[float]:
        """Seconds from the benchmark start at which each request arrives: the partial
        sums of exponential gaps of mean 1 / request_rate (all 0 for inf)."""
        if math.isinf(self.request_rate):
            return [0.0] * self.num_prompts
        rng = np.random.default_rng([self.seed, _ARRIVAL_STREAM])
        # The first request is sent at once; the rate spaces the ones after it.
        gaps = np.concatenate([[0.0], rng.standard_exponential(self.num_prompts - 1)]) / self.request_rate
        return np.cumsum(gaps).tolist()

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return out


# -- per-request records and the summary -----------------------------------------------


@dataclass(frozen=True)
class RequestRecord:
    """What one request did. Times are seconds; ``sent_s`` counts from the benchmark
    start. A failed request keeps what it saw before failing and its ``error``."""

    index: int
    sent_s: float
    success: bool
    latency_s: float
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    input_tokens: int | None = None
    output_tokens: int = 0
    output_tokens_source: Literal["usage", "chunks", "engine"] = "chunks"
    finish_reason: str | None = None
    error: str = ""

    def __post_init__(self) -> None:
        if self.success == bool(self.error):
            raise ValueError(
                f"error: set exactly when the request failed, got success={self.success} error={self.error!r}"
            )
        if self.success and (self.ttft_s is None or self.output_tokens < 1):
            raise ValueError(
                f"ttft_s / output_tokens: a successful request has a first token, got ttft_s={self.ttft_s} "
                f"output_tokens={self.output_tokens}"
            )
        if self.output_tokens_source not in ("usage", "chunks", "engine"):
            raise ValueError(
                f"output_tokens_source: {self.output_tokens_source!r} (allowed: 'usage', 'chunks', 'engine')"
            )

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with one token or a failure)."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median and 99th percentile (linear interpolation) in milliseconds over
    ``count`` samples; all None when there is no sample."""

    count: int
    mean_ms: float | None
    median_ms: float | None
    p99_ms: float | None

    @classmethod
    def of_seconds(cls, samples_s: Sequence[float]) -> "LatencyStats":
        if not samples_s:
            return cls(0, None, None, None)
        ms = np.asarray(samples_s, dtype=np.float64) * 1000.0
        return cls(len(ms), float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


@dataclass(frozen=True)
class BenchSummary:
    """The metrics of one run (see the module docstring for each definition)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    input_tokens_unknown: int
    output_tokens_from_usage: int
    output_tokens_from_chunks: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    errors: dict[str, int] = field(default_factory=dict)


def summarize(records: Sequence[RequestRecord], duration_s: float) -> BenchSummary:
    """The metrics of a run's records over its duration."""
    if not duration_s > 0:
        raise BenchError(f"duration_s: {duration_s!r} (allowed: a number > 0)")
    ok = [r for r in records if r.success]
    total_in = sum(r.input_tokens for r in ok if r.input_tokens is not None)
    total_out = sum(r.output_tokens for r in ok)
    return BenchSummary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        input_tokens_unknown=sum(r.input_tokens is None for r in ok),
        output_tokens_from_usage=sum(r.output_tokens_source == "usage" for r in ok),
        output_tokens_from_chunks=sum(r.output_tokens_source == "chunks" for r in ok),
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft=LatencyStats.of_seconds([r.ttft_s for r in ok]),
        tpot=LatencyStats.of_seconds([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=LatencyStats.of_seconds([gap for r in ok for gap in r.itl_s]),
        e2el=LatencyStats.of_seconds([r.latency_s for r in ok]),
        errors=dict(Counter(r.error for r in records if not r.success).most_common()),
    )


@dataclass(frozen=True)
class BenchReport:
    """One run: where it ran, the workload, every request's record and the summary."""

    mode: Literal["http", "in-process"]
    target: dict[str, Any]
    workload: Workload
    records: tuple[RequestRecord, ...]
    summary: BenchSummary
    date: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    @classmethod
    def build(cls, mode: Literal["http", "in-process"], target: dict[str, Any], workload: Workload,
              records: Sequence[RequestRecord], duration_s: float) -> "BenchReport":
        ordered = tuple(sorted(records, key=lambda r: r.index))
        if [r.index for r in ordered] != list(range(workload.num_prompts)):
            raise RuntimeError(f"records: expected one per prompt 0..{workload.num_prompts - 1}, got {len(ordered)}")
        return cls(mode, target, workload, ordered, summarize(ordered, duration_s))

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "date": self.date,
            "target": self.target,
            "workload": self.workload.to_json(),
            "summary": asdict(self.summary),
            "requests": [asdict(r) | {"tpot_s": r.tpot_s} for r in self.records],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    def table(self) -> str:
        """The result table, laid out like vLLM's benchmark_serving."""
        s = self.summary
        width = 50
        lines = [f"{' Serving Benchmark Result (' + self.mode + ') ':=^{width}}"]

        def row(label: str, value: object) -> None:
            if value is None:
                text = "-"
            elif isinstance(value, float):
                text = f"{value:.2f}"
            else:
                text = str(value)
            lines.append(f"{label:<40}{text:<10}")

        row("Successful requests:", s.completed)
        row("Failed requests:", s.failed)
        for message, count in s.errors.items():
            lines.append(f"  {count} x {message[:200]}")
        if self.workload.max_concurrency is not None:
            row("Maximum request concurrency:", self.workload.max_concurrency)
        row("Benchmark duration (s):", s.duration_s)
        row("Total input tokens:", s.total_input_tokens)
        if s.input_tokens_unknown:
            row("  requests with unknown input tokens:", s.input_tokens_unknown)
        row("Total generated tokens:", s.total_output_tokens)
        if s.output_tokens_from_chunks:
            row("  of them counted by chunks (no usage):", s.output_tokens_from_chunks)
        row("Request throughput (req/s):", s.request_throughput)
        row("Output token throughput (tok/s):", s.output_throughput)
        row("Total token throughput (tok/s):", s.total_token_throughput)
        for title, short, stats in (
            ("Time to First Token", "TTFT", s.ttft),
            ("Time per Output Token (excl. 1st token)", "TPOT", s.tpot),
            ("Inter-token Latency", "ITL", s.itl),
            ("End-to-end Latency", "E2EL", s.e2el),
        ):
            lines.append(f"{title:-^{width}}")
            row(f"Mean {short} (ms):", stats.mean_ms)
            row(f"Median {short} (ms):", stats.median_ms)
            row(f"P99 {short} (ms):", stats.p99_ms)
        lines.append("=" * width)
        return "\n".join(lines)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
