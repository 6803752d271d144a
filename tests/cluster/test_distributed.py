"""DP execution in one process: the packed DP metadata, placement, the MoE exchange
over gloo among threads, and Engine's greedy tokens against the one-rank Engine.

In the batch-invariant mode (the CPU default) an EP replica's arithmetic is the one-rank
engine's bit for bit: the ranks exchange whole (row, slot) expert contributions and add
a row's slots in slot order, as one rank does, so even the logprobs are equal. A TP
replica's down projection reduces the intermediate dimension in two pieces where one
rank reduces it in one GEMM: its logprobs equal a TP replica's under any placement of
the requests, and the one-rank engine's only to fp32 rounding (the named limit of
docs/ARCHITECTURE.md); its greedy tokens equal the engine's here (no near-tie).
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cluster.batch import DP_METADATA_LAYOUT, DPMetadata, DPMetadataError, MicrobatchRows, RankStepInfo
from dsv41.cluster.distributed import DPExpertExchange, GroupSpec, open_process_group
from dsv41.cluster.engine import Engine
from dsv41.cluster.placement import RankLoad, place
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.request import CumulativeOutputs
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.linalg import batch_invariant
from dsv41.model.loader import ExpertShard
from dsv41.model.moe import moe_forward
from dsv41.model.params import load_model_params

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
OPTIONS = dict(block_size=32, state_transfer="copy", max_num_seqs=4, max_num_batched_tokens=64)

request_ids = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)


@st.composite
def rank_infos(draw: st.DrawFn) -> RankStepInfo:
    """A rank's step: its rows, the decoder and query rows bounded replay leaves of
    them (or every row), and maybe its two TBO microbatches."""
    rows = draw(st.integers(0, 10_000))
    decoder = draw(st.one_of(st.none(), st.integers(0, rows)))
    query = draw(st.one_of(st.none(), st.integers(0, rows if decoder is None else decoder)))
    microbatches: tuple[MicrobatchRows, ...] = ()
    if rows >= 2 and draw(st.booleans()):
        decoder_all = rows if decoder is None else decoder
        query_all = decoder_all if query is None else query
        first = draw(st.integers(1, rows - 1))
        first_decoder = draw(st.integers(max(0, decoder_all - (rows - first)), min(first, decoder_all)))
        first_query = draw(
            st.integers(max(0, query_all - (decoder_all - first_decoder)), min(first_decoder, query_all))
        )
        microbatches = (
            MicrobatchRows(first, first_decoder, first_query),
            MicrobatchRows(rows - first, decoder_all - first_decoder, query_all - first_query),
        )
    ids = tuple(draw(st.lists(request_ids, max_size=4)))
    pages = draw(st.one_of(st.just(-1), st.just(0) if rows == 0 else st.integers(1, 10_000)))
    return RankStepInfo(rows, draw(st.booleans()), ids, decoder, query, microbatches, pages)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**40), st.lists(rank_infos(), min_size=1, max_size=8))
def test_dp_metadata_wire_round_trips(step_id: int, ranks: list[RankStepInfo]) -> None:
    """from_wire(to_wire(m)) == m for every metadata, as one flat int64 tensor."""
    metadata = DPMetadata(step_id=step_id, ranks=tuple(ranks))
    wire = metadata.to_wire()
    assert wire.dtype == torch.int64 and wire.dim() == 1
    assert DPMetadata.from_wire(wire) == metadata


def test_dp_metadata_rejects_unknown_layouts_and_corrupt_tensors() -> None:
    """Another layout version, a truncated tensor or trailing words are refused."""
    wire = DPMetadata(step_id=3, ranks=(RankStepInfo(5, True, ("a",)), RankStepInfo(0, False))).to_wire()
    other = wire.clone()
    other[0] = DP_METADATA_LAYOUT + 1
    with pytest.raises(DPMetadataError, match="layout"):
        DPMetadata.from_wire(other)
    with pytest.raises(DPMetadataError, match="truncated"):
        DPMetadata.from_wire(wire[:-1])
    with pytest.raises(DPMetadataError, match="after the last rank"):
        DPMetadata.from_wire(torch.cat((wire, torch.zeros(1, dtype=torch.int64))))


def test_stage_rows_outside_the_ranks_rows_are_refused() -> None:
    """Decoder rows are some of a rank's rows and query rows some of its decoder
    rows: anything else is refused, on construction and off the wire."""
    for decoder, query in ((6, None), (3, 4), (-1, 0)):
        with pytest.raises(DPMetadataError, match="decoder_rows / query_rows"):
            RankStepInfo(5, True, (), decoder, query)
    wire = DPMetadata(step_id=1, ranks=(RankStepInfo(5, True, (), 3, 1),)).to_wire()
    wire[5] = 9  # the rank's decoder rows
    with pytest.raises(DPMetadataError, match="corrupt"):
        DPMetadata.from_wire(wire)


def test_decode_pages_that_contradict_the_rows_are_refused() -> None:
    """A rank's decode PAGE count is -1 (not a plain decode), 0 exactly when it has no
    row, or at least 1: anything else is refused, on construction and off the wire."""
    for rows, pages in ((0, 1), (3, 0), (3, -2)):
        with pytest.raises(DPMetadataError, match="decode_pages"):
            RankStepInfo(rows, False, decode_pages=pages)
    wire = DPMetadata(step_id=1, ranks=(RankStepInfo(5, False, decode_pages=2),)).to_wire()
    wire[7] = 0  # the rank's decode PAGEs
    with pytest.raises(DPMetadataError, match="corrupt"):
        DPMetadata.from_wire(wire)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 300)), min_size=1, max_size=6),
    st.integers(1, 5),
)
def test_placement_prefers_the_longest_prefix_then_the_least_loaded(loads: list[tuple[int, int]], cap: int) -> None:
    """The chosen rank has room if any rank has; among those, no rank has a longer
    cached prefix, and none with an equal prefix has fewer requests."""
    ranks = [RankLoad(unfinished=u, cached_prefix_tokens=c) for u, c in loads]
    chosen = place(ranks, cap)
    with_room = [r for r in ranks if r.unfinished < cap] or ranks
    assert ranks[chosen] in with_room
    for other in with_room:
        assert other.cached_prefix_tokens <= ranks[chosen].cached_prefix_tokens
        if other.cached_prefix_tokens == ranks[chosen].cached_prefix_tokens:
            assert other.unfinished >= ranks[chosen].unfinished


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_exchange_equals_the_whole_layer_with_idle_ranks(tiny_dir: Path, mode: str) -> None:
    """Two ranks with expert shards, one of them holding no rows (padding), give each
    rank's rows the output of moe_forward over every expert (fp32 rounding only)."""
    whole, _ = load_model_params(tiny_dir)
    layer = whole.layers[1]
    cfg = whole.config
    rows = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    want = moe_forward(rows, layer.moe, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)
    shards = [load_model_params(tiny_dir, shard=ExpertShard(mode, r, 2))[0] for r in range(2)]
    split = {0: rows, 1: rows[:0]}
    got: dict[int, torch.Tensor] = {}
    store = dist.HashStore()

    def run(rank: int) -> None:
        group = open_process_group(GroupSpec("gloo", 2), rank, store)
        exchange = DPExpertExchange(cfg, group, rank, "gloo")
        exchange.begin_step([7, 0])
        got[rank] = exchange(shards[rank].layers[1], split[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
    assert got[1].shape == (0, cfg.hidden_size)


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_the_invariant_exchange_is_exact_under_ep_and_placement_free_under_tp(tiny_dir: Path, mode: str) -> None:
    """In the batch-invariant mode, EP: each rank's rows get moe_forward's bits exactly;
    TP: a row's result is the same whichever rank holds it and whatever rows share the
    step."""
    whole, _ = load_model_params(tiny_dir)
    cfg = whole.config
    rows = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with batch_invariant(True):
        want = moe_forward(rows, whole.layers[1].moe, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)
    shards = [load_model_params(tiny_dir, shard=ExpertShard(mode, r, 2))[0] for r in range(2)]

    def exchange(split: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        got: dict[int, torch.Tensor] = {}
        store = dist.HashStore()

        def run(rank: int) -> None:
            group = open_process_group(GroupSpec("gloo", 2), rank, store)
            rank_exchange = DPExpertExchange(cfg, group, rank, "gloo", expert_mode=mode, batch_invariant=True)
            rank_exchange.begin_step([split[0].shape[0], split[1].shape[0]])
            with batch_invariant(True):
                got[rank] = rank_exchange(shards[rank].layers[1], split[rank])

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got

    first = exchange({0: rows[:3], 1: rows[3:]})
    second = exchange({0: rows[5:], 1: rows[:5]})
    assert torch.equal(torch.cat((first[0], first[1])), torch.cat((second[1], second[0])))
    if mode == "ep":
        assert torch.equal(torch.cat((first[0], first[1])), want)
    else:
        torch.testing.assert_close(torch.cat((first[0], first[1])), want, rtol=1e-5, atol=1e-5)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 7, 70, 3, 25)]


def _staggered(dp: Engine, prompts: list[list[int]], order: list[int]) -> dict[int, object]:
    """Adds prompts[order[0]] at step 0, the next one per step; returns each prompt's
    finished output."""
    got: dict[int, object] = {}
    whole = CumulativeOutputs()
    step = 0
    while dp.has_unfinished_requests() or step < len(order):
        if step < len(order):
            dp.add_request(f"r{order[step]}", prompts[order[step]], GREEDY)
        for out in dp.step():
            cumulative = whole.add(out)
            if out.finished:
                got[int(out.request_id[1:])] = cumulative
        step += 1
    for scheduler in dp.schedulers:
        stats = scheduler.block_manager.stats()
        assert stats.requests == 0 and stats.pages_used == stats.image_pages
    return got


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_threaded_dp2_gives_the_engines_tokens(tiny_dir: Path, mode: str) -> None:
    """A DP2 replica in threads (own pools per rank, experts sharded) generates the
    greedy tokens of the one-rank Engine for a staggered mixed batch: requests arrive
    while others decode, so ranks prefill, decode and idle (pad) at different steps.
    EP: the logprobs are the engine's bit for bit. TP: they are the same for another
    arrival order (another placement of every request)."""
    engine = Engine.from_pretrained(tiny_dir, **OPTIONS)
    prompts = _prompts(engine.config.vocab_size)
    want = engine.generate(prompts, GREEDY)
    dp = Engine.in_process(tiny_dir, DPLayout(2, mode), **OPTIONS)
    got = _staggered(dp, prompts, list(range(len(prompts))))
    assert [got[i].token_ids for i in range(len(prompts))] == [o.token_ids for o in want]
    if mode == "ep":
        assert [got[i].logprobs for i in range(len(prompts))] == [o.logprobs for o in want]
    else:
        reordered = _staggered(Engine.in_process(tiny_dir, DPLayout(2, mode), **OPTIONS), prompts, [3, 1, 4, 0, 2])
        assert [reordered[i].logprobs for i in range(len(prompts))] == [got[i].logprobs for i in range(len(prompts))]
