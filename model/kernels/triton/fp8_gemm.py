"""The FP8-activation projection: rows quantised to FP8, times an FP8 weight, on the
FP8 tensor cores.

Owns ``fp8_activation_matmul`` (model/linalg.py's ``GpuKernels.fp8_matmul``) and its
GEMM kernel, and ``round_fp8_rows`` (``GpuKernels.round_fp8``: the rows' fake
quantisation for the calls that multiply them in bf16). The rows are quantised by
store.py's ``store_rows_kernel`` (the plane writer's FP8 path: E4M3 codes and one E8M0
power-of-two scale per row and 32 channels, formats.quantize_fp8's bits), then each
output tile walks K one 32-wide block at a time: the block's [BLOCK_M, 32] x [32,
BLOCK_N] E4M3 product on the tensor cores (products of E4M3 values are exact in fp32),
scaled by the rows' and the weight's power-of-two scales of that block (exact) and
added to an fp32 accumulator. Scaling every 32 channels is forced by the checkpoint's
32x32 weight scales; it is also DeepGEMM's fix for Hopper's FP8 accumulation, which
keeps fewer bits than fp32 over long K. So the result is the fake-quantised rows'
product with the decoded weight up to fp32 summation order
(tests/model/test_kernels_fp8_gemm.py bounds it).
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.model.formats import (
    E2M1_MAX,
    FP8_AMAX_FLOOR,
    FP8_BLOCK,
    FP8_E4M3_MAX,
    MXFP4_AMAX_FLOOR,
    NVFP4_AMAX_FLOOR,
    row_scale_groups,
)
from dsv41.model.kernels.triton.decode import e8m0_to_f32
from dsv41.model.kernels.triton.moe import TL_DTYPES
from dsv41.model.kernels.triton.store import store_rows_kernel
from dsv41.model.stored_weights import FP8_TILE, Fp8Weight

# One tile shape for every call (not yet tuned on a GPU: see BENCHMARKS.md).
FP8_GEMM_TILE = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4)
# store_rows_kernel's rows per program: a row of a 4,096-wide projection input each.
QUANTISE_VALUES_PER_PROGRAM = 4096
# store_rows_kernel's format codes (decode.load_decoded's): bf16 bit patterns, FP8.
BF16_FORMAT = 0
FP8_FORMAT = 1
# The GEMM scales each K step by the rows' and the weight's scale of that step alone.
if FP8_BLOCK != FP8_TILE:
    raise RuntimeError(f"FP8_BLOCK {FP8_BLOCK} != FP8_TILE {FP8_TILE}: an activation scale group must span a weight tile")


@triton.jit
def fp8_scaled_matmul_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_bsk,
    stride_cm,
    OUT: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile of (a . 2^sa) @ (b . 2^sb).T: a [M, K] and b
    [N, K] E4M3 bytes, sa one E8M0 byte per row and BLOCK channels, sb one per BLOCK x
    BLOCK block of b; each BLOCK-wide step's E4M3 product scaled, then accumulated in
    fp32."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + cols.to(tl.int64)[:, None] * stride_bn
    a_scales = a_scale_ptr + rows.to(tl.int64) * stride_asm
    b_scales = b_scale_ptr + (cols // BLOCK).to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        a = tl.load(a_rows + ks[None, :], mask=row_mask[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        b = tl.load(b_rows + ks[None, :], mask=col_mask[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        block = k0 // BLOCK
        row_scale = e8m0_to_f32(tl.load(a_scales + block, mask=row_mask, other=127))
        col_scale = e8m0_to_f32(tl.load(b_scales + block * stride_bsk, mask=col_mask, other=127))
        acc += tl.dot(a, tl.trans(b)) * (row_scale[:, None] * col_scale[None, :])
    tl.store(
        c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :],
        acc.to(OUT),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def _check_width(k: int) -> None:
    if k % FP8_BLOCK:
        raise ValueError(f"x: width {k} (allowed: a multiple of {FP8_BLOCK}, whole scale groups)")


def _store_fp8_rows(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, store_fmt: int) -> None:
    """x's rows on the FP8 grid into ``values`` (E4M3 bytes, FP8_FORMAT, with their
    scale bytes in ``scales``; or bf16 bit patterns of the rounded values, BF16_FORMAT)
    through the plane writer's kernel: one plane unit of x's rows, row i at row i."""
    m, k = x.shape
    if m == 0:
        return
    x = x.contiguous()
    rows_per_program = max(1, QUANTISE_VALUES_PER_PROGRAM // triton.next_power_of_2(k))
    store_rows_kernel[(triton.cdiv(m, rows_per_program),)](
        x,
        torch.arange(m, device=x.device),
        values,
        scales,
        m,
        x.stride(0),
        m,
        values.numel(),
        values.stride(0),
        scales.numel(),
        scales.stride(0),
        WIDTH=k,
        BLOCK=FP8_BLOCK,
        NUM_BLOCKS=triton.next_power_of_2(k // FP8_BLOCK),
        BLOCK_R=rows_per_program,
        STORE_FMT=store_fmt,
        ROUND_FMT=FP8_FORMAT,
        FP8_MAX=FP8_E4M3_MAX,
        FP8_FLOOR=FP8_AMAX_FLOOR,
        E2M1_MAX=E2M1_MAX,
        MXFP4_FLOOR=MXFP4_AMAX_FLOOR,
        NVFP4_FLOOR=NVFP4_AMAX_FLOOR,
    )


def quantise_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) as E4M3 bytes [M, K] and E8M0 scale bytes [M, K /
    32] (uint8 both): formats.quantize_fp8(x)'s bytes, in one launch."""
    m, k = x.shape
    _check_width(k)
    values = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(m, row_scale_groups(k, FP8_BLOCK), dtype=torch.uint8, device=x.device)
    _store_fp8_rows(x, values, scales, FP8_FORMAT)
    return values, scales


def round_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """bf16 rows x [M, K] (K a multiple of 32) on the FP8 grid, in bf16:
    formats.round_fp8(x)'s bits in one launch instead of its chain of torch ops (what a
    decode step's projections in the FP8-activation mode quantise with on a GPU)."""
    m, k = x.shape
    _check_width(k)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x: {x.dtype} (allowed: torch.bfloat16)")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    bits = out.view(torch.int16)
    # A bf16 store writes no scales: the kernel is handed the values again, never read.
    _store_fp8_rows(x, bits, bits, BF16_FORMAT)
    return out


def fp8_scaled_matmul(
    values: torch.Tensor, scales: torch.Tensor, weight: Fp8Weight, out_dtype: torch.dtype
) -> torch.Tensor:
    """Quantised rows (``quantise_fp8_rows``'s bytes) times ``weight`` -> [M, N] in
    ``out_dtype`` (bf16 or fp32)."""
    m, k = values.shape
    n = weight.shape[0]
    if weight.shape[1] != k or k % FP8_TILE:
        raise ValueError(f"values, weight: widths {k}, {weight.shape[1]} (allowed: equal, a multiple of {FP8_TILE})")
    out = torch.empty(m, n, dtype=out_dtype, device=values.device)
    if m == 0 or n == 0:
        return out
    tile = FP8_GEMM_TILE
    fp8_scaled_matmul_kernel[(triton.cdiv(m, tile["BLOCK_M"]), triton.cdiv(n, tile["BLOCK_N"]))](
        values,
        scales,
        weight.values.view(torch.uint8),
        weight.scale,
        out,
        m,
        n,
        k,
        values.stride(0),
        scales.stride(0),
        weight.values.stride(0),
        *weight.scale.stride(),
        out.stride(0),
        OUT=TL_DTYPES[out_dtype],
        BLOCK=FP8_TILE,
        **tile,
    )
    return out


def fp8_activation_matmul(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [M, K] quantised to FP8 per row and 32 channels, times ``weight`` -> [M, N] in
    the weight's compute dtype."""
    if x.dim() != 2:
        raise ValueError(f"x: shape {tuple(x.shape)} (allowed: [M, K], a projection's rows)")
    return fp8_scaled_matmul(*quantise_fp8_rows(x), weight, weight.dtype)
