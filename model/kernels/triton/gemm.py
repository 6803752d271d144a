"""A fixed-tile GEMM for the batch-invariant mode on NVIDIA GPUs.

Owns ``fixed_tile_matmul``: ``a @ b.T`` where every output tile is computed by one
program with one tile shape and one walk over K (no split over K, no autotuning, no
choice from the problem size), so an output row's value does not depend on how many
rows share the call or where the row sits in it. cuBLAS instead picks its algorithm,
and possibly a split of K, from M, which is why model/linalg.py routes the projections
here in that mode. fp32 operands use IEEE products (no TF32), as torch's fp32 matmul.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsv41.model.kernels.triton.moe import TL_DTYPES

# Triton's CPU interpreter computes bf16 dots wrongly (model/kernels/triton/__init__.py),
# so under it bf16 operands are lifted to fp32, which holds them exactly.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# One tile shape per operand dtype (fp32's smaller tiles keep IEEE dots in shared memory).
TILES = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
    torch.float32: dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2),
}


@triton.jit
def fixed_tile_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    OUT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + cols.to(tl.int64)[:, None] * stride_bn + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    tl.store(
        c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :],
        acc.to(OUT),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def fixed_tile_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` for a [M, K] and b [N, K] of one dtype (bf16 or fp32) -> [M, N] in
    that dtype, accumulated in fp32 over K in ``BLOCK_K`` steps."""
    if a.dtype != b.dtype or a.dtype not in TILES:
        raise ValueError(f"a, b: {a.dtype}, {b.dtype} (allowed: both {' or both '.join(map(str, TILES))})")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a, b: shapes {tuple(a.shape)}, {tuple(b.shape)} (allowed: [M, K] and [N, K])")
    a, b = a.contiguous(), b.contiguous()
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    tiles = TILES[a.dtype]
    grid = (triton.cdiv(m, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]))
    fixed_tile_matmul_kernel[grid](
        a, b, out, m, n, k, a.stride(0), b.stride(0), out.stride(0),
        OUT=TL_DTYPES[a.dtype], IEEE=a.dtype == torch.float32 or INTERPRETED, **tiles,
    )
    return out
