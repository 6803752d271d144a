"""The pool planes in place for kernels, and format-aware writes by flat row address.

Owns the planes as kernels read and write them in place (``PlaneView``, and each ratio-2
owner's committed compressor tails), and a writer of compute values into each plane's
stored format (bf16 or NVFP4 main KV, FP8 or FP4 index keys, bf16 or FP8 SWA rings)
through model/formats.py for callers without a kernel backend: tests and tools that
fill planes. The runtime stores through its kernels' ``write_rows`` instead, which
gives the same bytes (tests/model/test_kernels_compress_store.py holds them equal).
Window KV and index keys arrive already on their grids (FP8- and MXFP4-rounded), which
both of their formats hold exactly; compressed KV arrives before its NVFP4 rounding and
is rounded here (packing already-rounded NVFP4 rows is not exact when a block's E4M3
scale is subnormal), so a kernel decoding a plane reads exactly the model's values in
either format.

Addresses are flat: an entry row is ``page * rows_per_page(owner) + row``, a ring row
``slot * ring_rows + position % ring_rows``.

Must not import: model (other than model.formats), cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache.pools import V41Pools
from model.formats import quantize_fp8, quantize_mxfp4, quantize_nvfp4, round_nvfp4

COMMITTED_TAIL_ROW = 0  # the tail row a non-speculative forward leaves pending


@dataclass(frozen=True)
class PlaneView:
    """One plane in place for kernels (model/kernels/interface.PlaneView): ``values``
    [units, rows, width], ``scales`` [units, rows, groups] or None, ``fmt`` one of
    bf16 | fp8 | nvfp4 | mxfp4."""

    values: torch.Tensor
    scales: torch.Tensor | None
    fmt: str


class PlaneIO:
    """Exposes one rank's planes to kernels (the runtime's PagedStore) and writes
    compute values into them."""

    def __init__(self, pools: V41Pools) -> None:
        self.pools = pools
        self.geometry = pools.geometry

    def _split(self, owner: int, entry_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_page = self.geometry.rows_per_page(owner)
        return torch.div(entry_rows, per_page, rounding_mode="floor"), entry_rows.remainder(per_page)

    def _ring_split(self, ring_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_slot = self.geometry.ring_rows
        return torch.div(ring_rows, per_slot, rounding_mode="floor"), ring_rows.remainder(per_slot)

    # -- planes in place (what kernels read) ---------------------------------------------

    def window_plane(self, layer: int) -> PlaneView:
        if self.geometry.swa_dtype == "bf16":
            return PlaneView(self.pools.swa_ring(layer), None, "bf16")
        return PlaneView(self.pools.swa_ring(layer), self.pools.swa_scales(layer), "fp8")

    def main_plane(self, owner: int) -> PlaneView:
        if self.geometry.kv_cache_dtype == "bf16":
            return PlaneView(self.pools.main_kv(owner), None, "bf16")
        return PlaneView(self.pools.main_kv(owner), self.pools.main_kv_scales(owner), "nvfp4")

    def index_plane(self, owner: int) -> PlaneView:
        fmt = "fp8" if self.geometry.index_cache_dtype == "fp8" else "mxfp4"
        return PlaneView(self.pools.index_values(owner), self.pools.index_scales(owner), fmt)

    # -- SWA rings ----------------------------------------------------------------------

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

    def write_index(self, owner: int, entry_rows: torch.Tensor, keys: torch.Tensor) -> None:
        page, row = self._split(owner, entry_rows)
        quantize = quantize_fp8 if self.geometry.index_cache_dtype == "fp8" else quantize_mxfp4
        values, scales = quantize(keys)
        self.pools.index_values(owner)[page, row] = values
        self.pools.index_scales(owner)[page, row] = scales

    # -- compressor tails -----------------------------------------------------------------

    def tail_plane(self, owner: int) -> torch.Tensor:
        """[num_slots, 2, head_dim] float32 in place: each slot's pending ratio-2 token's
        v (0) and g (1), the row a non-speculative forward reads and leaves."""
        return self.pools.compressor_tail(owner)[:, COMMITTED_TAIL_ROW]
