"""Shared fixtures of the cache tests: a small geometry whose STATE image spans two
PAGEs, so image paging is exercised at every size."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from dsv41.cache.geometry import V41PoolGeometry

# Two Full owners (ratio 2 then ratio 1), four target layers, one DSpark stage.
# PAGE: owner 1 (16 rows): 2048 + 512 + 16 -> 2576 aligned; owner 3 (32 rows):
# 4096 + 1024 + 32 = 5152; PAGE = 7728. STATE: 4 rings * 16 * 64 * 2 = 8192, cursor
# 4 * 8 = 32 -> image 8224 (2 PAGEs); owner 1's tail 2 * 64 * 4 = 512 -> 8736.
SMALL_GEOMETRY: dict[str, Any] = dict(
    num_layers=4,
    full_owners=(1, 3),
    owner_ratios=(2, 1),
    window=16,
    head_dim=64,
    index_head_dim=32,
    dspark_layers=(4,),
    engram_history=3,
    block_size=32,
    kv_cache_dtype="bf16",
    index_cache_dtype="fp8",
    num_speculative_tokens=0,
    encoder_replay=True,
)


@pytest.fixture(scope="session")
def make_geometry() -> Callable[..., V41PoolGeometry]:
    """Builds the small geometry with the given fields replaced."""

    def make(**overrides: Any) -> V41PoolGeometry:
        return V41PoolGeometry(**{**SMALL_GEOMETRY, **overrides})

    return make
