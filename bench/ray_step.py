"""Benchmark of the Ray overhead of one engine-group step.

The step path of ``actors/``: the DPEngine schedules every rank's batch, packs the DP
metadata, makes one Ray call per rank carrying its ScheduledBatch and the metadata
tensor, and gathers the StepResults. The ranks here are actors with a trivial model
(each answers token 0 for every sampling segment without computing), so the time per
step is scheduling + Ray transport + (de)serialisation, and the "ray ms" column is
the round trip of the calls alone (scheduler to ranks and back). ``c`` requests of
16 prompt tokens decode (``ignore_eos``) for ``--steps`` steps after a warm-up.
Prints a table and writes JSON (``--out``).

Usage: python3 bench/ray_step.py [--out bench/results/ray_step.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ray  # noqa: E402
import torch  # noqa: E402

from cluster.batch import ScheduledBatch  # noqa: E402
from cluster.dp_engine import DPEngine, DPLayout  # noqa: E402
from cluster.engine import engine_options  # noqa: E402
from cluster.request import SamplingParams  # noqa: E402
from cluster.runner import SampledToken, StepResult  # noqa: E402
from model.tiny import make_tiny  # noqa: E402


class TrivialRank:
    """A rank that answers without computing: the call shape of RankActor.execute."""

    def execute(self, batch: ScheduledBatch, metadata_wire: torch.Tensor) -> StepResult:
        return StepResult(
            step_id=batch.step_id,
            sampled={s.request_id: SampledToken(0, None) for s in batch.segments if s.sample},
        )


class TimedRayRanks:
    """One Ray call per rank per step, gathered; records each step's round trip."""

    def __init__(self, world: int) -> None:
        self.ranks = [ray.remote(TrivialRank).options(num_cpus=0).remote() for _ in range(world)]
        self.round_trips_ms: list[float] = []

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor) -> list[StepResult]:
        start = time.perf_counter()
        results = ray.get([r.execute.remote(b, metadata) for r, b in zip(self.ranks, batches)])
        self.round_trips_ms.append((time.perf_counter() - start) * 1e3)
        return results

    def restart(self) -> None:
        raise RuntimeError("trivial ranks do not fail")


def run(model_dir: Path, world: int, concurrency: int, steps: int) -> dict[str, float]:
    ranks = TimedRayRanks(world)
    options = engine_options(dict(block_size=32, max_num_seqs=64, max_num_batched_tokens=2048))
    engine = DPEngine.over(model_dir, DPLayout(world), ranks, options)
    params = SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"r{i}", list(range(3, 19)), params)
    for _ in range(5):  # prefill and warm-up
        engine.step()
    ranks.round_trips_ms.clear()
    step_ms = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
    for rank in ranks.ranks:
        ray.kill(rank)
    return {
        "dp": world,
        "running": concurrency,
        "step_ms_median": statistics.median(step_ms),
        "ray_ms_median": statistics.median(ranks.round_trips_ms),
        "ray_ms_p90": sorted(ranks.round_trips_ms)[int(0.9 * len(ranks.round_trips_ms))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "ray_step.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = make_tiny(Path(tempfile.mkdtemp()) / "tiny")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    rows = []
    try:
        for world in (1, 2, 4):
            for concurrency in (1, 64):
                print(f"dp={world} running={concurrency} ...", file=sys.stderr)
                rows.append(run(model_dir, world, concurrency, args.steps))
    finally:
        ray.shutdown()
    print("| dp | running | step ms (median) | ray ms (median) | ray ms (p90) |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dp']} | {r['running']} | {r['step_ms_median']:.2f} | {r['ray_ms_median']:.2f} | "
            f"{r['ray_ms_p90']:.2f} |"
        )
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "steps": args.steps,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
