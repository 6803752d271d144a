"""Paged == reference bit for bit under every x86 instruction set this CPU has, not only
the one torch picks by default: CI and users land on AVX2-only and AVX512 machines alike.

Each setting runs the every-chunking parity test and the batch-composition test of
test_runtime_parity.py in a subprocess with ATen's kernels (ATEN_CPU_CAPABILITY), MKL's
(MKL_ENABLE_INSTRUCTIONS) and oneDNN's (ONEDNN_MAX_CPU_ISA) held to that instruction
set; the child reports the capability ATen really used, so a setting the CPU cannot run
fails instead of silently testing another.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# (ATen capability, MKL instructions, oneDNN ISA, the /proc/cpuinfo flag it needs)
SETTINGS = {
    "avx2": ("avx2", "AVX2", "AVX2", "avx2"),
    "avx512": ("avx512", "AVX512", "AVX512_CORE", "avx512f"),
}
TESTS = (
    "tests/cluster/test_runtime_parity.py::test_paged_logits_and_selections_equal_the_reference_at_every_chunking",
    "tests/cluster/test_runtime_parity.py::test_a_requests_logprobs_do_not_depend_on_its_batch",
)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets only")
@pytest.mark.parametrize("isa", sorted(SETTINGS))
def test_parity_is_exact_under_each_instruction_set(isa: str) -> None:
    """The parity test passes with ATen, MKL and oneDNN held to ``isa``."""
    aten, mkl, onednn, flag = SETTINGS[isa]
    if flag not in _cpu_flags():
        pytest.skip(f"this CPU has no {flag}")
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": aten,
        "MKL_ENABLE_INSTRUCTIONS": mkl,
        "ONEDNN_MAX_CPU_ISA": onednn,
    }
    used = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout.strip()
    assert used.lower() == aten, f"ATen ran {used!r} with ATEN_CPU_CAPABILITY={aten}"
    # `-n 0`: the two tests in the child's own process, not in xdist workers that the
    # suite's addopts would start for them (two more torch imports and collections,
    # ~6 s of CPU a setting on the 2-core box, for one module's tests).
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *TESTS, "-q", "-x", "-p", "no:cacheprovider", "-n", "0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
