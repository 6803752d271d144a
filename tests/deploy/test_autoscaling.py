"""Autoscaling over HTTP: a live local Serve app whose LLM server scales on ongoing
requests between one and two replicas (each a whole local engine), the only application
on the package's shared 2-CPU Ray cluster. Every wait has a deadline."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import openai
import pytest
from ray import serve

from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams

APP_NAME = "autoscaled"
LLM_SERVER = "LLMServer"
# A new replica is a new worker process that imports torch and loads its engine.
SCALE_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 60
ENGINE = {"block_size": 32, "max_model_len": 256, "cache_memory_bytes": 64 << 20}
MAX_TOKENS = 8
NUM_STREAMS = 4
PROMPTS = [[5 + i, 17, 200, 3 * i + 1] for i in range(NUM_STREAMS)]
# Decisions on a short window: metrics every 0.5 s over the last 2 s, no upscale delay,
# a 2 s downscale delay, one ongoing request per replica as the target.
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
    "upscale_delay_s": 0,
    "downscale_delay_s": 2,
}


@pytest.fixture(scope="module")
def base_url(tiny_dir: Path, serve_app: Callable[..., str]) -> str:
    args = {
        "model": str(tiny_dir),
        "served_model_name": "tiny",
        "engine": ENGINE,
        "autoscaling_config": AUTOSCALING,
        "max_ongoing_requests": 8,
        "ray_actor_options": {"num_cpus": 1},
    }
    return serve_app(args, name=APP_NAME)


def _replica_states() -> dict[str, int]:
    deployment = serve.status().applications[APP_NAME].deployments[LLM_SERVER]
    return {state: count for state, count in deployment.replica_states.items() if count}


def _wait_for_replicas(states: dict[str, int], timeout_s: float, while_waiting: str) -> None:
    deadline = time.monotonic() + timeout_s
    while _replica_states() != states:
        assert time.monotonic() < deadline, f"{while_waiting}: replicas {_replica_states()} after {timeout_s} s"
        time.sleep(0.25)


class _StreamingLoad:
    """``NUM_STREAMS`` clients, each streaming greedy completions of its own prompt one
    after another until stopped; every answer is kept as (prompt index, text, usage
    completion tokens, the finish reasons its chunks carried)."""

    def __init__(self, base_url: str) -> None:
        self.answers: list[tuple[int, str, int, tuple[str, ...]]] = []
        self.failures: list[Exception] = []
        self._base_url = base_url
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(NUM_STREAMS)]

    def __enter__(self) -> "_StreamingLoad":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S)
        assert not any(t.is_alive() for t in self._threads), "a streaming client did not finish"

    def _client(self, index: int) -> None:
        client = openai.OpenAI(base_url=f"{self._base_url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        try:
            while not self._stop.is_set():
                chunks = list(
                    client.completions.create(
                        model="tiny",
                        prompt=PROMPTS[index],
                        max_tokens=MAX_TOKENS,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True},
                    )
                )
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                finish = tuple(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
                self.answers.append((index, text, chunks[-1].usage.completion_tokens, finish))
        except Exception as exc:  # noqa: BLE001 - reported by the test, not lost in a thread
            self.failures.append(exc)

    def wait_for_answers(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.answers) < count and not self.failures:
            assert time.monotonic() < deadline, f"{len(self.answers)} answers of {count} after {timeout_s} s"
            time.sleep(0.1)


def test_streaming_load_scales_to_two_replicas_and_back(base_url: str, tiny_dir: Path) -> None:
    """Four concurrent streaming clients (four ongoing requests against a target of one
    per replica) scale the LLM server from one replica to two, as ``serve.status()``
    shows; the two replicas (one CPU each) and the ingress fit the 2-CPU cluster
    because the ingress reserves none. The load goes on for ``2 * NUM_STREAMS`` more
    answers with both replicas running. Every answer is complete (every token, one
    finish reason, ``length``) with the text of an uninterrupted greedy run of the same
    engine configuration outside Serve; once the load stops the deployment scales back
    to one replica."""
    assert _replica_states() == {"RUNNING": 1}
    with _StreamingLoad(base_url) as load:
        _wait_for_replicas({"RUNNING": 2}, SCALE_TIMEOUT_S, "upscale under load")
        load.wait_for_answers(len(load.answers) + 2 * NUM_STREAMS, SCALE_TIMEOUT_S)
    assert not load.failures, load.failures
    _wait_for_replicas({"RUNNING": 1}, SCALE_TIMEOUT_S, "downscale after the load")

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [output.text for output in Engine.from_pretrained(tiny_dir, **ENGINE).generate(PROMPTS, params)]
    assert {index for index, *_ in load.answers} == set(range(NUM_STREAMS))
    assert all(
        (text, tokens, finish) == (expected[index], MAX_TOKENS, ("length",)) for index, text, tokens, finish in load.answers
    ), [answer for answer in load.answers if answer[1] != expected[answer[0]]]
