"""The number formats of DeepSeek-V4.1: rounding, packing and unpacking.

Owns the one implementation of each format MODEL_FACTS.md section 7 names, used by
the model's fake quantisation, the cache's packed planes and the checkpoint
loader/writer alike:

- FP8 E4M3 in blocks of 32 channels with a power-of-two (E8M0) scale: window KV,
  Engram table rows, and (in 32x32 blocks) the FP8 weights. A row whose width 32 does
  not divide ends in a partial block with a scale of its own, as the weights' edge
  tiles do (an Engram row of 16 values has one scale).
- E2M1 (FP4) codes, two per byte, low nibble = even element.
- MXFP4: E2M1 in blocks of 32 with a power-of-two (E8M0) scale: index query/keys,
  and the FP4 routed experts (blocks along the input dim).
- NVFP4: E2M1 in blocks of 16 with an E4M3 scale: compressed KV.

``round_*`` functions return the dequantised values (the published model computes
with those); ``quantize_*`` return the packed bytes and ``dequantize_*`` read them
back, bit for bit the same values.

Must not import: anything of this project (this module is the one ``cache/`` may
import from ``model/``), ray, triton.
"""

from __future__ import annotations

import functools

import torch

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Floors that keep an all-zero block's scale finite. FP8's is the published one;
# MXFP4 uses the same floor (?): the model facts give none, so it lives here alone.
FP8_AMAX_FLOOR = 1e-4
MXFP4_AMAX_FLOOR = 1e-4
NVFP4_AMAX_FLOOR = 6.0 * 2.0**-9
FP8_BLOCK = 32
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
WEIGHT_BLOCK = 32
E8M0_BIAS = 127

# The signed grid is indexed by code & 7, bit 3 is the sign.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring grid values; at a midpoint the even code wins.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Midpoints whose upper neighbour has the even code (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0).
_E2M1_TIES_UP = (0.75, 1.75, 3.5)


class FormatError(ValueError):
    """A tensor whose shape or dtype does not fit the format asked for."""


def _blocks(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    if x.shape[-1] % block:
        raise FormatError(f"{what}: last dim {x.shape[-1]} is not a multiple of the block size {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def divide_exactly(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """fp32 ``x / divisor``, one IEEE division on every device: torch's CUDA division by
    a Python number multiplies by its rounded reciprocal instead (another value in the
    last bit), so the divisor goes as a one-element tensor of ``x``'s device."""
    return x / _table((divisor,), x.device)


def pow2_scale(amax: torch.Tensor, grid_max: float, floor: float) -> torch.Tensor:
    """2^ceil(log2(max(amax, floor) / grid_max)): the E8M0 scale of a block, with the
    log2 rounded to float32 before the ceiling (as the published model's torch.log2
    gives it), computed from y's bits instead of a log2 whose last bit depends on the
    library and on where an element sits in a vectorised loop.

    For y = 2^e (1 + f), float32 rounds e + log2(1 + f) down to e when log2(1 + f) is
    under half the float32 gap above e, 2^g, and the scale is then 2^e, not 2^(e+1):
    that is f * 2^23 <= ln2 * 2^(g + 23) on f's grid of 2^-23 (never within 0.09 of an
    integer for the exponents a block scale reaches). model/kernels/triton/store.py's
    pow2_exponent is the same derivation in a kernel."""
    y = divide_exactly(amax.float().clamp_min(floor), grid_max)
    bits = y.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    f_bits = bits & 0x7FFFFF
    magnitude_bits = e.abs().float().view(torch.int32)
    magnitude_exponent = ((magnitude_bits >> 23) & 0xFF) - 127
    negative_power_of_two = (e < 0) & ((magnitude_bits & 0x7FFFFF) == 0)
    g = magnitude_exponent - 24 - negative_power_of_two.to(torch.int32)
    threshold = 0.6931471805599453 * ((g + 23 + 127) << 23).view(torch.float32)
    rounds_up = torch.where(e == 0, f_bits > 0, f_bits.float() > threshold)
    return ((e + rounds_up.to(torch.int32) + 127) << 23).view(torch.float32)


# -- E8M0 ---------------------------------------------------------------------------


def pow2_scale_byte(scale: torch.Tensor) -> torch.Tensor:
    """The E8M0 byte of each scale ``pow2_scale`` made: a normal float32 power of two,
    whose biased exponent field is its E8M0 code (both biased by 127). Unlike
    a log2 of the scale, this needs no check that it is a power of two, so nothing
    waits on the device (a forward captured as a CUDA graph quantises through here).
    A float32 2^-127 is subnormal, with exponent field 0: E8M0's code for it."""
    return ((scale.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """Biased exponent bytes (uint8, or torch.float8_e8m0fnu) as float32 scales."""
    if code.dtype == getattr(torch, "float8_e8m0fnu", None):
        code = code.view(torch.uint8)
    if code.dtype != torch.uint8:
        raise FormatError(f"e8m0_decode: expected uint8 exponent bytes, got {code.dtype}")
    return torch.exp2(code.float() - E8M0_BIAS)


# -- FP8 E4M3 -----------------------------------------------------------------------


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def row_scale_groups(width: int, block: int) -> int:
    """The scales of a row of ``width`` values in groups of ``block``: ceil(width /
    block), the last group partial where ``block`` does not divide ``width``."""
    return -(-width // block)


def _pad_last_dim(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` in float32 with zeros appended to its last dim up to a multiple of
    ``block``. Zeros never raise a group's amax, so a partial group gets the scale
    of its own values."""
    pad = (-x.shape[-1]) % block
    return torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()


def quantize_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 bytes [..., D] (uint8) and E8M0 scale bytes [..., ceil(D / block)]."""
    width = x.shape[-1]
    padded = _pad_last_dim(x, block)
    xb = _blocks(padded, block, "quantize_fp8")
    scale = pow2_scale(xb.abs().amax(-1, keepdim=True), FP8_E4M3_MAX, FP8_AMAX_FLOOR)
    values = _to_e4m3(xb / scale).view(torch.uint8).reshape(padded.shape)[..., :width]
    return values, pow2_scale_byte(scale.squeeze(-1))


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    v = values.view(torch.float8_e4m3fn).float()
    width = v.shape[-1]
    groups = row_scale_groups(width, block)
    if scales.shape[-1] != groups:
        raise FormatError(
            f"dequantize_fp8: {scales.shape[-1]} scales per row of {width} values (expected ceil({width} / {block}) = {groups})"
        )
    vb = _pad_last_dim(v, block).reshape(*v.shape[:-1], groups, block)
    return (vb * e8m0_decode(scales).unsqueeze(-1)).reshape(*v.shape[:-1], groups * block)[..., :width]


def round_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 E4M3 fake quantisation in blocks of ``block`` channels (window KV)."""
    return dequantize_fp8(*quantize_fp8(x, block), block=block).to(x.dtype)


# -- E2M1 (FP4) codes ---------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A constant float32 table on ``device``, made once per device: a forward
    captured as a CUDA graph cannot copy one from the host."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (ties to even, saturating at 6) of each value, uint8 in 0..15."""
    a = x.float().abs()
    mids = _table(_E2M1_MIDPOINTS, x.device)
    code = torch.bucketize(a, mids, right=False)
    ties_up = _table(_E2M1_TIES_UP, x.device)
    code = code + torch.isin(a, ties_up).to(code.dtype)
    sign = (x.float() < 0) & (code > 0)
    return (code | (sign.to(code.dtype) << 3)).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    grid = _table(E2M1_GRID, code.device)
    c = code.to(torch.int64)
    magnitude = grid[c & 7]
    return torch.where((c & 8) != 0, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim, the even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise FormatError(f"pack_nibbles: last dim {codes.shape[-1]} is odd")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    p = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    low, high = p & 0x0F, p >> 4
    return torch.stack((low, high), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


# -- MXFP4 --------------------------------------------------------------------------


def quantize_mxfp4(x: torch.Tensor, block: int = MXFP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed E2M1 bytes [..., D / 2] and E8M0 scale bytes [..., D / block]."""
    xb = _blocks(x, block, "quantize_mxfp4")
    scale = pow2_scale(xb.abs().amax(-1, keepdim=True), E2M1_MAX, MXFP4_AMAX_FLOOR)
    codes = e2m1_encode(xb / scale).reshape(x.shape)
    return pack_nibbles(codes), pow2_scale_byte(scale.squeeze(-1))


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, block: int = MXFP4_BLOCK) -> torch.Tensor:
    v = e2m1_decode(unpack_nibbles(packed))
    vb = v.reshape(*v.shape[:-1], v.shape[-1] // block, block)
    return (vb * e8m0_decode(scales).unsqueeze(-1)).reshape(v.shape)


def round_mxfp4(x: torch.Tensor, block: int = MXFP4_BLOCK) -> torch.Tensor:
    """MXFP4 fake quantisation (index query and keys)."""
    return dequantize_mxfp4(*quantize_mxfp4(x, block), block=block).to(x.dtype)


# -- NVFP4 --------------------------------------------------------------------------


def quantize_nvfp4(x: torch.Tensor, block: int = NVFP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed E2M1 bytes [..., D / 2] and E4M3 scale bytes [..., D / block]."""
    xb = _blocks(x, block, "quantize_nvfp4")
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(NVFP4_AMAX_FLOOR)
    scale = _to_e4m3(divide_exactly(amax, E2M1_MAX))
    codes = e2m1_encode(xb / scale.float()).reshape(x.shape)
    return pack_nibbles(codes), scale.squeeze(-1).view(torch.uint8)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, block: int = NVFP4_BLOCK) -> torch.Tensor:
    v = e2m1_decode(unpack_nibbles(packed))
    vb = v.reshape(*v.shape[:-1], v.shape[-1] // block, block)
    return (vb * scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)).reshape(v.shape)


def round_nvfp4(x: torch.Tensor, block: int = NVFP4_BLOCK) -> torch.Tensor:
    """NVFP4 fake quantisation (compressed KV)."""
    return dequantize_nvfp4(*quantize_nvfp4(x, block), block=block).to(x.dtype)


# -- weights on disk ----------------------------------------------------------------


def _pad_to_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = w.shape
    pr, pc = (-rows) % block, (-cols) % block
    return torch.nn.functional.pad(w.float(), (0, pc, 0, pr)) if pr or pc else w.float()


def quantize_fp8_weight(w: torch.Tensor, block: int = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 weight [out, in] with one E8M0 scale per block x block tile
    ([ceil(out / block), ceil(in / block)])."""
    rows, cols = w.shape
    padded = _pad_to_blocks(w, block)
    tiles = padded.reshape(padded.shape[0] // block, block, padded.shape[1] // block, block)
    scale = pow2_scale(tiles.abs().amax(dim=(1, 3), keepdim=True), FP8_E4M3_MAX, FP8_AMAX_FLOOR)
    values = _to_e4m3(tiles / scale).reshape(padded.shape)[:rows, :cols]
    return values, pow2_scale_byte(scale.reshape(scale.shape[0], scale.shape[2]))


def dequantize_fp8_weight(values: torch.Tensor, scales: torch.Tensor, block: int = WEIGHT_BLOCK) -> torch.Tensor:
    rows, cols = values.shape
    expected = (-(-rows // block), -(-cols // block))
    if tuple(scales.shape) != expected:
        raise FormatError(f"dequantize_fp8_weight: scale shape {tuple(scales.shape)}, expected {expected}")
    s = e8m0_decode(scales).repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return values.view(torch.float8_e4m3fn).float() * s


def quantize_fp4_weight(w: torch.Tensor, block: int = MXFP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 weight [out, in] packed into int8 [out, in / 2] with one E8M0 scale per
    ``block`` input columns ([out, in / block]): MXFP4 along the input dim."""
    packed, scales = quantize_mxfp4(w, block)
    return packed.view(torch.int8), scales


def dequantize_fp4_weight(packed: torch.Tensor, scales: torch.Tensor, block: int = MXFP4_BLOCK) -> torch.Tensor:
    rows, half = packed.shape
    expected = (rows, half * 2 // block)
    if tuple(scales.shape) != expected:
        raise FormatError(f"dequantize_fp4_weight: scale shape {tuple(scales.shape)}, expected {expected}")
    return dequantize_mxfp4(packed, scales, block)
