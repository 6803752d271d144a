"""Format-aware reads and writes of the pool planes, by flat row address.

Owns the conversion between compute values and each plane's stored format (bf16 or
NVFP4 main KV, FP8 or FP4 index keys, bf16 or FP8 SWA rings, fp32 compressor tails)
through model/formats.py, so the runtime never sees a byte layout. Window KV and index
keys arrive already on their grids (FP8- and MXFP4-rounded), which both of their
formats hold exactly; compressed KV arrives before its NVFP4 rounding and is rounded
here (packing already-rounded NVFP4 rows is not exact when a block's E4M3 scale is
subnormal), so a read returns exactly the model's NVFP4 values in either main format.

Addresses are flat: an entry row is ``page * rows_per_page(owner) + row``, a ring row
``slot * ring_rows + position % ring_rows``.

Must not import: model (other than model.formats), cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch

from cache.pools import V41Pools
from model.formats import (
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
    round_nvfp4,
)

COMMITTED_TAIL_ROW = 0  # the tail row a non-speculative forward leaves pending


class PlaneIO:
    """Reads and writes one rank's pools in compute precision (``dtype``)."""

    def __init__(self, pools: V41Pools, dtype: torch.dtype) -> None:
        self.pools = pools
        self.geometry = pools.geometry
        self.dtype = dtype

    def _split(self, owner: int, entry_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_page = self.geometry.rows_per_page(owner)
        return torch.div(entry_rows, per_page, rounding_mode="floor"), entry_rows.remainder(per_page)

    def _ring_split(self, ring_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_slot = self.geometry.ring_rows
        return torch.div(ring_rows, per_slot, rounding_mode="floor"), ring_rows.remainder(per_slot)

    # -- SWA rings ----------------------------------------------------------------------

    def read_window(self, layer: int, ring_rows: torch.Tensor) -> torch.Tensor:
        slot, row = self._ring_split(ring_rows)
        ring = self.pools.swa_ring(layer)
        if self.geometry.swa_dtype == "bf16":
            return ring[slot, row].to(self.dtype)
        return dequantize_fp8(ring[slot, row], self.pools.swa_scales(layer)[slot, row]).to(self.dtype)

    def write_window(self, layer: int, ring_rows: torch.Tensor, kv: torch.Tensor) -> None:
        slot, row = self._ring_split(ring_rows)
        ring = self.pools.swa_ring(layer)
        if self.geometry.swa_dtype == "bf16":
            ring[slot, row] = kv.to(torch.bfloat16)
        else:
            values, scales = quantize_fp8(kv)
            ring[slot, row] = values
            self.pools.swa_scales(layer)[slot, row] = scales

    # -- main KV ------------------------------------------------------------------------

    def read_main(self, owner: int, entry_rows: torch.Tensor) -> torch.Tensor:
        page, row = self._split(owner, entry_rows)
        main = self.pools.main_kv(owner)
        if self.geometry.kv_cache_dtype == "bf16":
            return main[page, row].to(self.dtype)
        return dequantize_nvfp4(main[page, row], self.pools.main_kv_scales(owner)[page, row]).to(self.dtype)

    def write_main(self, owner: int, entry_rows: torch.Tensor, kv_unrounded: torch.Tensor) -> None:
        page, row = self._split(owner, entry_rows)
        main = self.pools.main_kv(owner)
        if self.geometry.kv_cache_dtype == "bf16":
            main[page, row] = round_nvfp4(kv_unrounded.float()).to(torch.bfloat16)
        else:
            packed, scales = quantize_nvfp4(kv_unrounded)
            main[page, row] = packed
            self.pools.main_kv_scales(owner)[page, row] = scales

    # -- index keys ---------------------------------------------------------------------

    def read_index(self, owner: int, entry_rows: torch.Tensor) -> torch.Tensor:
        page, row = self._split(owner, entry_rows)
        values = self.pools.index_values(owner)[page, row]
        scales = self.pools.index_scales(owner)[page, row]
        if self.geometry.index_cache_dtype == "fp8":
            return dequantize_fp8(values, scales).to(self.dtype)
        return dequantize_mxfp4(values, scales).to(self.dtype)

    def write_index(self, owner: int, entry_rows: torch.Tensor, keys: torch.Tensor) -> None:
        page, row = self._split(owner, entry_rows)
        quantize = quantize_fp8 if self.geometry.index_cache_dtype == "fp8" else quantize_mxfp4
        values, scales = quantize(keys)
        self.pools.index_values(owner)[page, row] = values
        self.pools.index_scales(owner)[page, row] = scales

    # -- compressor tails -----------------------------------------------------------------

    def read_tail(self, owner: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tail = self.pools.compressor_tail(owner)[slots, COMMITTED_TAIL_ROW]
        return tail[:, 0], tail[:, 1]

    def write_tail(self, owner: int, slots: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
        tail = self.pools.compressor_tail(owner)
        tail[slots, COMMITTED_TAIL_ROW, 0] = v.float()
        tail[slots, COMMITTED_TAIL_ROW, 1] = g.float()
