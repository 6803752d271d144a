"""The rank's persistent block table (cache/block_table.py) against a list per row.

Property: over any sequence of deltas (keep a row's first PAGEs and append new ones,
clear a row) each row holds exactly the list a plain Python model holds, its width
growing as rows do; a gather of any rows to any width is those lists padded with
NO_ROW (and cut to the width); a delta that keeps more than a row holds is refused.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cache.addressing import NO_ROW
from dsv41.cache.block_table import BlockTable, BlockTableError

ROWS = 5


@st.composite
def deltas(draw: st.DrawFn) -> list[tuple[int, float, list[int]]]:
    """(row, share of its PAGEs kept, new PAGEs) per step."""
    return draw(
        st.lists(
            st.tuples(
                st.integers(0, ROWS - 1),
                st.sampled_from([0.0, 0.5, 1.0, 1.0]),
                st.lists(st.integers(0, 999), max_size=12),
            ),
            max_size=40,
        )
    )


@settings(max_examples=150, deadline=None)
@given(steps=deltas(), gathers=st.lists(st.lists(st.integers(0, ROWS - 1), max_size=ROWS), min_size=1, max_size=3))
def test_rows_follow_their_deltas_and_gathers_are_padded_rows(
    steps: list[tuple[int, float, list[int]]], gathers: list[list[int]]
) -> None:
    """Every delta's row equals the model's after it; gathers equal the padded lists."""
    table = BlockTable(ROWS, width=2)
    model: list[list[int]] = [[] for _ in range(ROWS)]
    for row, share, new in steps:
        kept = int(len(model[row]) * share)
        table.update(row, kept, new)
        model[row] = model[row][:kept] + new
        assert [table.row(r) for r in range(ROWS)] == [tuple(m) for m in model]
        assert all(table.num_pages(r) == len(model[r]) for r in range(ROWS))
        assert table.width >= max(len(m) for m in model)
    for rows in gathers:
        for width in (0, 1, table.width, table.width + 3):
            want = [(model[r] + [NO_ROW] * width)[:width] for r in rows]
            got = table.rows(rows, width)
            assert got.dtype == torch.long and got.shape == (len(rows), width)
            assert got.tolist() == want


def test_clear_empties_a_row_and_overkeeping_is_refused() -> None:
    """A cleared row holds nothing (NO_ROW where its PAGEs were); keeping more PAGEs
    than a row holds raises, naming the row."""
    table = BlockTable(2)
    table.update(1, 0, [4, 5, 6])
    table.clear(1)
    assert table.row(1) == () and table.rows([1], 3).tolist() == [[NO_ROW] * 3]
    with pytest.raises(BlockTableError, match="row 0: keeps 1 of its 0"):
        table.update(0, 1, [2])
