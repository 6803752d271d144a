"""Liveness of the real engine under pool pressure (tiny models, fp32 on CPU).

The property (DESIGN.md, "Liveness"): a workload whose every request fits the empty
pools alone always finishes. Checked on every step of random workloads (pools near
the largest request, block sizes 32 and 64, copy and replay, prefix caching on and
off, an offload store, shared prefixes, late arrivals, aborts at random steps,
n > 1): while anything is unfinished a batch runs (at most one idle step, after a
step that preempted everything), the block manager's invariants hold and the
requests it holds are the running ones, which are exactly the requests the rank
holds, each with the block manager's PAGE table in its row of the rank's table
(cluster/persistent_batch.py, built from the step deltas alone); once the workload is
done and the cache is evicted, every PAGE, slot and image is free, and the rank holds
no request after the next step; and every finished request has the tokens of its solo
run.

Which solo run: the same request alone in a fresh engine of the same state transfer
and block size, cold (one prefill chunk, prefix caching off, so no sample of n > 1
resumes from another's PAGEs). Under copy every finished request must equal it
exactly: a resumed request restores an exact image or recomputes its windows from 0
over exact cached KV. Under replay a request that resumed at a prefix hit
legitimately gets other logits (its rebuilt windows start at the replay start: the
spec's accuracy note), so only the requests none of whose forwards read a cached
PAGE (write_from 0 in every segment) are compared; the others are held to liveness
and the invariants alone.

The engines run in the batch-invariant mode (the CPU default), so equal means equal:
no tolerance for a greedy pick that flips at a near tie.

A second property test runs the same engine over a simulated rank (``_SimulatedRank``)
for many more workloads than the model could run in time: PAGE rows, STATE images,
slots and offloaded units hold ids of the token prefixes they were computed from, and
every forward checks what it reads, through the PAGE table its PersistentBatch keeps
from the step deltas (the real one). So a PAGE handed to two owners, an image reclaimed
while a restore still needs it, a hit resumed from the wrong rows, a fetch of the wrong
unit or a PAGE delta lost fails there, and the sampled token is a function of the
checked prefix.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from dsv41.cluster.batch import ScheduledBatch, ScheduledSegment
from dsv41.cluster.engine import Engine
from dsv41.cluster.options import EngineError, RankLayout, engine_options
from dsv41.cluster.persistent_batch import PersistentBatch
from dsv41.cluster.ranks import DPLayout, DPStepExecutor, LocalRank
from dsv41.cluster.request import CumulativeOutputs
from dsv41.cluster.runner import LaunchedStep, SampledToken, StepResult
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.config import V41Config
from dsv41.model.params import ModelParams
from dsv41.model.source import ModelSource
from dsv41.model.tiny import TINY_ALT, make_tiny

# The checkpoint of issue 13: twelve layers, window 64 (a STATE image of 8 PAGEs of 32).
WINDOW64 = dataclasses.replace(TINY_ALT, sliding_window=64)
Model = tuple[ModelParams, Tokenizer]


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path) -> Model:
    return ModelSource.parse(tiny_dir).load_params(dtype=torch.float32)


@pytest.fixture(scope="module")
def window64_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = make_tiny(tmp_path_factory.mktemp("window64"), spec=WINDOW64)
    return ModelSource.parse(path).load_params(dtype=torch.float32)


@dataclass(frozen=True)
class _Arrival:
    step: int
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    abort_at: int | None  # the step it is aborted at (None: it runs to its end)

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, n=self.n, ignore_eos=True)


class _Recorder:
    """The engine's executor, counting the batches it runs, noting the requests
    whose forwards read cached PAGEs (write_from > 0), and checking after each step
    that the rank holds the running requests alone, each with its PAGE table."""

    def __init__(self, engine: Engine, inner: DPStepExecutor) -> None:
        self.engine = engine
        self.inner = inner
        self.batches = 0
        self.hit_readers: set[str] = set()

    @property
    def rank_requests(self) -> PersistentBatch:
        return self.inner.runner.requests if isinstance(self.inner, LocalRank) else self.inner.requests

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[StepResult]:
        self.batches += sum(1 for batch in batches if not batch.is_empty)
        self.hit_readers.update(seg.request_id for batch in batches for seg in batch.segments if seg.write_from > 0)
        results = self.inner.execute(batches, metadata)
        self._check_rank()
        return results

    def launch(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[LaunchedStep]:
        """Async scheduling's launch, recorded and checked as ``execute``; a launched
        step's result counts as work too (the step that commits the last draw in
        flight schedules nothing)."""
        self.batches += sum(1 for batch in batches if not batch.is_empty)
        self.hit_readers.update(seg.request_id for batch in batches for seg in batch.segments if seg.write_from > 0)
        (launched,) = self.inner.launch(batches, metadata)
        self._check_rank()

        def finish() -> StepResult:
            self.batches += 1
            return launched.result()

        return [LaunchedStep(finish)]

    def _check_rank(self) -> None:
        held, bm = self.rank_requests, self.engine.block_manager
        running = {r.request_id for r in self.engine.scheduler.running}
        assert held.request_ids == running, (held.request_ids, running)
        assert all(held.pages(rid) == bm.page_table(rid) for rid in running)

    def restart(self) -> None:
        self.inner.restart()


def _engine(model: Model, **options: object) -> tuple[Engine, _Recorder]:
    params, tokenizer = model
    engine = Engine.from_params(params, tokenizer, engine_options(options))
    recorder = _Recorder(engine, engine.executor)
    engine.executor = recorder
    return engine, recorder


def _drive(engine: Engine, recorder: _Recorder, arrivals: list[_Arrival]) -> dict[str, tuple[int, ...]]:
    """Runs the workload, checking liveness and the block manager on every step;
    returns the tokens of every request that finished (not aborted)."""
    bm = engine.block_manager
    finals: dict[str, tuple[int, ...]] = {}
    whole = CumulativeOutputs()
    max_steps = 4 * sum(a.n * (len(a.prompt) + a.max_tokens) for a in arrivals)
    step = idle = 0
    last_arrival = max(a.step for a in arrivals)
    while step <= last_arrival or engine.has_unfinished_requests():
        for a in arrivals:
            if a.step == step:
                engine.add_request(a.request_id, a.prompt, a.params())
            if a.abort_at == step:
                engine.abort(a.request_id)
        unfinished = engine.has_unfinished_requests()
        before = recorder.batches
        for out in engine.step():
            cumulative = whole.add(out)
            if out.finished:
                finals[out.request_id] = cumulative.token_ids
        idle = idle + 1 if unfinished and recorder.batches == before else 0
        stats = engine.stats()
        assert idle <= 1, f"step {step}: nothing ran for {idle} steps; {stats}"
        bm.check_invariants()
        assert stats.ranks[0].requests == stats.requests_running == stats.ranks[0].slots_used
        step += 1
        assert step <= max_steps, f"{step} steps without finishing: {stats}"
    bm.evict(bm.config.num_pages)
    s = bm.stats()
    assert (s.pages_free, s.images, s.slots_used, s.requests) == (bm.config.num_pages, 0, 0, 0), s
    bm.check_invariants()
    engine.step()  # delivers the releases of the requests that ended last
    table = recorder.rank_requests.block_table
    assert not recorder.rank_requests and all(table.num_pages(r) == 0 for r in range(table.num_rows))
    return finals


_SOLO: dict[tuple[object, ...], tuple[tuple[int, ...], ...]] = {}


def _solo(model: Model, arrival: _Arrival, state_transfer: str, block_size: int) -> tuple[tuple[int, ...], ...]:
    """The tokens of each sample of ``arrival`` run alone in a fresh engine, cold."""
    key = (id(model[0]), state_transfer, block_size, arrival.prompt, arrival.max_tokens, arrival.n)
    if key not in _SOLO:
        pages = -(-(len(arrival.prompt) + arrival.max_tokens) // block_size)
        engine, _ = _engine(
            model,
            state_transfer=state_transfer,
            block_size=block_size,
            num_pages=pages,
            max_num_batched_tokens=512,
            enable_prefix_caching=False,  # n > 1: no sample resumes from another's PAGEs
        )
        _SOLO[key] = tuple(out.token_ids for out in engine.generate([arrival.prompt], arrival.params()))
    return _SOLO[key]


def _check_tokens(
    model: Model,
    arrivals: list[_Arrival],
    finals: dict[str, tuple[int, ...]],
    recorder: _Recorder,
    state_transfer: str,
    block_size: int,
) -> int:
    """Every finished request's tokens against its solo run (see the module
    docstring for which, under replay); returns how many were compared."""
    compared = 0
    for a in arrivals:
        ids = [a.request_id] if a.n == 1 else [f"{a.request_id}#{i}" for i in range(a.n)]
        if a.abort_at is None:
            assert all(rid in finals for rid in ids), f"{a.request_id} did not finish"
        for rid, solo in zip(ids, _solo(model, a, state_transfer, block_size)):
            if rid not in finals or (state_transfer == "replay" and rid in recorder.hit_readers):
                continue
            assert finals[rid] == solo, f"{rid}: {finals[rid]}, alone {solo}"
            compared += 1
    return compared


def _workload(
    rng: random.Random,
    vocab: int,
    *,
    num_requests: int,
    max_prompt: int,
    max_tokens: int,
    arrive_within: int,
    aborts: int,
    n_max: int = 1,
    share: float = 0.5,
    min_shared: int = 1,
) -> list[_Arrival]:
    """Prompts of 1..max_prompt tokens, a fraction ``share`` of them starting with
    ``min_shared`` or more tokens of one shared prefix, arriving over
    ``arrive_within`` steps; ``aborts`` of them aborted at a random step after they
    arrive."""
    shared = [rng.randrange(3, vocab) for _ in range(max_prompt)]
    aborted = set(rng.sample(range(num_requests), aborts))
    arrivals = []
    for i in range(num_requests):
        if rng.random() < share:
            cut = rng.randint(min_shared, max_prompt)
            prompt = shared[:cut] + [rng.randrange(3, vocab) for _ in range(rng.randint(0, max_prompt - cut))]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))]
        step = rng.randint(0, arrive_within)
        arrivals.append(
            _Arrival(
                step=step,
                request_id=f"r{i}",
                prompt=tuple(prompt),
                max_tokens=rng.randint(1, max_tokens),
                n=rng.randint(1, n_max) if rng.random() < 0.3 else 1,
                abort_at=step + rng.randint(0, 12) if i in aborted else None,
            )
        )
    return arrivals


# Seed of the issue's workload that stalls main without this fix (9b1f1df, fedb7b4):
# from step 13 nothing runs, two requests wait, and two STATE images attached to
# prefix-cache entries hold 16 of the 24 PAGEs.
ISSUE_SEED = 12


def test_the_issue_workload_finishes_with_the_solo_tokens(window64_model: Model) -> None:
    """Issue 13's workload (copy, prefix caching, window 64, block_size 32, 24 PAGEs,
    max_num_seqs 4, ten interleaved requests of up to 300 tokens, about half sharing
    a prefix, two aborted early): it never idles, and every request that is not
    aborted finishes with the tokens it gets alone."""
    rng = random.Random(ISSUE_SEED)
    engine, recorder = _engine(
        window64_model,
        state_transfer="copy",
        block_size=32,
        num_pages=24,
        max_num_seqs=4,
        max_num_batched_tokens=rng.choice((32, 64, 96)),
    )
    arrivals = _workload(
        rng, engine.config.vocab_size, num_requests=10, max_prompt=300, max_tokens=8, arrive_within=30, aborts=2
    )
    finals = _drive(engine, recorder, arrivals)
    assert _check_tokens(window64_model, arrivals, finals, recorder, "copy", 32) >= 8


@dataclass(frozen=True)
class _Scale:
    """How large a random case may grow."""

    max_requests: int
    max_prompt: int
    max_tokens: int
    arrive_within: int  # steps
    n_max: int
    budgets: tuple[int, ...]  # max_num_batched_tokens to choose from


# What the model runs in time, and what a simulated rank does.
ENGINE_SCALE = _Scale(
    max_requests=8, max_prompt=160, max_tokens=16, arrive_within=60, n_max=2, budgets=(16, 32, 48, 96)
)
SIMULATED_SCALE = _Scale(
    max_requests=12, max_prompt=200, max_tokens=40, arrive_within=60, n_max=3, budgets=(8, 16, 32, 48, 96)
)


def _random_case(
    seed: int, config: V41Config, scale: _Scale, state_transfer: str | None = None
) -> tuple[dict[str, object], list[_Arrival]]:
    """Engine options and a workload drawn from ``seed``: the state transfer given
    (None: either), block size 32 or 64, a budget and a batch width, prefix caching (always under
    copy, which keeps images only with it; mostly under replay), an offload store at
    times; up to ``scale`` requests, most sharing a prefix. The pools hold the
    largest request plus up to a STATE image and two PAGEs (replay: three PAGEs), so
    PAGEs run short for a request beside the images its prefix hit carries."""
    rng = random.Random(seed)
    state_transfer = state_transfer or rng.choice(("copy", "replay"))
    block_size = rng.choice((32, 32, 64))
    caching = state_transfer == "copy" or rng.random() < 0.7
    options: dict[str, object] = dict(
        state_transfer=state_transfer,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 4),
        max_num_batched_tokens=rng.choice(scale.budgets),
        enable_prefix_caching=caching,
        offload_host_bytes=(16 << 20) if caching and rng.random() < 0.35 else 0,
    )
    arrivals = _workload(
        rng,
        config.vocab_size,
        num_requests=rng.randint(3, scale.max_requests),
        max_prompt=rng.randint(block_size, scale.max_prompt),
        max_tokens=rng.randint(1, scale.max_tokens),
        arrive_within=rng.randint(0, scale.arrive_within),
        aborts=rng.randint(0, 2),
        n_max=scale.n_max,
        share=0.9,
        min_shared=block_size,
    )
    largest = max(-(-(len(a.prompt) + a.max_tokens) // block_size) for a in arrivals)
    image_pages = RankLayout.build(config, engine_options(options)).geometry.image_pages
    options["num_pages"] = largest + rng.randint(0, (image_pages if state_transfer == "copy" else 1) + 2)
    return options, arrivals


NUM_CASES = 8


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_random_workloads_finish_without_leaks_with_the_solo_tokens(tiny_model: Model, case: int) -> None:
    """A random workload and engine shape per case, copy and replay in turn (see the
    module docstring): no stall, no leak, the invariants on every step, the solo
    tokens at the end."""
    state_transfer = ("copy", "replay")[case % 2]
    options, arrivals = _random_case(1000 + case, tiny_model[0].config, ENGINE_SCALE, state_transfer)
    engine, recorder = _engine(tiny_model, **options)
    finals = _drive(engine, recorder, arrivals)
    _check_tokens(tiny_model, arrivals, finals, recorder, str(options["state_transfer"]), int(options["block_size"]))


# Cases whose workloads preempt a request while a step is in flight (found by search:
# async scheduling without an offload store), under copy and replay.
ASYNC_SEEDS = (3020, 3045, 3046, 3022)


@pytest.mark.parametrize("seed", ASYNC_SEEDS)
def test_random_workloads_under_async_scheduling(tiny_model: Model, seed: int) -> None:
    """Random cases as above under async scheduling (no offload store: refused with
    it): no stall, no leak, the invariants on every step, and the solo tokens of the
    synchronous engine at the end, through preemption, aborts and prefix hits while a
    step is in flight."""
    state_transfer = ("copy", "replay")[seed % 2]
    options, arrivals = _random_case(seed, tiny_model[0].config, ENGINE_SCALE, state_transfer)
    options.update(offload_host_bytes=0, async_scheduling=True)
    engine, recorder = _engine(tiny_model, **options)
    finals = _drive(engine, recorder, arrivals)
    _check_tokens(tiny_model, arrivals, finals, recorder, str(options["state_transfer"]), int(options["block_size"]))
    assert engine.stats().preemptions[0] > 0, "a request was preempted while a step was in flight"


def test_a_request_the_empty_pools_cannot_hold_is_refused(tiny_model: Model, tiny_dir: Path) -> None:
    """prompt + max_tokens beyond the pools (of each rank, under DP too) is refused at
    add_request with what it needs and what the pools hold, and nothing is queued,
    for every sample of n > 1; one that fits exactly is served."""
    engine, _ = _engine(tiny_model, state_transfer="copy", block_size=32, num_pages=4)
    greedy = SamplingParams(max_tokens=29, temperature=0.0, ignore_eos=True)
    with pytest.raises(EngineError, match=r"129 tokens need 5 PAGEs of 32 tokens, and the pools hold 4 PAGEs \(128"):
        engine.add_request("big", [5] * 100, greedy)
    with pytest.raises(EngineError, match="need 5 PAGEs"):
        engine.add_request("big", [5] * 100, dataclasses.replace(greedy, n=3))
    assert not engine.has_unfinished_requests() and engine.request("big#0") is None
    assert engine.block_manager.stats().requests == 0
    out = engine.generate([[5] * 100], dataclasses.replace(greedy, max_tokens=28))[0]
    assert len(out.token_ids) == 28

    dp = Engine.in_process(tiny_dir, DPLayout(1), block_size=32, num_pages=4)
    try:
        with pytest.raises(EngineError, match="need 5 PAGEs"):
            dp.add_request("big", [5] * 100, greedy)
        assert not dp.has_unfinished_requests()
    finally:
        dp.executor.close()


_TAG_KV, _TAG_IMAGE = 1, 2


class _SimulatedRank:
    """A rank whose pools hold prefix ids instead of model state, read back and
    checked by every forward (see the module docstring), publishing to and fetching
    from the engine's real offload store. A PAGE's int64 words: a tag, then per row
    the id of the prefix ending at that row (KV) or (position, prefix id, index,
    PAGE count) of the image stored there. The token sampled after a prefix is its
    id modulo the vocabulary."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        geometry = engine.geometry
        self.block_size = geometry.block_size
        self.pools = torch.zeros(engine.pool_size.num_pages, geometry.page_bytes, dtype=torch.uint8)
        self.words = self.pools.view(torch.int64)
        if self.words.shape[1] < self.block_size + 1:
            raise ValueError(f"page_bytes {geometry.page_bytes}: too few for {self.block_size} prefix ids")
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (committed position, prefix id)
        self.requests = PersistentBatch(engine.pool_size.num_slots)
        self._prefix_ids: dict[str, list[int]] = {}

    def prefix_ids(self, request_id: str) -> list[int]:
        """ids[k] names the request's first k tokens."""
        request = self.engine.request(request_id)
        assert request is not None, f"{request_id}: scheduled but not live"
        ids = self._prefix_ids.setdefault(request_id, [1])
        tokens = request.all_token_ids
        for token in tokens[len(ids) - 1 :]:
            ids.append(_next_prefix_id(ids[-1], token))
        return ids

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[StepResult]:
        (batch,) = batches
        return [self._execute(batch)]

    def restart(self) -> None:
        raise AssertionError("a simulated rank never fails")

    def _execute(self, batch: ScheduledBatch) -> StepResult:
        self.requests.update(batch)
        offload = self.engine.offload
        for seg in batch.segments:
            for fill in seg.fetch:
                assert offload is not None
                self.pools[list(fill.pages)] = offload.fetch(fill.handle)
        for seg in batch.segments:
            self._ready_slot(seg)
        for seg in batch.segments:
            self._read(seg)
        sampled = {}
        for seg in batch.segments:
            ids = self.prefix_ids(seg.request_id)
            self._write(seg, ids)
            self.slots[seg.slot] = (seg.end, ids[seg.end])
            if seg.sample:
                sampled[seg.request_id] = SampledToken(ids[seg.end] % self.engine.config.vocab_size, None)
        for seg in batch.segments:
            if seg.store_after is not None:
                image = seg.store_after
                position, prefix = self.slots[seg.slot]
                for i, page in enumerate(image.pages):
                    self.words[page, :5] = torch.tensor([_TAG_IMAGE, position, prefix, i, len(image.pages)])
        for seg in batch.segments:
            for unit in seg.publish:
                assert offload is not None
                offload.publish(unit.key, self.pools[list(unit.pages)].clone())
        return StepResult(step_id=batch.step_id, sampled=sampled)

    def _ready_slot(self, seg: ScheduledSegment) -> None:
        ids = self.prefix_ids(seg.request_id)
        if seg.reset is not None:
            self.slots[seg.slot] = (seg.reset.position, ids[seg.reset.position])
        elif seg.restore is not None:
            pages = list(seg.restore.pages)
            words = self.words[pages, :5].tolist()
            expected = [[_TAG_IMAGE, seg.start, ids[seg.start], i, len(pages)] for i in range(len(pages))]
            assert words == expected, f"{seg.request_id}: restored image {words}, stored {expected}"
            self.slots[seg.slot] = (seg.start, ids[seg.start])
        assert self.slots.get(seg.slot) == (seg.start, ids[seg.start]), (
            f"{seg.request_id}: slot {seg.slot} holds {self.slots.get(seg.slot)}, the step starts at {seg.start}"
        )

    def _read(self, seg: ScheduledSegment) -> None:
        """Every row below the forward's writes holds the request's own prefix."""
        ids = self.prefix_ids(seg.request_id)
        pages = self.requests.pages(seg.request_id)
        assert len(pages) * self.block_size >= seg.end, f"{seg.request_id}: PAGEs short of {seg.end}"
        pages, rows = self._rows(seg, 0, self._first_write(seg))
        held = torch.where(self.words[pages, 0] == _TAG_KV, self.words[pages, rows], 0)
        expected = torch.tensor(ids[1 : len(pages) + 1], dtype=torch.int64)
        wrong = (held != expected).nonzero()
        assert not len(wrong), f"{seg.request_id}: position {int(wrong[0])} does not hold its prefix"

    def _write(self, seg: ScheduledSegment, ids: list[int]) -> None:
        first = self._first_write(seg)
        pages, rows = self._rows(seg, first, seg.end)
        for page in set(pages.tolist()):
            if self.words[page, 0] != _TAG_KV:
                self.words[page] = 0
                self.words[page, 0] = _TAG_KV
        self.words[pages, rows] = torch.tensor(ids[first + 1 : seg.end + 1], dtype=torch.int64)

    @staticmethod
    def _first_write(seg: ScheduledSegment) -> int:
        """The forward reads rows [0, end) and writes those from here on (rows below
        write_from are cached)."""
        return min(max(seg.start, seg.write_from), seg.end)

    def _rows(self, seg: ScheduledSegment, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end)
        table = torch.tensor(self.requests.pages(seg.request_id), dtype=torch.int64)
        return table[positions // self.block_size], 1 + positions % self.block_size


def _next_prefix_id(parent: int, token: int) -> int:
    """The id of a prefix extended by one token (never 0, an unwritten row)."""
    return hash((parent, token)) or 2


@pytest.mark.parametrize("seed", range(300))
def test_random_workloads_on_a_simulated_rank(tiny_model: Model, seed: int) -> None:
    """For a random workload and engine shape, over a rank that checks every row,
    image and slot it reads: no stall, no leak, the invariants on every step, and
    every finished request has the tokens its prefix ids give alone."""
    options, arrivals = _random_case(seed, tiny_model[0].config, SIMULATED_SCALE)
    engine, recorder = _engine(tiny_model, **options)
    recorder.inner = _SimulatedRank(engine)
    finals = _drive(engine, recorder, arrivals)
    vocab = engine.config.vocab_size
    for a in arrivals:
        prefix = 1
        for token in a.prompt:
            prefix = _next_prefix_id(prefix, token)
        alone = []
        for _ in range(a.max_tokens):
            alone.append(prefix % vocab)
            prefix = _next_prefix_id(prefix, alone[-1])
        for rid in [a.request_id] if a.n == 1 else [f"{a.request_id}#{i}" for i in range(a.n)]:
            assert rid in finals or a.abort_at is not None, f"{rid} did not finish"
            assert finals.get(rid, tuple(alone)) == tuple(alone), f"{rid}: {finals[rid]}, alone {alone}"
