"""What a rank keeps of the requests it runs from one step to the next.

Owns ``PersistentBatch`` (the part of vLLM's persistent InputBatch this runtime needs):
per request running on the rank, the ``NewRequestData`` its first segment brought
(sampling parameters, seed) and its STATE slot, and the rank's ``BlockTable``
(cache/block_table.py), whose row for that slot holds the request's PAGE ids. Each
ScheduledBatch updates it (``update``): the requests that left the rank are dropped
first, their rows cleared, then each segment's PAGE delta lands in its row (a new
request's whole table; a running one's PAGEs appended past those it keeps). A step's
page tables are then a gather of its segments' rows (``page_tables``). A batch that
does not follow what the rank holds (a cached segment of a request it does not hold,
a new one on a slot another holds) is refused: the scheduler and the rank disagree.

Must not import: model, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from dsv41.cache.block_table import BlockTable
from dsv41.cluster.batch import NewRequestData, ScheduledBatch, ScheduledSegment


class StepInputError(RuntimeError):
    """A batch whose deltas do not follow what the rank holds; the message says how."""


@dataclass(frozen=True)
class _Held:
    slot: int
    data: NewRequestData


class PersistentBatch:
    """The requests a rank runs, their data and their PAGE tables, between steps."""

    def __init__(self, num_slots: int) -> None:
        self.block_table = BlockTable(num_slots)
        self._held: dict[str, _Held] = {}
        self._slot_owners: list[str | None] = [None] * num_slots

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    @property
    def request_ids(self) -> frozenset[str]:
        return frozenset(self._held)

    def update(self, batch: ScheduledBatch) -> None:
        """Applies ``batch``'s deltas: its releases, then each segment's data and PAGEs."""
        self.release(batch.released_request_ids)
        for seg in batch.segments:
            held = self._held.get(seg.request_id)
            if seg.new_request is not None:
                owner = self._slot_owners[seg.slot]
                if held is not None or owner is not None:
                    raise StepInputError(
                        f"step {batch.step_id}: {seg.request_id!r} arrives new on slot {seg.slot}, but the rank holds "
                        f"{'it' if held is not None else repr(owner)} there"
                    )
                self._held[seg.request_id] = _Held(seg.slot, seg.new_request)
                self._slot_owners[seg.slot] = seg.request_id
            elif held is None or held.slot != seg.slot:
                where = "nothing of it" if held is None else f"it on slot {held.slot}"
                raise StepInputError(
                    f"step {batch.step_id}: {seg.request_id!r} on slot {seg.slot} comes as running, but the rank "
                    f"holds {where}"
                )
            self.block_table.update(seg.slot, seg.kept_pages, seg.new_pages)

    def release(self, request_ids: Iterable[str]) -> None:
        """Drops requests that left the rank, clearing their rows."""
        for request_id in request_ids:
            held = self._held.pop(request_id, None)
            if held is None:
                raise StepInputError(f"release of {request_id!r}: the rank holds nothing of it")
            self._slot_owners[held.slot] = None
            self.block_table.clear(held.slot)

    def data(self, request_id: str) -> NewRequestData:
        return self._held[request_id].data

    def pages(self, request_id: str) -> tuple[int, ...]:
        """The request's PAGE ids as the rank holds them (a copy: for checks)."""
        return self.block_table.row(self._held[request_id].slot)

    def page_tables(self, segments: Sequence[ScheduledSegment], block_size: int) -> torch.Tensor:
        """The step's page tables of ``segments`` [S, P]: their rows, as wide as the
        PAGEs the furthest segment end needs (cache/addressing.build_step_addresses);
        refused when a row lacks a PAGE its segment reaches."""
        needs = [-(-seg.end // block_size) for seg in segments]
        for seg, need in zip(segments, needs):
            held = self.block_table.num_pages(seg.slot)
            if held < need:
                raise StepInputError(
                    f"{seg.request_id!r}: positions up to {seg.end} need {need} PAGEs, the rank holds {held} of it"
                )
        return self.block_table.rows([seg.slot for seg in segments], max(needs, default=0))
