"""The runtime validation through a Ray engine group (``dsv41 validate --backend ray``).

Each scenario runs on a fresh DP2 EP group (a SchedulerActor and two RankActors, gloo
among them) and must finish every request with the tokens of its uninterrupted run on
such a group (alone, one chunk, nothing cached), reading the group only through its
client (outputs, ``request``, ``stats``). That DP2 equals one rank is test_group's.
"""

from __future__ import annotations

import json
from pathlib import Path

import ray

from dsv41.deploy.cli import main

# The cheap scenarios: each starts its own group, which costs ~10 s on the 2-core box.
RAY_SCENARIOS = ("chunked_reordered", "prefix_forks", "preemption", "cancellation")


def test_dp2_engine_group_passes_the_scheduler_scenarios(ray_cluster: None, tiny_dir: Path, tmp_path: Path) -> None:
    """Chunked and reordered arrivals, prefix forks placed on the rank that cached
    their prefix (the forks took admission hits), preemption on every rank's tight
    pool, and cancellation at every point with every rank's PAGEs and slots released:
    all pass through the group, and the report names the group's shape and the
    scenarios that ran. Ray is the fixture's, so the command leaves it running."""
    out = tmp_path / "report.json"
    main(
        ["validate", "--model", str(tiny_dir), "--output", str(out), "--backend", "ray", "--dp", "2"]
        + ["--expert-mode", "ep", "--scenarios", ",".join(RAY_SCENARIOS)]
    )
    report = json.loads(out.read_text())
    failed = {s["name"]: {k: v for k, v in s["checks"].items() if not v} for s in report["scenarios"] if not s["passed"]}
    assert report["passed"], failed
    assert [s["name"] for s in report["scenarios"]] == list(RAY_SCENARIOS)
    assert report["replica"] == {
        "kind": "ray", "dp": 2, "expert_mode": "ep", "backend": "gloo", "device": "cpu", "kernel_backend": "torch",
        "batch_invariant": True, "dtype": "float32", "speculative_method": None, "num_speculative_tokens": None,
        "cudagraph_mode": "none", "weight_storage": "stored",
    }
    preemption = next(s for s in report["scenarios"] if s["name"] == "preemption")
    assert len(preemption["preemptions"]) == 2
    assert ray.is_initialized()
