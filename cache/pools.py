"""The cache's device memory: one backing buffer per device and typed views into it.

Owns: ``PoolSize`` (how many PAGEs and STATE slots a memory budget buys) and
``V41Pools`` (the uint8 buffer of one device, laid out page-major as a PAGE region
``[num_pages, page_bytes]`` followed by a STATE region ``[num_slots, state_bytes]``,
and one strided typed view per plane of ``V41PoolGeometry``). Because a PAGE is one
contiguous row of bytes, offload and checkpoint images move whole PAGEs as byte rows;
kernels read and write the typed views, which alias the same bytes.

Must not import: anything of this project but ``cache.geometry`` (and, through it,
``model.formats``), the scheduler, ray. Which PAGE or slot belongs to whom is the block
manager's business; this module only holds bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dsv41.cache.geometry import CURSOR_POSITION, DEAD_ENGRAM_ID, PlaneKind, PlaneSpec, Region, V41PoolGeometry


class PoolError(ValueError):
    """A pool size or access the pools cannot serve; the message names the field."""


@dataclass(frozen=True)
class PoolSize:
    """PAGEs and STATE slots of one device's pools."""

    num_pages: int
    num_slots: int

    def __post_init__(self) -> None:
        for name in ("num_pages", "num_slots"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise PoolError(f"{name}: {value!r} (allowed: a positive integer)")

    @classmethod
    def from_budget(
        cls,
        geometry: V41PoolGeometry,
        budget_bytes: int,
        *,
        num_slots: int,
        max_num_pages: int | None = None,
    ) -> "PoolSize":
        """STATE slots first (one per request that may run at once), then every whole
        PAGE the rest of ``budget_bytes`` holds, at most ``max_num_pages`` (tests cap
        it to force preemption)."""
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise PoolError(f"num_slots: {num_slots!r} (allowed: a positive integer)")
        if max_num_pages is not None and (not isinstance(max_num_pages, int) or max_num_pages <= 0):
            raise PoolError(f"max_num_pages: {max_num_pages!r} (allowed: a positive integer or None)")
        state_bytes = num_slots * geometry.state_bytes
        num_pages = (budget_bytes - state_bytes) // geometry.page_bytes
        if num_pages < 1:
            raise PoolError(
                f"budget_bytes: {budget_bytes:,} holds {num_slots} STATE slots ({state_bytes:,} bytes) but no "
                f"PAGE of {geometry.page_bytes:,} bytes (allowed: >= {state_bytes + geometry.page_bytes:,}, "
                "or fewer slots)"
            )
        if max_num_pages is not None:
            num_pages = min(num_pages, max_num_pages)
        return cls(num_pages=num_pages, num_slots=num_slots)

    def nbytes(self, geometry: V41PoolGeometry) -> int:
        return self.num_pages * geometry.page_bytes + self.num_slots * geometry.state_bytes


class V41Pools:
    """The PAGE and STATE storage of one device.

    ``page_rows`` ``[num_pages, page_bytes]`` and ``state_rows`` ``[num_slots,
    state_bytes]`` are the raw byte rows; ``image_rows`` is the checkpointed prefix of
    every STATE row. Each plane view has the PAGE (or slot) index first, then the
    plane's shape, e.g. ``main_kv(owner)[page, row, dim]``. All views alias
    ``buffer``: a write through any of them is a write to the bytes the others see.
    A fresh pool is all zeros with every slot in the reset state.
    """

    def __init__(self, geometry: V41PoolGeometry, size: PoolSize, device: torch.device | str = "cpu") -> None:
        self.geometry = geometry
        self.size = size
        self.device = torch.device(device)
        self.buffer = torch.zeros(size.nbytes(geometry), dtype=torch.uint8, device=self.device)
        page_region = size.num_pages * geometry.page_bytes
        self.page_rows = self.buffer[:page_region].view(size.num_pages, geometry.page_bytes)
        self.state_rows = self.buffer[page_region:].view(size.num_slots, geometry.state_bytes)
        self.image_rows = self.state_rows[:, : geometry.image_bytes]
        self._views = {
            (p.kind, p.key): self._typed_view(p) for p in geometry.page_planes + geometry.state_planes
        }
        self.cursor[:, CURSOR_POSITION + 1 :] = DEAD_ENGRAM_ID

    @property
    def num_pages(self) -> int:
        return self.size.num_pages

    @property
    def num_slots(self) -> int:
        return self.size.num_slots

    def _typed_view(self, plane: PlaneSpec) -> torch.Tensor:
        rows = self.page_rows if plane.region is Region.PAGE else self.state_rows
        flat = rows[:, plane.offset : plane.end].view(plane.dtype)
        return flat.view(rows.shape[0], *plane.shape)

    def _view(self, kind: PlaneKind, key: int | None) -> torch.Tensor:
        if (kind, key) not in self._views:
            # Raises naming the allowed keys, or saying the plane does not exist here.
            self.geometry.plane(kind, key)
        return self._views[(kind, key)]

    # -- PAGE planes ------------------------------------------------------------------

    def main_kv(self, owner: int) -> torch.Tensor:
        """[num_pages, rows, head_dim] bf16, or [num_pages, rows, head_dim / 2] packed
        NVFP4 bytes under kv_cache_dtype="fp4"."""
        return self._view(PlaneKind.MAIN_KV, owner)

    def main_kv_scales(self, owner: int) -> torch.Tensor:
        """[num_pages, rows, head_dim / 16] E4M3 bytes (kv_cache_dtype="fp4" only)."""
        return self._view(PlaneKind.MAIN_KV_SCALES, owner)

    def index_values(self, owner: int) -> torch.Tensor:
        """[num_pages, rows, index_head_dim] E4M3 bytes (fp8), or [.., index_head_dim / 2]
        packed E2M1 bytes (fp4)."""
        return self._view(PlaneKind.INDEX_VALUES, owner)

    def index_scales(self, owner: int) -> torch.Tensor:
        """[num_pages, rows, index_head_dim / 32] E8M0 bytes."""
        return self._view(PlaneKind.INDEX_SCALES, owner)

    # -- STATE planes -----------------------------------------------------------------

    def swa_ring(self, layer: int) -> torch.Tensor:
        """[num_slots, ring_rows, head_dim] bf16, or E4M3 bytes under an FP8 ring."""
        return self._view(PlaneKind.SWA_RING, layer)

    def swa_scales(self, layer: int) -> torch.Tensor:
        """[num_slots, ring_rows, head_dim / 32] E8M0 bytes (FP8 rings only)."""
        return self._view(PlaneKind.SWA_SCALES, layer)

    def compressor_tail(self, owner: int) -> torch.Tensor:
        """[num_slots, tail_rows, 2, head_dim] float32: the pending token's v (0) and g (1)."""
        return self._view(PlaneKind.COMPRESSOR_TAIL, owner)

    @property
    def cursor(self) -> torch.Tensor:
        """[num_slots, 1 + engram_history] int64: committed position, then the last
        compressed Engram ids oldest first (DEAD_ENGRAM_ID where there is none)."""
        return self._view(PlaneKind.CURSOR, None)

    def reset_state(self, slot: int) -> None:
        """Makes ``slot`` a fresh request's STATE: rings and tails zero, position 0,
        Engram history DEAD. Nothing of a previous occupant survives."""
        if not 0 <= slot < self.num_slots:
            raise PoolError(f"slot: {slot} (allowed: 0..{self.num_slots - 1})")
        self.state_rows[slot].zero_()
        self.cursor[slot, CURSOR_POSITION + 1 :] = DEAD_ENGRAM_ID

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """A host copy of whole PAGEs' bytes, uint8 [len(pages), page_bytes] (what an
        offload store keeps of them)."""
        return self.page_rows[self._page_index(pages)].cpu()

    def write_pages(self, pages: Sequence[int], rows: torch.Tensor) -> None:
        """Overwrites whole PAGEs with ``rows`` (uint8 [len(pages), page_bytes])."""
        index = self._page_index(pages)
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (len(pages), self.geometry.page_bytes):
            raise PoolError(
                f"rows: {rows.dtype} {tuple(rows.shape)} (allowed: uint8 [{len(pages)}, {self.geometry.page_bytes}])"
            )
        self.page_rows.index_copy_(0, index, rows.to(self.device))

    def _page_index(self, pages: Sequence[int]) -> torch.Tensor:
        if not pages or min(pages) < 0 or max(pages) >= self.num_pages:
            raise PoolError(f"pages: {list(pages)} (allowed: at least one PAGE id in 0..{self.num_pages - 1})")
        return torch.tensor(list(pages), dtype=torch.long, device=self.device)
