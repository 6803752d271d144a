"""The tiered offload store: what comes back is exactly what was put, the host tier
never holds more than its budget, the least recently used unit leaves first (to disk
when there is a disk tier), and units of another layout are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cache.offload import OffloadError, OffloadKey, TieredStore, UnitKind

PAGE = 16
LAYOUT = "layout-a"


def _key(i: int, kind: UnitKind = UnitKind.PAGE, layout: str = LAYOUT) -> OffloadKey:
    return OffloadKey(layout, i.to_bytes(4, "little"), kind)


def _rows(i: int, n: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


ops = st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 7), st.integers(1, 3)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops, st.booleans())
def test_store_returns_what_was_put_within_budgets(tmp_path_factory: pytest.TempPathFactory, steps, disk: bool) -> None:
    """Against a model of an LRU over host then disk: every get returns the last rows
    put under the key (or None once evicted from the last tier), host bytes stay in
    budget, and with a disk tier nothing small enough is lost."""
    disk_dir = tmp_path_factory.mktemp("offload") if disk else None
    store = TieredStore(LAYOUT, PAGE, 4 * PAGE, disk_dir=disk_dir, disk_budget_bytes=64 * PAGE if disk else 0)
    latest: dict[int, torch.Tensor] = {}
    for op, i, n in steps:
        # Even ids are images (several PAGEs), odd ids single PAGE units.
        key = _key(i, UnitKind.IMAGE if i % 2 == 0 else UnitKind.PAGE)
        if op == "put":
            latest[i] = _rows(len(latest) * 10 + i, n if i % 2 == 0 else 1)
            store.put(key, latest[i])
        else:
            got = store.get(key)
            if got is not None:
                assert torch.equal(got, latest[i])
            elif disk and i in latest:
                pytest.fail("a unit within the disk budget was lost")
        assert store.stats().host_bytes <= 4 * PAGE


def test_least_recently_used_leaves_first() -> None:
    """With room for two PAGEs, touching the first keeps it over the second."""
    store = TieredStore(LAYOUT, PAGE, 2 * PAGE)
    store.put(_key(0), _rows(0))
    store.put(_key(1), _rows(1))
    assert store.get(_key(0)) is not None
    store.put(_key(2), _rows(2))
    assert _key(0) in store and _key(1) not in store and _key(2) in store
    assert store.stats().evictions == 1


def test_disk_tier_serves_what_host_memory_dropped(tmp_path: Path) -> None:
    """An evicted unit comes back from disk byte for byte and counts a disk hit."""
    store = TieredStore(LAYOUT, PAGE, PAGE, disk_dir=tmp_path, disk_budget_bytes=8 * PAGE)
    store.put(_key(0), _rows(0))
    store.put(_key(1), _rows(1))
    assert torch.equal(store.get(_key(0)), _rows(0))
    assert store.stats().disk_hits == 1


def test_other_layouts_and_malformed_units_are_refused() -> None:
    """A key of another layout_id, rows of another PAGE size, or several PAGEs under a
    PAGE key change nothing and raise naming the field."""
    store = TieredStore(LAYOUT, PAGE, 8 * PAGE)
    with pytest.raises(OffloadError, match="layout_id"):
        store.put(_key(0, layout="layout-b"), _rows(0))
    with pytest.raises(OffloadError, match="layout_id"):
        store.get(_key(0, layout="layout-b"))
    with pytest.raises(OffloadError, match="page_bytes"):
        store.put(_key(0), torch.zeros(1, PAGE + 1, dtype=torch.uint8))
    with pytest.raises(OffloadError, match="PAGE unit"):
        store.put(_key(0), _rows(0, 2))
    assert store.stats().puts == 0
