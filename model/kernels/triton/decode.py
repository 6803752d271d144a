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
scale groups) is read the same way.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    groups, and whole bytes of packed nibbles)."""
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
    return out
