"""Checkpoints: STATE images in PAGE units, their contracts one by one (random
sequences with the block manager are in test_cache_state_machine.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import pytest
import torch

from dsv41.cache.block_manager import StateImage
from dsv41.cache.checkpoints import CheckpointError, Checkpoints
from dsv41.cache.geometry import V41PoolGeometry
from dsv41.cache.pools import PoolSize, V41Pools

MakeGeometry = Callable[..., V41PoolGeometry]


def _pools(geometry: V41PoolGeometry, num_pages: int = 8) -> tuple[V41Pools, Checkpoints]:
    pools = V41Pools(geometry, PoolSize(num_pages=num_pages, num_slots=3))
    return pools, Checkpoints(pools)


def _fill_state(pools: V41Pools, slot: int, seed: int, position: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    pools.state_rows[slot] = torch.randint(0, 256, pools.state_rows[slot].shape, dtype=torch.uint8, generator=generator)
    pools.cursor[slot, 0] = position


def _image(geometry: V41PoolGeometry, pages: tuple[int, ...], num_tokens: int) -> StateImage:
    return StateImage(
        layout_id=geometry.layout_id, pages=pages, image_bytes=geometry.image_bytes, num_tokens=num_tokens
    )


@pytest.mark.parametrize("dtypes", [("bf16", "fp8"), ("fp4", "fp4")])
def test_store_then_restore_moves_the_image_region_only(make_geometry: MakeGeometry, dtypes: tuple[str, str]) -> None:
    """An image fills ceil(image_bytes / page_bytes) PAGEs (the last one's spare bytes
    zeroed); restoring it into another slot makes that slot's rings and cursor the
    stored bytes, keeps that slot's own compressor tails and touches no other slot."""
    g = make_geometry(kv_cache_dtype=dtypes[0], index_cache_dtype=dtypes[1])
    pools, checkpoints = _pools(g)
    pools.page_rows.fill_(0xAB)
    _fill_state(pools, 0, seed=1, position=64)
    _fill_state(pools, 1, seed=2, position=96)
    _fill_state(pools, 2, seed=3, position=7)
    stored = pools.image_rows[0].clone()
    assert g.image_pages == -(-g.image_bytes // g.page_bytes) == 2
    image = _image(g, (5, 2), num_tokens=64)
    checkpoints.store(0, image)
    assert torch.equal(pools.page_rows[[5, 2]].reshape(-1)[: g.image_bytes], stored)
    assert not pools.page_rows[2, g.image_bytes - g.page_bytes :].any()
    tails, other = pools.state_rows[1, g.image_bytes :].clone(), pools.state_rows[2].clone()
    checkpoints.restore(image, 1)
    assert torch.equal(pools.image_rows[1], stored)
    assert torch.equal(pools.state_rows[1, g.image_bytes :], tails)
    assert torch.equal(pools.state_rows[2], other)


def test_an_image_of_another_layout_is_refused(make_geometry: MakeGeometry) -> None:
    """Restoring (or storing) under an image of another geometry (here: another
    window) is refused naming both layout ids, and changes nothing."""
    g, other = make_geometry(), make_geometry(window=8)
    pools, checkpoints = _pools(g)
    _fill_state(pools, 0, seed=1, position=32)
    foreign = StateImage(layout_id=other.layout_id, pages=(0, 1), image_bytes=g.image_bytes, num_tokens=32)
    before = pools.buffer.clone()
    for attempt in (lambda: checkpoints.restore(foreign, 0), lambda: checkpoints.store(0, foreign)):
        with pytest.raises(CheckpointError) as info:
            attempt()
        assert other.layout_id in str(info.value) and g.layout_id in str(info.value)
    assert torch.equal(pools.buffer, before)


def test_store_refuses_a_boundary_the_slot_has_not_committed(make_geometry: MakeGeometry) -> None:
    """An image names the position it holds: storing a slot whose cursor says another
    position is refused, and restoring from PAGEs that hold no image at the record's
    position (freed and reused) is refused before any slot changes."""
    g = make_geometry()
    pools, checkpoints = _pools(g)
    _fill_state(pools, 0, seed=1, position=30)
    with pytest.raises(CheckpointError, match="committed position is 30"):
        checkpoints.store(0, _image(g, (0, 1), num_tokens=32))
    checkpoints.store(0, _image(g, (0, 1), num_tokens=30))
    pools.page_rows[1].zero_()  # another owner overwrote the PAGE holding the cursor
    before = pools.buffer.clone()
    with pytest.raises(CheckpointError, match="position 0, not 30"):
        checkpoints.restore(_image(g, (0, 1), num_tokens=30), 2)
    assert torch.equal(pools.buffer, before)


def test_fork_and_relocate_keep_the_bytes(make_geometry: MakeGeometry) -> None:
    """fork restores one image into several slots; relocate copies it to other PAGEs
    and returns the record naming them, refusing PAGEs that overlap its own."""
    g = make_geometry()
    pools, checkpoints = _pools(g)
    _fill_state(pools, 0, seed=5, position=32)
    stored = pools.image_rows[0].clone()
    image = _image(g, (0, 1), num_tokens=32)
    checkpoints.store(0, image)
    moved = checkpoints.relocate(image, [6, 3])
    assert moved == replace(image, pages=(6, 3))
    pools.page_rows[[0, 1]] = 0
    checkpoints.fork(moved, [1, 2])
    assert torch.equal(pools.image_rows[1], stored) and torch.equal(pools.image_rows[2], stored)
    with pytest.raises(CheckpointError, match="repeats a slot"):
        checkpoints.fork(moved, [1, 1])
    with pytest.raises(CheckpointError, match="overlap"):
        checkpoints.relocate(moved, [3, 4])


def test_records_that_do_not_fit_the_pools_are_refused(make_geometry: MakeGeometry) -> None:
    """An image with the wrong byte count, PAGE count or PAGEs outside the pool, and a
    slot outside the pool, are refused."""
    g = make_geometry()
    pools, checkpoints = _pools(g, num_pages=4)
    cases = [
        (replace(_image(g, (0, 1), 0), image_bytes=g.image_bytes - 16), "bytes in"),
        (_image(g, (0, 1, 2), 0), "in 3 PAGEs"),
        (_image(g, (0, 4), 0), "PAGE 4 outside"),
    ]
    for image, message in cases:
        with pytest.raises(CheckpointError, match=message):
            checkpoints.restore(image, 0)
    with pytest.raises(CheckpointError, match="slot: 3"):
        checkpoints.store(3, _image(g, (0, 1), 0))
