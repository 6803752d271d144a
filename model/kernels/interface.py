"""The kernel interface of the paged hot paths, and the plane handles kernels read.

Owns two contracts: ``PlaneView`` (one stored plane as the storage layer exposes it,
read in place by kernels) and ``PagedKernels`` (sparse attention over window rows plus
selected compressed rows, and the index scorer over a request's tile of entry rows).
Every backend computes the same function; the torch backend is the reference.
Must not import: cache, cluster, actors, deploy, ray, triton.
"""

from __future__ import annotations

from typing import Protocol

import torch

PLANE_FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")


class PlaneView(Protocol):
    """A plane in place: ``values`` [units, rows, width] (bf16 rows, or bytes: E4M3, or
    two E2M1 codes per byte), ``scales`` [units, rows, groups] bytes (E8M0 for fp8 and
    mxfp4, E4M3 for nvfp4) or None for bf16. A flat row r is unit r // rows, row r % rows."""

    values: torch.Tensor
    scales: torch.Tensor | None
    fmt: str


class PlaneSource(Protocol):
    """Where the kernels find the planes of one rank's pools."""

    def window_plane(self, layer: int) -> PlaneView: ...
    def main_plane(self, owner: int) -> PlaneView: ...
    def index_plane(self, owner: int) -> PlaneView: ...


class PagedKernels(Protocol):
    name: str

    def attend(
        self,
        q: torch.Tensor,
        chunk_kv: torch.Tensor,
        chunk_rows: torch.Tensor,
        ring_rows: torch.Tensor,
        window_valid: torch.Tensor,
        ring: PlaneView,
        entry_rows: torch.Tensor | None,
        main: PlaneView | None,
        sink: torch.Tensor,
        softmax_scale: float,
    ) -> torch.Tensor:
        """Sparse attention of q [R, H, D] over each row's window keys — this step's
        ``chunk_kv`` rows (``chunk_rows`` [R, W]) or flat ``ring_rows`` of the ring
        plane, ``window_valid`` [R, W] — plus the flat ``entry_rows`` [R, K] of the main
        plane (NO_ROW = -1 for an empty slot). fp32 softmax with a zero-value sink key.
        Returns [R, H, D] in q's dtype."""
        ...

    def score(
        self,
        q: torch.Tensor,
        head_weights: torch.Tensor,
        tile_rows: torch.Tensor,
        row_segments: torch.Tensor,
        index: PlaneView,
    ) -> torch.Tensor:
        """Index scores [R, C] = sum_h w_h ReLU(q_h . k_c) of each row (q [R, Hi, Di] and
        head weights [R, Hi] fp32) against its segment's tile of flat entry rows
        (``tile_rows`` [S, C], ``row_segments`` [R]); -inf where the tile has NO_ROW."""
        ...
