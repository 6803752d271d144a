"""An engine in a child process of its replica (``backend: process``,
deploy/engine_process.py): its life is tied to the replica's both ways, its death is a
dead engine at once, and an LLM server over it answers exactly as one over the engine in
process. (Its streams' properties are tests/deploy/test_serve_async_engine.py's, run on
both placements.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsv41.cluster.request import CumulativeOutputs
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.deploy.app_args import AppArgs
from dsv41.deploy.async_engine import AsyncEngine, EngineDeadError
from dsv41.deploy.engine_process import EngineProcess, engine_processes
from dsv41.deploy.llm_server import LLMServer
from dsv41.deploy.metrics import ServingMetrics

ENGINE_OPTIONS = {"block_size": 32, "max_model_len": 256}
# A child whose replica is gone notices at its next read; well within this on a loaded box.
ORPHAN_EXIT_S = 20
# A killed child's streams end at the step loop's next read of the socket.
DEAD_STREAM_S = 5


def _exited_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_engine_process_ends_every_stream_and_fails_health(tiny_dir: Path) -> None:
    """SIGKILL of the child while two requests stream ends both with EngineDeadError
    within DEAD_STREAM_S, each counted as failed; check_alive and check_health raise
    from then on, and a new request is refused at once."""
    process = EngineProcess(tiny_dir, ENGINE_OPTIONS)
    engine = AsyncEngine(process, ServingMetrics("t", max_model_len=256))
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def stream(request_id: str, started: asyncio.Event) -> int:
        count = 0
        async for output in engine.generate(request_id, [5, 9, 200, 17], params):
            count += len(output.token_ids)
            started.set()
        return count

    async def kill_while_streaming() -> tuple[list[object], float]:
        events = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(stream(f"r{i}", event)) for i, event in enumerate(events)]
        for event in events:
            await event.wait()
        os.kill(process.pid, signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, time.monotonic() - killed

    results, took = asyncio.run(kill_while_streaming())
    assert all(isinstance(result, EngineDeadError) for result in results), results
    assert took < DEAD_STREAM_S
    assert engine.metrics.value("requests_failed") == 2
    with pytest.raises(EngineDeadError, match="exited with code -9"):
        process.check_alive()
    with pytest.raises(EngineDeadError):
        engine.check_health()
    engine.shutdown()
    process.close()


def test_the_engine_process_exits_when_its_replica_is_killed(tiny_dir: Path, tmp_path: Path) -> None:
    """A replica killed with SIGKILL (no shutdown hook runs) leaves no engine process:
    the child sees its socket close and exits within ORPHAN_EXIT_S, idle or stepping."""
    script = tmp_path / "replica.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, threading
            from dsv41.cluster.sampling_params import SamplingParams
            from dsv41.deploy.engine_process import EngineProcess, engine_processes
            process = EngineProcess({str(tiny_dir)!r}, {ENGINE_OPTIONS!r})
            if sys.argv[1] == "stepping":
                process.add_request("long", [5, 9, 200], SamplingParams(max_tokens=250, ignore_eos=True))
                process.step()
            print(process.pid, flush=True)
            threading.Event().wait()
            """
        )
    )
    for state in ("idle", "stepping"):
        replica = subprocess.Popen(
            [sys.executable, str(script), state], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        )
        assert replica.stdout is not None
        child = int(replica.stdout.readline())
        replica.kill()
        replica.wait()
        assert _exited_within(child, ORPHAN_EXIT_S), f"{state}: the engine process outlived its replica"


def test_a_load_failure_is_raised_by_the_constructor_and_leaves_no_process(tmp_path: Path) -> None:
    """A model the child cannot load raises RuntimeError naming the model and the
    child's error, and the child is gone."""
    missing = tmp_path / "no-such-checkpoint"
    before = engine_processes(os.getpid())
    with pytest.raises(RuntimeError, match=f"could not load {missing}"):
        EngineProcess(missing, ENGINE_OPTIONS)
    assert engine_processes(os.getpid()) == before


def test_an_llm_server_over_an_engine_process_answers_as_one_in_process(tiny_dir: Path) -> None:
    """The same completion bodies (greedy, and seeded sampling with n = 2) get the same
    choices from an LLMServer with backend 'process' as from one with 'local'; the
    process server's health check passes, and its shutdown hook leaves no child."""
    bodies = [
        {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0.0},
        {"model": "tiny", "prompt": [5, 9, 200, 17], "max_tokens": 8, "temperature": 0.9, "seed": 11, "n": 2},
    ]

    def answers(backend: str) -> list[list[dict[str, object]]]:
        args = AppArgs(model=str(tiny_dir), served_model_name="tiny", backend=backend, engine=ENGINE_OPTIONS, ray_metrics=False)
        server = LLMServer.func_or_class(args)
        try:
            asyncio.run(server.check_health())
            got = [asyncio.run(server.completions(dict(body)))["choices"] for body in bodies]
            if backend == "process":
                assert engine_processes(os.getpid()) == {server._engine_process.pid}
        finally:
            server.__del__()
        return got

    local = answers("local")
    assert answers("process") == local
    assert engine_processes(os.getpid()) == set()


def test_adds_arriving_together_are_admitted_in_one_turn(tiny_dir: Path) -> None:
    """An interrupted step returns at once; adds sent while the child steps another
    request are all taken at its next turn (an add is not a round trip): the first
    outputs that carry any of them carry a token of each, and every request's tokens
    equal the engine's own greedy run."""
    from dsv41.cluster.engine import Engine

    process = EngineProcess(tiny_dir, ENGINE_OPTIONS)
    try:
        # An interrupted wait returns at once with nothing, even with the child idle
        # (no message is coming): what lets a step loop send a command it just queued.
        process.interrupt_step()
        assert process.step() == []
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        prompts = [[5, 9, 200], [40, 41], [7, 8, 9, 10]]
        ids = [f"r{i}" for i in range(len(prompts))]
        process.add_request("busy", [3, 4], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        process.step()
        for request_id, prompt in zip(ids, prompts):
            process.add_request(request_id, prompt, params)
        whole = CumulativeOutputs()
        finals = {}
        firsts: list[set[str]] = []
        seen: set[str] = set()
        while process.has_unfinished_requests():
            outputs = process.step()
            new = {o.request_id for o in outputs if o.request_id in ids} - seen
            if new:
                firsts.append(new)
                seen |= new
            for output in outputs:
                final = whole.add(output)
                if final is not None:
                    finals[output.request_id] = final.token_ids
        assert firsts[0] == set(ids)
        want = Engine.from_pretrained(tiny_dir, **ENGINE_OPTIONS).generate(prompts, params)
        assert [finals[request_id] for request_id in ids] == [w.token_ids for w in want]
    finally:
        process.close()
