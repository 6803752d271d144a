"""The pool planes in place for kernels.

Owns the planes as kernels read and write them in place (``PlaneView``: bf16 or NVFP4
main KV, FP8 or FP4 index keys, bf16 or FP8 SWA rings; and each ratio-2 owner's
committed compressor tails): the runtime's ``PagedStore``. Writing compute values into
a plane's stored format is the kernels' ``write_rows`` (model/kernels), one
implementation per backend over model/formats.py.

Addresses are flat: an entry row is ``page * rows_per_page(owner) + row``, a ring row
``slot * ring_rows + position % ring_rows``.

Must not import: model (other than model.formats), cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.cache.pools import V41Pools

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
    """Exposes one rank's planes to kernels (the runtime's PagedStore)."""

    def __init__(self, pools: V41Pools) -> None:
        self.pools = pools
        self.geometry = pools.geometry

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

    # -- compressor tails -----------------------------------------------------------------

    def tail_plane(self, owner: int) -> torch.Tensor:
        """[num_slots, 2, head_dim] float32 in place: each slot's pending ratio-2 token's
        v (0) and g (1), the row a non-speculative forward reads and leaves."""
        return self.pools.compressor_tail(owner)[:, COMMITTED_TAIL_ROW]

    def stage_tails(
        self, owner: int, slots: torch.Tensor, rows: torch.Tensor, v: torch.Tensor, g: torch.Tensor
    ) -> None:
        """Stores a speculative verify's rows' (v, g) [N, head_dim] in tail rows ``rows``
        of ``slots``; the committed row is never among them."""
        if bool((rows == COMMITTED_TAIL_ROW).any()) or bool((rows >= self.geometry.tail_rows).any()):
            raise ValueError(f"rows: staged tail rows must lie in 1..{self.geometry.tail_rows - 1}")
        tails = self.pools.compressor_tail(owner)
        tails[slots, rows, 0] = v.float()
        tails[slots, rows, 1] = g.float()

    def commit_staged_tail(self, slot: int, row: int) -> None:
        """Makes staged tail row ``row`` of ``slot`` its committed pending token, in every
        ratio-2 owner (the accepted prefix ended on that row's position)."""
        if not 1 <= row < self.geometry.tail_rows:
            raise ValueError(f"row: {row} (allowed: a staged tail row 1..{self.geometry.tail_rows - 1})")
        for owner in self.geometry.tail_owners:
            tails = self.pools.compressor_tail(owner)
            tails[slot, COMMITTED_TAIL_ROW] = tails[slot, row]
