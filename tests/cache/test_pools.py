"""V41Pools: page-major byte layout, typed views aliasing the buffer, reset_state and
sizing from a memory budget."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cache.geometry import DEAD_ENGRAM_ID, GeometryError, PlaneKind, PlaneSpec, Region, V41PoolGeometry
from dsv41.cache.pools import PoolError, PoolSize, V41Pools

MakeGeometry = Callable[..., V41PoolGeometry]

DTYPES = [("bf16", "fp8"), ("fp4", "fp4"), ("bf16", "fp4"), ("fp4", "fp8")]


def _view_of(pools: V41Pools, plane: PlaneSpec) -> torch.Tensor:
    accessors = {
        PlaneKind.MAIN_KV: pools.main_kv,
        PlaneKind.MAIN_KV_SCALES: pools.main_kv_scales,
        PlaneKind.INDEX_VALUES: pools.index_values,
        PlaneKind.INDEX_SCALES: pools.index_scales,
        PlaneKind.SWA_RING: pools.swa_ring,
        PlaneKind.SWA_SCALES: pools.swa_scales,
        PlaneKind.COMPRESSOR_TAIL: pools.compressor_tail,
    }
    return pools.cursor if plane.kind is PlaneKind.CURSOR else accessors[plane.kind](plane.key)


def _random_like(view: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random bytes reinterpreted as the view's dtype (no NaN checks needed: the
    comparison below is on bytes)."""
    nbytes = view[0].numel() * view.element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(view.dtype).view(view.shape[1:])


@pytest.mark.parametrize("dtypes", DTYPES)
def test_writes_through_each_view_land_in_that_units_bytes(
    make_geometry: MakeGeometry, dtypes: tuple[str, str]
) -> None:
    """Writing one unit (PAGE or slot) of any plane's view changes exactly the bytes
    [offset, offset + nbytes) of that unit's row in the one backing buffer, and the
    bytes read back through the raw rows are the bytes written."""
    g = make_geometry(kv_cache_dtype=dtypes[0], index_cache_dtype=dtypes[1])
    pools = V41Pools(g, PoolSize(num_pages=3, num_slots=2))
    generator = torch.Generator().manual_seed(0)
    for plane in g.page_planes + g.state_planes:
        view = _view_of(pools, plane)
        rows = pools.page_rows if plane.region is Region.PAGE else pools.state_rows
        assert tuple(view.shape) == (rows.shape[0], *plane.shape) and view.dtype == plane.dtype
        assert view.untyped_storage().data_ptr() == pools.buffer.untyped_storage().data_ptr()
        unit = rows.shape[0] - 1
        before = pools.buffer.clone()
        value = _random_like(view, generator)
        view[unit] = value
        changed = (pools.buffer != before).nonzero().flatten()
        base = rows[unit].data_ptr() - pools.buffer.data_ptr()
        assert changed.numel() > 0
        assert base + plane.offset <= int(changed.min()) and int(changed.max()) < base + plane.end
        assert torch.equal(rows[unit, plane.offset : plane.end], value.reshape(-1).view(torch.uint8))


def test_regions_are_page_major_and_contiguous(make_geometry: MakeGeometry) -> None:
    """The buffer is [num_pages * page_bytes | num_slots * state_bytes]; each PAGE and
    each STATE entry is one contiguous row, and image_rows is the first image_bytes
    of every entry."""
    g = make_geometry()
    pools = V41Pools(g, PoolSize(num_pages=5, num_slots=3))
    assert pools.buffer.numel() == 5 * g.page_bytes + 3 * g.state_bytes
    assert pools.page_rows.is_contiguous() and pools.state_rows.is_contiguous()
    assert pools.state_rows.data_ptr() == pools.buffer.data_ptr() + 5 * g.page_bytes
    assert tuple(pools.image_rows.shape) == (3, g.image_bytes)
    assert pools.image_rows.data_ptr() == pools.state_rows.data_ptr()


def _scribble(pools: V41Pools, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    pools.buffer.copy_(torch.randint(0, 256, pools.buffer.shape, dtype=torch.uint8, generator=generator))


@pytest.mark.parametrize("dtypes", DTYPES)
def test_reset_state_leaves_nothing_of_the_previous_occupant(
    make_geometry: MakeGeometry, dtypes: tuple[str, str]
) -> None:
    """reset_state(slot) zeroes that slot's rings and tails, sets position 0 and the
    Engram history DEAD, and touches no other byte of the buffer."""
    g = make_geometry(kv_cache_dtype=dtypes[0], index_cache_dtype=dtypes[1])
    pools = V41Pools(g, PoolSize(num_pages=2, num_slots=3))
    _scribble(pools, 1)
    before = pools.buffer.clone()
    pools.reset_state(1)
    expected_cursor = torch.tensor([0] + [DEAD_ENGRAM_ID] * g.engram_history)
    assert torch.equal(pools.cursor[1], expected_cursor)
    for plane in g.state_planes:
        if plane.kind is not PlaneKind.CURSOR:
            assert not _view_of(pools, plane)[1].view(torch.uint8).any()
    pools_rows = pools.state_rows
    for slot in (0, 2):
        offset = pools_rows[slot].data_ptr() - pools.buffer.data_ptr()
        assert torch.equal(pools.buffer[offset : offset + g.state_bytes], before[offset : offset + g.state_bytes])
    assert torch.equal(pools.page_rows.reshape(-1), before[: pools.page_rows.numel()])


def test_fresh_pools_are_zero_with_every_slot_reset(make_geometry: MakeGeometry) -> None:
    """A new pool reads as all zeros except the cursors' DEAD Engram history."""
    pools = V41Pools(make_geometry(), PoolSize(num_pages=2, num_slots=2))
    assert not pools.page_rows.any()
    assert torch.equal(pools.cursor[:, 0], torch.zeros(2, dtype=torch.int64))
    assert bool((pools.cursor[:, 1:] == DEAD_ENGRAM_ID).all())


@settings(max_examples=40, deadline=None)
@given(
    budget_pages=st.integers(1, 50),
    spare=st.integers(0, 7727),
    num_slots=st.integers(1, 4),
    cap=st.one_of(st.none(), st.integers(1, 60)),
)
def test_budget_buys_slots_first_then_whole_pages(
    make_geometry: MakeGeometry, budget_pages: int, spare: int, num_slots: int, cap: int | None
) -> None:
    """from_budget reserves num_slots STATE entries, then takes every whole PAGE the
    rest holds, at most the cap; the result never exceeds the budget."""
    g = make_geometry()
    budget = num_slots * g.state_bytes + budget_pages * g.page_bytes + spare
    size = PoolSize.from_budget(g, budget, num_slots=num_slots, max_num_pages=cap)
    assert size.num_slots == num_slots
    assert size.num_pages == (budget_pages if cap is None else min(cap, budget_pages))
    assert size.nbytes(g) <= budget


def test_budget_without_room_for_a_page_is_refused(make_geometry: MakeGeometry) -> None:
    """A budget that holds the slots but not one PAGE is refused, naming the minimum."""
    g = make_geometry()
    with pytest.raises(PoolError, match="budget_bytes: .* no PAGE"):
        PoolSize.from_budget(g, 2 * g.state_bytes + g.page_bytes - 1, num_slots=2)
    with pytest.raises(PoolError, match="num_pages: 0"):
        PoolSize(num_pages=0, num_slots=1)


def test_missing_planes_are_refused_by_name(make_geometry: MakeGeometry) -> None:
    """Views that do not exist under the geometry are refused naming what exists."""
    pools = V41Pools(make_geometry(), PoolSize(num_pages=1, num_slots=1))
    with pytest.raises(GeometryError, match="swa_scales: no such plane"):
        pools.swa_scales(0)
    with pytest.raises(GeometryError, match="main_kv_scales: no such plane"):
        pools.main_kv_scales(1)
    with pytest.raises(GeometryError, match=r"allowed: \[1, 3\]"):
        pools.main_kv(2)
    with pytest.raises(PoolError, match="slot: 1"):
        pools.reset_state(1)
