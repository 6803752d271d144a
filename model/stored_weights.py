"""Weights kept in the form the checkpoint stores them.

Owns ``Fp8Weight`` (FP8 E4M3 values with one E8M0 scale per 32x32 tile: the attention
projections, shared experts, the indexer's wq_b and Engram's wkv) and ``Fp4Weight``
(E2M1 nibble pairs with one E8M0 scale per 32 input values: the routed experts), each
made from the checkpoint's bytes as they are (no decode, no repack), and their exact
decode (``decoded``). A projection takes either wherever it takes a plain weight
(model/linalg.py ``linear`` / ``grouped_linear``): on a GPU a kernel reads the stored
bytes and decodes each tile in registers; on the CPU the weight is decoded for the call.
The decode is exact (an E4M3 or E2M1 value times a power of two is a bf16 value), so a
projection through a stored weight computes the same products as one through its
decoded copy.

Must not import: cache, cluster, actors, deploy, ray, triton, model.kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from dsv41.model import formats

# Values per E8M0 scale along each axis of an FP8 weight tile, and along an FP4 row.
FP8_TILE = formats.WEIGHT_BLOCK
FP4_GROUP = formats.MXFP4_BLOCK
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)


def _check_values(owner: str, values: torch.Tensor, dtype: torch.dtype, stored: torch.dtype) -> tuple[int, int]:
    """Refuses a compute dtype that cannot hold the decode, or values that are not a 2-D
    tensor of the stored dtype; their shape."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{owner}.dtype: {dtype} (allowed: {', '.join(map(str, COMPUTE_DTYPES))})")
    if values.dim() != 2 or values.dtype != stored:
        raise ValueError(f"{owner}.values: {values.dtype} {tuple(values.shape)} (allowed: 2-D {stored})")
    return values.shape[0], values.shape[1]


def _check_scale(owner: str, weight: "Fp8Weight | Fp4Weight", expected: tuple[int, int], layout: str) -> None:
    """Refuses scales that are not uint8 of ``expected`` shape, or not on the values' device."""
    scale, values = weight.scale, weight.values
    if scale.dtype != torch.uint8 or tuple(scale.shape) != expected:
        raise ValueError(
            f"{owner}.scale: {scale.dtype} {tuple(scale.shape)} (allowed: uint8 {expected}, {layout} of values "
            f"{tuple(values.shape)})"
        )
    if scale.device != values.device:
        raise ValueError(f"{owner}.scale: on {scale.device}, values on {values.device} (allowed: one device)")


class _StoredBytes:
    """What both stored forms share: their values' device, and the bytes they hold."""

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes


@dataclass(frozen=True, eq=False)
class Fp8Weight(_StoredBytes):
    """An FP8 weight [out, in] as stored: ``values`` E4M3 [out, in] (float8_e4m3fn),
    ``scale`` one E8M0 byte per 32x32 tile [ceil(out / 32), ceil(in / 32)] (uint8;
    the edge tiles may be partial); ``dtype`` the compute dtype it decodes to."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        rows, cols = _check_values("Fp8Weight", self.values, self.dtype, torch.float8_e4m3fn)
        expected = (-(-rows // FP8_TILE), -(-cols // FP8_TILE))
        _check_scale("Fp8Weight", self, expected, f"one E8M0 byte per {FP8_TILE}x{FP8_TILE} tile")

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def decoded(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The exact decode in ``dtype`` (default: the compute dtype)."""
        return formats.dequantize_fp8_weight(self.values, self.scale).to(dtype or self.dtype)

    def row_groups(self, groups: int) -> tuple["Fp8Weight", ...]:
        """The weight cut into ``groups`` equal row blocks (a grouped projection's
        per-group weights), each of whole scale tiles."""
        rows = self.values.shape[0]
        if groups <= 0 or rows % groups or (rows // groups) % FP8_TILE:
            raise ValueError(
                f"row_groups: groups {groups} of an FP8 weight of {rows} rows (allowed: a count that cuts the rows "
                f"into equal blocks of whole {FP8_TILE}-row scale tiles)"
            )
        size = rows // groups
        tiles = size // FP8_TILE
        return tuple(
            Fp8Weight(self.values[g * size : (g + 1) * size], self.scale[g * tiles : (g + 1) * tiles], self.dtype)
            for g in range(groups)
        )


@dataclass(frozen=True, eq=False)
class Fp4Weight(_StoredBytes):
    """An FP4 expert weight [out, in] as stored: ``values`` E2M1 nibble pairs [out,
    in / 2] (uint8, the even column in the low nibble), ``scale`` one E8M0 byte per 32
    input values [out, in / 32] (uint8); ``dtype`` the compute dtype it decodes to."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        rows, half = _check_values("Fp4Weight", self.values, self.dtype, torch.uint8)
        if (half * 2) % FP4_GROUP:
            raise ValueError(f"Fp4Weight.values: rows of {half * 2} values (allowed: a multiple of {FP4_GROUP})")
        _check_scale("Fp4Weight", self, (rows, half * 2 // FP4_GROUP), f"one E8M0 byte per {FP4_GROUP} values")

    @property
    def shape(self) -> torch.Size:
        rows, half = self.values.shape
        return torch.Size((rows, half * 2))

    def decoded(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The exact decode in ``dtype`` (default: the compute dtype)."""
        return formats.dequantize_fp4_weight(self.values, self.scale).to(dtype or self.dtype)


StoredWeight = Union[Fp8Weight, Fp4Weight]
# A projection's weight: plain (the compute dtype, or float32) or as stored.
Weight = Union[torch.Tensor, Fp8Weight, Fp4Weight]


def weight_bytes(weight: Weight) -> int:
    """The device bytes a weight holds (values and scales)."""
    return weight.nbytes if isinstance(weight, (Fp8Weight, Fp4Weight)) else weight.numel() * weight.element_size()
