"""A decode step's addresses at a fixed width (cache/addressing.build_decode_addresses):
its own rows are exactly the step's addresses, the shapes depend on the width alone,
and every padding row, group and write names nothing (NO_ROW destinations, no valid
key, an empty tile): what a replayed decode graph relies on."""

from __future__ import annotations

import random

import pytest
import torch

from dsv41.cache.addressing import (
    NO_ROW,
    DecodeWidth,
    PoolShape,
    SegmentSpec,
    build_decode_addresses,
    build_step_addresses,
    decode_pages,
)
from dsv41.cluster.cuda_graphs import tensor_leaves

SHAPE = PoolShape(block_size=32, window=8, ring_rows=8, ratios=(1, 2))


def _decode_segments(rng: random.Random, count: int) -> tuple[list[SegmentSpec], torch.Tensor]:
    """``count`` decode segments on distinct slots and their page tables (NO_ROW past
    each one's PAGEs, as wide as the longest needs)."""
    segments, tables = [], []
    pages = iter(rng.sample(range(200), 200))
    for slot in rng.sample(range(16), count):
        start = rng.randrange(0, 150)
        tables.append([next(pages) for _ in range(-(-(start + 1) // SHAPE.block_size))])
        window_start = rng.choice([0, min(start, rng.randrange(0, 150))])
        segments.append(SegmentSpec(slot, start, 1, write_from=rng.choice([0, start]), window_start=window_start))
    width = max((len(t) for t in tables), default=0)
    page_tables = torch.tensor([t + [NO_ROW] * (width - len(t)) for t in tables], dtype=torch.long).view(count, width)
    return segments, page_tables


@pytest.mark.parametrize("seed", range(20))
def test_own_rows_are_the_steps_and_padding_names_nothing(seed: int) -> None:
    """For random decode steps at random widths: the first n rows, groups and writes of
    the padded addresses equal build_step_addresses' bit for bit; every padding write
    and group has a NO_ROW destination; padding rows see no key and no entry."""
    rng = random.Random(seed)
    n = rng.randrange(0, 6)
    segments, page_tables = _decode_segments(rng, n)
    width = DecodeWidth(requests=n + rng.randrange(0, 4) or 1, pages=decode_pages(segments, SHAPE) + rng.randrange(0, 3))
    own = build_step_addresses(segments, page_tables, SHAPE)
    padded = build_decode_addresses(segments, page_tables, SHAPE, width)
    rows = width.requests
    assert torch.equal(padded.positions[:n], own.positions)
    assert torch.equal(padded.row_segments, torch.arange(rows)), "each row its own segment, padding ones after"
    win, own_win = padded.window, own.window
    for name in ("chunk_rows", "ring_rows", "valid"):
        assert torch.equal(getattr(win, name)[:n], getattr(own_win, name))
    assert not win.valid[n:].any() and (win.chunk_rows[n:] == NO_ROW).all() and (win.ring_rows[n:] == NO_ROW).all()
    written = own_win.write_rows.numel()
    assert torch.equal(win.write_rows[:written], own_win.write_rows)
    assert torch.equal(win.write_dst[:written], own_win.write_dst)
    assert (win.write_dst[written:] == NO_ROW).all()
    for ratio, plan in padded.compression.items():
        mine = own.compression[ratio]
        groups = mine.dst.numel()
        assert torch.equal(plan.dst[:groups], mine.dst) and (plan.dst[groups:] == NO_ROW).all()
        assert torch.equal(plan.second_rows[:groups], mine.second_rows)
        assert torch.equal(plan.first_rows[:groups], mine.first_rows)
        assert torch.equal(plan.first_tail_slots[:groups], mine.first_tail_slots)
        assert (plan.first_rows[groups:] == NO_ROW).all() and (plan.first_tail_slots[groups:] == NO_ROW).all()
        tails = mine.tail_write_slots.numel()
        assert torch.equal(plan.tail_write_slots[:tails], mine.tail_write_slots)
        assert (plan.tail_write_slots[tails:] == NO_ROW).all()
    for ratio, tile in padded.tiles.items():
        mine = own.tiles[ratio]
        assert torch.equal(tile.visible[:n], mine.visible) and (tile.visible[n:] == 0).all()
        assert torch.equal(tile.entry_rows[:n, : mine.width], mine.entry_rows)
        assert (tile.entry_rows[:, mine.width :] == NO_ROW).all() and (tile.entry_rows[n:] == NO_ROW).all()


def test_shapes_depend_on_the_width_alone() -> None:
    """Two decode steps of different batches and contexts at one width have the same
    tensor shapes and dtypes (one graph replays both)."""
    rng = random.Random(7)
    width = DecodeWidth(requests=6, pages=8)
    shapes = set()
    for count in (0, 1, 3, 6):
        padded = build_decode_addresses(*_decode_segments(rng, count), SHAPE, width)
        shapes.add(tuple((tuple(t.shape), t.dtype) for t in tensor_leaves(padded)))
    assert len(shapes) == 1


def test_refuses_what_the_width_cannot_hold() -> None:
    """More requests or PAGEs than the width, or a segment that is not one committed row, is an error naming it."""
    segments = [SegmentSpec(0, 40, 1), SegmentSpec(1, 5, 1)]
    tables = torch.tensor([[1, 2], [3, NO_ROW]])
    with pytest.raises(ValueError, match="width.requests"):
        build_decode_addresses(segments, tables, SHAPE, DecodeWidth(1, 4))
    with pytest.raises(ValueError, match="width.pages"):
        build_decode_addresses(segments, tables, SHAPE, DecodeWidth(2, 1))
    with pytest.raises(ValueError, match="one committed row"):
        build_decode_addresses([SegmentSpec(0, 3, 2)], torch.tensor([[1]]), SHAPE, DecodeWidth(2, 2))
    with pytest.raises(ValueError, match="DecodeWidth.requests"):
        DecodeWidth(0, 1)
