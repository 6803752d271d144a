"""A fixed-tile GEMM for the batch-invariant mode on NVIDIA GPUs.

Owns ``fixed_tile_matmul``: ``a @ b.T``, or for a batch of items each item's own
``a[i] @ b[i].T``, where every output tile is computed by one program with one tile
shape and one walk over K (no split over K, no autotuning, no choice from the problem
size), so an output row's value does not depend on how many rows or items share the
call or where the row sits in it. cuBLAS instead picks its algorithm, and possibly a
split of K, from M (and a batched GEMM's from the batch count), which is why
model/linalg.py routes the projections and the per-row products (attention, index
scores) here in that mode. fp32 operands use IEEE products (no TF32), as torch's fp32
matmul.
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
    stride_ab,
    stride_am,
    stride_ak,
    stride_bb,
    stride_bn,
    stride_bk,
    stride_cb,
    stride_cm,
    OUT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Items on the grid's first axis, the one without CUDA's 65,535 limit.
    item = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptr += item * stride_ab
    b_ptr += item * stride_bb
    c_ptr += item * stride_cb
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks.to(tl.int64)[None, :] * stride_ak,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + cols.to(tl.int64)[:, None] * stride_bn + ks.to(tl.int64)[None, :] * stride_bk,
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
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
    that dtype, or each item's ``a[i] @ b[i].T`` for a [B, M, K] and b [B, N, K] -> [B,
    M, N], accumulated in fp32 over K in ``BLOCK_K`` steps. Any strides (a transposed
    view of the values' rows is a ``b``); each item's tiles are the same programs
    whatever B."""
    if a.dtype != b.dtype or a.dtype not in TILES:
        raise ValueError(f"a, b: {a.dtype}, {b.dtype} (allowed: both {' or both '.join(map(str, TILES))})")
    batched = a.dim() == 3
    if a.dim() not in (2, 3) or b.dim() != a.dim() or a.shape[-1] != b.shape[-1] or (batched and a.shape[0] != b.shape[0]):
        raise ValueError(
            f"a, b: shapes {tuple(a.shape)}, {tuple(b.shape)} (allowed: [M, K] and [N, K], or [B, M, K] and [B, N, K])"
        )
    a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
    items, m, k = a3.shape
    n = b3.shape[1]
    out = torch.empty(items, m, n, dtype=a.dtype, device=a.device)
    if items and m and n:
        tiles = TILES[a.dtype]
        grid = (items, triton.cdiv(m, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]))
        fixed_tile_matmul_kernel[grid](
            a3, b3, out, m, n, k, *a3.stride(), *b3.stride(), out.stride(0), out.stride(1),
            OUT=TL_DTYPES[a.dtype], IEEE=a.dtype == torch.float32 or INTERPRETED, **tiles,
        )
    return out if batched else out[0]
