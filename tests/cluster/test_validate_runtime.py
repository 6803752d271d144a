"""The runtime validation suite on the real engine (spec: "Scheduler acceptance").

Each scenario asserts that every request finishes with exactly the tokens of its own
uninterrupted run (alone, one prefill chunk, nothing cached): chunked and reordered
batches under a 32-token budget, prefix forks restoring checkpoint images, replay
from a missing image, preemption with PAGEs just above one request's need, every prompt at once under a
32-token budget and a tight pool with one abort, cancellation
at every point (waiting, mid prefill, the first deferred step, decoding) with every
PAGE and slot released, slot recycling, replay hits agreeing across identical runs,
and paged/reference parity for bf16/fp8 and fp4/fp4 caches. It runs on two tiny
checkpoints with different seeds and sizes so nothing is tuned to one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.validate import run_validation
from deploy.cli import main


SCENARIOS = {
    "chunked_reordered",
    "prefix_forks",
    "replay_from_missing_image",
    "preemption",
    "tight_mixed",
    "cancellation",
    "slot_recycle",
    "replay_same_hits",
    "parity_bf16_fp8",
    "parity_fp4_fp4",
}


def _assert_passed(report: dict) -> None:
    failed = {s["name"]: {k: v for k, v in s["checks"].items() if not v} for s in report["scenarios"] if not s["passed"]}
    assert report["passed"], failed
    assert {s["name"] for s in report["scenarios"]} == SCENARIOS


def test_validate_command_passes_every_scenario_on_the_tiny_model(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dsv41 validate` on the embedded checkpoint (block 32): every scenario passes
    and the JSON report says so."""
    out = tmp_path / "report.json"
    main(["validate", "--model", str(tiny_dir), "--output", str(out)])
    _assert_passed(json.loads(out.read_text()))
    assert "PASS" in capsys.readouterr().out


def test_every_scenario_passes_on_the_second_checkpoint(tiny_alt_dir: Path) -> None:
    """The same scenarios on other sizes, weights and a 64-token PAGE."""
    _assert_passed(run_validation(tiny_alt_dir, block_size=64))
