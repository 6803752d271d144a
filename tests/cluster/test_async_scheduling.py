"""Async scheduling (cluster/engine.Engine._step_async): the next step is scheduled
and launched while the previous one runs, a decode row whose token that step still
draws carrying PLACEHOLDER_TOKEN (read from the token feed on the device by a decode
graph, or from the previous launch's result by an eager step). The property: every
request's tokens, logprobs and finish reason are the synchronous engine's, for random
workloads of greedy and seeded sampling, stop tokens, stop strings, max_tokens and
aborts, with and without decode graphs (on the CPU their static steps, the functions a
graph captures), and grammars or penalties (whose rows wait for the step in flight).
Pool pressure, preemption and prefix caching under async scheduling are covered by
tests/cluster/test_liveness.py.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Sequence

import pytest
import torch

from dsv41.cluster.batch import PLACEHOLDER_TOKEN, ScheduledBatch
from dsv41.cluster.cuda_graphs import DecodeBuckets
from dsv41.cluster.engine import Engine
from dsv41.cluster.options import EngineError, RankLayout, engine_options
from dsv41.cluster.ranks import DPLayout, DPRank, LocalRank, RankFailure, ThreadedRanks
from dsv41.cluster.request import CumulativeOutputs, RequestOutput
from dsv41.cluster.runner import LaunchedStep, StepResult
from dsv41.cluster.sampling_params import SamplingParams, StructuredOutputs
from dsv41.model.kernels import load_kernels
from dsv41.model.source import ModelSource

BUCKETS = DecodeBuckets(batch_sizes=(1, 2, 4), page_counts=(1, 2, 4))
OPTIONS = dict(block_size=32, max_num_seqs=5, max_num_batched_tokens=64, num_pages=64)


class _Launches:
    """The engine's ranks, recording what each launched step carried: its placeholder
    rows, and whether they ran in a decode graph (on the CPU its static step) or an
    eager step."""

    def __init__(self, inner: LocalRank | ThreadedRanks) -> None:
        self.inner = inner
        self.graph_placeholders = 0
        self.eager_placeholders = 0
        self.graph_runs = 0
        self.batches: list[tuple[ScheduledBatch, ...]] = []
        ranks = [inner.rank] if isinstance(inner, LocalRank) else list(inner.ranks)
        for graphs in (rank.runner.graphs for rank in ranks):
            if graphs is not None:
                graphs.run = self._counting(graphs.run)  # type: ignore[method-assign]

    def _counting(self, run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def counted(*args: object) -> torch.Tensor:
            self.graph_runs += 1
            return run(*args)

        return counted

    def launch(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[LaunchedStep]:
        self.batches.append(tuple(batches))
        runs = self.graph_runs
        launched = self.inner.launch(batches, metadata)
        placeholders = sum(seg.has_placeholder for batch in batches for seg in batch.segments)
        if self.graph_runs > runs:
            self.graph_placeholders += placeholders
        else:
            self.eager_placeholders += placeholders
        return launched

    def execute(self, batches, metadata):  # type: ignore[no-untyped-def]
        return self.inner.execute(batches, metadata)

    def restart(self) -> None:
        self.inner.restart()

    @property
    def ranks(self) -> tuple[DPRank, ...]:
        return (self.inner.rank,) if isinstance(self.inner, LocalRank) else self.inner.ranks


def _engine(tiny_dir: Path, buckets: DecodeBuckets | None, **options: object) -> Engine:
    """A one-rank engine in this thread, with decode graphs of ``buckets`` (their
    static steps on the CPU) or none."""
    parsed = engine_options({**OPTIONS, **options})
    params, tokenizer = ModelSource.parse(tiny_dir).load_params(dtype=parsed.dtype, device=parsed.device)
    rank = DPRank(
        params,
        RankLayout.build(params.config, parsed),
        0,
        None,
        kernels=load_kernels(parsed.kernel_backend),
        batch_invariant=bool(parsed.batch_invariant),
        decoder_replay=parsed.decoder_swa_bounded_replay,
        decode_graphs=buckets,
        feed_samples=parsed.async_scheduling,
    )
    engine = Engine(params.config, tokenizer, parsed, 1, LocalRank(rank), None)
    if parsed.async_scheduling:
        engine.executor = _Launches(LocalRank(rank))
    return engine


def _arrivals(seed: int, vocab: int, *, penalties: bool) -> list[tuple[int, str, list[int], SamplingParams, int | None]]:
    """(arrival step, id, prompt, params, abort step or None) of a random workload:
    greedy and seeded rows, logprobs, EOS and stop tokens that end requests early,
    stop strings, and a few aborts; with ``penalties`` some rows penalise repeats."""
    rng = random.Random(seed)
    out = []
    for i in range(rng.randint(6, 9)):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 90))]
        params = SamplingParams(
            max_tokens=rng.randrange(2, 24),
            temperature=rng.choice([0.0, 0.9]),
            seed=rng.randrange(1000),
            logprobs=rng.choice([None, 2]),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=rng.sample(range(3, vocab), 12) if rng.random() < 0.4 else (),
            stop=["e"] if rng.random() < 0.2 else (),
            repetition_penalty=1.3 if penalties and rng.random() < 0.5 else 1.0,
            n=2 if rng.random() < 0.15 else 1,
        )
        step = rng.randrange(0, 14)
        abort = step + rng.randrange(1, 10) if rng.random() < 0.15 else None
        out.append((step, f"r{i}", prompt, params, abort))
    return out


def _run(engine: Engine, arrivals: list) -> dict[str, RequestOutput]:
    """The workload stepped to its end; the whole output of each request that was
    not aborted. Checks on every step that a step with work runs."""
    whole = CumulativeOutputs()
    final: dict[str, RequestOutput] = {}
    aborted = {rid for _, rid, _, _, abort in arrivals if abort is not None}
    step = 0
    last = max(max(a[0] for a in arrivals), max((a[4] or 0) for a in arrivals))
    while step <= last or engine.has_unfinished_requests():
        for arrive, rid, prompt, params, abort in arrivals:
            if arrive == step:
                engine.add_request(rid, prompt, params)
            if abort == step:
                engine.abort(rid)
        for out in engine.step():
            cumulative = whole.add(out)
            if out.finished and out.request_id.split("#")[0] not in aborted:
                final[out.request_id] = cumulative
        step += 1
        assert step < 2000, "the workload did not finish"
    return final


def _assert_same(got: dict[str, RequestOutput], want: dict[str, RequestOutput]) -> None:
    assert sorted(got) == sorted(want)
    for rid, expected in want.items():
        assert got[rid].token_ids == expected.token_ids, rid
        assert got[rid].logprobs == expected.logprobs, rid
        assert got[rid].text == expected.text, rid
        assert got[rid].finish_reason == expected.finish_reason, rid


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode_graphs"])
@pytest.mark.parametrize("seed", [3, 4])
def test_async_steps_give_the_synchronous_engines_outputs(tiny_dir: Path, graphs: bool, seed: int) -> None:
    """A random workload (see ``_arrivals``) under async scheduling gives every request
    that is not aborted the synchronous engine's tokens, logprobs, text and finish
    reason bit for bit; rows whose token was still being drawn ran, in decode graphs
    (read from the token feed) and in eager steps beside a prefill."""
    buckets = BUCKETS if graphs else None
    sync = _engine(tiny_dir, buckets)
    arrivals = _arrivals(seed, sync.config.vocab_size, penalties=False)
    want = _run(sync, arrivals)
    engine = _engine(tiny_dir, buckets, async_scheduling=True)
    got = _run(engine, arrivals)
    _assert_same(got, want)
    launches = engine.executor
    assert isinstance(launches, _Launches)
    assert launches.eager_placeholders > 0, "a placeholder row ran in an eager step"
    if graphs:
        assert launches.graph_placeholders > 0, "a decode graph read a row's token from the token feed"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode_graphs"])
def test_dp2_async_steps_give_the_synchronous_replicas_outputs(
    tiny_dir: Path, graphs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two DP ranks in threads (gloo, experts sharded), each launched in its thread
    with the step's DP metadata: a random workload under async scheduling gives every
    request that is not aborted the synchronous DP2 replica's outputs bit for bit, and
    placeholder rows ran on the ranks: in eager steps, and with decode graphs (options
    refuse graphs on the CPU, so the buckets are given to the layout: each bucket's
    static step, the function a graph captures, reading the rank's token feed) in the
    graphs every rank replays at one width."""
    options = {**OPTIONS, "max_num_seqs": 4}
    if graphs:
        monkeypatch.setattr(RankLayout, "decode_buckets", lambda self, config, options: BUCKETS)
    sync = Engine.in_process(tiny_dir, DPLayout(2), **options)
    arrivals = _arrivals(6, sync.config.vocab_size, penalties=False)
    want = _run(sync, arrivals)
    engine = Engine.in_process(tiny_dir, DPLayout(2), async_scheduling=True, **options)
    assert isinstance(engine.executor, ThreadedRanks)
    launches = _Launches(engine.executor)
    engine.executor = launches
    _assert_same(_run(engine, arrivals), want)
    assert launches.eager_placeholders > 0, "a placeholder row ran in an eager step"
    if graphs:
        assert launches.graph_placeholders > 0, "a decode graph read a row's token from its rank's token feed"
    assert not engine.has_unfinished_requests()


def test_a_rank_lost_with_a_step_in_flight_ends_every_request_and_the_replica_goes_on(tiny_dir: Path) -> None:
    """A DP2 replica under async scheduling whose step in flight loses a rank (its
    result raises RankFailure): every request in flight ends in error, the ranks are
    restarted once, nothing of the lost step is committed, and the replica then serves
    a new request with its solo tokens."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (solo,) = Engine.in_process(tiny_dir, DPLayout(2), **OPTIONS).generate([[9, 10, 11, 12, 13]], params)
    engine = Engine.in_process(tiny_dir, DPLayout(2), async_scheduling=True, **OPTIONS)
    launches = _Launches(engine.executor)
    engine.executor = launches
    lose_at = 4
    inner_launch = launches.launch

    def losing(batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[LaunchedStep]:
        launched = inner_launch(batches, metadata)
        if len(launches.batches) != lose_at:
            return launched

        def lost() -> StepResult:
            raise RankFailure("rank 1: lost (test)")

        return [launched[0], LaunchedStep(lost)]

    launches.launch = losing  # type: ignore[method-assign]
    for i in range(3):
        engine.add_request(f"r{i}", [20 + i, 21, 22, 23], params)
    ended: list[RequestOutput] = []
    for _ in range(lose_at + 1):
        ended.extend(out for out in engine.step() if out.finished)
    assert engine.num_restarts == 1
    assert sorted(out.request_id for out in ended) == ["r0", "r1", "r2"]
    assert all(out.finish_reason == "error" for out in ended)
    assert not engine.has_unfinished_requests()
    (after,) = engine.generate([[9, 10, 11, 12, 13]], params)
    assert after.token_ids == solo.token_ids


def test_rows_that_read_their_tokens_on_the_host_wait_for_the_step_in_flight(tiny_dir: Path) -> None:
    """With repetition penalties on some requests and grammars on two (their sampling
    reads their tokens on the host), async scheduling still gives the synchronous
    engine's outputs: those requests' rows are scheduled only once the step in flight
    is committed, and the others' rows still run ahead with placeholders."""
    sync = _engine(tiny_dir, BUCKETS)
    arrivals = _arrivals(5, sync.config.vocab_size, penalties=True)
    assert any(params.uses_penalties for _, _, _, params, _ in arrivals)
    for i, grammar in enumerate((StructuredOutputs(regex="[a-c]{3,8}x"), StructuredOutputs(choice=["alpha", "beta"]))):
        params = SamplingParams(max_tokens=12, temperature=0.7, seed=i, structured_outputs=grammar)
        arrivals.append((i + 1, f"grammar{i}", [5, 6, 7, 8 + i] * 5, params, None))
    want = _run(sync, arrivals)
    engine = _engine(tiny_dir, BUCKETS, async_scheduling=True)
    _assert_same(_run(engine, arrivals), want)


def test_a_reused_request_id_gets_none_of_its_predecessors_draws(tiny_dir: Path) -> None:
    """A request aborted while its row is in flight, and another added at once under
    the same id: the new request's output is its own solo run's (the draw in flight is
    the aborted one's and is dropped)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (solo,) = _engine(tiny_dir, BUCKETS).generate([[9, 10, 11, 12, 13]], params)
    engine = _engine(tiny_dir, BUCKETS, async_scheduling=True)
    engine.add_request("r", [50, 51, 52], params)
    for _ in range(3):
        engine.step()
    assert engine.request("r") is not None and engine.request("r").num_pending_tokens == 1
    assert engine.abort("r")
    engine.add_request("r", [9, 10, 11, 12, 13], params)
    whole = CumulativeOutputs()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            cumulative = whole.add(out)
            if out.finished:
                final = cumulative
    assert final is not None and final.token_ids == solo.token_ids


def test_the_last_token_in_flight_is_not_scheduled_past(tiny_dir: Path) -> None:
    """A request whose last allowed token (max_tokens) is being drawn gets no further
    row: a one-request engine with max_tokens 3 runs exactly one prefill and two
    decode rows, and its scheduler's cursor ends at prompt + 2."""
    engine = _engine(tiny_dir, BUCKETS, async_scheduling=True)
    rows = []
    launches = engine.executor
    assert isinstance(launches, _Launches)
    inner = launches.launch

    def counting(batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[LaunchedStep]:
        rows.extend((seg.start, seg.length, seg.token_ids[-1] == PLACEHOLDER_TOKEN) for seg in batches[0].segments)
        return inner(batches, metadata)

    launches.launch = counting  # type: ignore[method-assign]
    (out,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 3
    assert rows == [(0, 4, False), (4, 1, True), (5, 1, True)]


def test_async_scheduling_is_refused_where_it_cannot_run(tiny_dir: Path) -> None:
    """Refused before anything loads: with speculation, with an offload store, and
    with ranks that cannot launch a step (the Ray engine group's refusal:
    tests/actors/test_group.py)."""
    with pytest.raises(EngineError, match="async_scheduling: True with speculative_method"):
        engine_options(dict(async_scheduling=True, speculative_method="dspark"))
    with pytest.raises(EngineError, match="async_scheduling: True with offload_host_bytes"):
        engine_options(dict(async_scheduling=True, offload_host_bytes=1 << 20))
    with pytest.raises(EngineError, match="async_scheduling: 1"):
        engine_options(dict(async_scheduling=1))
    parsed = engine_options({**OPTIONS, "async_scheduling": True})
    params, tokenizer = ModelSource.parse(tiny_dir).load_params(dtype=parsed.dtype)

    class _NoLaunch:
        def execute(self, batches, metadata):  # type: ignore[no-untyped-def]
            raise AssertionError("never runs")

        def restart(self) -> None:
            pass

    with pytest.raises(EngineError, match="async_scheduling: True with ranks run by a _NoLaunch"):
        Engine(params.config, tokenizer, parsed, 1, _NoLaunch(), None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_async_graph_steps_give_the_synchronous_engines_outputs_on_cuda(
    tiny_dir: Path, cuda_engine_options: dict[str, object]
) -> None:
    """On a GPU (Triton kernels, batch-invariant, FULL graphs captured): async
    scheduling, whose graphs read placeholder rows' tokens from the token feed while
    the host schedules the next step, gives the synchronous eager engine's outputs."""
    eager = Engine.from_pretrained(tiny_dir, **cuda_engine_options)
    arrivals = _arrivals(3, eager.config.vocab_size, penalties=False)
    arrivals = [(step, rid, prompt[:60], params, abort) for step, rid, prompt, params, abort in arrivals]
    want = _run(eager, arrivals)
    engine = Engine.from_pretrained(
        tiny_dir, cudagraph_mode="full", cudagraph_batch_sizes=(1, 2, 4, 6), async_scheduling=True, **cuda_engine_options
    )
    _assert_same(_run(engine, arrivals), want)
