"""A step's addresses built over the batch at once (cache/addressing.build_step_addresses:
no loop over segments or rows) equal a per-segment, per-row Python transcription of
the addressing rules, bit for bit, on random steps of prefill chunks, decodes,
verifies, empty segments, prefix-cached groups and replays."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cache.addressing import (
    NO_ROW,
    CompressionPlan,
    EntryTile,
    PoolShape,
    SegmentSpec,
    StepAddresses,
    WindowPlan,
    build_step_addresses,
    staged_tail_row,
)
from dsv41.cluster.cuda_graphs import tensor_leaves

# Where build_step_addresses expands the window's addresses: numpy on the host, torch
# on the CPU, and a GPU where there is one.
WINDOW_DEVICES = (None, "cpu") + (("cuda",) if torch.cuda.is_available() else ())


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def _entry_rows(page_tables: torch.Tensor, segments: list[int], entries: list[int], per_page: int) -> list[int]:
    return [int(page_tables[s, j // per_page]) * per_page + j % per_page for s, j in zip(segments, entries)]


def _reference_plan(
    segments: list[SegmentSpec], page_tables: torch.Tensor, shape: PoolShape, ratio: int
) -> CompressionPlan:
    """The compression plan, group by group and row by row."""
    names = (
        "first", "tails", "second", "pos", "seg", "entry", "tail_rows", "tail_slots", "st_rows", "st_slots", "st_tail"
    )
    out: dict[str, list[int]] = {name: [] for name in names}
    base = 0
    for s, seg in enumerate(segments):
        for j in range(max(seg.start // ratio, seg.write_from // ratio), seg.end // ratio):
            first, last = j * ratio, (j + 1) * ratio - 1
            if last < seg.start:
                continue
            out["first"].append(base + first - seg.start if first >= seg.start else NO_ROW)
            out["tails"].append(NO_ROW if first >= seg.start else seg.slot)
            out["second"].append(base + last - seg.start)
            out["pos"].append(first)
            out["seg"].append(s)
            out["entry"].append(j)
        if ratio == 2 and seg.tentative:
            for pos in range(seg.start + seg.start % 2, seg.end, 2):
                out["st_rows"].append(base + pos - seg.start)
                out["st_slots"].append(seg.slot)
                out["st_tail"].append(staged_tail_row(seg.start, pos))
        elif ratio == 2 and seg.length and seg.end % 2 == 1:
            out["tail_rows"].append(base + seg.end - 1 - seg.start)
            out["tail_slots"].append(seg.slot)
        base += seg.length
    return CompressionPlan(
        ratio=ratio,
        first_rows=_long(out["first"]),
        first_tail_slots=_long(out["tails"]),
        second_rows=_long(out["second"]),
        entry_positions=_long(out["pos"]),
        dst=_long(_entry_rows(page_tables, out["seg"], out["entry"], shape.entries_per_page(ratio))),
        tail_write_rows=_long(out["tail_rows"]),
        tail_write_slots=_long(out["tail_slots"]),
        staged_rows=_long(out["st_rows"]),
        staged_slots=_long(out["st_slots"]),
        staged_tail_rows=_long(out["st_tail"]),
    )


def _reference(
    segments: list[SegmentSpec], page_tables: torch.Tensor, shape: PoolShape, compression: bool
) -> StepAddresses:
    """Every address of the step, one row and one window key at a time."""
    W, ring = shape.window, shape.ring_rows
    positions, row_segments, chunk_rows, ring_rows, valid, write_rows, write_dst = [], [], [], [], [], [], []
    base = 0
    for s, seg in enumerate(segments):
        for pos in range(seg.start, seg.end):
            positions.append(pos)
            row_segments.append(s)
            keys = range(pos - W + 1, pos + 1)
            ok = [k >= seg.window_start and k >= 0 for k in keys]
            valid.append(ok)
            chunk_rows.append([base + k - seg.start if v and k >= seg.start else NO_ROW for k, v in zip(keys, ok)])
            ring_rows.append([seg.slot * ring + k % ring if v and k < seg.start else NO_ROW for k, v in zip(keys, ok)])
            if pos >= seg.end - ring:
                write_rows.append(base + pos - seg.start)
                write_dst.append(seg.slot * ring + pos % ring)
        base += seg.length
    rows = len(positions)
    tiles = {}
    for ratio in shape.ratios:
        per_page = shape.entries_per_page(ratio)
        counts = [seg.end // ratio for seg in segments]
        width = max(counts, default=0)
        tiles[ratio] = dict(
            ratio=ratio, entries_per_page=per_page, width=width, page_tables=page_tables[:, : -(-width // per_page)],
            counts=_long(counts), visible=_long([(p + 1) // ratio for p in positions]),
        )
    return StepAddresses(
        positions=_long(positions),
        row_segments=_long(row_segments),
        window=WindowPlan(
            chunk_rows=_long(chunk_rows).view(rows, W),
            ring_rows=_long(ring_rows).view(rows, W),
            valid=torch.tensor(valid, dtype=torch.bool).view(rows, W),
            write_rows=_long(write_rows),
            write_dst=_long(write_dst),
        ),
        compression={r: _reference_plan(segments, page_tables, shape, r) for r in shape.ratios} if compression else {},
        tiles={r: EntryTile(**fields) for r, fields in tiles.items()},
    )


@st.composite
def _steps(draw: st.DrawFn) -> tuple[list[SegmentSpec], torch.Tensor, PoolShape, bool]:
    block = draw(st.sampled_from([4, 8, 16]))
    window = draw(st.integers(1, 12))
    shape = PoolShape(
        block_size=block, window=window, ring_rows=window + draw(st.integers(0, 4)),
        ratios=tuple(sorted(draw(st.sets(st.sampled_from([1, 2]), min_size=1)))),
    )
    count = draw(st.integers(0, 7))
    slots = draw(st.permutations(range(10)))[:count]
    segments, tables = [], []
    for slot in slots:
        start = draw(st.integers(0, 60))
        length = draw(st.integers(0, 9))
        tentative = draw(st.integers(0, max(length - 1, 0)))
        write_from = draw(st.sampled_from([0, start, start + length, draw(st.integers(0, 70))]))
        window_start = draw(st.sampled_from([0, start, draw(st.integers(0, start))]))
        segments.append(SegmentSpec(slot, start, length, write_from, window_start, tentative))
        need = -(-(start + length) // block)
        tables.append(draw(st.lists(st.integers(0, 500), min_size=need, max_size=need + 2)))
    wide = max((len(t) for t in tables), default=0)
    page_tables = _long([t + [NO_ROW] * (wide - len(t)) for t in tables]).view(count, wide)
    return segments, page_tables, shape, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(step=_steps())
def test_step_addresses_equal_the_per_row_transcription(
    step: tuple[list[SegmentSpec], torch.Tensor, PoolShape, bool],
) -> None:
    """Every tensor of build_step_addresses (same dtype, shape and values) and every
    tile's width equal the per-row transcription's, with and without compression plans,
    with the window's addresses expanded on the host (numpy) and by torch on a device
    (the CPU's; a GPU's too where there is one)."""
    segments, page_tables, shape, compression = step
    want = _reference(segments, page_tables, shape, compression)
    for device in WINDOW_DEVICES:
        got = build_step_addresses(segments, page_tables, shape, compression=compression, device=device)
        assert sorted(got.compression) == sorted(want.compression) and sorted(got.tiles) == sorted(want.tiles)
        assert [t.width for t in got.tiles.values()] == [t.width for t in want.tiles.values()]
        got_leaves, want_leaves = tensor_leaves(got), tensor_leaves(want)
        assert len(got_leaves) == len(want_leaves)
        for a, b in zip(got_leaves, want_leaves):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b)
        for ratio, tile in got.tiles.items():
            assert torch.equal(tile.entry_rows, want.tiles[ratio].entry_rows)
