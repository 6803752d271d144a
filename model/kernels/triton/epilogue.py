"""A projection's epilogue (model/epilogue.py) as one fused Triton launch.

Owns ``epilogue_kernel`` and its launch: after a site's GEMM, each row (a [T, H, D]
projection's every head is a row of its own) is loaded once, RMS-normed, rotated by
RoPE at its position (forward or inverse), rounded to FP8 E4M3 or MXFP4 in blocks of 32
channels and stored in the output dtype. Unfused, these chains were about 1,500 of the
2,551 torch ops of a batch-1 decode step of the small slice (bench/op_census.py
--small; a rounding alone is about 30 ops, the pow2 scale's bit tricks most of them);
fused they are 39 launches.

A row is held as its even and odd channels, [BLOCK_R, pairs] each, so RoPE's pairs
(2i, 2i + 1) are the same lanes of the two halves and a block of 32 channels is 16
consecutive pairs. The arithmetic follows model/epilogue.apply_epilogue's order in
float32 (no multiply-add fusion): the angles in float64 (position times the rope's
float64 inverse frequency, as rope.cos_sin), their cos and sin in float64 rounded to
float32, the rotation's products and sums, and the roundings through
model/kernels/triton/store.py's encoders (the E8M0 exponent from the amax's bits, IEEE
division by the power-of-two scale, E4M3 / E2M1 nearest-even codes) and decode.py's
decoders, which are formats.py's bit for bit. So the rope and the roundings are the
torch path's bits (tests/model/test_kernels_epilogue.py); the RMSNorm differs from it
only through its mean of squares, a row reduction in the kernel's own order, and the
rounding after a norm can then land one grid step away where a value sits at a
midpoint. Compiled, cos, sin and rsqrt are libdevice's (the functions torch's CUDA ops
call); under the interpreter numpy's cos and sin and one over the correctly rounded
square root (torch's CPU rsqrt); the mean of squares is divided as torch's mean is on
the device (mhc.mean_as_torch). tests/model/test_kernels_epilogue.py passes on an H200
(2026-12-02) against the torch path on the same device.
A program reads and writes its own rows only, in an order fixed by the row width: a
row's result does not depend on how many rows share the launch (the batch-invariant
mode's requirement).
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv41.model.epilogue import Epilogue, check_epilogue
from dsv41.model.formats import E2M1_MAX, FP8_AMAX_FLOOR, FP8_BLOCK, FP8_E4M3_MAX, MXFP4_AMAX_FLOOR
from dsv41.model.kernels.triton.decode import e2m1_to_f32, e4m3_to_f32
from dsv41.model.kernels.triton.mhc import (
    mean_as_torch,
    out_rows,
    rows_per_program,
    rsqrt_as_torch,
    store_rounded,
    uses_libdevice,
)
from dsv41.model.kernels.triton.store import f32_to_e2m1, f32_to_e4m3, pow2_exponent, pow2_from_exponent

# Pairs of channels in one scale block of 32 channels (FP8's and MXFP4's alike).
BLOCK_PAIRS = tl.constexpr(FP8_BLOCK // 2)
# Row blocks a program may take in turn (largest first), and the programs a launch keeps
# at least when it takes more than one (about eight per SM of an H100 or H200).
ROW_BLOCK_CHOICES = (16, 8, 4, 2)
MIN_PROGRAMS = 1024


@triton.jit
def _cos_sin(angle, LIBDEVICE: tl.constexpr):
    """float64 cos and sin, each rounded to float32 (rope.cos_sin)."""
    if LIBDEVICE:
        return libdevice.cos(angle).to(tl.float32), libdevice.sin(angle).to(tl.float32)
    else:
        return tl.cos(angle).to(tl.float32), tl.sin(angle).to(tl.float32)


@triton.jit
def _round_to_grid(x, scale, FP8: tl.constexpr):
    """x's value on the E4M3 (FP8) or E2M1 grid of ``scale`` (formats.round_fp8 /
    round_mxfp4 after the scale): code of x / scale, decoded, times the scale."""
    scaled = tl.math.div_rn(x, scale)
    if FP8:
        return e4m3_to_f32(f32_to_e4m3(scaled)) * scale
    else:
        return e2m1_to_f32(f32_to_e2m1(scaled)) * scale


@triton.jit
def epilogue_kernel(
    x_ptr,
    out_ptr,
    norm_ptr,
    positions_ptr,
    inv_freq_ptr,
    rows,
    heads,
    stride_x,
    stride_out,
    eps,
    WIDTH: tl.constexpr,
    PAIRS: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    NORM: tl.constexpr,
    ROPE: tl.constexpr,
    INVERSE: tl.constexpr,
    FP8: tl.constexpr,
    MXFP4: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_FLOOR: tl.constexpr,
    GRID_MAX: tl.constexpr,
    MXFP4_FLOOR: tl.constexpr,
):
    """ROW_BLOCKS blocks of BLOCK_R rows of WIDTH channels (PAIRS: WIDTH / 2 padded to a
    power of two), one block after another: the RMSNorm (NORM), the rotation of the last
    ROPE_PAIRS pairs at row r's position ``positions[r // heads]`` (ROPE; INVERSE:
    conjugate), the FP8 or MXFP4 rounding, then the output dtype (OUT_BF16: bf16 bit
    patterns, nearest even). With ROW_BLOCKS > 1 the program's rows are heads of one
    token (the host's ``row_blocks``), so the float64 cos and sin are computed once for
    all of them; every block's arithmetic is the first block's, so a row's bits do not
    depend on ROW_BLOCKS."""
    first = tl.program_id(0).to(tl.int64) * (BLOCK_R * ROW_BLOCKS)
    p = tl.arange(0, PAIRS)[None, :]
    channel = p < WIDTH // 2
    if ROPE:
        r = first + tl.arange(0, BLOCK_R)
        freq_index = p - (WIDTH // 2 - ROPE_PAIRS)
        rotated = (freq_index >= 0) & channel
        position = tl.load(positions_ptr + r // heads, mask=r < rows, other=0).to(tl.float64)
        freq = tl.load(inv_freq_ptr + freq_index, mask=rotated, other=0.0)
        cos, sin = _cos_sin(position[:, None] * freq, LIBDEVICE)
    for block in range(ROW_BLOCKS):
        r = first + block * BLOCK_R + tl.arange(0, BLOCK_R)
        live = r < rows
        mask = live[:, None] & channel
        even_at = x_ptr + r[:, None] * stride_x + 2 * p
        even = tl.load(even_at, mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(even_at + 1, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            mean = mean_as_torch(tl.sum(even * even + odd * odd, axis=1), WIDTH, LIBDEVICE)
            inv_rms = rsqrt_as_torch(mean + eps, LIBDEVICE)[:, None]
            even = (even * inv_rms) * tl.load(norm_ptr + 2 * p, mask=channel, other=0.0).to(tl.float32)
            odd = (odd * inv_rms) * tl.load(norm_ptr + 2 * p + 1, mask=channel, other=0.0).to(tl.float32)
        if ROPE:
            if INVERSE:
                # rope.apply's rotation by -sin, written without negating sin: Triton's
                # -x is 0 - x, which turns sin = +0 into +0, not -0 (a zero's sign then
                # differs from torch's at position 0).
                even, odd = (
                    tl.where(rotated, even * cos + odd * sin, even),
                    tl.where(rotated, odd * cos - even * sin, odd),
                )
            else:
                even, odd = (
                    tl.where(rotated, even * cos - odd * sin, even),
                    tl.where(rotated, even * sin + odd * cos, odd),
                )
        if FP8 or MXFP4:
            even3 = tl.reshape(even, (BLOCK_R, PAIRS // BLOCK_PAIRS, BLOCK_PAIRS))
            odd3 = tl.reshape(odd, (BLOCK_R, PAIRS // BLOCK_PAIRS, BLOCK_PAIRS))
            amax = tl.maximum(tl.max(tl.abs(even3), axis=2), tl.max(tl.abs(odd3), axis=2))
            if FP8:
                exponent = pow2_exponent(amax, FP8_MAX, FP8_FLOOR)
            else:
                exponent = pow2_exponent(amax, GRID_MAX, MXFP4_FLOOR)
            scale = pow2_from_exponent(exponent)[:, :, None]
            even = tl.reshape(_round_to_grid(even3, scale, FP8), (BLOCK_R, PAIRS))
            odd = tl.reshape(_round_to_grid(odd3, scale, FP8), (BLOCK_R, PAIRS))
        out_at = out_ptr + r[:, None] * stride_out + 2 * p
        store_rounded(out_at, even, mask, OUT_BF16)
        store_rounded(out_at + 1, odd, mask, OUT_BF16)


def row_blocks(rows: int, heads: int, block_r: int, rope: bool) -> int:
    """Row blocks one program takes (``epilogue_kernel``'s ROW_BLOCKS): with a rope,
    the most of ROW_BLOCK_CHOICES that keep a program within one token's heads and the
    launch at MIN_PROGRAMS programs or more, so the float64 cos and sin (most of a
    rotated head's time: a prefill's query and output epilogues were bound by them) are
    computed once per program; else one. A row's bits are the same for every choice."""
    if rope:
        for blocks in ROW_BLOCK_CHOICES:
            if heads % (block_r * blocks) == 0 and rows // (block_r * blocks) >= MIN_PROGRAMS:
                return blocks
    return 1


def fused_epilogue(
    x: torch.Tensor,
    spec: Epilogue,
    positions: torch.Tensor | None = None,
    block_r: int | None = None,
    blocks: int | None = None,
) -> torch.Tensor:
    """model/epilogue.apply_epilogue in one launch. ``block_r``: rows per block
    (default mhc.rows_per_program: one on a GPU); ``blocks``: row blocks per program
    (default ``row_blocks``; it must keep a program within one token's heads)."""
    check_epilogue(x, spec, positions)
    width = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    flat = x.contiguous().view(-1, width)
    out = torch.empty(x.shape, dtype=spec.out_dtype, device=x.device)
    rows = flat.shape[0]
    if rows == 0:
        return out
    stored = out_rows(out).view(rows, width)
    norm = spec.norm.contiguous() if spec.norm is not None else flat
    rope = spec.rope
    if rope is not None:
        positions_arg = positions.contiguous()
        inv_freq = rope.inv_freq.to(device=x.device, dtype=torch.float64).contiguous()
    else:
        positions_arg, inv_freq = flat, flat  # never read
    block_r = block_r or rows_per_program(x.device)
    if blocks is None:
        blocks = row_blocks(rows, heads, block_r, rope is not None)
    elif blocks > 1 and heads % (block_r * blocks) != 0:
        raise ValueError(f"blocks: {blocks} of {block_r} rows (allowed: a divisor of the {heads} heads of a token)")
    epilogue_kernel[(triton.cdiv(rows, block_r * blocks),)](
        flat,
        stored,
        norm,
        positions_arg,
        inv_freq,
        rows,
        heads,
        flat.stride(0),
        stored.stride(0),
        spec.eps,
        WIDTH=width,
        PAIRS=max(BLOCK_PAIRS.value, triton.next_power_of_2(width // 2)),
        ROPE_PAIRS=0 if rope is None else rope.rope_dim // 2,
        NORM=spec.norm is not None,
        ROPE=rope is not None,
        INVERSE=spec.inverse,
        FP8=spec.round_to == "fp8",
        MXFP4=spec.round_to == "mxfp4",
        OUT_BF16=spec.out_dtype == torch.bfloat16,
        BLOCK_R=block_r,
        ROW_BLOCKS=blocks,
        LIBDEVICE=uses_libdevice(x.device),
        FP8_MAX=FP8_E4M3_MAX,
        FP8_FLOOR=FP8_AMAX_FLOOR,
        GRID_MAX=E2M1_MAX,
        MXFP4_FLOOR=MXFP4_AMAX_FLOOR,
        enable_fp_fusion=False,
    )
    return out
