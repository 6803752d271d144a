"""Several replicas' metrics through Ray's export: one scrape of the node's Ray metrics
agent holds every replica's series, told apart by ``ReplicaId``, and together they
count exactly the requests sent (each ``/metrics`` scrape reaches one replica only)."""

from __future__ import annotations

import time
import urllib.request
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

import openai
from prometheus_client.parser import text_string_to_metric_families

NUM_REPLICAS = 2
MODEL_NAME = "tiny-replicas"
EXPORT_TIMEOUT_S = 90


def _exported(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
        return {f.name: f for f in text_string_to_metric_families(response.read().decode())}


def test_one_ray_scrape_holds_every_replica(
    tiny_dir: Path, local_serve: Callable[..., AbstractContextManager[str]], free_port: Callable[[], int]
) -> None:
    """Two replicas, eight completions of 4 tokens each over HTTP: Ray's metrics agent
    shows both replicas' gauges (two ReplicaIds, both of this model), and the
    replicas' request_success and generation_tokens counters add up to the eight
    requests and their 32 tokens."""
    metrics_port = free_port()
    args = {
        "model": str(tiny_dir),
        "served_model_name": MODEL_NAME,
        "metrics_prefix": "vllm:",
        "num_replicas": NUM_REPLICAS,
        "engine": {"block_size": 32, "max_model_len": 256, "cache_memory_bytes": 32 << 20},
        "ray_actor_options": {"num_cpus": 1},
    }
    with local_serve(args, name="replicas", ray_options={"_metrics_export_port": metrics_port}) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
        for i in range(8):
            client.completions.create(
                model=MODEL_NAME, prompt=[10 + i, 11, 12], max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True}
            )
        deadline = time.monotonic() + EXPORT_TIMEOUT_S
        while True:
            families = _exported(metrics_port)
            running = families.get("ray_vllm_num_requests_running")
            success = families.get("ray_vllm_request_success")
            replicas = set() if running is None else {s.labels["ReplicaId"] for s in running.samples}
            done = 0 if success is None else sum(s.value for s in success.samples if s.name.endswith("_total"))
            if len(replicas) == NUM_REPLICAS and done == 8:
                break
            assert time.monotonic() < deadline, f"Ray's export shows replicas {replicas} and {done} successes"
            time.sleep(1)
    assert "" not in replicas
    assert {s.labels["model_name"] for s in running.samples} == {MODEL_NAME}
    generated = families["ray_vllm_generation_tokens"]
    assert sum(s.value for s in generated.samples if s.name.endswith("_total")) == 32
    assert {s.labels["ReplicaId"] for s in generated.samples} <= replicas
