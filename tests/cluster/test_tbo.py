"""Prefill two-batch overlap (cluster/tbo.py, model/microbatch.py) on a DP2 replica in
threads, gloo among them.

In the batch-invariant mode (the CPU default) a row's arithmetic does not depend on
the other rows of its call (model/linalg.py) nor, under EP, on which rank holds its
experts, so a step run as two microbatches gives the unsplit step's bits: the same
tokens, logprobs and prompt logits with TBO on as off. The split is real (each layer's
MoE gathers once per microbatch) and overlapped (the first microbatch's gather is in
flight while the second attends), and every rank takes the path the step's metadata
selects for all of them.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.actors.engine_group import EngineGroup
from dsv41.cluster.batch import (
    DPMetadata,
    DPMetadataError,
    MicrobatchRows,
    NewRequestData,
    RankStepInfo,
    ScheduledBatch,
    ScheduledSegment,
)
from dsv41.cluster.engine import Engine
from dsv41.cluster.options import EngineError, EngineOptions
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.request import CumulativeOutputs, RequestOutput
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.cluster.tbo import runs_split, split

OPTIONS = dict(block_size=32, max_num_seqs=4, max_num_batched_tokens=128, enable_prefix_caching=False)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


class _Recorder:
    """Watches a DP replica's steps without changing them: each step's batches and
    results (through the executor), and how many microbatches each rank's exchange
    was given."""

    def __init__(self, engine: Engine) -> None:
        self.steps: list[dict[str, Any]] = []
        executor = engine.executor
        execute = executor.execute

        def recorded(batches: Any, metadata: torch.Tensor) -> Any:
            self.steps.append({"batches": batches, "split": [None] * len(batches)})
            results = execute(batches, metadata)
            self.steps[-1]["results"] = results
            return results

        executor.execute = recorded
        for rank in executor.ranks:
            begin = rank.exchange.begin_step

            def begin_step(rows: Any, layers: Any = None, microbatches: Any = (), rank: Any = rank, begin=begin) -> None:
                self.steps[-1]["split"][rank.rank] = len(microbatches)
                begin(rows, layers, microbatches)

            rank.exchange.begin_step = begin_step


def _staggered(engine: Engine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    """Runs ``arrivals`` (step, prompt, params), request i added before step i's
    ``step()``, to the end; every request's whole output."""
    got: dict[str, RequestOutput] = {}
    whole = CumulativeOutputs()
    step = 0
    while step <= max(at for at, _, _ in arrivals) or engine.has_unfinished_requests():
        for i, (at, prompt, params) in enumerate(arrivals):
            if at == step:
                engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            cumulative = whole.add(out)
            if out.finished:
                got[out.request_id] = cumulative
        step += 1
    return got


@pytest.mark.parametrize(
    ("expert_mode", "token_split", "replay"),
    [("ep", True, True), ("ep", False, True), ("tp", True, False)],
)
def test_tbo_gives_the_tokens_and_logits_of_ordinary_execution(
    tiny_dir: Path, expert_mode: str, token_split: bool, replay: bool
) -> None:
    """A DP2 replica with TBO on generates TBO off's tokens and logprobs, and its
    prompt logits and top-k selections bit for bit, for requests arriving at set steps: steps where both
    ranks prefill run split (each rank's exchange given two microbatches), and steps
    where a rank decodes only or idles run unsplit on every rank. Within requests
    (token split, a request's rows cut across the microbatches) and at request
    boundaries; with decoder replay (the microbatches' decoder rows) and without."""
    options = {**OPTIONS, "decoder_swa_bounded_replay": replay, "tbo_prefill_token_split": token_split}
    base = Engine.in_process(tiny_dir, DPLayout(2, expert_mode), **options)
    vocab = base.config.vocab_size
    logits = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    # Both ranks prefill one request (steps 0-1), then each prefills one beside a
    # decode (from step 3), then one rank prefills while the other decodes (step 9).
    arrivals = [
        (0, _prompt(vocab, 90, 1), GREEDY),
        (0, _prompt(vocab, 40, 2), logits),
        (3, _prompt(vocab, 130, 3), GREEDY),
        (3, _prompt(vocab, 100, 4), logits),
        (9, _prompt(vocab, 7, 5), GREEDY),
    ]
    runs = {}
    with_tbo = Engine.in_process(
        tiny_dir, DPLayout(2, expert_mode), enable_tbo_prefill=True, tbo_prefill_min_tokens=4, **options
    )
    for tbo, engine in ((False, base), (True, with_tbo)):
        recorder = _Recorder(engine)
        runs[tbo] = (_staggered(engine, arrivals), recorder.steps)
        engine.executor.close()
    (off, off_steps), (on, on_steps) = runs[False], runs[True]
    assert {k: (o.token_ids, o.logprobs, o.prompt_logprobs) for k, o in on.items()} == {
        k: (o.token_ids, o.logprobs, o.prompt_logprobs) for k, o in off.items()
    }
    assert len(on_steps) == len(off_steps)
    split_steps = split_logits = 0
    for with_tbo, without in zip(on_steps, off_steps):
        for a, b in zip(with_tbo["results"], without["results"]):
            assert a.row_logits.keys() == b.row_logits.keys()
            assert all(torch.equal(a.row_logits[r], b.row_logits[r]) for r in a.row_logits)
            assert a.row_selections.keys() == b.row_selections.keys()
            for r, picked in a.row_selections.items():
                assert picked.keys() == b.row_selections[r].keys()
                assert all(torch.equal(picked[layer], b.row_selections[r][layer]) for layer in picked)
        assert without["split"] == [0, 0]
        infos = [RankStepInfo.of(batch) for batch in with_tbo["batches"]]
        counts = with_tbo["split"]
        assert len(set(counts)) == 1, "every rank takes the same path"
        if not all(info.is_prefill for info in infos):
            assert counts == [0, 0]
        if all(info.is_prefill and info.num_tokens >= 4 for info in infos) and (
            token_split or all(len(b.segments) >= 2 for b in with_tbo["batches"])
        ):
            assert counts == [2, 2]
        split_steps += counts[0] == 2
        split_logits += counts[0] == 2 and any(r.row_logits for r in with_tbo["results"])
    mixed = [s for s in on_steps if len({RankStepInfo.of(b).is_prefill for b in s["batches"]}) == 2]
    assert split_steps >= 2 and split_logits and mixed, (
        "the workload has split steps (one with prompt logits) and steps a rank without prefill keeps whole"
    )


def test_the_microbatches_run_split_and_overlapped(tiny_dir: Path) -> None:
    """In a step where both ranks prefill, a rank's exchange gathers twice per layer
    (once per microbatch) and the first microbatch's gather of every layer is still
    in flight while the second microbatch's attention runs; the same step without
    TBO gathers once per layer and waits on each gather before anything else runs."""
    options = {**OPTIONS, "decoder_swa_bounded_replay": False}
    traces = {}
    for tbo in (False, True):
        engine = Engine.in_process(tiny_dir, DPLayout(2, "ep"), enable_tbo_prefill=tbo, tbo_prefill_min_tokens=4, **options)
        vocab = engine.config.vocab_size
        for i in range(2):
            engine.add_request(f"r{i}", _prompt(vocab, 48 + i, i), GREEDY)
        rank = engine.executor.ranks[0]
        events: list[tuple[str, int]] = []
        gather, attention = rank.exchange._all_gather, rank.runner.runtime._attention

        class Work:
            def __init__(self, work: Any, index: int) -> None:
                self.work, self.index = work, index

            def wait(self) -> None:
                self.work.wait()
                events.append(("wait", self.index))

        def traced_gather(*args: Any) -> Work:
            index = sum(kind == "gather" for kind, _ in events)
            events.append(("gather", index))
            return Work(gather(*args), index)

        def traced_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
            events.append(("attention", -1))
            return attention(*args, **kwargs)

        rank.exchange._all_gather = traced_gather
        rank.runner.runtime._attention = traced_attention
        engine.step()
        traces[tbo] = events
        engine.executor.close()
    layers = len(rank.runner.params.layers)

    def overlapped(events: list[tuple[str, int]]) -> int:
        """How many gathers had an attention between their issue and their wait."""
        issued = {index: at for at, (kind, index) in enumerate(events) if kind == "gather"}
        waited = {index: at for at, (kind, index) in enumerate(events) if kind == "wait"}
        return sum(any(kind == "attention" for kind, _ in events[issued[i] : waited[i]]) for i in issued)

    assert sum(kind == "gather" for kind, _ in traces[False]) == layers
    assert sum(kind == "gather" for kind, _ in traces[True]) == 2 * layers
    assert overlapped(traces[False]) == 0
    assert overlapped(traces[True]) == layers


def _info(rows: int, prefill: bool = True, split_at: int | None = None) -> RankStepInfo:
    microbatches = () if split_at is None else (MicrobatchRows(split_at, split_at, 0), MicrobatchRows(rows - split_at, rows - split_at, 1))
    return RankStepInfo(rows, prefill, decoder_rows=rows, query_rows=1 if microbatches else None, microbatches=microbatches)


def test_eligibility_is_every_ranks_and_any_peer_can_veto_it() -> None:
    """A step runs split only when every rank has a prefill, split its rows and has
    at least the threshold's rows; an idle peer, a decode-only peer, a peer below the
    threshold or one that could not split selects ordinary execution for all."""
    ready = _info(64, split_at=32)
    assert runs_split(DPMetadata(1, (ready, ready)), min_tokens=64)
    for peer in (
        RankStepInfo(0, False),  # idle
        _info(3, prefill=False),  # decodes only
        _info(63, split_at=30),  # below the threshold
        _info(64),  # did not split (one request, cut at request boundaries)
    ):
        assert not runs_split(DPMetadata(1, (ready, peer)), min_tokens=64)
        assert not runs_split(DPMetadata(1, (peer, ready)), min_tokens=64)


def test_microbatch_rows_must_add_up_to_the_ranks_rows() -> None:
    """Two microbatches summing to the rank's rows, decoder rows and query rows, or
    none; they round-trip through the wire."""
    info = RankStepInfo(10, True, ("a",), 8, 2, (MicrobatchRows(5, 3, 1), MicrobatchRows(5, 5, 1)))
    metadata = DPMetadata(4, (info, RankStepInfo(0, False)))
    assert DPMetadata.from_wire(metadata.to_wire()) == metadata
    for microbatches in ((MicrobatchRows(5, 3, 1),), (MicrobatchRows(5, 3, 1), MicrobatchRows(4, 4, 1))):
        with pytest.raises(DPMetadataError, match="microbatches"):
            RankStepInfo(10, True, (), 8, 2, microbatches)
    with pytest.raises(DPMetadataError, match="MicrobatchRows"):
        MicrobatchRows(0, 0, 0)


@st.composite
def batches(draw: st.DrawFn) -> ScheduledBatch:
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    segments = []
    for i, n in enumerate(lengths):
        start = draw(st.integers(0, 100))
        segments.append(
            ScheduledSegment(
                request_id=f"q{i}", slot=i, start=start, token_ids=tuple(range(5, 5 + n)), write_from=0,
                window_start=0, sample=draw(st.booleans()), output_index=0, num_prompt_tokens=start + n,
                new_pages=(i,) * 8, kept_pages=0, new_request=NewRequestData(GREEDY, 0),
            )
        )
    return ScheduledBatch(step_id=1, segments=tuple(segments))


@settings(max_examples=80, deadline=None)
@given(batches(), st.booleans())
def test_a_split_is_the_batch_cut_in_two(batch: ScheduledBatch, token_split: bool) -> None:
    """The microbatches are the step's rows in order, cut once: at the middle row
    (inside a request if one spans it) or at the request boundary nearest it; a
    request cut in two is two consecutive chunks of it, only the second sampling,
    the first carrying the step's PAGE delta and slot preparation and the second
    continuing from the table it leaves; a batch that cannot be cut in two non-empty
    parts is not split."""
    parts = split(batch, token_split)
    rows = [(s.request_id, s.start + i, t) for s in batch.segments for i, t in enumerate(s.token_ids)]
    if parts is None:
        assert len(rows) < 2 if token_split else len(batch.segments) == 1
        return
    first, second = parts
    assert first.num_tokens and second.num_tokens
    cut = [(s.request_id, s.start + i, t) for p in parts for s in p.segments for i, t in enumerate(s.token_ids)]
    assert cut == rows
    if token_split:
        assert first.num_tokens == batch.num_tokens // 2
    else:
        ends = [sum(s.length for s in batch.segments[: i + 1]) for i in range(len(batch.segments) - 1)]
        assert first.num_tokens in ends
        assert all(abs(2 * first.num_tokens - batch.num_tokens) <= abs(2 * e - batch.num_tokens) for e in ends)
    if first.segments[-1].request_id == second.segments[0].request_id:
        head, tail = first.segments[-1], second.segments[0]
        original = next(s for s in batch.segments if s.request_id == head.request_id)
        assert not head.sample and tail.sample == original.sample and head.end == tail.start
        assert tail.reset is None and tail.restore is None
        assert (head.new_pages, head.kept_pages, head.new_request) == (
            original.new_pages,
            original.kept_pages,
            original.new_request,
        )
        assert tail.new_request is None and not tail.new_pages
        assert tail.kept_pages == original.kept_pages + len(original.new_pages)


def test_tbo_is_refused_before_loading_without_dp_attention(trained_tiny_dir: Path, tmp_path: Path) -> None:
    """TBO on a replica of one rank is refused with its reason before any weight is
    read (the model directory holds its config and tokenizer only: loading would fail
    otherwise), on every path a replica is made by; its options are checked like
    every other."""
    missing = tmp_path / "no-weights"
    missing.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(trained_tiny_dir / name, missing / name)
    with pytest.raises(EngineError, match="enable_tbo_prefill.*1 DP rank"):
        Engine.from_pretrained(missing, enable_tbo_prefill=True)
    with pytest.raises(EngineError, match="enable_tbo_prefill.*1 DP rank"):
        Engine.in_process(missing, DPLayout(1), enable_tbo_prefill=True)
    with pytest.raises(EngineError, match="enable_tbo_prefill.*1 DP rank"):
        EngineGroup(str(missing), dp=1, enable_tbo_prefill=True)
    for bad in ({"tbo_prefill_min_tokens": -1}, {"tbo_prefill_min_tokens": 1.5}, {"enable_tbo_prefill": "yes"}):
        with pytest.raises(EngineError, match=next(iter(bad))):
            EngineOptions(**bad)  # type: ignore[arg-type]
