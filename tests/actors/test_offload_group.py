"""An engine group's OffloadActor: a prefix evicted from a rank's pools, asked again,
restores from the actor (counted in the ranks' fetched_pages, the metric
``dsv41:offload_fetched_pages_total``) and the request gets the tokens of its
uninterrupted run (under ``copy`` every resume is exact)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import ray

from dsv41.actors.engine_group import EngineGroup
from dsv41.actors.group import GroupOptions
from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# 12 PAGEs of 32 tokens: a second and third prompt of 4 PAGEs each push the first one's
# cached PAGEs (and their images) out of the rank's pools.
OPTIONS = dict(block_size=32, state_transfer="copy", max_num_seqs=2, max_num_batched_tokens=64, num_pages=12)


def _wait_for_puts(group: EngineGroup, count: int, timeout_s: float = 30.0) -> None:
    """Publications are fire-and-forget: wait until the actor has stored them."""
    deadline = time.monotonic() + timeout_s
    while group.group_stats()["offload"]["puts"] < count:
        assert time.monotonic() < deadline, f"offload actor got {group.group_stats()['offload']} puts"
        time.sleep(0.2)


def test_evicted_prefix_restores_from_the_offload_actor(ray_cluster: None, tiny_dir: Path) -> None:
    """Three 3.2-PAGE prompts through a one-rank group whose pools hold about one of
    them: the first prompt, asked again after the other two evicted it, is served from
    PAGEs and an image fetched from the OffloadActor, with the tokens of the first
    prompt's uninterrupted run."""
    rng = random.Random(3)
    engine = Engine.from_pretrained(tiny_dir, **OPTIONS)
    vocab = engine.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(3 * 32 + 7)] for _ in range(3)]
    expected = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]

    compiled = GroupOptions(rank_num_cpus=0.5, step_timeout_s=20.0, transport="compiled")
    with EngineGroup(tiny_dir, dp=1, group_options=compiled, offload_host_bytes=64 << 20, **OPTIONS) as group:
        for prompt, tokens in zip(prompts, expected):
            assert group.generate([prompt], GREEDY)[0].token_ids == tokens
        _wait_for_puts(group, 3 * 3)  # three full PAGEs per prompt at least
        assert group.stats().ranks[0].evictions > 0
        again = group.generate([prompts[0]], GREEDY)[0]
        stats = group.stats().ranks[0]
        assert again.token_ids == expected[0]
        assert stats.fetched_pages == 3 and stats.fetched_images == 1
        assert group.group_stats()["offload"]["hits"] >= 4
    assert not ray.util.list_named_actors() or all(
        "offload" not in name for name in ray.util.list_named_actors()
    )
