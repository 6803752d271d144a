"""A rank's PAGE table, kept from step to step: one row of PAGE ids per STATE slot.

Owns ``BlockTable`` (vLLM's worker BlockTable): an int64 tensor with a row per
STATE slot, row ``s`` holding the PAGE ids of the request that runs on slot ``s``
(``NO_ROW`` past its count), changed only by what a step's deltas say — keep the
row's first PAGEs and append new ones, or clear it — and read as a gather of the
step's rows (``rows``), the page tables the addressing of that step reads. So a
step costs the rank O(PAGEs added) and one gather, never a rebuild of each table.
Its width grows (doubling) to the longest row it has held.

Must not import: model (other than model.formats), cluster, actors, deploy, ray.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dsv41.cache.addressing import NO_ROW

INITIAL_WIDTH = 16  # PAGEs per row before the first growth (2k tokens at 128 a PAGE)


class BlockTableError(RuntimeError):
    """A delta that does not fit the rows the table holds: a bug upstream, never data."""


class BlockTable:
    """The PAGE ids of each STATE slot's request, on the host."""

    def __init__(self, num_rows: int, width: int = INITIAL_WIDTH) -> None:
        if num_rows < 1 or width < 1:
            raise ValueError(f"BlockTable: {num_rows} rows of width {width} (allowed: both >= 1)")
        self._table = torch.full((num_rows, width), NO_ROW, dtype=torch.long)
        self._counts = [0] * num_rows

    @property
    def num_rows(self) -> int:
        return len(self._counts)

    @property
    def width(self) -> int:
        return self._table.shape[1]

    def num_pages(self, row: int) -> int:
        return self._counts[row]

    def update(self, row: int, kept: int, new_pages: Sequence[int]) -> None:
        """Row ``row`` keeps its first ``kept`` PAGE ids (at most what it holds) and
        gets ``new_pages`` after them."""
        count = self._counts[row]
        if not 0 <= kept <= count:
            raise BlockTableError(f"row {row}: keeps {kept} of its {count} PAGEs (allowed: 0..{count})")
        end = kept + len(new_pages)
        if end > self.width:
            self._grow(end)
        if end < count:
            self._table[row, end:count] = NO_ROW
        if new_pages:
            self._table[row, kept:end] = torch.tensor(new_pages, dtype=torch.long)
        self._counts[row] = end

    def clear(self, row: int) -> None:
        self.update(row, 0, ())

    def rows(self, rows: Sequence[int], num_pages: int) -> torch.Tensor:
        """The first ``num_pages`` PAGE ids of each of ``rows``, as [len(rows),
        num_pages] (NO_ROW past a row's count): a copy, the table stays as it is."""
        index = torch.tensor(rows, dtype=torch.long)
        if num_pages <= self.width:
            return self._table[index, :num_pages]
        pad = torch.full((len(rows), num_pages - self.width), NO_ROW, dtype=torch.long)
        return torch.cat((self._table[index], pad), dim=1)

    def row(self, row: int) -> tuple[int, ...]:
        """Row ``row``'s PAGE ids (a Python copy: for checks, not the step's path)."""
        return tuple(self._table[row, : self._counts[row]].tolist())

    def _grow(self, width: int) -> None:
        grown = torch.full((self.num_rows, max(width, 2 * self.width)), NO_ROW, dtype=torch.long)
        grown[:, : self.width] = self._table
        self._table = grown
