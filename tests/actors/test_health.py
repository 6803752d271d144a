"""Step transports and the health loop of an engine group.

Properties: GroupOptions refuses every out-of-range field, naming it and the allowed
values. Each transport ("sockets", "compiled", "calls") hands every rank its own packed step and
returns the results in rank order; a rank's exception, a dead rank and a missed
deadline each raise RankGroupFailure promptly (a dead rank well before the deadline).
An idle group whose rank is killed is restarted by its health loop within seconds (a
ping of a dead rank fails at once) without any step being called; the request that was
in flight is handed out, ended with finish_reason "error", by the next step; the group
then serves the in-process Engine's tokens again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray

from dsv41.actors.engine_group import EngineGroup
from dsv41.actors.group import GroupOptions
from dsv41.actors.rank import RankActor
from dsv41.actors.step_wire import pack_step, unpack_result
from dsv41.actors.transport import TRANSPORTS, RankGroupFailure, open_transport
from dsv41.cluster.batch import DPMetadata, ScheduledBatch
from dsv41.cluster.engine import Engine
from dsv41.cluster.options import EngineOptions
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.runner import SampledToken, StepResult
from dsv41.cluster.sampling_params import SamplingParams

STEP_OK, STEP_RAISES, STEP_HANGS = 1, 2, 3
FAULTY_RANK = 1


NUMERIC_FIELDS = ("rank_num_cpus", "step_timeout_s", "start_timeout_s", "health_interval_s")


@pytest.mark.parametrize(
    "field, bad",
    [(f, v) for f in NUMERIC_FIELDS for v in (0, -1.0, "1", True)] + [("transport", "rpc"), ("transport", None)],
)
def test_group_options_name_the_bad_field(field: str, bad: Any) -> None:
    """Every numeric field must be a positive number, transport one of TRANSPORTS."""
    with pytest.raises(ValueError, match=rf"GroupOptions\.{field}: .*allowed"):
        GroupOptions(**{field: bad})


def _echo_rank_class() -> type:
    """A RankActor whose step answers without a model: its batch's step id, and under
    its own name the step id of the metadata every rank shares; at STEP_RAISES /
    STEP_HANGS the FAULTY_RANK raises / sleeps. Defined in a function so that Ray
    ships the class by value to its workers."""

    class EchoRank(RankActor):
        def __init__(self, world: int, rank: int) -> None:
            super().__init__("", EngineOptions(), DPLayout(world), rank)

        def execute(self, batch: ScheduledBatch, metadata_wire: Any) -> StepResult:
            step = DPMetadata.from_wire(metadata_wire).step_id
            if self.rank == FAULTY_RANK and step == STEP_RAISES:
                raise RuntimeError("injected rank failure")
            if self.rank == FAULTY_RANK and step == STEP_HANGS:
                time.sleep(60)
            return StepResult(batch.step_id, {f"rank{self.rank}": SampledToken(step, None)})

    return EchoRank


def _batch_tag(step: int, rank: int) -> int:
    return 100 * step + rank


def _steps(step: int, world: int) -> list[bytes]:
    """Rank i's batch carries the tag (step, i); the metadata says ``step``."""
    batches = tuple(ScheduledBatch(_batch_tag(step, rank)) for rank in range(world))
    metadata = DPMetadata.of(step, batches).to_wire()
    words = metadata.tolist()
    return [pack_step(b, words) for b in batches]


def _each_rank_answered_its_own(results: list[bytes], step: int, world: int) -> bool:
    return [unpack_result(r) for r in results] == [
        StepResult(_batch_tag(step, rank), {f"rank{rank}": SampledToken(step, None)}) for rank in range(world)
    ]


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_transport_results_in_rank_order_and_failures_raise(ray_cluster: None, kind: str) -> None:
    """Each rank gets its own step and the shared metadata, and the results come back
    in rank order, step after step; a rank's exception and a
    missed deadline raise RankGroupFailure (the deadline within seconds of itself, not
    after the hung rank's minute);
    once the hung rank is killed, the next step fails long before its deadline."""
    world = 2
    actor_class = ray.remote(_echo_rank_class()).options(num_cpus=0)
    ranks = [actor_class.remote(world, rank) for rank in range(world)]
    transport = open_transport(kind, "echo", ranks, timeout_s=30)
    try:
        for _ in range(3):  # the first also waits for the workers (and a graph's loops) to start
            results = transport.exchange(_steps(STEP_OK, world), timeout_s=120)
            assert _each_rank_answered_its_own(results, STEP_OK, world)
        with pytest.raises(RankGroupFailure, match="injected rank failure"):
            transport.exchange(_steps(STEP_RAISES, world), timeout_s=30)
        assert _each_rank_answered_its_own(transport.exchange(_steps(STEP_OK, world), timeout_s=30), STEP_OK, world)
        started = time.monotonic()
        with pytest.raises(RankGroupFailure, match="TimeoutError"):
            transport.exchange(_steps(STEP_HANGS, world), timeout_s=1.0)
        assert time.monotonic() - started < 5.0
        ray.kill(ranks[FAULTY_RANK], no_restart=True)
        started = time.monotonic()
        with pytest.raises(RankGroupFailure):
            transport.exchange(_steps(STEP_OK, world), timeout_s=30)
        assert time.monotonic() - started < 10
    finally:
        # As RankGroup after a failure: actors first, so no graph loop is left to wait for.
        for rank in ranks:
            ray.kill(rank, no_restart=True)
        transport.close()


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
OPTIONS = dict(block_size=32, state_transfer="copy", max_num_seqs=4, max_num_batched_tokens=64)
HEALTH_INTERVAL_S = 0.5


def test_idle_group_restarts_itself_after_a_rank_dies(ray_cluster: None, tiny_dir: Path) -> None:
    """Kill the rank of an idle DP1 group (the step-time kill of a DP4 group with its
    process group is test_group's): without any step, the health loop restarts the
    group within seconds (stats show it); the request in flight ends in error
    at the next step; the group then serves the Engine's tokens."""
    prompt = list(range(3, 40))
    want = Engine.from_pretrained(tiny_dir, **OPTIONS).generate([prompt], GREEDY)[0].token_ids
    options = GroupOptions(health_interval_s=HEALTH_INTERVAL_S)
    with EngineGroup(str(tiny_dir), dp=1, group_options=options, name="health", **OPTIONS) as group:
        long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
        group.add_request("doomed", prompt, long)
        group.step()
        assert group.has_unfinished_requests()
        ray.kill(ray.get_actor(group.rank_names()[0]), no_restart=True)
        killed = time.monotonic()
        while group.group_stats()["restarts"] == 0:
            # A dead rank answers a ping at once; the new generation starts in the background.
            assert time.monotonic() - killed < 60 * HEALTH_INTERVAL_S, "the health loop did not restart the group"
            time.sleep(HEALTH_INTERVAL_S / 2)
        stats = group.group_stats()
        assert stats["generation"] == 2 and stats["health_checks"] >= 1
        assert "ActorDiedError" in stats["last_failure"]
        assert group.has_unfinished_requests()  # the ended request's output is still to be handed out
        outputs = group.step()
        assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [("doomed", True, "error")]
        assert not group.has_unfinished_requests()
        assert group.generate([prompt], GREEDY)[0].token_ids == want
