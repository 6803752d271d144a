"""The hardware ceilings a benchmark compares against, measured in its own run.

Owns two measurements: the device-to-device copy bandwidth (bytes read + written per
second, of a buffer far larger than any cache) and the bf16 matmul rate (one large
square GEMM). On CUDA they are timed with CUDA events, on the CPU with the wall clock;
each is the median of several repetitions after a warm-up. Used by bench/kernels.py,
bench/decode_step.py and bench/prefill.py. Imports only torch.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

# (copy buffer float32 elements, matmul size, repetitions) per device type: CUDA's copy
# is 2 GiB each way and its GEMM 8192^3; the CPU's copy is 64 MiB and its GEMM 256^3,
# because a CPU without bf16 instructions multiplies bf16 at well under 1 GFLOP/s.
_SIZES = {"cuda": (1 << 29, 8192, 20), "cpu": (1 << 24, 256, 5)}


def ceilings(device: str = "cuda") -> dict[str, float]:
    """``copy_bytes_per_s`` (read + write) and ``bf16_flop_per_s`` on ``device``."""
    where = torch.device(device)
    if where.type not in _SIZES:
        raise ValueError(f"device: {device!r} (allowed: a cuda or cpu device)")
    copy_elements, n, reps = _SIZES[where.type]
    src = torch.randn(copy_elements, device=where)
    dst = torch.empty_like(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), where, reps)
    del src, dst
    a = torch.randn(n, n, device=where, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=where, dtype=torch.bfloat16)
    matmul_s = _median_seconds(lambda: a @ b, where, reps)
    return {
        "copy_bytes_per_s": 2 * copy_elements * 4 / copy_s,
        "bf16_flop_per_s": 2 * n**3 / matmul_s,
    }


def _median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    for _ in range(3):  # warm-up: allocator, cuBLAS handles and heuristics, clocks
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def describe_ceilings(measured: dict[str, float]) -> str:
    return (
        f"copy {measured['copy_bytes_per_s'] / 1e9:,.1f} GB/s (read + write), "
        f"bf16 matmul {measured['bf16_flop_per_s'] / 1e9:,.1f} GFLOP/s"
    )
