"""Decoding of the stored number formats inside Triton kernels.

Owns bit-level decoders of E4M3 bytes, E8M0 scale bytes and packed E2M1 codes, written
with integer arithmetic so they run the same compiled on a GPU and under
``TRITON_INTERPRET=1`` on a CPU. They are the kernel-side twins of model/formats.py's
dequantizers, and tests hold them to those bit for bit.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_to_f32(byte):
    """An E4M3 (fn) byte as float32: 1 sign, 4 exponent (bias 7), 3 mantissa bits;
    exponent 0 is subnormal. The stored planes never hold NaN. Normal values are
    assembled as float32 bits (exponent rebased to 127, mantissa shifted up)."""
    b = byte.to(tl.int32)
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    normal = (((b & 0x80) << 24) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa / 8 * 2^-6
    subnormal = tl.where((b & 0x80) != 0, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def e8m0_to_f32(byte):
    """A biased power-of-two exponent byte as its scale 2^(byte - 127), built as
    float32 bits (byte 0, 2^-127, is float32's one subnormal case here)."""
    e = byte.to(tl.int32)
    return tl.where(e == 0, 5.877471754111438e-39, (e << 23).to(tl.float32, bitcast=True))


@triton.jit
def e2m1_to_f32(code):
    """A 4-bit E2M1 code (bit 3 sign, code & 7 indexes 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    c = code.to(tl.int32)
    m = c & 7
    magnitude = tl.where(m < 4, m.to(tl.float32) * 0.5, tl.where(m < 6, (m - 2).to(tl.float32), (m - 6).to(tl.float32) * 2.0 + 4.0))
    return tl.where((c & 8) != 0, -magnitude, magnitude)


@triton.jit
def load_decoded(values_ptr, scales_ptr, row_off, scale_off, dims, mask, FMT: tl.constexpr):
    """Rows [N, D] of a plane as float32. ``row_off`` / ``scale_off`` [N] are element
    offsets of each row in the values / scales tensors; ``dims`` [D] the channels.
    FMT: 0 bf16 or float rows, 1 FP8 E4M3 + E8M0 per 32, 2 NVFP4 (E2M1 pairs + E4M3 per
    16), 3 MXFP4 (E2M1 pairs + E8M0 per 32)."""
    m2 = mask[:, None]
    if FMT == 0:
        out = tl.load(values_ptr + row_off[:, None] + dims[None, :], mask=m2, other=0.0).to(tl.float32)
    elif FMT == 1:
        raw = tl.load(values_ptr + row_off[:, None] + dims[None, :], mask=m2, other=0)
        scale = tl.load(scales_ptr + scale_off[:, None] + (dims // 32)[None, :], mask=m2, other=127)
        out = e4m3_to_f32(raw) * e8m0_to_f32(scale)
    else:
        packed = tl.load(values_ptr + row_off[:, None] + (dims // 2)[None, :], mask=m2, other=0).to(tl.int32)
        code = (packed >> ((dims % 2) * 4)[None, :]) & 0xF
        if FMT == 2:
            scale = e4m3_to_f32(tl.load(scales_ptr + scale_off[:, None] + (dims // 16)[None, :], mask=m2, other=0))
        else:
            scale = e8m0_to_f32(tl.load(scales_ptr + scale_off[:, None] + (dims // 32)[None, :], mask=m2, other=127))
        out = e2m1_to_f32(code) * scale
    return out
