"""Faults of a live ``backend: ray`` replica (DP2, offload store on) over HTTP: each
actor kind of the replica is SIGKILLed by the pid Ray records while streams run, on a
2-CPU Ray cluster that the replica fills (its placement group: one CPU for the
replica, half a CPU per rank), so a placement group left behind by a dead replica
would keep its replacement from ever starting.

Properties, one test per fault, in the order they run on the module's application:
- a RankActor: every stream in flight ends with an OpenAI error event (500
  ``request_failed``) and ``[DONE]`` within seconds, counted as failed requests (never
  as a finish reason), and the group restarts in place and serves the greedy tokens;
- the OffloadActor: no stream notices (each ends complete), a prompt long enough to
  look the store up is served with its greedy tokens while the store is down, and Ray
  restarts the store;
- the SchedulerActor: every stream ends with a 503 ``engine_dead`` error event and
  ``[DONE]``, ``/health`` answers 503 at once, and Serve replaces the replica, which
  serves the greedy tokens;
- the replica process: every stream ends with a 503 ``replica_lost`` error event and
  ``[DONE]``, and the replacement serves the greedy tokens;
- then the same application deployed again as two one-rank replicas (half the
  resources each) runs both, each with its own actor names and placement group;
- then deployed as one ``backend: process`` replica (the engine in a child process of
  the replica): SIGKILL of the engine process ends every stream with a 503
  ``engine_dead`` error event, ``/health`` answers 503 at once and Serve replaces the
  replica; SIGKILL of the replica ends them with ``replica_lost`` and its engine
  process exits by itself; each replacement serves the greedy tokens.
After every fault of a ``backend: ray`` replica, exactly one placement group per
replica is held. Each test prints
its recovery time. Every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
from ray import serve
from ray._private import state
from ray.util import placement_group_table

from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.deploy.app import build_app, run_app
from dsv41.deploy.app_args import AppArgs
from dsv41.deploy.llm_server import llm_server_placement
from dsv41.deploy.engine_process import engine_processes

APP_NAME = "faults"
REQUEST_TIMEOUT_S = 60
# A new replica is a new worker process and a new group of three more (scheduler,
# two ranks) that import torch and load the model on two shared cores.
RECOVERY_TIMEOUT_S = 180
ENGINE = {
    "block_size": 32,
    "max_model_len": 512,
    "cache_memory_bytes": 64 << 20,
    "state_transfer": "copy",
    "offload_host_bytes": 32 << 20,
}
APP_ARGS = {
    "served_model_name": "tiny",
    "backend": "ray",
    "dp": 2,
    "engine": ENGINE,
    "ray_actor_options": {"num_cpus": 1},
    "group": {"rank_num_cpus": 0.5, "health_interval_s": 1.0},
    "health_check_period_s": 1.0,
}
NUM_STREAMS = 4
# Long enough that every stream is still decoding when its replica's actor dies (four
# such streams take ~20 s here) and that each completes PAGEs (publishes to the store).
STREAM_TOKENS = 120
PROMPTS = [[5 + i, 17, 200, 3 * i + 1] for i in range(NUM_STREAMS)]
# Over one PAGE: its admission looks the offload store up.
LONG_PROMPT = [(7 * i) % 500 + 3 for i in range(3 * 32 + 5)]
CHECK_TOKENS = 8


@pytest.mark.parametrize(
    "args, error",
    [
        ({"group": {"rank_num_cpus": 1}}, "group: .* needs backend 'ray'"),
        ({"backend": "ray", "group": {"rank_cpus": 1}}, r"group: unknown \['rank_cpus'\]"),
        ({"backend": "ray", "group": {"rank_num_cpus": 0}}, r"GroupOptions\.rank_num_cpus"),
        ({"backend": "ray", "ray_actor_options": {"num_cpus": 0}}, "ray_actor_options: .* reserves nothing"),
        ({"health_check_period_s": 0}, "health_check_period_s: 0"),
        ({"health_check_timeout_s": "5"}, "health_check_timeout_s: '5'"),
    ],
)
def test_fault_arguments_are_checked(args: dict[str, Any], error: str) -> None:
    """The group's options, the replica's reservation under backend ray and the health
    check's timing are refused when wrong, naming the field and what is allowed."""
    with pytest.raises(ValueError, match=error):
        AppArgs(**args)


def test_a_ray_replica_reserves_its_ranks_in_its_own_placement_group() -> None:
    """Under backend ray each LLM server replica asks Serve for one STRICT_PACK
    placement group: its own resources first, then a bundle per rank (GPUs included);
    a local replica asks for none."""
    replica = {"num_cpus": 0.5, "memory": 1 << 30, "resources": {"head": 1}}
    args = AppArgs(backend="ray", dp=2, ray_actor_options=replica, group={"rank_num_gpus": 1})
    assert llm_server_placement(args) == {
        "placement_group_bundles": [{"CPU": 0.5, "memory": 1 << 30, "head": 1}, {"CPU": 0.5, "GPU": 1}, {"CPU": 0.5, "GPU": 1}],
        "placement_group_strategy": "STRICT_PACK",
    }
    assert llm_server_placement(AppArgs()) == {}


@pytest.fixture(scope="module")
def base_url(tiny_dir: Path, serve_app: Callable[..., str]) -> str:
    return serve_app({"model": str(tiny_dir), **APP_ARGS}, name=APP_NAME)


@pytest.fixture(scope="module")
def greedy(tiny_dir: Path) -> Callable[[list[int], int], str]:
    """The text of an uninterrupted greedy run of the in-process Engine (a DP2 EP
    group gives its tokens)."""
    engine = Engine.from_pretrained(tiny_dir, **ENGINE)
    texts: dict[tuple[tuple[int, ...], int], str] = {}

    def text(prompt: list[int], max_tokens: int) -> str:
        key = (tuple(prompt), max_tokens)
        if key not in texts:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            texts[key] = engine.generate([prompt], params)[0].text
        return texts[key]

    return text


def _body(prompt: list[int], max_tokens: int, *, stream: bool) -> bytes:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body).encode()


def _post(
    base_url: str, prompt: list[int], max_tokens: int, timeout_s: float = REQUEST_TIMEOUT_S
) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=_body(prompt, max_tokens, stream=False), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


class _Stream(threading.Thread):
    """One streamed greedy completion, read event by event: ``events`` holds each
    ``data:`` payload (parsed JSON, or the string ``[DONE]``); ``started`` is set at
    the first one."""

    def __init__(self, base_url: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.prompt = prompt
        self.events: list[Any] = []
        self.started = threading.Event()
        self.failure: BaseException | None = None
        self._request = urllib.request.Request(
            f"{base_url}/v1/completions", data=_body(prompt, STREAM_TOKENS, stream=True), headers={"Content-Type": "application/json"}
        )

    def run(self) -> None:
        try:
            with urllib.request.urlopen(self._request, timeout=REQUEST_TIMEOUT_S) as response:
                for line in response:
                    if line.startswith(b"data: "):
                        payload = line[6:].strip().decode()
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                        self.started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc
        finally:
            self.started.set()

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events if isinstance(e, dict) and e.get("choices"))

    def error(self) -> dict[str, Any]:
        """The error event that ended the stream (asserting it did end so)."""
        assert self.failure is None, self.failure
        assert len(self.events) >= 2 and self.events[-1] == "[DONE]", self.events[-3:]
        assert set(self.events[-2]) == {"error"}, self.events[-2]
        error = self.events[-2]["error"]
        assert error["type"] == "server_error" and error["message"] and "Traceback" not in error["message"]
        return error


def _streams_in_flight(base_url: str) -> list[_Stream]:
    streams = [_Stream(base_url, prompt) for prompt in PROMPTS]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(REQUEST_TIMEOUT_S) and stream.failure is None, stream.failure
    return streams


def _join(streams: list[_Stream], timeout_s: float) -> float:
    """Waits for every stream to end; returns the time it took."""
    started = time.monotonic()
    for stream in streams:
        stream.join(max(timeout_s - (time.monotonic() - started), 0))
        assert not stream.is_alive(), f"a stream did not end within {timeout_s} s"
    return time.monotonic() - started


def _alive(pattern: str) -> list[str]:
    """Names of the live Ray actors matching ``pattern`` (a regular expression)."""
    return sorted(a["Name"] for a in state.actors().values() if a["State"] == "ALIVE" and re.fullmatch(pattern, a["Name"]))


def _replica_actors() -> list[str]:
    return _alive(rf"SERVE_REPLICA::{APP_NAME}#LLMServer#\w+")


def _group_actor(kind: str) -> str:
    """The one live actor of the replica's engine group named ``...-{kind}``."""
    (name,) = _alive(rf"dsv41-{APP_NAME}-\w+-{kind}")
    return name


def _held_placement_groups() -> list[str]:
    return sorted(pg["name"] for pg in placement_group_table().values() if pg["state"] != "REMOVED")


def _served_again(base_url: str, greedy: Callable[[list[int], int], str], since: float) -> float:
    """Polls a greedy completion until it answers 200 with the greedy text; returns
    the time since ``since``."""
    while True:
        # Serve holds a request sent while the replacement replica starts until it can
        # take it, so one request may wait for the whole start (over a minute on a
        # loaded 2-core box): the bound is the recovery's, not one request's.
        remaining = RECOVERY_TIMEOUT_S - (time.monotonic() - since)
        status, body = _post(base_url, PROMPTS[0], CHECK_TOKENS, timeout_s=max(remaining, 1.0))
        if status == 200:
            assert body["choices"][0]["text"] == greedy(PROMPTS[0], CHECK_TOKENS)
            return time.monotonic() - since
        assert status == 503, body
        assert time.monotonic() - since < RECOVERY_TIMEOUT_S, body
        time.sleep(0.25)


def _dead_engine_replaced(
    base_url: str, greedy: Callable[[list[int], int], str], kill: Callable[[], object]
) -> tuple[float, float, float]:
    """Kills the replica's engine (``kill``) while four streams decode and checks that
    each stream ends with a 503 engine_dead error event and [DONE], that /health answers
    503 at once, and that a replacement serves the greedy text; returns the seconds from
    the kill until the streams ended, /health failed and the replacement served."""
    streams = _streams_in_flight(base_url)
    kill()
    killed = time.monotonic()
    ended = _join(streams, REQUEST_TIMEOUT_S)
    assert {stream.error()["code"] for stream in streams} == {"engine_dead"}
    assert _health(base_url) == 503
    unhealthy = time.monotonic() - killed
    return ended, unhealthy, _served_again(base_url, greedy, killed)


def _one_placement_group_per_replica(replicas: list[str]) -> None:
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while _held_placement_groups() != replicas:
        assert time.monotonic() < deadline, f"placement groups {_held_placement_groups()} for replicas {replicas}"
        time.sleep(0.25)


def test_a_dead_rank_fails_the_streams_in_flight_and_the_group_restarts(
    base_url: str,
    greedy: Callable[[list[int], int], str],
    metric: Callable[[str, str], float],
    sigkill_actor: Callable[[str], int],
) -> None:
    """SIGKILL rank 1 while four streams decode: each ends with a 500 request_failed
    error event and [DONE]; the four count as failed requests and never as finished
    ones; the same replica then serves the greedy text (its group restarted)."""
    replicas = _replica_actors()
    assert len(replicas) == 1
    _one_placement_group_per_replica(replicas)
    failed = metric(base_url, "dsv41:requests_failed_total")
    streams = _streams_in_flight(base_url)
    sigkill_actor(_group_actor(r"g\d+-rank1"))
    killed = time.monotonic()
    ended = _join(streams, REQUEST_TIMEOUT_S)
    assert {stream.error()["code"] for stream in streams} == {"request_failed"}
    recovered = _served_again(base_url, greedy, killed)
    assert metric(base_url, "dsv41:requests_failed_total") == failed + NUM_STREAMS
    metrics = urllib.request.urlopen(f"{base_url}/metrics", timeout=REQUEST_TIMEOUT_S).read().decode()
    assert 'finished_reason="error"' not in metrics
    assert _replica_actors() == replicas
    _one_placement_group_per_replica(replicas)
    print(f"\nrank SIGKILL: streams ended in {ended:.2f} s; served again after {recovered:.1f} s")


def _restarts(name: str) -> list[int]:
    return [a["NumRestarts"] for a in state.actors().values() if a["Name"] == name and a["State"] == "ALIVE"]


def _wait_for_restarts(name: str, count: int, since: float) -> float:
    while _restarts(name) != [count]:
        assert time.monotonic() - since < RECOVERY_TIMEOUT_S, f"{name} restarts: {_restarts(name)}"
        time.sleep(0.25)
    return time.monotonic() - since


def test_a_dead_offload_store_costs_no_request(
    base_url: str, greedy: Callable[[list[int], int], str], sigkill_actor: Callable[[str], int]
) -> None:
    """SIGKILL the OffloadActor while four streams decode (their ranks publish PAGEs to
    it): every stream ends complete, every token and finish reason "length", no error.
    SIGKILL it again once Ray has restarted it, with nothing running, and ask at once
    for a prompt of over three PAGEs, whose admission looks the store up: it is served
    with its greedy text (recomputed). Ray restarts the store again; the replica is the
    same throughout. (The streams' text is not compared with solo runs: four greedy
    streams batched together may leave the solo run's tokens after a few hundred
    tokens, batch variance that issue 15 removes.)"""
    replicas = _replica_actors()
    offload = _group_actor("offload")
    streams = _streams_in_flight(base_url)
    sigkill_actor(offload)
    killed = time.monotonic()
    restarted = _wait_for_restarts(offload, 1, killed)
    # What bounds this wait is the streams' STREAM_TOKENS tokens each on the two shared
    # cores, beside the store's restart and the other test worker, not a request's
    # latency: in a fresh-clone run of the suite on a slow day (2026-12-07, every test
    # about twice its usual time) they had not ended 60 s after the restart. A stream
    # that hangs still fails here.
    _join(streams, RECOVERY_TIMEOUT_S)
    for stream in streams:
        assert stream.failure is None and stream.events[-1] == "[DONE]", stream.events[-2:]
        finishes = [c["finish_reason"] for e in stream.events[:-1] for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"] and stream.events[-2]["usage"]["completion_tokens"] == STREAM_TOKENS

    sigkill_actor(offload)
    killed = time.monotonic()
    status, body = _post(base_url, LONG_PROMPT, CHECK_TOKENS)
    served = time.monotonic() - killed
    assert status == 200 and body["choices"][0]["text"] == greedy(LONG_PROMPT, CHECK_TOKENS), body
    idle_restarted = _wait_for_restarts(offload, 2, killed)
    assert _replica_actors() == replicas
    print(f"\noffload SIGKILL: streams unaffected, the store back after {restarted:.1f} s; killed idle, a long "
          f"prompt was served {served:.2f} s after and the store back after {idle_restarted:.1f} s")


def _health(base_url: str) -> int:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=REQUEST_TIMEOUT_S) as response:
            return response.status
    except urllib.error.HTTPError as error:
        body = json.loads(error.read())
        assert body["error"]["type"] == "server_error", body
        return error.code


def test_a_dead_scheduler_fails_health_and_serve_replaces_the_replica(
    base_url: str, greedy: Callable[[list[int], int], str], sigkill_actor: Callable[[str], int]
) -> None:
    """SIGKILL the SchedulerActor while four streams decode: each ends with a 503
    engine_dead error event and [DONE]; /health answers 503 at once; Serve replaces
    the replica (the old one's placement group goes, its successor's is placed on the
    freed CPUs) and the new replica serves the greedy text."""
    (old,) = _replica_actors()
    ended, unhealthy, recovered = _dead_engine_replaced(base_url, greedy, lambda: sigkill_actor(_group_actor("scheduler")))
    (new,) = _replica_actors()
    assert new != old
    _one_placement_group_per_replica([new])
    print(f"\nscheduler SIGKILL: streams ended in {ended:.2f} s, /health 503 after {unhealthy:.2f} s; "
          f"the replacement served after {recovered:.1f} s")


def test_a_dead_replica_process_is_replaced_and_releases_everything(
    base_url: str, greedy: Callable[[list[int], int], str], sigkill_actor: Callable[[str], int]
) -> None:
    """SIGKILL the LLM server replica's process while four streams decode: each ends
    with a 503 replica_lost error event and [DONE]; the replica's group dies with it
    (its actors are the replica's), Serve removes its placement group and the
    replacement, placed on the freed CPUs, serves the greedy text."""
    (old,) = _replica_actors()
    old_group = _group_actor("scheduler").removesuffix("-scheduler")
    streams = _streams_in_flight(base_url)
    sigkill_actor(old)
    killed = time.monotonic()
    ended = _join(streams, REQUEST_TIMEOUT_S)
    assert {stream.error()["code"] for stream in streams} == {"replica_lost"}
    recovered = _served_again(base_url, greedy, killed)
    (new,) = _replica_actors()
    assert new != old and not _alive(rf"{re.escape(old_group)}-.*")
    _one_placement_group_per_replica([new])
    print(f"\nreplica SIGKILL: streams ended in {ended:.2f} s; the replacement served after {recovered:.1f} s")


def test_two_ray_replicas_run_side_by_side(base_url: str, tiny_dir: Path, greedy: Callable[[list[int], int], str]) -> None:
    """The application deleted (its replica shut down gracefully, releasing its
    placement group) and deployed again with two one-rank replicas of half the
    resources each:
    both run (each group's actors named after its replica, each replica in its own
    placement group) and requests, one at a time, get the greedy text. (Redeployed in
    place, Serve would keep the old replica until a new one runs, which a full cluster
    cannot place.)"""
    started = time.monotonic()
    serve.delete(APP_NAME)
    assert not _held_placement_groups() and not _alive(rf"dsv41-{APP_NAME}-.*")
    halves = {**APP_ARGS, "num_replicas": 2, "dp": 1, "ray_actor_options": {"num_cpus": 0.5}, "group": {"rank_num_cpus": 0.5}}
    run_app(build_app({"model": str(tiny_dir), **halves}), name=APP_NAME, route_prefix="/", timeout_s=RECOVERY_TIMEOUT_S)
    replicas = _replica_actors()
    assert len(replicas) == 2
    assert len(_alive(rf"dsv41-{APP_NAME}-\w+-scheduler")) == 2 and len(_alive(rf"dsv41-{APP_NAME}-\w+-g1-rank0")) == 2
    _one_placement_group_per_replica(replicas)
    for prompt in PROMPTS:
        status, body = _post(base_url, prompt, CHECK_TOKENS)
        assert status == 200 and body["choices"][0]["text"] == greedy(prompt, CHECK_TOKENS), body
    assert serve.status().applications[APP_NAME].deployments["LLMServer"].replica_states.get("RUNNING") == 2
    print(f"\ntwo replicas: running and serving {time.monotonic() - started:.1f} s after the redeploy")


def _engine_process(replica: str) -> int:
    """The pid of the engine process of the live LLM server replica actor ``replica``."""
    (pid,) = [a["Pid"] for a in state.actors().values() if a["Name"] == replica and a["State"] == "ALIVE"]
    (child,) = engine_processes(pid)
    return child


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_dead_engine_process_fails_health_and_serve_replaces_the_replica(
    base_url: str, tiny_dir: Path, greedy: Callable[[list[int], int], str]
) -> None:
    """The application deployed again as one ``backend: process`` replica; SIGKILL of
    its engine process while four streams decode: each ends with a 503 engine_dead
    error event and [DONE]; /health answers 503 at once; Serve replaces the replica,
    whose own engine process serves the greedy text."""
    serve.delete(APP_NAME)
    process_args = {"served_model_name": "tiny", "backend": "process", "engine": ENGINE, "health_check_period_s": 1.0}
    run_app(build_app({"model": str(tiny_dir), **process_args}), name=APP_NAME, route_prefix="/", timeout_s=RECOVERY_TIMEOUT_S)
    (old,) = _replica_actors()
    child = _engine_process(old)
    ended, unhealthy, recovered = _dead_engine_replaced(base_url, greedy, lambda: os.kill(child, signal.SIGKILL))
    (new,) = _replica_actors()
    assert new != old and _engine_process(new) != child
    print(f"\nengine process SIGKILL: streams ended in {ended:.2f} s, /health 503 after {unhealthy:.2f} s; "
          f"the replacement served after {recovered:.1f} s")


def test_a_dead_process_replica_leaves_no_engine_process(
    base_url: str, greedy: Callable[[list[int], int], str], sigkill_actor: Callable[[str], int]
) -> None:
    """SIGKILL of the ``backend: process`` replica while four streams decode: each ends
    with a 503 replica_lost error event and [DONE]; its engine process exits by itself
    (no shutdown hook ran: its socket closed), and the replacement serves the greedy
    text."""
    (old,) = _replica_actors()
    child = _engine_process(old)
    streams = _streams_in_flight(base_url)
    sigkill_actor(old)
    killed = time.monotonic()
    ended = _join(streams, REQUEST_TIMEOUT_S)
    assert {stream.error()["code"] for stream in streams} == {"replica_lost"}
    assert _gone(child, REQUEST_TIMEOUT_S), "the engine process outlived its replica"
    orphaned = time.monotonic() - killed
    recovered = _served_again(base_url, greedy, killed)
    print(f"\nprocess replica SIGKILL: streams ended in {ended:.2f} s, its engine process exited within "
          f"{orphaned:.2f} s; the replacement served after {recovered:.1f} s")
