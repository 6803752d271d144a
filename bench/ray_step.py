"""Benchmark of the Ray overhead of one engine-group step, per step transport.

The step path of ``actors/``: a Engine schedules every rank's batch and packs the DP
metadata; ``actors.step_wire.pack_step`` turns each rank's share into bytes; the
group's transport (``actors.transport.open_transport``: ``sockets``, the default,
``compiled`` or ``calls``) carries them to the ranks' ``execute_packed`` and their packed
StepResults back. The ranks here are RankActors with a trivial model (token 0 for every
sampling segment, no compute), so a step is scheduling + packing + transport.
``objects`` is the wire before any packing, kept as the reference: one call per rank
carrying the ScheduledBatch and the metadata tensor through Ray's own serialiser.

Columns: ``step`` is the engine's whole step, ``exchange`` the transport's round trip
(driver to ranks and back, the ranks' unpacking and packing included), ``pack`` the
driver's packing of the steps and unpacking of the results, ``engine`` the rest of the
step (scheduling, the DP metadata, applying the results: the engine's own Python,
whatever the transport); ``cpu/step`` the CPU time the driver and every rank process
used per step, and ``idle cpu`` the share of one core they use while no step runs (a
compiled graph's channels are polled: a waiting reader spins on sched_yield rather
than sleeping). ``running`` requests of 16 prompt tokens, each with its own
SamplingParams, decode (``ignore_eos``); each configuration runs ``--repeats`` times,
interleaved with the others, ``--steps`` steps each after a warm-up; medians and p90
are over all steps of all repeats. The load average of the box is recorded (other
work on it inflates every figure).

A second table prices the wire alone, in this process: one rank's ScheduledBatch (DP1,
``running`` segments) of a decode step pickled whole by the C pickler and by
``ray.cloudpickle`` (Ray's serialiser for Python objects: a Python-level hook per
object), and through the step wire (pack and unpack; a decode step of running
requests, a delta: no sampling parameters, no PAGE sent before); its StepResult the
same three ways; and the DP metadata as a tensor and as its int words.

Usage: python3 -m bench.ray_step [--steps 200] [--repeats 3] [--out bench/results/ray_step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]

import ray
import torch

from dsv41.actors.group import GroupOptions
from dsv41.actors.rank import RankActor
from dsv41.actors.step_wire import pack_result, pack_step, unpack_result, unpack_step
from dsv41.actors.transport import TRANSPORTS, StepTransport, failing_as, open_transport
from dsv41.cluster.batch import ScheduledBatch
from dsv41.cluster.engine import Engine
from dsv41.cluster.options import EngineOptions, engine_options
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.runner import SampledToken, StepResult
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.source import ModelSource
from dsv41.model.tiny import make_tiny

OBJECTS = "objects"  # the reference wire: dataclasses and a tensor through Ray's serialiser
STEP_TIMEOUT_S = 60.0
IDLE_WINDOW_S = 1.0


class TrivialRank(RankActor):
    """A RankActor whose step answers without computing; its wire is the real one."""

    def __init__(self, world: int, rank: int) -> None:
        super().__init__("", EngineOptions(), DPLayout(world), rank)

    def execute(self, batch: ScheduledBatch, metadata_wire: torch.Tensor) -> StepResult:
        return StepResult(
            step_id=batch.step_id,
            sampled={s.request_id: SampledToken(0, None) for s in batch.segments if s.sample},
        )

    def cpu_seconds(self) -> float:
        return process_cpu_seconds()


def process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Timings:
    step_ms: list[float] = field(default_factory=list)
    exchange_ms: list[float] = field(default_factory=list)
    pack_ms: list[float] = field(default_factory=list)
    cpu_ms_per_step: list[float] = field(default_factory=list)
    idle_cpu_share: list[float] = field(default_factory=list)

    def add(self, other: "Timings") -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))


def cpu_seconds(ranks: Sequence[Any]) -> float:
    """CPU time used so far by this process and every rank process."""
    return process_cpu_seconds() + sum(ray.get([r.cpu_seconds.remote() for r in ranks]))


class TimedExecutor:
    """A DPStepExecutor over the ranks through one wire and transport; times the parts."""

    def __init__(self, kind: str, ranks: Sequence[Any]) -> None:
        self.kind = kind
        self.ranks = list(ranks)
        self.transport: StepTransport | None = None if kind == OBJECTS else open_transport(
            kind, "bench", ranks, STEP_TIMEOUT_S
        )
        self.timings = Timings()

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor) -> list[StepResult]:
        if self.transport is None:
            start = time.perf_counter()
            with failing_as(f"bench ({OBJECTS} wire)"):
                results = ray.get(
                    [r.execute.remote(b, metadata) for r, b in zip(self.ranks, batches)], timeout=STEP_TIMEOUT_S
                )
            self.timings.exchange_ms.append((time.perf_counter() - start) * 1e3)
            self.timings.pack_ms.append(0.0)
            return results
        start = time.perf_counter()
        words = metadata.tolist()
        steps = [pack_step(batch, words) for batch in batches]
        sent = time.perf_counter()
        packed = self.transport.exchange(steps, STEP_TIMEOUT_S)
        received = time.perf_counter()
        results = [unpack_result(result) for result in packed]
        done = time.perf_counter()
        self.timings.exchange_ms.append((received - sent) * 1e3)
        self.timings.pack_ms.append((sent - start + done - received) * 1e3)
        return results

    def restart(self) -> None:
        raise RuntimeError("trivial ranks do not fail")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def decoding_engine(model_dir: Path, executor: Any, world: int, running: int, steps: int) -> Engine:
    """An engine over ``executor`` whose ``running`` requests decode for ``steps`` more
    steps after their prefill and a warm-up. Each request has its own SamplingParams,
    as requests from clients do."""
    options = engine_options(dict(block_size=32, max_num_seqs=64, max_num_batched_tokens=2048))
    engine = Engine.over(ModelSource.parse(model_dir), DPLayout(world), executor, options)
    for i in range(running):
        params = SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True, seed=i)
        engine.add_request(f"r{i}", list(range(3, 19)), params)
    for _ in range(5):
        engine.step()
    return engine


def measure(model_dir: Path, executor: TimedExecutor, world: int, running: int, steps: int) -> Timings:
    engine = decoding_engine(model_dir, executor, world, running, steps)
    executor.timings = Timings()
    cpu_before = cpu_seconds(executor.ranks)
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        executor.timings.step_ms.append((time.perf_counter() - start) * 1e3)
    cpu_after = cpu_seconds(executor.ranks)
    # The two cpu_seconds calls themselves are a few ms among `steps` steps.
    executor.timings.cpu_ms_per_step.append((cpu_after - cpu_before) * 1e3 / steps)
    idle_start = time.perf_counter()
    time.sleep(IDLE_WINDOW_S)
    idle_cpu = cpu_seconds(executor.ranks) - cpu_after
    executor.timings.idle_cpu_share.append(idle_cpu / (time.perf_counter() - idle_start))
    return executor.timings


class CapturingExecutor:
    """A DPStepExecutor in this process that keeps the last step's batches."""

    def __init__(self) -> None:
        self.rank = TrivialRank(1, 0)
        self.last: tuple[Sequence[ScheduledBatch], torch.Tensor, list[StepResult]] | None = None

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor) -> list[StepResult]:
        results = [self.rank.execute(b, metadata) for b in batches]
        self.last = (batches, metadata, results)
        return results

    def restart(self) -> None:
        raise RuntimeError("in-process trivial ranks do not fail")


def median_us(work: Callable[[], object], repeats: int = 300) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def measure_wire(model_dir: Path, running: int) -> dict[str, float]:
    executor = CapturingExecutor()
    engine = decoding_engine(model_dir, executor, 1, running, steps=2)
    engine.step()
    assert executor.last is not None
    (batch,), metadata, (result,) = executor.last
    words = metadata.tolist()
    assert unpack_step(pack_step(batch, words))[0] == batch
    return {
        "running": running,
        "batch_bytes": len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)),
        "step_wire_bytes": len(pack_step(batch, words)),
        "batch_pickle_us": median_us(lambda: pickle.loads(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))),
        "batch_cloudpickle_us": median_us(lambda: pickle.loads(ray.cloudpickle.dumps(batch, protocol=5))),
        "step_wire_us": median_us(lambda: unpack_step(pack_step(batch, words))),
        "result_pickle_us": median_us(lambda: pickle.loads(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))),
        "result_cloudpickle_us": median_us(lambda: pickle.loads(ray.cloudpickle.dumps(result, protocol=5))),
        "result_wire_us": median_us(lambda: unpack_result(pack_result(result))),
        "metadata_tensor_us": median_us(lambda: pickle.loads(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))),
        "metadata_words_us": median_us(
            lambda: torch.tensor(pickle.loads(pickle.dumps(words, protocol=pickle.HIGHEST_PROTOCOL)))
        ),
    }


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "ray_step.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    kinds = (*TRANSPORTS, OBJECTS)
    load_before = os.getloadavg()
    model_dir = make_tiny(Path(tempfile.mkdtemp()) / "tiny")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    pooled: dict[tuple[str, int, int], Timings] = {}
    wire = [measure_wire(model_dir, running) for running in (1, 16, 64)]
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            actor_class = ray.remote(TrivialRank).options(num_cpus=0)
            ranks = [actor_class.remote(world, rank) for rank in range(world)]
            for repeat in range(args.repeats):
                for kind in kinds:
                    executor = TimedExecutor(kind, ranks)
                    try:
                        for running in (1, 64):
                            progress = f"dp={world} {kind} running={running} repeat {repeat + 1}/{args.repeats}"
                            print(progress, file=sys.stderr)
                            got = measure(model_dir, executor, world, running, args.steps)
                            pooled.setdefault((kind, world, running), Timings()).add(got)
                    finally:
                        executor.close()
            for rank in ranks:
                ray.kill(rank)
    finally:
        ray.shutdown()
    load_after = os.getloadavg()
    rows = [
        {
            "transport": kind,
            "dp": world,
            "running": running,
            "step_ms_median": statistics.median(t.step_ms),
            "exchange_ms_median": statistics.median(t.exchange_ms),
            "exchange_ms_p90": p90(t.exchange_ms),
            "pack_ms_median": statistics.median(t.pack_ms),
            "engine_ms_median": statistics.median(
                step - exchange - pack for step, exchange, pack in zip(t.step_ms, t.exchange_ms, t.pack_ms, strict=True)
            ),
            "cpu_ms_per_step_median": statistics.median(t.cpu_ms_per_step),
            "idle_cpu_share_median": statistics.median(t.idle_cpu_share),
        }
        for (kind, world, running), t in sorted(pooled.items(), key=lambda kv: (kv[0][1:], kinds.index(kv[0][0])))
    ]
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    print(
        "| dp | running | transport | step ms (median) | exchange ms (median) | exchange ms (p90) | pack ms (median) "
        "| engine ms (median) | cpu ms/step | idle cpu (cores) |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dp']} | {r['running']} | {r['transport']} | {r['step_ms_median']:.2f} | "
            f"{r['exchange_ms_median']:.2f} | {r['exchange_ms_p90']:.2f} | {r['pack_ms_median']:.2f} | "
            f"{r['engine_ms_median']:.2f} | {r['cpu_ms_per_step_median']:.2f} | {r['idle_cpu_share_median']:.2f} |"
        )
    print()
    print(
        "| running | batch bytes | step wire bytes | batch pickle µs | batch cloudpickle µs | step wire µs "
        "| result pickle µs | result cloudpickle µs | result wire µs | metadata tensor µs | metadata words µs |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in wire:
        print(
            f"| {w['running']} | {w['batch_bytes']} | {w['step_wire_bytes']} | {w['batch_pickle_us']:.0f} | "
            f"{w['batch_cloudpickle_us']:.0f} | {w['step_wire_us']:.0f} | {w['result_pickle_us']:.0f} | "
            f"{w['result_cloudpickle_us']:.0f} | {w['result_wire_us']:.0f} | {w['metadata_tensor_us']:.0f} | "
            f"{w['metadata_words_us']:.0f} |"
        )
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "default_transport": GroupOptions().transport,
        "steps": args.steps,
        "repeats": args.repeats,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "rows": rows,
        "wire": wire,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
