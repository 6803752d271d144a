"""The OffloadActor serves PAGE units through the Ray object store: rows put as a
``ray.put`` reference come back byte for byte from another caller, and a unit of
another layout is refused."""

from __future__ import annotations

import pytest
import ray
import torch

from actors.offload import OffloadActor
from cache.offload import OffloadError, OffloadKey, UnitKind


def test_offload_actor_round_trips_and_refuses_other_layouts(ray_cluster: None) -> None:
    """get(key) after put(key, ray.put(rows)) returns rows; another layout raises."""
    actor = ray.remote(OffloadActor).options(num_cpus=0).remote("layout-a", 32, 1 << 20)
    rows = torch.randint(0, 256, (3, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    key = OffloadKey("layout-a", b"\x01" * 16, UnitKind.IMAGE)
    ray.get(actor.put.remote(key, ray.put(rows)))
    assert torch.equal(ray.get(actor.get.remote(key)), rows)
    assert ray.get(actor.contains.remote([key, OffloadKey("layout-a", b"\x02", UnitKind.PAGE)])) == [True, False]
    with pytest.raises(OffloadError, match="layout_id"):
        ray.get(actor.get.remote(OffloadKey("layout-b", b"\x01" * 16, UnitKind.IMAGE)))
    assert ray.get(actor.stats.remote())["hits"] == 1
    ray.kill(actor)
