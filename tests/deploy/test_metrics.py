"""The serving metrics: vLLM's families (names, types, buckets, labels) under the chosen
prefix; counters that only grow, also over the engine's resets; the engine's
preemptions counted; and a live replica's ``/metrics`` and Ray's metrics export,
parsed by prometheus_client's parser, counting exactly the requests sent."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable, Iterator

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.deploy.async_engine import AsyncEngine
from dsv41.deploy.metrics import (
    DEFAULT_METRICS_PREFIX,
    EngineLoad,
    FinishedSequence,
    ServingMetrics,
    check_metrics_prefix,
    token_buckets,
)

# vLLM v1's PrometheusStatLogger (vllm/v1/metrics/loggers.py): name -> type, and the
# histograms' bucket boundaries ("tokens": its 1-2-5 series up to max_model_len).
VLLM_TYPES = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "num_preemptions": "counter",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "request_success": "counter",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
}
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
VLLM_BUCKETS = {
    "time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],  # fmt: skip
    "inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],  # fmt: skip
    "e2e_request_latency_seconds": REQUEST_LATENCY,
    "request_queue_time_seconds": REQUEST_LATENCY,
    "request_inference_time_seconds": REQUEST_LATENCY,
    "request_prefill_time_seconds": REQUEST_LATENCY,
    "request_decode_time_seconds": REQUEST_LATENCY,
    "request_prompt_tokens": "tokens",
    "request_generation_tokens": "tokens",
}
CUMULATIVE = (
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "offload_fetched_pages", "prefix_replayed_tokens"
)
MAX_MODEL_LEN = 512
MODEL_NAME = "tiny-metrics"


def _families(text: str) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _buckets(samples: list[Sample]) -> list[float]:
    return [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]


def _value(families: dict[str, object], name: str, suffix: str = "", **labels: str) -> float:
    """The sum of ``name``'s samples ending in ``suffix`` whose labels include ``labels``."""
    family = families[name]
    return sum(
        s.value
        for s in family.samples
        if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.mark.parametrize("prefix", [DEFAULT_METRICS_PREFIX, "vllm:", ""])
def test_the_families_are_vllms_under_the_prefix(prefix: str) -> None:
    """Rendered and parsed back: every vLLM family exists from the start under
    ``prefix`` with vLLM's type, labels ``model_name`` and ``engine`` (and
    ``finished_reason`` on request_success) and vLLM's histogram buckets."""
    metrics = ServingMetrics(MODEL_NAME, max_model_len=MAX_MODEL_LEN, prefix=prefix)
    families = _families(metrics.render().decode())
    for name, kind in VLLM_TYPES.items():
        family = families[prefix + name]
        assert family.type == kind, name
        expected = {"model_name", "engine"} | ({"finished_reason"} if name == "request_success" else set())
        assert family.samples, name
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                assert set(sample.labels) - {"le"} == expected, sample
                assert sample.labels["model_name"] == MODEL_NAME and sample.labels["engine"] == "0"
        if name in VLLM_BUCKETS:
            buckets = VLLM_BUCKETS[name]
            assert _buckets(family.samples) == (list(token_buckets(MAX_MODEL_LEN)) if buckets == "tokens" else buckets)
    assert token_buckets(MAX_MODEL_LEN) == (1, 2, 5, 10, 20, 50, 100, 200, 500)


@pytest.mark.parametrize("prefix", ["9x", "a-b", "vllm:", 3])
def test_a_prefix_prometheus_refuses_is_refused(prefix: object) -> None:
    """A prefix that would make a name Prometheus refuses raises, naming the option."""
    if prefix == "vllm:":
        assert check_metrics_prefix(prefix) == prefix
        return
    with pytest.raises(ValueError, match="metrics_prefix"):
        check_metrics_prefix(prefix)


@pytest.mark.parametrize(("name", "value"), [("metrics_prefix", "a-b"), ("ray_metrics", "yes"), ("ray_metrics", 1)])
def test_the_application_refuses_bad_metrics_args(name: str, value: object) -> None:
    """The application's metrics args are checked before Serve starts a replica: the
    error names the arg."""
    from dsv41.deploy.app_args import AppArgs

    with pytest.raises(ValueError, match=name):
        AppArgs(**{name: value})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 50)), min_size=1, max_size=30))
def test_cumulative_counts_are_counters_that_only_grow(steps: list[tuple[bool, int]]) -> None:
    """A random run of engine snapshots whose cumulative counts grow, and now and then
    start again from zero (ranks restarted) and reach less than before by the next
    snapshot: each exported counter never goes back, and equals the counts'
    increases, a reset counting its new value whole (a restart whose count is back
    at or above the last snapshot's by the next one reads as growth, as Prometheus
    itself reads a counter)."""
    metrics = ServingMetrics(MODEL_NAME, max_model_len=MAX_MODEL_LEN)
    total, expected = 0, 0
    for reset, grow in steps:
        if reset and total > 0:
            total = grow % total
            expected += total
        else:
            total += grow
            expected += grow
        load = EngineLoad(
            0, 0, 100, 0, prefix_lookup_tokens=total, prefix_hit_tokens=total, preemptions=total,
            offload_fetched_pages=total, prefix_replayed_tokens=total,
        )  # fmt: skip
        before = {name: metrics.value(name) for name in CUMULATIVE}
        metrics.observe_load(load)
        for name in CUMULATIVE:
            assert before[name] <= metrics.value(name) == expected, name


def test_finished_sequences_fill_the_request_histograms() -> None:
    """One finished sequence observes each request histogram once with its values;
    one that never got a token observes no phase histogram."""
    metrics = ServingMetrics(MODEL_NAME, max_model_len=MAX_MODEL_LEN, prefix="vllm:")
    metrics.observe_finished(FinishedSequence("length", 2.0, 17, 5, queue_time=0.5, prefill_time=0.25, decode_time=1.0))
    metrics.observe_finished(FinishedSequence("stop", 0.1, 3, 0))
    families = _families(metrics.render().decode())
    for name, total in (
        ("request_queue_time_seconds", 0.5),
        ("request_prefill_time_seconds", 0.25),
        ("request_decode_time_seconds", 1.0),
        ("request_inference_time_seconds", 1.25),
    ):
        assert _value(families, "vllm:" + name, "_count") == 1 and _value(families, "vllm:" + name, "_sum") == total
    assert _value(families, "vllm:e2e_request_latency_seconds", "_count") == 2
    assert _value(families, "vllm:request_prompt_tokens", "_sum") == 20
    assert _value(families, "vllm:request_success", "_total", finished_reason="length") == 1
    assert _value(families, "vllm:request_success", "_total", finished_reason="stop") == 1


def test_preemptions_are_counted(tiny_dir: Path) -> None:
    """Four requests that cannot all hold their PAGEs at once (6 PAGEs of 32 tokens,
    each needing 3 by its end): the engine preempts, and the counter equals the
    engine's own count of preemptions."""
    engine = Engine.from_pretrained(tiny_dir, block_size=32, num_pages=6, max_num_seqs=4, max_model_len=256)
    metrics = ServingMetrics(MODEL_NAME, max_model_len=256)
    serving = AsyncEngine(engine, metrics)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    async def run(i: int) -> None:
        async for _ in serving.generate(f"r{i}", list(range(20 + i, 60 + i)), params):
            pass

    async def all_of_them() -> None:
        await asyncio.gather(*(run(i) for i in range(4)))

    try:
        asyncio.run(all_of_them())
        deadline = time.monotonic() + 10
        preemptions = sum(engine.stats().preemptions)
        while metrics.value("num_preemptions") != preemptions and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        serving.shutdown()
    assert preemptions > 0
    assert metrics.value("num_preemptions") == preemptions


# -- a live replica -------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(
    tiny_dir: Path, local_serve: Callable[..., AbstractContextManager[str]], free_port: Callable[[], int]
) -> Iterator[tuple[str, int]]:
    """A one-replica application with vLLM's prefix, and Ray's metrics agent on a known port."""
    metrics_port = free_port()
    args = {
        "model": str(tiny_dir),
        "served_model_name": MODEL_NAME,
        "metrics_prefix": "vllm:",
        "engine": {"block_size": 32, "max_model_len": MAX_MODEL_LEN, "cache_memory_bytes": 64 << 20},
        "ray_actor_options": {"num_cpus": 1},
    }
    with local_serve(args, name="metrics", ray_options={"_metrics_export_port": metrics_port}) as url:
        yield url, metrics_port


def _scrape(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=60) as response:
        return _families(response.read().decode())


def _counters(families: dict[str, object]) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        if f.type in ("counter", "histogram")
        for s in f.samples
        if not s.name.endswith("_created")
    }


def test_a_live_replica_counts_exactly_the_requests_sent(live: tuple[str, int]) -> None:
    """Completions of known token-id prompts (one with n=2, one streamed, one prompt
    sent twice so that the prefix cache hits), each to its max_tokens: after each,
    /metrics parses, every counter and histogram sample is at least what it was; at
    the end the counts are exactly those of the sequences sent (successes, TTFT,
    e2e, queue, prefill, decode and length histograms; prompt and generation
    tokens; one inter-token latency per token after a sequence's first), nothing
    runs or waits, the prefix cache hit, and Ray's metrics export (tagged with the
    replica's id, ``ray_vllm_*``) counts the same."""
    base_url, metrics_port = live
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    shared = list(range(100, 200))
    # (prompt, max_tokens, n, stream)
    work = [
        (list(range(10, 17)), 5, 1, False),
        (shared, 4, 1, False),
        (list(range(30, 70)), 6, 2, False),
        (list(range(70, 75)), 7, 1, True),
        (shared, 3, 1, False),
    ]
    before = _scrape(f"{base_url}/metrics")
    previous = _counters(before)
    for prompt, max_tokens, n, stream in work:
        body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, n=n, temperature=0.0)
        answer = client.completions.create(**body, stream=stream, extra_body={"ignore_eos": True})
        if stream:
            list(answer)
        now = _counters(_scrape(f"{base_url}/metrics"))
        assert all(now[key] >= value for key, value in previous.items())
        previous = now
    after = _scrape(f"{base_url}/metrics")
    sequences = sum(n for _, _, n, _ in work)
    prompt_tokens = sum(len(p) * n for p, _, n, _ in work)
    generated = sum(m * n for _, m, n, _ in work)

    def grew(name: str, suffix: str = "_total", **labels: str) -> float:
        return _value(after, "vllm:" + name, suffix, **labels) - _value(before, "vllm:" + name, suffix, **labels)

    assert grew("request_success", finished_reason="length") == sequences
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert grew(name, "_count") == sequences, name
    assert grew("prompt_tokens") == grew("request_prompt_tokens", "_sum") == prompt_tokens
    assert grew("generation_tokens") == grew("request_generation_tokens", "_sum") == generated
    assert grew("inter_token_latency_seconds", "_count") == generated - sequences
    assert grew("prefix_cache_hits") > 0 and grew("prefix_cache_queries") >= grew("prefix_cache_hits")
    assert _value(after, "vllm:num_requests_running") == _value(after, "vllm:num_requests_waiting") == 0
    for family in after.values():
        assert family.name.startswith("vllm:"), family.name
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL_NAME and sample.labels["engine"] == "0", sample

    # Ray's export of the same replica: no request ran before this test, so its totals are the counts above.
    deadline = time.monotonic() + 90
    while True:
        exported = _scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        generated = _value(after, "vllm:generation_tokens", "_total")
        if "ray_vllm_request_success" in exported and _value(exported, "ray_vllm_generation_tokens", "_total") == generated:
            break
        assert time.monotonic() < deadline, "Ray's metrics export did not catch up in 90 s"
        time.sleep(1)
    replicas = {s.labels["ReplicaId"] for s in exported["ray_vllm_request_success"].samples}
    assert len(replicas) == 1 and "" not in replicas
    assert _value(exported, "ray_vllm_request_success", "_total", finished_reason="length") == _value(
        after, "vllm:request_success", "_total", finished_reason="length"
    )
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "inter_token_latency_seconds"):
        assert _value(exported, "ray_vllm_" + name, "_count") == _value(after, "vllm:" + name, "_count"), name
    # (Ray exports a counter once it has counted: no preemption ran, so none shows.)
    assert exported["ray_vllm_prefix_cache_hits"].type == "counter"
    assert exported["ray_vllm_kv_cache_usage_perc"].type == "gauge"
