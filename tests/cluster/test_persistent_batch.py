"""The rank's PersistentBatch follows the scheduler's deltas (cluster/persistent_batch.py).

Properties, on every step of random workloads on the real engine and ModelRunner
(tiny model; pools near the largest request so requests are preempted and resumed;
shared prefixes, so admissions hit the prefix cache; aborts at random steps; copy and
replay; DSpark speculation in half the cases, whose verifies grow PAGEs for their
lookahead rows and hand back those only rejected rows reached): after the rank applies
a step's batch it holds exactly the scheduler's running requests; each request the
step runs has, in the rank's block table, exactly the block manager's PAGE table; a
running request the step skips has the block manager's table as a prefix of its row
(a verify's handed-back PAGEs stay in the rank's row until the request's next
segment says how many it keeps), and without speculation exactly that table; once
every request has ended, a driver that steps while ``has_unfinished_requests()`` has
left no row held (the release-only step counts as unfinished work). The workloads reach
preemption, prefix hits, aborts and speculative shrinks (counted). And the rank
refuses a batch that does not follow what it holds.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Sequence

import pytest
import torch

from dsv41.cluster.batch import NewRequestData, ScheduledBatch, ScheduledSegment
from dsv41.cluster.engine import Engine
from dsv41.cluster.persistent_batch import PersistentBatch, StepInputError
from dsv41.cluster.ranks import LocalRank
from dsv41.cluster.runner import StepResult
from dsv41.cluster.sampling_params import SamplingParams

BLOCK = 32
NUM_CASES = 6


class _CheckingRank:
    """The engine's one local rank, checked against the engine's scheduler after it
    applies every batch; counts the speculative shrinks the deltas carried."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inner: LocalRank = engine.executor
        self.speculates = bool(engine.options.num_speculative_tokens)
        self.shrinks = 0

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[StepResult]:
        (batch,) = batches
        requests = self.inner.runner.requests
        released = set(batch.released_request_ids)
        for seg in batch.segments:
            if seg.new_request is None and seg.request_id not in released:
                self.shrinks += seg.kept_pages < len(requests.pages(seg.request_id))
        results = self.inner.execute(batches, metadata)
        scheduler, bm = self.engine.scheduler, self.engine.block_manager
        running = {r.request_id for r in scheduler.running}
        assert requests.request_ids == running, (requests.request_ids, running)
        for seg in batch.segments:
            assert requests.pages(seg.request_id) == bm.page_table(seg.request_id), seg.request_id
        for rid in running:
            table, row = bm.page_table(rid), requests.pages(rid)
            assert row[: len(table)] == table and (self.speculates or row == table), (rid, row, table)
        return results

    def restart(self) -> None:
        raise AssertionError("a local rank does not restart")


def _run_case(tiny_dir: Path, seed: int) -> tuple[Engine, _CheckingRank, int]:
    """One random case; returns the engine, its checking rank and the aborts made."""
    rng = random.Random(seed)
    speculate = seed % 2 == 1
    vocab = 512
    shared = [rng.randrange(3, vocab) for _ in range(96)]
    arrivals = []
    for i in range(rng.randint(3, 6)):
        prompt = shared[: rng.randint(BLOCK, 96)] if rng.random() < 0.7 else []
        prompt += [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        abort_at = rng.randint(2, 30) if rng.random() < 0.25 else None
        arrivals.append((rng.randint(0, 20), f"r{i}", prompt, rng.randint(1, 40), abort_at))
    largest = max(-(-(len(p) + n + 6) // BLOCK) for _, _, p, n, _ in arrivals)
    engine = Engine.from_pretrained(
        tiny_dir,
        block_size=BLOCK,
        num_pages=largest + rng.randint(1, 3),
        max_num_seqs=rng.randint(2, 4),
        max_num_batched_tokens=rng.choice((16, 32, 64)),
        state_transfer=rng.choice(("copy", "replay")),
        speculative_method="dspark" if speculate else None,
        decoder_swa_bounded_replay=rng.random() < 0.5,
    )
    rank = _CheckingRank(engine)
    engine.executor = rank
    aborts = step = 0
    last = max(a[0] for a in arrivals)
    while step <= last or engine.has_unfinished_requests():
        for at, rid, prompt, max_tokens, abort_at in arrivals:
            if at == step:
                engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            if abort_at is not None and at + abort_at == step:
                aborts += engine.abort(rid)
        engine.step()
        step += 1
        assert step < 2000, "the workload did not finish"
    requests = rank.inner.runner.requests
    table = requests.block_table
    assert len(requests) == 0 and all(table.num_pages(r) == 0 for r in range(table.num_rows))
    return engine, rank, aborts


def test_the_rank_tables_follow_the_block_manager_on_every_step(tiny_dir: Path) -> None:
    """See the module docstring; across the cases every path a table can take is taken."""
    preemptions = hits = aborts = shrinks = 0
    for seed in range(NUM_CASES):
        engine, rank, aborted = _run_case(tiny_dir, seed)
        preemptions += engine.scheduler.num_preemptions
        hits += engine.block_manager.stats().hits
        aborts += aborted
        shrinks += rank.shrinks
    assert preemptions and hits and aborts and shrinks, (preemptions, hits, aborts, shrinks)


def _segment(request_id: str, slot: int, *, new: bool, kept: int = 0) -> ScheduledSegment:
    return ScheduledSegment(
        request_id=request_id, slot=slot, start=0, token_ids=(5,), write_from=0, window_start=0, sample=True,
        output_index=0, num_prompt_tokens=1, new_pages=(3,), kept_pages=kept,
        new_request=NewRequestData(SamplingParams(), 0) if new else None,
    )


def _holding_a() -> PersistentBatch:
    """A rank of two slots holding request "a" on slot 0."""
    requests = PersistentBatch(num_slots=2)
    requests.update(ScheduledBatch(1, (_segment("a", 0, new=True),)))
    return requests


def test_a_batch_that_does_not_follow_what_the_rank_holds_is_refused() -> None:
    """A running segment of a request the rank does not hold (or holds on another
    slot), a new request on a slot another holds or under an id it holds, and the
    release of a request it does not hold each raise, naming the request, and so do the
    page tables of a segment reaching past the PAGEs its row holds; a release and a new
    request of the same id and slot in one batch are applied in that order."""
    cases = [
        (ScheduledBatch(2, (_segment("b", 1, new=False),)), "'b' on slot 1 comes as running"),
        (ScheduledBatch(2, (_segment("a", 1, new=False, kept=1),)), "holds it on slot 0"),
        (ScheduledBatch(2, (_segment("b", 0, new=True),)), "'b' arrives new on slot 0"),
        (ScheduledBatch(2, (_segment("a", 1, new=True),)), "'a' arrives new on slot 1"),
        (ScheduledBatch(2, released_request_ids=("c",)), "release of 'c'"),
    ]
    for batch, message in cases:
        with pytest.raises(StepInputError, match=message):
            _holding_a().update(batch)
    requests = _holding_a()
    beyond = dataclasses.replace(_segment("a", 0, new=False, kept=1), start=BLOCK, new_pages=())
    with pytest.raises(StepInputError, match="'a': positions up to 33 need 2 PAGEs, the rank holds 1"):
        requests.page_tables((beyond,), BLOCK)
    requests.update(ScheduledBatch(2, (_segment("a", 0, new=True),), released_request_ids=("a",)))
    assert requests.request_ids == {"a"} and requests.pages("a") == (3,)
    assert requests.page_tables((_segment("a", 0, new=False, kept=1),), BLOCK).tolist() == [[3]]
