"""Reading stored plane rows inside Triton kernels: row addressing and format decoding.

Owns the kernel side of the ``PlaneView`` contract (model/kernels/interface.py): a flat
row r is unit r // ROWS, row r % ROWS of a [units, ROWS, width] view. The split happens
here, in registers, against the plane's own strides, so the host prepares no per-key
addresses and the compiler sees every row start as a multiple of the strides (16-byte
aligned rows load as whole vectors). Also owns the decoding of the stored formats to a
compute dtype, value for value model/formats.py's dequantizers: bf16 rows, FP8 E4M3 +
E8M0 per 32 (the hardware E4M3 conversion), NVFP4 (E2M1 pairs + E4M3 per 16) and MXFP4
(E2M1 pairs + E8M0 per 32). A row is loaded as [rows, groups, group] so each group's
scale is one load per row, broadcast in registers; a span of a row's channels (whole
scale groups) is read the same way. A small bf16 tile decoded from nibbles is handed
over so that the compiler lays it out for a dot as bf16 data (NIBBLE_DOT_MIN_K).
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1): it computes bf16
# dots wrongly (garbage, seen with triton 3.9.0 on 2026-11-30), so there the kernels
# keep dot operands in fp32, and it runs no inline asm (mxfp4_pairs_to_bf16).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# The smallest dot K (a tile's rows or its channels) at which a bf16 tile decoded from
# E2M1 nibbles meets an MMA as the compiler lays it out. Triton 3.6 (the H200's) traces
# such an operand back to its byte loads and through the nibble interleave, takes it
# for 4-bit data and gives it 8 values of K a thread (kWidth 8) on MMAv2, the mma.sync
# path sm_90 takes for dots of fewer than 64 rows; that needs K >= 32 (4 threads x 8).
# The all-heads attention's wrong outputs on the H200 (BENCHMARKS.md) are the launches
# with such an operand in a dot of K 16, and triton PR 11691 fixes wrong small-K
# upcast dots upstream by bounding kWidth by K. Compiled for sm_90 by triton 3.6.0 on
# the CPU dev box (2026-12-03): kWidth 8 at K 16 in the attention kernels' NVFP4 dots,
# kWidth 2 with the tile handed over through opaque_bf16, as load_row_span does below
# this K; triton 3.9.0 picks kWidth 4 there on its own. With it the attention tests
# that had failed pass on the H200 (2026-12-03, BENCHMARKS.md).
NIBBLE_DOT_MIN_K = tl.constexpr(32)


@triton.jit
def row_offsets(flat_rows, ROWS: tl.constexpr, stride_unit, stride_row):
    """Element offsets of flat rows in a [units, ROWS, ...] view with the given strides.
    NO_ROW (-1) maps to row 0; callers mask it."""
    flat = tl.maximum(flat_rows, 0).to(tl.int64)
    unit = flat // ROWS
    return unit * stride_unit + (flat - unit * ROWS) * stride_row


@triton.jit
def e8m0_to_f32(byte):
    """A biased power-of-two exponent byte as its scale 2^(byte - 127), built as
    float32 bits (byte 0, 2^-127, is float32's one subnormal case here)."""
    e = byte.to(tl.int32)
    return tl.where(e == 0, 5.877471754111438e-39, (e << 23).to(tl.float32, bitcast=True))


@triton.jit
def e4m3_to_f32(byte):
    """An E4M3 (fn) byte (any integer type holding 0..255) as float32: the magnitude
    through the E4M3 type (a hardware conversion on GPUs that have one), the sign bit
    put back by hand, because the H200's conversion turns 0x80 (-0) into +0 and torch
    keeps -0. The stored planes never hold NaN."""
    b = byte.to(tl.int32)
    magnitude = (b & 0x7F).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return (magnitude.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_f32(code):
    """A 4-bit E2M1 code (bit 3 sign; code & 7 indexes 0, .5, 1, 1.5, 2, 3, 4, 6) as
    float32 bits: m >= 2 is exponent (m >> 1) + 126 with mantissa bit m & 1, i.e.
    (m + 252) << 22; m == 1 is 0.5 (exponent 126); m == 0 is zero."""
    c = code.to(tl.int32)
    m = c & 7
    bits = tl.where(m >= 2, (m + 252) << 22, m * (126 << 23))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


# The E2M1 pairs of four bytes to bf16, both nibbles of each byte times its scale, on
# 32-bit words of two bf16 lanes. Each byte goes to the low byte of a 16-bit lane
# (prmt), a nibble's magnitude bits are moved into the lane's exponent and first
# mantissa bits (6-8) and its sign into bit 15: the lane then holds the code's value
# times 2^-126 (code 1, 0.5, as bf16's subnormal 2^-127), so one multiply by 2^126 and
# one by the scale give the value, both exact (powers of two; the results are bf16
# normals or its exact subnormals). The multiplies are fma with -0.0 (x + -0 is x for
# every x), which sm_80 has; sm_90's mul.bf16x2 would do the same.
MXFP4_PAIRS_TO_BF16_PTX = tl.constexpr("""
{
.reg .b32 zero, bias, negzero, t<2>, m, s;
mov.b32 zero, 0;
mov.b32 bias, 0x7E807E80;
mov.b32 negzero, 0x80008000;
prmt.b32 t0, $4, zero, 0x4140;
prmt.b32 t1, $4, zero, 0x4342;
shl.b32 m, t0, 6; and.b32 m, m, 0x01C001C0; shl.b32 s, t0, 12; and.b32 s, s, 0x80008000; or.b32 m, m, s;
fma.rn.bf16x2 m, m, bias, negzero; fma.rn.bf16x2 $0, m, $5, negzero;
shl.b32 m, t1, 6; and.b32 m, m, 0x01C001C0; shl.b32 s, t1, 12; and.b32 s, s, 0x80008000; or.b32 m, m, s;
fma.rn.bf16x2 m, m, bias, negzero; fma.rn.bf16x2 $1, m, $6, negzero;
shl.b32 m, t0, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, t0, 8; and.b32 s, s, 0x80008000; or.b32 m, m, s;
fma.rn.bf16x2 m, m, bias, negzero; fma.rn.bf16x2 $2, m, $5, negzero;
shl.b32 m, t1, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, t1, 8; and.b32 s, s, 0x80008000; or.b32 m, m, s;
fma.rn.bf16x2 m, m, bias, negzero; fma.rn.bf16x2 $3, m, $6, negzero;
}
""")


@triton.jit
def e8m0_to_bf16(byte):
    """A biased power-of-two exponent byte as its scale 2^(byte - 127) in bf16, built as
    bits (byte 0, 2^-127, is bf16's subnormal 0x0040)."""
    e = byte.to(tl.int32)
    return tl.where(e == 0, 0x40, e << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def mxfp4_pairs_to_bf16(packed, pair_scale):
    """MXFP4 bytes [R, C] (two E2M1 codes, the even element in the low nibble) and each
    byte's scale as bf16 [R, C] -> their values in bf16 [R, 2C], exactly
    dequantize_mxfp4's, in about four instructions a value (MXFP4_PAIRS_TO_BF16_PTX)
    where e2m1_to_f32 and a scale multiply take about a dozen. Compiled kernels on
    NVIDIA GPUs only: the interpreter runs no asm."""
    low, high = tl.inline_asm_elementwise(
        MXFP4_PAIRS_TO_BF16_PTX,
        "=r,=r,=r,=r,r,r,r",
        [packed, pair_scale],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )
    return tl.interleave(low, high)


@triton.jit
def load_rows(
    values_ptr,
    scales_ptr,
    flat_rows,
    present,
    ROWS: tl.constexpr,
    values_stride_unit,
    values_stride_row,
    scales_stride_unit,
    scales_stride_row,
    WIDTH: tl.constexpr,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """Rows [N, WIDTH] of a plane as OUT_DTYPE, N = flat_rows.shape[0]; rows where
    ``present`` is false read as zeros (finite: they meet zero probabilities). FMT is
    the plane's FORMAT_CODES entry (0 bf16, 1 FP8 E4M3 + E8M0, 2 NVFP4, 3 MXFP4; see
    model/kernels/triton/__init__.py), GROUP its channels per scale."""
    return load_row_span(
        values_ptr,
        scales_ptr,
        flat_rows,
        present,
        ROWS,
        values_stride_unit,
        values_stride_row,
        scales_stride_unit,
        scales_stride_row,
        0,
        WIDTH,
        FMT,
        GROUP,
        OUT_DTYPE,
    )


@triton.jit
def load_row_span(
    values_ptr,
    scales_ptr,
    flat_rows,
    present,
    ROWS: tl.constexpr,
    values_stride_unit,
    values_stride_row,
    scales_stride_unit,
    scales_stride_row,
    first,
    WIDTH: tl.constexpr,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """Channels [first, first + WIDTH) of rows of a plane as OUT_DTYPE [N, WIDTH], as
    load_rows reads them; ``first`` and WIDTH are multiples of GROUP (whole scale
    groups, and whole bytes of packed nibbles). A bf16 NVFP4 / MXFP4 tile with fewer
    than NIBBLE_DOT_MIN_K rows or channels leaves through opaque_bf16."""
    offsets = row_offsets(flat_rows, ROWS, values_stride_unit, values_stride_row)
    if FMT == 0:
        dims = tl.arange(0, WIDTH)
        rows = tl.load(values_ptr + offsets[:, None] + first + dims[None, :], mask=present[:, None], other=0.0)
        out = rows.to(OUT_DTYPE)
    else:
        groups = tl.arange(0, WIDTH // GROUP)
        scale_offsets = row_offsets(flat_rows, ROWS, scales_stride_unit, scales_stride_row) + first // GROUP
        scale_bytes = tl.load(scales_ptr + scale_offsets[:, None] + groups[None, :], mask=present[:, None], other=0)
        if FMT == 2:
            scale = e4m3_to_f32(scale_bytes)
        else:
            scale = e8m0_to_f32(scale_bytes)
        if FMT == 1:
            lanes = tl.arange(0, GROUP)
            raw = tl.load(
                values_ptr + (offsets + first)[:, None, None] + (groups * GROUP)[None, :, None] + lanes[None, None, :],
                mask=present[:, None, None],
                other=0,
            )
            # The hardware conversion alone, without e4m3_to_f32's sign repair: rows
            # read here only meet dot products, where -0 and +0 are the same number.
            decoded = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            lanes = tl.arange(0, GROUP // 2)
            packed = tl.load(
                values_ptr
                + (offsets + first // 2)[:, None, None]
                + (groups * (GROUP // 2))[None, :, None]
                + lanes[None, None, :],
                mask=present[:, None, None],
                other=0,
            ).to(tl.int32)
            # The even channel is the low nibble (model/formats.pack_nibbles).
            decoded = tl.interleave(e2m1_to_f32(packed & 0xF), e2m1_to_f32(packed >> 4))
        out = tl.reshape(decoded * scale[:, :, None], (flat_rows.shape[0], WIDTH)).to(OUT_DTYPE)
        if FMT >= 2 and OUT_DTYPE == tl.bfloat16:
            # Either axis may be a dot's K: the channels for q . k, the rows for p . v.
            if flat_rows.shape[0] < NIBBLE_DOT_MIN_K or WIDTH < NIBBLE_DOT_MIN_K:
                out = opaque_bf16(out)
    return out


@triton.jit
def opaque_bf16(x):
    """bf16 values unchanged, through an instruction the compiler cannot see through (an
    asm with side effects, so no pass treats it as pure): a dot operand's width heuristic
    stops there and takes the operand for 16-bit data. Compiled kernels only: the
    interpreter runs no asm."""
    return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [x], dtype=tl.bfloat16, is_pure=False, pack=1)
