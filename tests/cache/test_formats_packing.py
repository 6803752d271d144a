"""Pack/unpack round trips of every cache format (model/formats.py) and that each
cache plane holds the model's rounded values exactly."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cache.geometry import V41PoolGeometry
from dsv41.cache.pools import PoolSize, V41Pools
from dsv41.model.formats import (
    E2M1_GRID,
    FormatError,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    pack_nibbles,
    pow2_scale_byte,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
    round_fp8,
    round_mxfp4,
    round_nvfp4,
    unpack_nibbles,
)

MakeGeometry = Callable[..., V41PoolGeometry]

# Rows of 64 channels at one magnitude (2^exponent): blocks span the grids' whole range.
rows_strategy = st.builds(
    lambda seed, exponent, rows: torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))
    * 2.0**exponent,
    seed=st.integers(0, 2**31 - 1),
    exponent=st.integers(-12, 12),
    rows=st.integers(1, 4),
)


@settings(max_examples=40, deadline=None)
@given(rows_strategy)
def test_fp8_e8m0_round_trip_is_exact_and_idempotent(x: torch.Tensor) -> None:
    """FP8 + E8M0 scales: unpacking the packed bytes gives round_fp8, and the rounded
    values pack and unpack to themselves (a plane may be written from them)."""
    values, scales = quantize_fp8(x)
    assert values.dtype == torch.uint8 and tuple(scales.shape) == (x.shape[0], 2)
    rounded = dequantize_fp8(values, scales)
    assert torch.equal(rounded, round_fp8(x))
    assert torch.equal(dequantize_fp8(*quantize_fp8(rounded)), rounded)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    exponent=st.integers(-12, 12),
    rows=st.integers(0, 4),
    width=st.integers(1, 100),
)
def test_fp8_rows_of_any_width_end_in_a_partial_group(seed: int, exponent: int, rows: int, width: int) -> None:
    """A row of any width packs into ceil(width / 32) E8M0 scales (no rows: none): the bytes and scales
    are those of the row padded with zeros to whole groups, cut back to its width (a
    partial last group is scaled by its own values), and the round trip is exact and
    idempotent as for whole groups."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 2.0**exponent
    values, scales = quantize_fp8(x)
    groups = -(-width // 32)
    assert tuple(values.shape) == (rows, width) and tuple(scales.shape) == (rows, groups)
    padded_values, padded_scales = quantize_fp8(torch.nn.functional.pad(x, (0, groups * 32 - width)))
    assert torch.equal(values, padded_values[:, :width]) and torch.equal(scales, padded_scales)
    rounded = dequantize_fp8(values, scales)
    assert torch.equal(rounded, round_fp8(x))
    assert torch.equal(dequantize_fp8(*quantize_fp8(rounded)), rounded)


def test_fp8_scales_must_cover_the_row() -> None:
    """Decoding refuses scales that are not ceil(width / 32) per row."""
    values, scales = quantize_fp8(torch.randn(2, 48))
    with pytest.raises(FormatError, match=r"ceil\(48 / 32\) = 2"):
        dequantize_fp8(values, scales[:, :1])


@settings(max_examples=40, deadline=None)
@given(rows_strategy)
def test_mxfp4_round_trip_is_exact_and_idempotent(x: torch.Tensor) -> None:
    """E2M1 packed two per byte + E8M0 per 32 (MXFP4): unpacking gives round_mxfp4, and
    the rounded values pack and unpack to themselves."""
    packed, scales = quantize_mxfp4(x)
    assert tuple(packed.shape) == (x.shape[0], 32) and tuple(scales.shape) == (x.shape[0], 2)
    rounded = dequantize_mxfp4(packed, scales)
    assert torch.equal(rounded, round_mxfp4(x))
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(rounded)), rounded)


@settings(max_examples=40, deadline=None)
@given(rows_strategy)
def test_nvfp4_e4m3_round_trip_is_exact(x: torch.Tensor) -> None:
    """NVFP4 (E2M1 packed + E4M3 scale per 16): unpacking the bytes packed from a row
    gives round_nvfp4 of that row, at every magnitude; and where a block's E4M3 scale
    is normal (amax >= 6 * 2^-6) the rounded values also pack to themselves."""
    packed, scales = quantize_nvfp4(x)
    assert tuple(packed.shape) == (x.shape[0], 32) and tuple(scales.shape) == (x.shape[0], 4)
    rounded = dequantize_nvfp4(packed, scales)
    assert torch.equal(rounded, round_nvfp4(x))
    normal = x.reshape(-1, 16).abs().amax(-1) >= 6 * 2.0**-6
    again = round_nvfp4(rounded).reshape(-1, 16)
    assert torch.equal(again[normal], rounded.reshape(-1, 16)[normal])


def test_nvfp4_repacking_a_rounded_row_with_a_subnormal_scale_is_lossy() -> None:
    """The limit behind "pack the unrounded row": a block with amax 1.6 * 6 * 2^-9 gets
    the subnormal E4M3 scale 2^-8 (x / s = 4.8 rounds to 4); re-packing the rounded block
    picks the scale 2^-9, on which 4 * 2^-8 = 8 * 2^-9 saturates to 6 * 2^-9. So the
    packed main plane must be written from the row before rounding, as the model
    rounds it, never from its rounded values."""
    block = torch.zeros(1, 16)
    block[0, 0] = 1.6 * 6 * 2.0**-9
    rounded = round_nvfp4(block)
    assert rounded[0, 0].item() == 4 * 2.0**-8
    assert round_nvfp4(rounded)[0, 0].item() == 6 * 2.0**-9


def test_e8m0_round_trips_every_power_of_two() -> None:
    """Every power of two 2^-127..2^127 has its biased exponent as its E8M0 byte, and decodes back."""
    scales = torch.exp2(torch.arange(-127, 128, dtype=torch.float64)).float()
    codes = pow2_scale_byte(scales)
    assert torch.equal(codes, torch.arange(0, 255, dtype=torch.uint8))
    assert torch.equal(e8m0_decode(codes), scales)


def test_e2m1_nibbles_round_trip_with_even_element_low() -> None:
    """Every pair of 4-bit codes packs into one byte, the even element in the low
    nibble, and unpacks to the same codes."""
    codes = torch.arange(16, dtype=torch.uint8)
    pairs = torch.cartesian_prod(codes, codes)  # [256, 2]
    packed = pack_nibbles(pairs)
    assert torch.equal(packed.flatten(), (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8))
    assert torch.equal(unpack_nibbles(packed), pairs)
    assert torch.equal(e2m1_encode(e2m1_decode(codes)), torch.where(codes == 8, 0, codes).to(torch.uint8))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_midpoints_round_to_the_even_code(sign: float) -> None:
    """A value exactly between two E2M1 grid points takes the one with the even code
    (grid index), on both signs; just off the midpoint rounds to the nearer point."""
    grid = list(E2M1_GRID)
    for lower in range(len(grid) - 1):
        mid = (grid[lower] + grid[lower + 1]) / 2
        even = lower if lower % 2 == 0 else lower + 1
        assert e2m1_decode(e2m1_encode(torch.tensor([sign * mid]))).item() == sign * grid[even]
        eps = 1e-3
        assert e2m1_decode(e2m1_encode(torch.tensor([sign * (mid - eps)]))).item() == sign * grid[lower]
        assert e2m1_decode(e2m1_encode(torch.tensor([sign * (mid + eps)]))).item() == sign * grid[lower + 1]


@settings(max_examples=40, deadline=None)
@given(rows_strategy)
def test_mxfp4_keys_survive_the_fp8_index_plane_exactly(x: torch.Tensor) -> None:
    """The model's MXFP4-rounded index keys, stored as E4M3 + E8M0 per 32 (the FP8 index
    plane), read back bit for bit: the FP8 plane loses nothing of an MXFP4 key."""
    keys = round_mxfp4(x)
    assert torch.equal(dequantize_fp8(*quantize_fp8(keys)), keys)


@settings(max_examples=20, deadline=None)
@given(keys=rows_strategy, main=rows_strategy, window=rows_strategy)
def test_planes_hold_the_models_rounded_values_exactly(
    make_geometry: MakeGeometry, keys: torch.Tensor, main: torch.Tensor, window: torch.Tensor
) -> None:
    """Through the pool views: MXFP4 keys in the FP8 and the FP4 index planes, NVFP4
    rows in bf16 and in packed main KV (packed from the unrounded row), FP8 window rows
    in bf16 and FP8 rings all read back exactly the values the model computes with."""
    keys, main, window = keys[:1, :32], main[:1], window[:1]
    bf16 = V41Pools(make_geometry(head_dim=64), PoolSize(num_pages=1, num_slots=1))
    packed = V41Pools(make_geometry(kv_cache_dtype="fp4", index_cache_dtype="fp4"), PoolSize(num_pages=1, num_slots=1))
    k = round_mxfp4(keys)
    bf16.index_values(1)[0, :1], bf16.index_scales(1)[0, :1] = quantize_fp8(k)
    assert torch.equal(dequantize_fp8(bf16.index_values(1)[0, :1], bf16.index_scales(1)[0, :1]), k)
    packed.index_values(1)[0, :1], packed.index_scales(1)[0, :1] = quantize_mxfp4(k)
    assert torch.equal(dequantize_mxfp4(packed.index_values(1)[0, :1], packed.index_scales(1)[0, :1]), k)

    m = round_nvfp4(main)
    bf16.main_kv(3)[0, :1] = m.to(torch.bfloat16)
    assert torch.equal(bf16.main_kv(3)[0, :1].float(), m)
    packed.main_kv(3)[0, :1], packed.main_kv_scales(3)[0, :1] = quantize_nvfp4(main)
    assert torch.equal(dequantize_nvfp4(packed.main_kv(3)[0, :1], packed.main_kv_scales(3)[0, :1]), m)

    w = round_fp8(window)
    bf16.swa_ring(0)[0, :1] = w.to(torch.bfloat16)
    assert torch.equal(bf16.swa_ring(0)[0, :1].float(), w)
    packed.swa_ring(0)[0, :1], packed.swa_scales(0)[0, :1] = quantize_fp8(w)
    assert torch.equal(dequantize_fp8(packed.swa_ring(0)[0, :1], packed.swa_scales(0)[0, :1]), w)
