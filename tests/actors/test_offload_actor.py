"""The OffloadActor serves PAGE units through the Ray object store: rows put as a
``ray.put`` reference come back byte for byte from another caller, and a unit of
another layout is refused. Its connector survives the actor's crash: lookups answer
misses at once while Ray restarts it, and reach the restarted store again."""

from __future__ import annotations

import time
from typing import Callable

import pytest
import ray
import torch

from dsv41.actors.offload import OffloadActor, RayOffloadConnector
from dsv41.cache.offload import OffloadError, OffloadKey, UnitKind


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


@ray.remote(num_cpus=0)
def _fetch_elsewhere(connector: RayOffloadConnector, handle: str) -> torch.Tensor:
    return connector.fetch(handle)


def test_connector_pins_units_past_eviction_until_taken(ray_cluster: None) -> None:
    """What a lookup hands out stays fetchable, byte for byte and from another
    worker, even after the store has evicted the unit; a token is taken once and an
    expired one is refused; a published unit is found by a later lookup; an absent key
    looks up as None."""
    actor = ray.remote(OffloadActor).options(num_cpus=0).remote("layout-a", 32, 64)
    connector = RayOffloadConnector(actor, "layout-a")
    g = torch.Generator().manual_seed(1)
    first, second, third = (torch.randint(0, 256, (1, 32), dtype=torch.uint8, generator=g) for _ in range(3))
    keys = [OffloadKey("layout-a", bytes([i + 1]) * 16, UnitKind.PAGE) for i in range(3)]
    connector.publish(keys[0], first)
    connector.publish(keys[1], second)
    ray.get(actor.stats.remote())  # the actor runs calls in order: both puts have landed
    handles = connector.lookup(keys)
    assert handles[2] is None and handles[0] is not None and handles[1] is not None
    connector.publish(keys[2], third)  # a 64-byte budget: evicts the oldest unit
    assert ray.get(actor.contains.remote(keys)) == [False, True, True]
    assert torch.equal(ray.get(_fetch_elsewhere.remote(connector, handles[0])), first)
    with pytest.raises(OffloadError, match="not pinned"):
        connector.fetch(handles[0])
    assert torch.equal(connector.fetch(handles[1]), second)
    assert ray.get(actor.stats.remote())["pinned"] == 0
    ray.kill(actor)

    short = ray.remote(OffloadActor).options(num_cpus=0).remote("layout-a", 32, 64, pin_ttl_s=0.5)
    short_connector = RayOffloadConnector(short, "layout-a")
    short_connector.publish(keys[0], first)
    late = short_connector.lookup([keys[0]])[0]
    time.sleep(1.0)
    with pytest.raises(OffloadError, match="not pinned"):
        short_connector.fetch(late)
    assert torch.equal(ray.get(short.get.remote(keys[0])), first)  # the store itself still holds it
    ray.kill(short)


def test_connector_answers_misses_while_its_store_restarts(ray_cluster: None, sigkill_actor: Callable[[str], int]) -> None:
    """SIGKILL a restartable OffloadActor holding a unit: the next lookup raises
    nothing and answers a miss within the connector's call deadline (the call waits
    for the restart at most that long); the lookups after it answer misses without
    waiting while the store is down; once Ray has restarted the actor (empty) the
    connector reaches it again: a unit published then is found."""
    actor = ray.remote(OffloadActor).options(name="restartable-offload", num_cpus=0, max_restarts=-1).remote("layout-a", 32, 1 << 20)
    connector = RayOffloadConnector(actor, "layout-a", call_timeout_s=1.0)
    rows = torch.randint(0, 256, (1, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    key = OffloadKey("layout-a", b"\x07" * 16, UnitKind.PAGE)
    ray.get(actor.ping.remote())
    connector.publish(key, rows)
    assert connector.lookup([key])[0] is not None and connector.available

    sigkill_actor("restartable-offload")
    started = time.monotonic()
    assert connector.lookup([key]) == [None]
    assert time.monotonic() - started < connector.call_timeout_s + 2.0
    while not connector.available:
        started = time.monotonic()
        assert connector.lookup([key]) == [None]
        assert time.monotonic() - started < 0.5, "a lookup waited for the store while it was down"
        assert time.monotonic() - started < 60, "the store did not come back"
        time.sleep(0.05)
    assert connector.lookup([key]) == [None]  # restarted empty
    connector.publish(key, rows)
    handle = connector.lookup([key])[0]
    assert handle is not None and torch.equal(connector.fetch(handle), rows)
    ray.kill(actor)
