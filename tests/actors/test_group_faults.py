"""Crashes of an engine group's actors other than a rank (a rank's is test_group's and
test_health's), each a SIGKILL of the actor's process by the pid Ray records.

Properties: a killed SchedulerActor takes its ranks and its OffloadActor along (it
owns them), its client's ``check_alive`` fails within seconds, and ``close`` releases
the placement group, so a group that needs every CPU of the cluster starts right
after. A killed OffloadActor costs no request: the group serves the in-process
Engine's tokens throughout (a prefix the store held is recomputed), Ray restarts the
store, and once it is back an evicted prefix is restored from it again. Each test
prints how long its recovery took.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Callable

import pytest
from ray._private import state
from ray.util import placement_group_table

from dsv41.actors.engine_group import EngineGroup
from dsv41.actors.group import GroupOptions, RankGroupDead
from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# The shared module cluster has 4 CPUs: two ranks of 2 CPUs each fill it, so a group
# whose placement group leaked would keep the next one from starting.
WHOLE_CLUSTER = GroupOptions(rank_num_cpus=2.0, start_timeout_s=60.0)
OPTIONS = dict(block_size=32, state_transfer="copy", max_num_seqs=4, max_num_batched_tokens=64)
# 12 PAGEs: three 3.2-PAGE prompts evict the first one's PAGEs from the pools.
OFFLOAD_OPTIONS = dict(OPTIONS, max_num_seqs=2, num_pages=12, offload_host_bytes=64 << 20)
RECOVERY_TIMEOUT_S = 60


def _actor_states(prefix: str) -> dict[str, str]:
    """The GCS state of every actor named ``prefix...`` (the last one of each name)."""
    return {a["Name"]: a["State"] for a in state.actors().values() if a["Name"].startswith(prefix)}


def test_dead_scheduler_fails_the_health_check_and_close_frees_the_cluster(
    ray_cluster: None, tiny_dir: Path, sigkill_actor: Callable[[str], int]
) -> None:
    """SIGKILL the SchedulerActor of a DP2 group that holds every CPU: check_alive
    raises RankGroupDead within seconds, both ranks die with it, close() removes the
    group's placement group, and a second group of the same size starts and serves
    the Engine's tokens."""
    prompt = list(range(3, 40))
    want = Engine.from_pretrained(tiny_dir, **OPTIONS).generate([prompt], GREEDY)[0].token_ids
    group = EngineGroup(str(tiny_dir), dp=2, group_options=WHOLE_CLUSTER, name="doomed", **OPTIONS).__enter__()
    try:
        asyncio.run(group.check_alive())
        assert group.generate([prompt], GREEDY)[0].token_ids == want
        sigkill_actor("doomed-scheduler")
        killed = time.monotonic()
        with pytest.raises(RankGroupDead, match="scheduler cannot serve"):
            asyncio.run(group.check_alive())
        noticed = time.monotonic() - killed
        while set(_actor_states("doomed-").values()) != {"DEAD"}:
            assert time.monotonic() - killed < RECOVERY_TIMEOUT_S, _actor_states("doomed-")
            time.sleep(0.1)
        assert len(_actor_states("doomed-g1-rank")) == 2
    finally:
        group.close()
    assert [pg["state"] for pg in placement_group_table().values() if pg["name"] == "doomed-ranks"] == ["REMOVED"]
    with EngineGroup(str(tiny_dir), dp=2, group_options=WHOLE_CLUSTER, name="successor", **OPTIONS) as successor:
        assert successor.generate([prompt], GREEDY)[0].token_ids == want
    print(f"\nscheduler SIGKILL: check_alive failed after {noticed:.2f} s; a new group served after "
          f"{time.monotonic() - killed:.1f} s")


def _wait_for_puts(group: EngineGroup, count: int) -> None:
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while (group.group_stats()["offload"] or {"puts": 0})["puts"] < count:
        assert time.monotonic() < deadline, f"offload store: {group.group_stats()['offload']}"
        time.sleep(0.2)


def test_dead_offload_actor_costs_recomputation_then_serves_again(
    ray_cluster: None, tiny_dir: Path, sigkill_actor: Callable[[str], int]
) -> None:
    """A one-rank group whose pools hold about one of three prompts: the first prompt,
    evicted and published, would be restored from the store; SIGKILL the store and ask
    it again: it is recomputed (no PAGE fetched) with the tokens of its uninterrupted
    run, and so is every prompt while the store is down. Ray restarts the store
    (empty); once it answers, the first prompt's PAGEs are published again, evicted,
    and the next ask restores them from it with the same tokens."""
    rng = random.Random(3)
    engine = Engine.from_pretrained(tiny_dir, **OFFLOAD_OPTIONS)
    vocab = engine.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(3 * 32 + 7)] for _ in range(3)]
    expected = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]

    def run_all() -> None:
        for prompt, tokens in zip(prompts, expected):
            assert group.generate([prompt], GREEDY)[0].token_ids == tokens

    with EngineGroup(tiny_dir, dp=1, name="offloaded", **OFFLOAD_OPTIONS) as group:
        run_all()
        _wait_for_puts(group, 3 * 3)
        sigkill_actor("offloaded-offload")
        killed = time.monotonic()
        assert group.generate([prompts[0]], GREEDY)[0].token_ids == expected[0]
        first_after = time.monotonic() - killed
        assert group.stats().ranks[0].fetched_pages == 0
        while group.group_stats()["offload"] is None:
            assert time.monotonic() - killed < RECOVERY_TIMEOUT_S, "the offload store did not come back"
            run_all()
        back = time.monotonic() - killed
        run_all()
        _wait_for_puts(group, 3 * 3)
        run_all()
        assert group.generate([prompts[0]], GREEDY)[0].token_ids == expected[0]
        assert group.stats().ranks[0].fetched_pages >= 3
        assert group.group_stats()["generation"] == 1  # no rank ever failed
    print(f"\noffload SIGKILL: the next request took {first_after:.2f} s (recomputed); the store answered again "
          f"after {back:.1f} s")
