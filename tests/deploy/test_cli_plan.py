"""`dsv41 plan`: the memory plan of a model on a replica shape, printed as one table,
and its refusal of bad input naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv41.cluster.memory_plan import plan_memory
from dsv41.cluster.options import EngineOptions
from dsv41.cluster.ranks import DPLayout
from dsv41.deploy.cli import main
from dsv41.model.config import FLASH_CONFIG_DIR
from dsv41.model.source import ModelSource

# (flags, DP ranks, expert mode, GPU bytes): issue 18's five V4.1-Flash shapes.
FLASH_RUNS = (
    (["--dp", "4", "--expert-mode", "ep", "--gpu-memory", "288GB"], 4, "ep", 288 * 10**9),
    (["--dp", "4", "--expert-mode", "tp", "--gpu-memory", "288GB"], 4, "tp", 288 * 10**9),
    (["--dp", "4", "--expert-mode", "ep", "--gpu-memory", "141GB"], 4, "ep", 141 * 10**9),
    (["--dp", "4", "--expert-mode", "tp", "--gpu-memory", "141GB"], 4, "tp", 141 * 10**9),
    (["--dp", "8", "--expert-mode", "ep", "--gpu-memory", "141GB"], 8, "ep", 141 * 10**9),
)


@pytest.mark.parametrize("flags, dp, mode, gpu", FLASH_RUNS, ids=lambda v: str(v) if isinstance(v, (int, str)) else None)
def test_plan_prints_the_flash_plan(flags: list[str], dp: int, mode: str, gpu: int, capsys: pytest.CaptureFixture[str]) -> None:
    """For V4.1-Flash's shipped config, `dsv41 plan` prints the plan's table, which ends
    in the verdict line (fits or not, tokens of cache left) of the same plan computed
    through the Python interface with the engine's default options but the CLI's
    default compute dtype, bfloat16."""
    main(["plan", "--model", str(FLASH_CONFIG_DIR), *flags])
    printed = capsys.readouterr().out.strip()
    plan = plan_memory(ModelSource.parse(FLASH_CONFIG_DIR), DPLayout(dp, mode), EngineOptions(gpu_memory_bytes=gpu, dtype=torch.bfloat16))
    assert printed == plan.render()
    assert printed.splitlines()[-1] == plan.verdict()
    assert "fits" in plan.verdict() and f"DP{dp}+{mode.upper()}" in plan.verdict()


def test_plan_of_a_checkpoint_without_gpu_memory(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --gpu-memory the plan sizes the pools as the engine does by default
    (cache_memory_bytes) and says so; the table names every stored kind."""
    main(["plan", "--model", str(tiny_dir), "--block-size", "32"])
    printed = capsys.readouterr().out
    plan = plan_memory(ModelSource.parse(tiny_dir), DPLayout(1), EngineOptions(block_size=32, dtype=torch.bfloat16))
    assert printed.strip() == plan.render()
    for row in ("FP8 E4M3 values", "FP4 E2M1 values", "E8M0 scales", "BF16 tensors", "FP32 tensors", "Engram tables (host"):
        assert row in printed
    assert "cache_memory_bytes" in plan.verdict()


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--dp", "0"], "--dp"),
        (["--dp", "two"], "--dp"),
        (["--expert-mode", "foo"], "--expert-mode"),
        (["--gpu-memory", "-1"], "--gpu-memory"),
        (["--gpu-memory", "12 parsecs"], "--gpu-memory"),
        (["--gpu-memory-reserve", "-5GB", "--gpu-memory", "141GB"], "--gpu-memory-reserve"),
    ],
)
def test_bad_flags_exit_naming_the_flag(tiny_dir: Path, flags: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad value exits with argparse's usage error, which names the flag."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", str(tiny_dir), *flags])
    assert exit_info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["/nonexistent/model-dir", "generated:no-such-slice"])
def test_a_model_that_does_not_exist_exits_naming_the_flag(model: str) -> None:
    """A --model that names no directory or slice exits with a message naming --model."""
    with pytest.raises(SystemExit, match="dsv41 plan: --model"):
        main(["plan", "--model", model])


def test_a_directory_without_a_config_exits_naming_the_flag(tmp_path: Path) -> None:
    """A directory with no config.json exits naming --model and the missing file."""
    with pytest.raises(SystemExit, match=r"dsv41 plan: --model .*config\.json"):
        main(["plan", "--model", str(tmp_path)])
