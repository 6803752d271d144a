"""Engine groups on Ray actors: a SchedulerActor driving RankActors joined by gloo.

Properties: a DP group generates exactly the greedy tokens of the in-process one-rank
Engine (fp32, ignore_eos) for a staggered batch in which ranks prefill, decode and
idle (pad) at different steps; killing a rank mid-generation ends every in-flight
request with finish_reason "error" within 30 s, the group restarts and serves the
same tokens again, and no PAGE stays referenced. TINY's moe_intermediate_size is 64,
so TP experts split at most 2 ways (32-column FP4 scale groups): TP is tested at DP2,
EP at DP4. Each runs one step transport: DP2 one Ray call per rank ("calls"), DP4 the
sockets (the default), whose kill-and-recover path is the one served.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import ray

from dsv41.actors.engine_group import EngineGroup
from dsv41.actors.group import GroupOptions
from dsv41.cluster.engine import Engine
from dsv41.cluster.options import EngineError
from dsv41.cluster.request import CumulativeOutputs
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.deploy.async_engine import AsyncEngine
from dsv41.deploy.metrics import ServingMetrics

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = dict(block_size=32, state_transfer="copy", max_num_seqs=4, max_num_batched_tokens=64)
GROUP = GroupOptions(rank_num_cpus=0.5, step_timeout_s=20.0)
CALLS = GroupOptions(rank_num_cpus=0.5, step_timeout_s=20.0, transport="calls")


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 7, 70, 3, 25, 33)]


@pytest.fixture(scope="module")
def expected(tiny_dir: Path) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    engine = Engine.from_pretrained(tiny_dir, **OPTIONS)
    prompts = _prompts(engine.config.vocab_size)
    return prompts, [o.token_ids for o in engine.generate(prompts, GREEDY)]


def _staggered(group: EngineGroup, prompts: list[list[int]], tag: str) -> list[tuple[int, ...]]:
    """One request at first, one more after each step: early steps leave ranks idle."""
    got: dict[str, tuple[int, ...]] = {}
    whole = CumulativeOutputs()
    step = 0
    while step < len(prompts) or group.has_unfinished_requests():
        if step < len(prompts):
            group.add_request(f"{tag}{step}", prompts[step], GREEDY)
        for out in group.step():
            cumulative = whole.add(out)
            if out.finished:
                assert out.finish_reason == "length", out
                got[out.request_id] = cumulative.token_ids
        step += 1
    return [got[f"{tag}{i}"] for i in range(len(prompts))]


def _no_page_held(group: EngineGroup) -> bool:
    return all(r["requests"] == 0 and r["pages_used"] == r["image_pages"] for r in group.group_stats()["ranks"])


def test_the_group_refuses_what_its_wires_cannot_carry(tiny_dir: Path) -> None:
    """Speculation (the step and result wires carry no drafts) and async scheduling (a
    rank actor runs each step to its result; no step is in flight on the wire) are
    refused when the group is made, before any actor starts, each error naming the
    option."""
    with pytest.raises(EngineError, match="speculative_method: 'dspark' on the Ray engine group"):
        EngineGroup(tiny_dir, dp=2, speculative_method="dspark")
    with pytest.raises(EngineError, match="async_scheduling: True on the Ray engine group"):
        EngineGroup(tiny_dir, dp=2, async_scheduling=True)


def test_dp2_tp_experts_give_the_engines_tokens(ray_cluster: None, tiny_dir: Path, expected) -> None:
    """DP2 with every expert's intermediate dim split over the two ranks, one Ray
    call per rank per step."""
    prompts, want = expected
    with EngineGroup(str(tiny_dir), dp=2, expert_mode="tp", group_options=CALLS, name="tp2", **OPTIONS) as group:
        assert group.group_stats()["transport"] == "calls"
        assert _staggered(group, prompts, "a") == want
        assert _no_page_held(group)
        assert _serves_through_the_async_engine(group, prompts[0]) == want[0]
        stats = group.stats()
        assert len(stats.ranks) == 2 and stats.requests_running == stats.requests_waiting == 0


def _serves_through_the_async_engine(group: EngineGroup, prompt: list[int]) -> tuple[int, ...]:
    """What a Serve replica does with a group: the AsyncEngine's step loop over it."""
    assert group.config.vocab_size == group.tokenizer.get_vocab_size() and group.max_model_len > len(prompt)
    serving = AsyncEngine(group, ServingMetrics("tiny", max_model_len=group.max_model_len))

    async def last_output():
        whole = CumulativeOutputs()
        final = None
        async for delta in serving.generate("served", prompt, GREEDY):
            final = whole.add(delta)
        return final

    try:
        return asyncio.run(last_output()).token_ids
    finally:
        serving.shutdown()


def test_dp4_ep_tokens_and_rank_failure_recovery(ray_cluster: None, tiny_dir: Path, expected) -> None:
    """DP4 with two whole experts per rank gives the Engine's tokens; then a rank is
    killed mid-generation: the in-flight requests end in error within 30 s, the
    group restarts and serves the same tokens, no PAGE held."""
    prompts, want = expected
    with EngineGroup(str(tiny_dir), dp=4, expert_mode="ep", group_options=GROUP, name="ep4", **OPTIONS) as group:
        assert group.group_stats()["transport"] == "sockets"
        assert _staggered(group, prompts, "a") == want
        for i, prompt in enumerate(prompts[:4]):
            group.add_request(f"doomed{i}", prompt, GREEDY)
        group.step()
        ray.kill(ray.get_actor(group.rank_names()[2]), no_restart=True)
        started = time.monotonic()
        ended = {}
        while len(ended) < 4:
            for out in group.step():
                if out.finished:
                    ended[out.request_id] = out.finish_reason
            assert time.monotonic() - started < 30
        assert set(ended.values()) == {"error"}
        assert group.group_stats()["restarts"] == 1
        assert not group.has_unfinished_requests()
        assert _staggered(group, prompts, "b") == want
        assert _no_page_held(group)
