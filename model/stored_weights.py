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


def _check_compute_dtype(owner: str, dtype: torch.dtype) -> None:
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{owner}.dtype: {dtype} (allowed: {', '.join(map(str, COMPUTE_DTYPES))})")


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """An FP8 weight [out, in] as stored: ``values`` E4M3 [out, in] (float8_e4m3fn),
    ``scale`` one E8M0 byte per 32x32 tile [ceil(out / 32), ceil(in / 32)] (uint8;
    the edge tiles may be partial); ``dtype`` the compute dtype it decodes to."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        _check_compute_dtype("Fp8Weight", self.dtype)
        if self.values.dim() != 2 or self.values.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"Fp8Weight.values: {self.values.dtype} {tuple(self.values.shape)} (allowed: 2-D torch.float8_e4m3fn)"
            )
        rows, cols = self.values.shape
        expected = (-(-rows // FP8_TILE), -(-cols // FP8_TILE))
        if self.scale.dtype != torch.uint8 or tuple(self.scale.shape) != expected:
            raise ValueError(
                f"Fp8Weight.scale: {self.scale.dtype} {tuple(self.scale.shape)} (allowed: uint8 {expected}, one E8M0 "
                f"byte per {FP8_TILE}x{FP8_TILE} tile of values {tuple(self.values.shape)})"
            )
        if self.scale.device != self.values.device:
            raise ValueError(f"Fp8Weight.scale: on {self.scale.device}, values on {self.values.device} (allowed: one device)")

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes

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
class Fp4Weight:
    """An FP4 expert weight [out, in] as stored: ``values`` E2M1 nibble pairs [out,
    in / 2] (uint8, the even column in the low nibble), ``scale`` one E8M0 byte per 32
    input values [out, in / 32] (uint8); ``dtype`` the compute dtype it decodes to."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        _check_compute_dtype("Fp4Weight", self.dtype)
        if self.values.dim() != 2 or self.values.dtype != torch.uint8:
            raise ValueError(
                f"Fp4Weight.values: {self.values.dtype} {tuple(self.values.shape)} (allowed: 2-D uint8 nibble pairs)"
            )
        rows, half = self.values.shape
        expected = (rows, half * 2 // FP4_GROUP)
        if (half * 2) % FP4_GROUP or self.scale.dtype != torch.uint8 or tuple(self.scale.shape) != expected:
            raise ValueError(
                f"Fp4Weight.scale: {self.scale.dtype} {tuple(self.scale.shape)} (allowed: uint8 {expected}, one E8M0 "
                f"byte per {FP4_GROUP} values of the {half * 2}-wide rows)"
            )
        if self.scale.device != self.values.device:
            raise ValueError(f"Fp4Weight.scale: on {self.scale.device}, values on {self.values.device} (allowed: one device)")

    @property
    def shape(self) -> torch.Size:
        rows, half = self.values.shape
        return torch.Size((rows, half * 2))

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes

    def decoded(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The exact decode in ``dtype`` (default: the compute dtype)."""
        return formats.dequantize_fp4_weight(self.values, self.scale).to(dtype or self.dtype)


StoredWeight = Union[Fp8Weight, Fp4Weight]
# A projection's weight: plain (the compute dtype, or float32) or as stored.
Weight = Union[torch.Tensor, Fp8Weight, Fp4Weight]


def weight_bytes(weight: Weight) -> int:
    """The device bytes a weight holds (values and scales)."""
    return weight.nbytes if isinstance(weight, (Fp8Weight, Fp4Weight)) else weight.numel() * weight.element_size()
