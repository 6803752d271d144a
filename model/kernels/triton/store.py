"""Quantised row stores into the paged planes, as one Triton launch per call.

Owns the kernel that turns compute rows (fp32 or bf16) into a plane's stored format and
writes them in place at flat row addresses (NO_ROW = -1 destinations are skipped):
bf16 rows, optionally first rounded to a quantised grid (a bf16 main plane holds
NVFP4-rounded entries); FP8 E4M3 with an E8M0 scale per 32 channels; NVFP4 (E2M1 pairs
and an E4M3 scale per 16); MXFP4 (E2M1 pairs and an E8M0 scale per 32). Its encoders are
the twins of decode.py's decoders and of model/formats.py's quantisers: integer bit
arithmetic, IEEE division (div_rn: a GPU's plain '/' is approximate), exact float
products and comparisons, so they store formats.py's bytes bit for bit compiled on a GPU
and under TRITON_INTERPRET=1 alike.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.model.formats import E2M1_MAX, FP8_AMAX_FLOOR, FP8_E4M3_MAX, MXFP4_AMAX_FLOOR, NVFP4_AMAX_FLOOR
from dsv41.model.kernels.triton.decode import e2m1_to_f32, e4m3_to_f32

# The plane formats' codes in the kernels (decode.load_decoded's).
FORMAT_CODES = {"bf16": 0, "fp8": 1, "nvfp4": 2, "mxfp4": 3}
# Values one program of a row-wise store moves (store_rows, and the compression path's
# kernels): a 512-channel row alone is too little work for a GPU program, and under the
# interpreter fewer, larger programs run faster.
VALUES_PER_PROGRAM = 4096


@triton.jit
def f32_to_bf16_bits(x):
    """bf16 bit patterns (int64 holding 16 bits) of finite float32 values, rounded to
    nearest even."""
    bits = x.to(tl.int32, bitcast=True).to(tl.int64)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def round_half_even(x):
    """x rounded to an integer, ties to even, for 0 <= x < 2^22: adding 2^23 leaves no
    fraction bits, and float32 addition rounds to nearest even."""
    return (x + 8388608.0) - 8388608.0


@triton.jit
def f32_to_e4m3(x):
    """E4M3 (fn) bytes (int64) of float32 values as torch's clamp(-448, 448) then
    .to(float8_e4m3fn) stores them: saturated at 448, nearest even, subnormal steps of
    2^-9 below 2^-6, the sign bit kept (also where a value rounds to zero)."""
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.int32, bitcast=True).to(tl.int64)
    # Keep 3 mantissa bits (nearest even), then rebias the exponent from 127 to 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2^-6 the grid is k * 2^-9 (k = 8 is 2^-6's normal code, so the grids join).
    subnormal = round_half_even(a * 512.0).to(tl.int64)
    return sign.to(tl.int64) | tl.where(a < 0.015625, subnormal, normal)


@triton.jit
def f32_to_e2m1(x):
    """E2M1 codes (int64, 0..15) of float32 values as model/formats.e2m1_encode gives
    them: the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6 (a midpoint goes to the even code),
    saturating at 6; bit 3 is the sign, set only on a nonzero code. The grid's step is
    .5 below 2, 1 below 4, then 2, and its codes count steps from 0, 2 and 4 there: a
    value rounds to a whole number of its region's steps, nearest even, whose parity is
    the code's."""
    a = tl.minimum(tl.abs(x), 6.0)
    low, mid = a < 2.0, a < 4.0
    steps = round_half_even(a * tl.where(low, 2.0, tl.where(mid, 1.0, 0.5)))  # exact: powers of two
    code = (steps + tl.where(low, 0.0, tl.where(mid, 2.0, 4.0))).to(tl.int64)
    return tl.where((x < 0.0) & (code > 0), code | 8, code)


@triton.jit
def pow2_exponent(amax, GRID_MAX: tl.constexpr, FLOOR: tl.constexpr):
    """The exponent k (int32) of model/formats.pow2_scale's
    2^ceil(log2(max(amax, FLOOR) / GRID_MAX)), whose log2 is rounded to float32 before
    the ceiling: for y = 2^e (1 + f) just above 2^e, float32 rounds e + log2(1 + f) down
    to e when log2(1 + f) is under half the float32 gap above e, 2^g, and k is then e,
    not e + 1. That is f < 2^(2^g) - 1, which on f's grid of 2^-23 is f * 2^23 <=
    ln2 * 2^(g + 23): for g in -25..-18 that product is never within 0.09 of an integer,
    far more than the series' next term or float32's error in it."""
    y = tl.math.div_rn(tl.maximum(amax, FLOOR), GRID_MAX)
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    f_bits = bits & 0x7FFFFF  # f * 2^23
    magnitude_bits = tl.abs(e).to(tl.float32).to(tl.int32, bitcast=True)
    magnitude_exponent = ((magnitude_bits >> 23) & 0xFF) - 127  # floor(log2 |e|)
    # The gap above e is 2^(floor(log2 |e|) - 23), half that below a negative power of two.
    g = magnitude_exponent - 24 - ((e < 0) & ((magnitude_bits & 0x7FFFFF) == 0)).to(tl.int32)
    threshold = 0.6931471805599453 * ((g + 23 + 127) << 23).to(tl.float32, bitcast=True)
    rounds_up = tl.where(e == 0, f_bits > 0, f_bits.to(tl.float32) > threshold)
    return e + rounds_up.to(tl.int32)


@triton.jit
def pow2_from_exponent(k):
    """2^k as float32 for k in -126..127, assembled from its bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def store_rows_kernel(
    src_ptr,
    dst_rows_ptr,
    values_ptr,
    scales_ptr,
    num_rows,
    stride_src_row,
    rows_per_unit,
    stride_values_unit,
    stride_values_row,
    stride_scales_unit,
    stride_scales_row,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    STORE_FMT: tl.constexpr,
    ROUND_FMT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_FLOOR: tl.constexpr,
    E2M1_MAX: tl.constexpr,
    MXFP4_FLOOR: tl.constexpr,
    NVFP4_FLOOR: tl.constexpr,
):
    """BLOCK_R source rows per program, each as [NUM_BLOCKS (padded to a power of two),
    BLOCK] channel groups: a quantised grid's scale groups (bf16 rows kept as they are
    use any BLOCK and mask past WIDTH). STORE_FMT is what the plane holds and ROUND_FMT
    the grid the values are rounded to first, in decode.load_decoded's codes (0 bf16,
    1 FP8, 2 NVFP4, 3 MXFP4; ROUND_FMT 0: no rounding). ``values_ptr`` is int16 for a
    bf16 plane (bit patterns), uint8 otherwise."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    dst = tl.load(dst_rows_ptr + rows, mask=rows < num_rows, other=-1).to(tl.int64)
    present = dst >= 0
    unit = tl.where(present, dst, 0) // rows_per_unit
    row = tl.where(present, dst, 0) % rows_per_unit
    group = tl.arange(0, NUM_BLOCKS).to(tl.int64)[None, :]
    cols = group[:, :, None] * BLOCK + tl.arange(0, BLOCK)[None, None, :]  # [1, NB, BLOCK]
    values_at = values_ptr + (unit * stride_values_unit + row * stride_values_row)[:, None, None]
    if ROUND_FMT == 0:
        mask = present[:, None, None] & (cols < WIDTH)
    else:
        mask = present[:, None, None] & (group < WIDTH // BLOCK)[:, :, None]  # [R, NB, 1]: whole scale groups
    x = tl.load(src_ptr + rows.to(tl.int64)[:, None, None] * stride_src_row + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if ROUND_FMT == 0:
        tl.store(values_at + cols, f32_to_bf16_bits(x).to(tl.int16), mask=mask)
    else:
        amax = tl.max(tl.abs(x), axis=2)
        if ROUND_FMT == 1:
            exponent = pow2_exponent(amax, FP8_MAX, FP8_FLOOR)
            scale_byte = exponent + 127
            scale = pow2_from_exponent(exponent)
        elif ROUND_FMT == 2:
            scale_byte = f32_to_e4m3(tl.math.div_rn(tl.maximum(amax, NVFP4_FLOOR), E2M1_MAX))
            scale = e4m3_to_f32(scale_byte)
        else:
            exponent = pow2_exponent(amax, E2M1_MAX, MXFP4_FLOOR)
            scale_byte = exponent + 127
            scale = pow2_from_exponent(exponent)
        scaled = tl.math.div_rn(x, scale[:, :, None])
        if ROUND_FMT == 1:
            code = f32_to_e4m3(scaled)
        else:
            code = f32_to_e2m1(scaled)
        if STORE_FMT == 0:
            if ROUND_FMT == 1:
                rounded = e4m3_to_f32(code) * scale[:, :, None]
            else:
                rounded = e2m1_to_f32(code) * scale[:, :, None]
            tl.store(values_at + cols, f32_to_bf16_bits(rounded).to(tl.int16), mask=mask)
        else:
            if ROUND_FMT == 1:
                tl.store(values_at + cols, code.to(tl.uint8), mask=mask)
            else:
                # Two codes a byte, the even channel's in the low nibble.
                even, odd = tl.split(tl.reshape(code, (BLOCK_R, NUM_BLOCKS, BLOCK // 2, 2)))
                packed_cols = group[:, :, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, None, :]
                tl.store(values_at + packed_cols, (even | (odd << 4)).to(tl.uint8), mask=mask)
            scales_at = scales_ptr + (unit * stride_scales_unit + row * stride_scales_row)[:, None] + group
            tl.store(scales_at, scale_byte.to(tl.uint8), mask=tl.reshape(mask, (BLOCK_R, NUM_BLOCKS)))


def store_rows(
    rows: torch.Tensor,
    flat_rows: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    store_fmt: int,
    round_fmt: int,
) -> None:
    """One launch of store_rows_kernel: ``rows`` [count, width] into the plane
    ``values`` [units, rows a unit, ...] (and its ``scales``, the same layout; a bf16
    plane's are never read) at ``flat_rows`` (unit * rows a unit + row; NO_ROW skipped),
    in groups of ``block`` channels, formats as the kernel's codes."""
    count, width = rows.shape
    rows_per_program = max(1, VALUES_PER_PROGRAM // triton.next_power_of_2(width))
    store_rows_kernel[(triton.cdiv(count, rows_per_program),)](
        rows,
        flat_rows,
        values,
        scales,
        count,
        rows.stride(0),
        values.shape[1],
        values.stride(0),
        values.stride(1),
        scales.stride(0),
        scales.stride(1),
        WIDTH=width,
        BLOCK=block,
        NUM_BLOCKS=triton.next_power_of_2(triton.cdiv(width, block)),
        BLOCK_R=rows_per_program,
        STORE_FMT=store_fmt,
        ROUND_FMT=round_fmt,
        FP8_MAX=FP8_E4M3_MAX,
        FP8_FLOOR=FP8_AMAX_FLOOR,
        E2M1_MAX=E2M1_MAX,
        MXFP4_FLOOR=MXFP4_AMAX_FLOOR,
        NVFP4_FLOOR=NVFP4_AMAX_FLOOR,
    )
