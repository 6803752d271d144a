"""STATE checkpoint images stored in PAGE units.

Owns: moving the image region of a STATE entry (its first ``image_bytes``: the SWA
rings and the cursor) into the ``ceil(image_bytes / page_bytes)`` PAGEs a
``StateImage`` names, and back: ``store`` (slot -> pages), ``restore`` (pages ->
slot), ``fork`` (one image into several slots), ``relocate`` (image -> other pages).
The PAGEs come from the block manager's allocator, which lives with the scheduler;
this class lives with the pools of one rank and moves bytes only.

Images never carry the FP32 compressor tails: CSA2 pools token pairs without overlap
and an image sits on a PAGE boundary, a multiple of every ratio, so the first group a
resumed forward reads is one it writes itself (spec, "Ownership and execution
boundaries"). A restore rewrites the whole image region, so no ring row or Engram id
of the slot's previous occupant survives, and leaves the slot's own tails.

Must not import: anything of this project but ``cache.geometry``, ``cache.pools`` and
``cache.block_manager`` (for the ``StateImage`` record); the scheduler; ray.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from dsv41.cache.block_manager import StateImage
from dsv41.cache.geometry import CURSOR_POSITION, PlaneKind
from dsv41.cache.pools import V41Pools


class CheckpointError(ValueError):
    """An image or slot a checkpoint operation cannot use; the message says why."""


class Checkpoints:
    """Checkpoint images in the PAGEs of one rank's pools."""

    def __init__(self, pools: V41Pools) -> None:
        self._pools = pools
        self._geometry = pools.geometry
        # Byte offset of the committed position (an int64 of the cursor) in an image.
        self._position_offset = self._geometry.plane(PlaneKind.CURSOR).offset + 8 * CURSOR_POSITION

    def store(self, slot: int, image: StateImage) -> None:
        """Writes the slot's image region into ``image.pages``. The slot's committed
        position must be ``image.num_tokens``: an image names the boundary it holds."""
        self._check_image(image)
        self._check_slot(slot)
        position = int(self._pools.cursor[slot, CURSOR_POSITION])
        if position != image.num_tokens:
            raise CheckpointError(
                f"image.num_tokens: {image.num_tokens}, but slot {slot}'s committed position is {position}"
            )
        page_bytes = self._geometry.page_bytes
        data = self._pools.image_rows[slot]
        full, rest = divmod(data.numel(), page_bytes)
        rows = self._pools.page_rows
        if full:
            rows.index_copy_(0, self._index(image.pages[:full]), data[: full * page_bytes].view(full, page_bytes))
        if rest:
            last = image.pages[full]
            rows[last, :rest].copy_(data[full * page_bytes :])
            # Zeroed so an image's PAGEs depend on the image alone, not on what they
            # held before: offload moves whole PAGEs.
            rows[last, rest:].zero_()

    def restore(self, image: StateImage, slot: int) -> None:
        """Overwrites the slot's whole image region (rings + cursor) with ``image``;
        its compressor tails are left for the resumed forward to overwrite."""
        self.fork(image, [slot])

    def fork(self, image: StateImage, slots: Sequence[int]) -> None:
        """Restores one image into each of ``slots`` (distinct). Refuses an image of
        another layout, or PAGEs that no longer hold an image taken at
        ``image.num_tokens``, before changing any slot."""
        self._check_image(image)
        if len(set(slots)) != len(slots):
            raise CheckpointError(f"slots: {list(slots)} repeats a slot")
        for slot in slots:
            self._check_slot(slot)
        data = self._pools.page_rows[self._index(image.pages)].view(-1)[: self._geometry.image_bytes]
        position = int(data[self._position_offset : self._position_offset + 8].view(torch.int64))
        if position != image.num_tokens:
            raise CheckpointError(
                f"image: its PAGEs hold a STATE at position {position}, not {image.num_tokens} "
                "(were they freed and reused?)"
            )
        for slot in slots:
            self._pools.image_rows[slot].copy_(data)

    def relocate(self, image: StateImage, pages: Sequence[int]) -> StateImage:
        """Copies the image to ``pages`` (as many as it has, none of its own) and
        returns the record naming them; handing the old PAGEs back is the caller's."""
        self._check_image(image)
        moved = replace(image, pages=tuple(pages))
        self._check_image(moved)
        if set(moved.pages) & set(image.pages):
            raise CheckpointError(f"pages: {list(pages)} overlap the image's own {list(image.pages)}")
        rows = self._pools.page_rows
        rows.index_copy_(0, self._index(moved.pages), rows[self._index(image.pages)])
        return moved

    # -- internals --------------------------------------------------------------------

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._pools.num_slots:
            raise CheckpointError(f"slot: {slot} (allowed: 0..{self._pools.num_slots - 1})")

    def _check_image(self, image: StateImage) -> None:
        g = self._geometry
        if image.layout_id != g.layout_id:
            raise CheckpointError(
                f"image: layout_id {image.layout_id!r} was stored under another geometry; these pools are "
                f"{g.layout_id!r} (allowed: images of the same layout only)"
            )
        if image.image_bytes != g.image_bytes or len(image.pages) != g.image_pages:
            raise CheckpointError(
                f"image: {image.image_bytes} bytes in {len(image.pages)} PAGEs; this layout's images are "
                f"{g.image_bytes} bytes in {g.image_pages} PAGEs"
            )
        if max(image.pages) >= self._pools.num_pages:
            raise CheckpointError(f"image: PAGE {max(image.pages)} outside 0..{self._pools.num_pages - 1}")

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        return torch.tensor(pages, dtype=torch.long, device=self._pools.device)
