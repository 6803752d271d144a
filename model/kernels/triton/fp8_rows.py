"""The FP8-activation mode's rows on a GPU: bf16 rows rounded to the FP8 grid.

Owns ``round_fp8_rows`` (model/linalg.py's ``GpuKernels.round_fp8``): a projection's
input in the FP8-activation mode, rounded to E4M3 per row and 32 channels with an E8M0
(power-of-two) scale, formats.round_fp8's bits, in one launch of store.py's
``store_rows_kernel`` (the plane writer's FP8 rounding, writing bf16) instead of
round_fp8's chain of torch ops. The rounded rows are then multiplied by the usual
bf16 GEMMs. An FP8 x FP8 tensor-core GEMM is not used: with the checkpoint's 32x32
weight scales and 32-channel row scales, every 32-wide K step's product has its own
scale pair and must leave the tensor cores' accumulator, which on Hopper serialised the
MMAs (17-19% of the FP8 matmul rate at 4,096 rows on an H100, slower than decoding the
weight and running cuBLAS bf16 at every measured shape: BENCHMARKS.md, "FP8
activations on the H100").
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch

from dsv41.model.formats import FP8_BLOCK
from dsv41.model.kernels.triton.store import FORMAT_CODES, store_rows


def round_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """bf16 rows x [M, K] (K a multiple of 32) on the FP8 grid, in bf16:
    formats.round_fp8(x)'s bits in one launch of the plane writer's kernel (one plane
    unit of x's rows, row i at row i; its bf16 store writes no scales)."""
    m, k = x.shape
    if k % FP8_BLOCK:
        raise ValueError(f"x: width {k} (allowed: a multiple of {FP8_BLOCK}, whole scale groups)")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x: {x.dtype} (allowed: torch.bfloat16)")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if m == 0:
        return out
    bits = out.view(1, m, k).view(torch.int16)
    # A bf16 store reads no scales: the values stand in for the scale plane.
    store_rows(
        x.contiguous(), torch.arange(m, device=x.device), bits, bits, FP8_BLOCK, FORMAT_CODES["bf16"], FORMAT_CODES["fp8"]
    )
    return out
