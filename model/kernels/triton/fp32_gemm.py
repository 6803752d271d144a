"""fp32 projections on bf16 tensor cores: ``split_fp32_matmul``.

Owns the GEMM of an fp32 row block by a wide fp32 weight (the LM head and DSpark's
heads, which MODEL_FACTS keeps fp32; model/linalg.py routes only such weights here) at
fp32 accuracy without the FP32 FMA units. Both operands are split exactly into three bf16
parts in registers (dots.split3: v == hi + mid + lo, each part the rounding of what the
earlier ones leave), and the six products whose weight is at least 2^-16 of the
leading one go through bf16 tensor-core dots accumulated in fp32. A bf16 x bf16
product is exact in fp32, so what is dropped is the three products of weight 2^-24 and
below (at most about 2^-25 of |w x| each element) and what is lost is the fp32
accumulation. The tensor cores add with truncation, so each ``BLOCK_K`` step's six
dots (the five small ones first, then hi * hi) start from zero and the step joins the
running sum in an fp32 add, as DeepGEMM promotes its FP8 partial sums: over all of K
the truncation's bias would otherwise add up (an H100, 2026-12-07: one accumulator
chained over K = 5,120 was further from float64 than cuBLAS's FP32 FMA GEMM). The tests
measure both paths against float64.

The weight's rows are the dots' M and the block's rows their N: the weight is read
once per program from HBM, split once, and a decode step's few rows pad only the
narrow side (a dot's N may be 16). A program walks all of K in ``BLOCK_K`` steps, no
split of K and nothing chosen from the data, so a row's value follows from the tile
shape alone; ``row_invariant=True`` (the batch-invariant mode) fixes that shape, and
otherwise the row block's width follows the row count (``ROW_BLOCKS``).

The dots are dots.parts_dot: under the interpreter (its dot multiplies bf16 operands as
bit patterns) the parts are widened back to fp32 and go through dots.ieee_dot, the same
exact products summed over K in order, so a row's bits do not depend on the call there
either.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.model.kernels.triton.dots import parts_dot, split3

# Weight rows per program, K per step, and warps and pipeline stages.
WEIGHT_ROWS = 128
BLOCK_K = 64
NUM_WARPS = 8
NUM_STAGES = 3
# The row block of the batch-invariant mode, and outside it the narrowest block that
# holds a call's rows (one dot's N: at least 16). At most 64: the running sum and the
# step's, [128, block] fp32 each over 256 threads, take 2 * block registers a thread,
# and the split parts of both tiles need room beside them.
INVARIANT_ROWS = 64
ROW_BLOCKS = (16, 32, 64)


@triton.jit
def split_fp32_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] w[n, k] for one tile: weight rows (program_id 0) by
    block rows (program_id 1), K in one walk."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_mask = cols < N
    row_mask = rows < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + ks[None, :] * stride_wk,
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + rows[None, :] * stride_xm + ks[:, None] * stride_xk,
            mask=row_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        w_hi, w_mid, w_lo = split3(w)
        x_hi, x_mid, x_lo = split3(x)
        # The step's sum starts from zero, the small products first, and joins the
        # running sum in an fp32 add (rounded to nearest): the tensor cores' own adds
        # truncate, which over all of K would bias the sum (the GPU test saw it lose
        # to cuBLAS's FMA GEMM).
        step = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        step = parts_dot(w_hi, x_mid, step)
        step = parts_dot(w_mid, x_hi, step)
        step = parts_dot(w_hi, x_lo, step)
        step = parts_dot(w_mid, x_mid, step)
        step = parts_dot(w_lo, x_hi, step)
        step = parts_dot(w_hi, x_hi, step)
        acc += step
    tl.store(
        out_ptr + rows[None, :] * stride_om + cols[:, None] * stride_on,
        acc,
        mask=col_mask[:, None] & row_mask[None, :],
    )


def row_block(m: int, row_invariant: bool) -> int:
    """The row block a call of ``m`` rows runs with: INVARIANT_ROWS in the
    batch-invariant mode, else the narrowest of ROW_BLOCKS holding the rows (the widest
    past them)."""
    if row_invariant:
        return INVARIANT_ROWS
    return next((block for block in ROW_BLOCKS if block >= m), ROW_BLOCKS[-1])


def split_fp32_matmul(a: torch.Tensor, b: torch.Tensor, *, row_invariant: bool = True) -> torch.Tensor:
    """``a @ b.T`` for fp32 a [M, K] and b [N, K] (any strides) -> [M, N] fp32 at fp32
    accuracy on bf16 tensor cores (the module docstring). ``row_invariant`` fixes the
    row block, so a row's value does not depend on M."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"a, b: {a.dtype}, {b.dtype} (allowed: both torch.float32)")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a, b: shapes {tuple(a.shape)}, {tuple(b.shape)} (allowed: [M, K] and [N, K])")
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=a.device)
    if m == 0 or n == 0:
        return out
    block_m = row_block(m, row_invariant)
    split_fp32_matmul_kernel[(triton.cdiv(n, WEIGHT_ROWS), triton.cdiv(m, block_m))](
        a, b, out, m, n, k, *a.stride(), *b.stride(), *out.stride(),
        BLOCK_N=WEIGHT_ROWS,
        BLOCK_M=block_m,
        BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out
