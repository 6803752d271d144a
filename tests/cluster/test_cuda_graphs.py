"""FULL graph mode's decode steps (cluster/cuda_graphs.py) on the CPU: the static step a
graph captures, run eagerly, gives exactly the eager engine's tokens and logprobs.

A decode step runs at its bucket's width (padding rows that read and write nothing)
from persistent buffers, its Engram rows staged before the forward; the bucket choice
and its bounds are unit-tested here. The capture and replay themselves need a CUDA
device (tests/model/test_gpu_runtime.py runs graph == eager there).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsv41.cache.addressing import DecodeWidth
from dsv41.cluster.cuda_graphs import DecodeBuckets, default_batch_sizes, page_buckets
from dsv41.cluster.token_graphs import MAX_DEFAULT_TOKEN_BUCKET, TokenGraphs, token_buckets
from dsv41.cluster.engine import Engine, LocalRank
from dsv41.cluster.distributed import DPExpertExchange, GroupSpec, open_process_group
from dsv41.cluster.options import EngineError, RankLayout, check_replica_options, engine_options
from dsv41.cluster.ranks import DPError, DPLayout, DPRank
from dsv41.cluster.request import CumulativeOutputs, RequestOutput
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.kernels import load_kernels
from dsv41.model.linalg import batch_invariant_enabled
from dsv41.model.runtime import PagedRuntime
from dsv41.model.source import ModelSource

BUCKETS = DecodeBuckets(batch_sizes=(1, 2, 4), page_counts=(1, 2, 4))
# The interpreted-Triton case's buckets: one batch size, so one or two requests run it
# padded or full and three beyond it; two PAGE counts.
TRITON_BUCKETS = DecodeBuckets(batch_sizes=(2,), page_counts=(1, 2))
TRITON_SEED = 31


def test_default_buckets() -> None:
    """vLLM's capture sizes cut at the batch; PAGE counts doubling up to the context's."""
    assert default_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_batch_sizes(3) == (1, 2, 3)
    assert default_batch_sizes(1) == (1,)
    assert page_buckets(1) == (1,)
    assert page_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert page_buckets(33) == (1, 2, 4, 8, 16, 32, 33)


def test_a_step_runs_at_the_narrowest_bucket_holding_it() -> None:
    """width_for picks the smallest batch and PAGE buckets at or above the step's, None
    beyond the largest of either; widths() lists every pair, largest first."""
    for requests in range(1, 7):
        for pages in range(1, 7):
            width = BUCKETS.width_for(requests, pages)
            if requests > 4 or pages > 4:
                assert width is None
                continue
            assert width == DecodeWidth(
                min(b for b in BUCKETS.batch_sizes if b >= requests), min(p for p in BUCKETS.page_counts if p >= pages)
            )
    widths = BUCKETS.widths()
    assert len(widths) == 9 and widths[0] == DecodeWidth(4, 4) and widths[-1] == DecodeWidth(1, 1)
    with pytest.raises(ValueError, match="batch_sizes"):
        DecodeBuckets(batch_sizes=(2, 1), page_counts=(1,))


def test_graph_options_are_refused_where_they_cannot_run(tiny_dir: Path) -> None:
    """Both graph modes need the Triton kernels on a CUDA device, and under DP
    attention the NCCL exchange there (a graph cannot capture gloo's collectives);
    TR_HYBRID refuses prefill two-batch overlap; bucket sizes are bounded by the batch
    (FULL) or the step's token budget (TR_HYBRID); each refusal names the field."""
    with pytest.raises(EngineError, match="kernel_backend 'triton' on a CUDA device"):
        engine_options(dict(cudagraph_mode="full"))
    with pytest.raises(EngineError, match="kernel_backend 'triton' on a CUDA device"):
        engine_options(dict(cudagraph_mode="tr_hybrid"))
    with pytest.raises(EngineError, match="cudagraph_mode: 'partial'"):
        engine_options(dict(cudagraph_mode="partial"))
    with pytest.raises(EngineError, match="cudagraph_batch_sizes"):
        engine_options(dict(cudagraph_batch_sizes=(1, 2)))
    cuda = dict(kernel_backend="triton", device="cuda", max_num_seqs=8, max_num_batched_tokens=256)
    with pytest.raises(EngineError, match="1..max_num_seqs = 8"):
        engine_options(dict(cudagraph_mode="full", cudagraph_batch_sizes=(16,), **cuda))
    with pytest.raises(EngineError, match="1..max_num_batched_tokens = 256"):
        engine_options(dict(cudagraph_mode="tr_hybrid", cudagraph_batch_sizes=(512,), **cuda))
    hybrid = engine_options(dict(cudagraph_mode="tr_hybrid", enable_tbo_prefill=True, **cuda))
    with pytest.raises(EngineError, match="'tr_hybrid' with enable_tbo_prefill"):
        check_replica_options(ModelSource.parse(tiny_dir).config(), hybrid, 2)
    with pytest.raises(EngineError, match="speculative_method"):
        engine_options(dict(cudagraph_mode="tr_hybrid", speculative_method="dspark", **cuda))
    params, _ = ModelSource.parse(tiny_dir).load_params(dtype=torch.float32, device="cpu")
    group = open_process_group(GroupSpec(backend="gloo", world=1), 0, dist.HashStore())
    exchange = DPExpertExchange(params.config, group, 0, "gloo")
    layout = RankLayout.build(params.config, engine_options({}))
    with pytest.raises(DPError, match="with the gloo exchange on 'cuda'"):
        DPRank(params, layout, 0, exchange, device="cuda", decode_graphs=BUCKETS)
    with pytest.raises(DPError, match="with the gloo exchange on 'cuda'"):
        DPRank(params, layout, 0, exchange, device="cuda", token_graphs=(2, 8))


def _engine(
    model: Path, buckets: DecodeBuckets | None, token_buckets: tuple[int, ...] | None = None, **options: object
) -> Engine:
    """A one-rank engine in this thread whose runner has decode graphs of ``buckets``
    (on the CPU: the static steps, run eagerly) or none, and token graphs of
    ``token_buckets`` (on the CPU: each part run eagerly on its bucket's buffers) or
    none."""
    parsed = engine_options(options)
    source = ModelSource.parse(model)
    params, tokenizer = source.load_params(dtype=parsed.dtype, device=parsed.device)
    layout = RankLayout.build(params.config, parsed)
    rank = DPRank(
        params,
        layout,
        0,
        None,
        kernels=load_kernels(parsed.kernel_backend),
        batch_invariant=bool(parsed.batch_invariant),
        decoder_replay=parsed.decoder_swa_bounded_replay,
        decode_graphs=buckets,
        token_graphs=token_buckets,
    )
    return Engine(params.config, tokenizer, parsed, 1, LocalRank(rank), None)


def _workload(
    engine: Engine, seed: int, requests: int, longest: int, longest_prompt: int, arrival_steps: int = 12
) -> dict[str, RequestOutput]:
    """``requests`` requests arriving over the first ``arrival_steps`` steps (greedy and seeded sampling,
    logprobs; prompts of at most ``longest_prompt`` tokens, outputs of at most
    ``longest``), stepped to completion; each one's whole output."""
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    arrivals = {}
    for i in range(requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, longest_prompt))]
        params = SamplingParams(
            max_tokens=rng.randrange(3, longest),
            temperature=rng.choice([0.0, 0.8]),
            seed=rng.randrange(1000),
            logprobs=2,
            ignore_eos=True,
        )
        arrivals.setdefault(rng.randrange(0, arrival_steps), []).append((f"r{i}", prompt, params))
    whole = CumulativeOutputs()
    final: dict[str, RequestOutput] = {}
    step = 0
    while len(final) < requests:
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            cumulative = whole.add(out)
            if out.finished:
                final[out.request_id] = cumulative
        step += 1
    return final


def _assert_same_outputs(replayed: dict[str, RequestOutput], eager: dict[str, RequestOutput]) -> None:
    """Every request's tokens and logprobs bit for bit."""
    assert sorted(replayed) == sorted(eager)
    for rid, want in eager.items():
        assert replayed[rid].token_ids == want.token_ids, rid
        assert replayed[rid].logprobs == want.logprobs, rid


def _workload_beyond_once(
    engine: Engine, workload: dict, caplog: pytest.LogCaptureFixture, logger_name: str
) -> dict[str, RequestOutput]:
    """``_workload`` on ``engine``, of which exactly one step (the first beyond the
    largest bucket) was logged as running eagerly."""
    with caplog.at_level(logging.WARNING, logger=logger_name):
        replayed = _workload(engine, **workload)
    beyond = [r for r in caplog.records if "beyond the largest bucket" in r.getMessage()]
    assert len(beyond) == 1, "a step beyond the largest bucket ran eagerly, logged once"
    return replayed


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_decode_steps_at_bucket_widths_give_the_eager_engines_tokens(
    tiny_dir: Path, kernel_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A random workload whose decode batches fill a bucket, fall between buckets (padded)
    and exceed the largest (run eagerly, logged once): every request's tokens and
    logprobs equal the eager engine's bit for bit, and the graph path ran at padded
    widths."""
    if kernel_backend == "triton" and torch.cuda.is_available():
        pytest.skip("with a GPU the Triton kernels run there: test_replayed_graphs_give_the_eager_engines_tokens_on_cuda")
    options = dict(
        block_size=32, max_num_seqs=6, enable_prefix_caching=False, kernel_backend=kernel_backend, num_pages=64
    )
    # Interpreted Triton takes seconds a step whatever its width (every layer's kernels
    # run), so its case runs fewer steps: three requests arriving together (6 steps, 42
    # prompt tokens; the seed is the cheapest of 60 that makes every kind of step) on
    # TRITON_BUCKETS, where they still make full, padded and beyond-bucket batches over
    # two PAGE buckets. The torch case runs every width of BUCKETS. On the CPU a
    # Triton kernel's path depends on the width only through its padding rows (valid
    # mask off) and its PAGE-table columns past a request's PAGEs: the interpreter runs
    # one program per wave, so no key or entry split depends on the rows, and the
    # batch-invariant mode's splits are fixed. A step beyond the largest bucket runs the
    # eager engine's own forward, whatever the backend.
    workload = dict(seed=3, requests=7, longest=40, longest_prompt=70)
    buckets = BUCKETS
    if kernel_backend == "triton":
        workload = dict(seed=TRITON_SEED, requests=3, longest=8, longest_prompt=36, arrival_steps=1)
        buckets = TRITON_BUCKETS
    eager = _workload(_engine(tiny_dir, None, **options), **workload)
    graphs_engine = _engine(tiny_dir, buckets, **options)
    graphs = graphs_engine.runner.graphs
    assert graphs is not None
    widths: list[tuple[int, DecodeWidth]] = []
    run = graphs.run

    def recording(width: DecodeWidth, token_ids: torch.Tensor, *args: object) -> torch.Tensor:
        widths.append((token_ids.numel(), width))
        return run(width, token_ids, *args)

    graphs.run = recording  # type: ignore[method-assign]
    _assert_same_outputs(_workload_beyond_once(graphs_engine, workload, caplog, "dsv41.cluster.cuda_graphs"), eager)
    assert any(n < width.requests for n, width in widths), "some steps ran padded"
    assert any(n == width.requests for n, width in widths), "some steps filled their bucket"
    assert len({width.pages for _, width in widths}) > 1, "several PAGE buckets ran"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_replayed_graphs_give_the_eager_engines_tokens_on_cuda(
    tiny_dir: Path, cuda_engine_options: dict[str, object]
) -> None:
    """On a GPU (Triton kernels, batch-invariant): the engine with cudagraph_mode 'full'
    captures every bucket at startup and its decode steps, replayed, give the eager
    engine's tokens and logprobs bit for bit."""
    options = cuda_engine_options
    eager = _workload(Engine.from_pretrained(tiny_dir, **options), seed=3, requests=7, longest=40, longest_prompt=70)
    engine = Engine.from_pretrained(tiny_dir, cudagraph_mode="full", cudagraph_batch_sizes=(1, 2, 4), **options)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.report is not None
    assert graphs.report.graphs == len(graphs.buckets.widths())
    replays = 0
    run = graphs.run

    def counting(*args: object) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return run(*args)

    graphs.run = counting  # type: ignore[method-assign]
    replayed = _workload(engine, seed=3, requests=7, longest=40, longest_prompt=70)
    assert replays > 0
    _assert_same_outputs(replayed, eager)


@pytest.mark.parametrize("expert_mode", ["ep", "tp"])
def test_dp2_decode_steps_replay_one_width_on_every_rank(
    tiny_dir: Path, expert_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under DP attention (two ranks in threads, gloo, experts sharded) with decode
    graphs: when every rank with rows runs a plain decode, every rank runs the bucket
    of the largest rank's rows and PAGEs (an idle rank replays it on padding alone), so
    the graphs' MoE collectives meet; a step where a rank prefills runs eagerly on
    every rank. Every request's tokens and logprobs equal the eager DP2 replica's bit
    for bit. Options refuse graphs on the CPU (nothing to capture there), so the
    buckets are given to the layout directly: the CPU runs each bucket's static step,
    the function a graph captures."""
    options = dict(block_size=32, max_num_seqs=4, enable_prefix_caching=False, num_pages=64)
    workload = dict(seed=5, requests=6, longest=24, longest_prompt=70)
    eager = _workload(Engine.in_process(tiny_dir, DPLayout(2, expert_mode), **options), **workload)
    monkeypatch.setattr(RankLayout, "decode_buckets", lambda self, config, options: BUCKETS)
    engine = Engine.in_process(tiny_dir, DPLayout(2, expert_mode), **options)
    ranks = engine.executor.ranks
    widths: list[list[tuple[str, DecodeWidth]]] = [[] for _ in ranks]
    for rank, seen in zip(ranks, widths):
        graphs = rank.runner.graphs
        assert graphs is not None
        run, run_padding = graphs.run, graphs.run_padding

        def recording(width: DecodeWidth, token_ids: torch.Tensor, *args: object, _run=run, _seen=seen) -> torch.Tensor:
            _seen.append(("rows", width))
            return _run(width, token_ids, *args)

        def padding(width: DecodeWidth, _run=run_padding, _seen=seen) -> None:
            _seen.append(("padding", width))
            _run(width)

        graphs.run, graphs.run_padding = recording, padding  # type: ignore[method-assign]
    replayed = _workload(engine, **workload)
    _assert_same_outputs(replayed, eager)
    first, second = widths
    assert [w for _, w in first] == [w for _, w in second], "every graph step ran one width on both ranks"
    kinds = {(a, b) for (a, _), (b, _) in zip(first, second)}
    assert ("rows", "rows") in kinds, "both ranks decoded in some graph step"
    assert kinds & {("rows", "padding"), ("padding", "rows")}, "an idle rank replayed padding in some graph step"
    assert ("padding", "padding") not in kinds


def test_default_token_buckets() -> None:
    """Powers of two up to the step's token budget, or 512; given sizes sorted."""
    assert token_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert token_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert token_buckets(8192)[-1] == MAX_DEFAULT_TOKEN_BUCKET
    assert token_buckets(8192, (64, 8)) == (8, 64)
    with pytest.raises(ValueError, match="token buckets"):
        token_buckets(64, (0, 8))


@pytest.mark.parametrize("decoder_replay", [False, True])
def test_token_graph_parts_give_the_eager_engines_tokens(
    tiny_dir: Path, decoder_replay: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """TR_HYBRID on the CPU: a random workload of chunked prefills, decodes and steps of
    both, each layer's token-wise parts run at the narrowest row bucket holding the step
    (or the decoder's rows under decoder replay) with attention between them, and steps
    beyond the largest bucket eagerly (logged once): every request's tokens and
    logprobs equal the eager engine's bit for bit, and the parts ran padded and full."""
    options = dict(
        block_size=32,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        num_pages=64,
        decoder_swa_bounded_replay=decoder_replay,
    )
    workload = dict(seed=11, requests=6, longest=12, longest_prompt=90)
    eager = _workload(_engine(tiny_dir, None, **options), **workload)
    engine = _engine(tiny_dir, None, (2, 8, 32), **options)
    graphs = engine.runner.token_graphs
    assert isinstance(graphs, TokenGraphs)
    assert graphs.report is not None and graphs.report.graphs == 0, "the CPU records nothing"
    rows_at: list[tuple[int, int | None]] = []
    bucket_for = graphs.bucket_for

    def recording(rows: int) -> int | None:
        bucket = bucket_for(rows)
        rows_at.append((rows, bucket))
        return bucket

    graphs.bucket_for = recording  # type: ignore[method-assign]
    _assert_same_outputs(_workload_beyond_once(engine, workload, caplog, "dsv41.cluster.token_graphs"), eager)
    assert any(bucket is not None and rows < bucket for rows, bucket in rows_at), "some parts ran padded"
    assert any(rows == bucket for rows, bucket in rows_at), "some parts filled their bucket"
    assert len({bucket for _, bucket in rows_at if bucket is not None}) == 3, "every bucket ran"


def test_graphs_are_recorded_under_the_runtimes_arithmetic_mode(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA graph keeps the kernels chosen while it was recorded, so every layer's
    token-wise parts (TR_HYBRID) and every decode step (FULL) run at startup under the
    runtime's batch-invariant mode, as its forward runs them at each step. Outside it a
    GPU records cuBLAS's GEMMs and torch's reductions instead of the mode's (on an H100
    TR_HYBRID's parts were recorded so, and its logprobs moved from the eager engine's
    by up to 1.2e-6 while its tokens stayed equal). Here the parts run eagerly at
    startup; each run is checked for the mode."""
    modes: list[bool] = []
    open_layer = PagedRuntime.open_layer

    def checking_open_layer(self: PagedRuntime, *args: object) -> object:
        modes.append(batch_invariant_enabled())
        return open_layer(self, *args)

    monkeypatch.setattr(PagedRuntime, "open_layer", checking_open_layer)
    options = dict(block_size=32, max_num_seqs=4, enable_prefix_caching=False, num_pages=32, batch_invariant=True)
    engine = _engine(tiny_dir, DecodeBuckets(batch_sizes=(1, 2), page_counts=(1,)), (2, 8), **options)
    assert engine.runner.graphs is not None and engine.runner.token_graphs is not None
    layers = len(engine.params.layers)
    # Decode graphs: one forward per width (2); token graphs: one open part per layer per bucket (2).
    assert len(modes) == 2 * layers + 2 * layers
    assert all(modes), modes


@pytest.mark.parametrize("decoder_replay", [False, True])
def test_dp2_token_graph_parts_run_each_steps_buckets_on_every_rank(
    tiny_dir: Path, decoder_replay: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TR_HYBRID under DP attention (two ranks in threads, gloo, experts sharded): every
    rank runs each step's parts at the same buckets, picked from the DP metadata (the
    largest rank's rows; from the decoder's first layer on, its decoder rows), so the
    MoE collectives recorded in the close parts meet; a rank whose rows do not reach a
    layer replays that layer's close part on padding. Every request's tokens and
    logprobs equal the eager DP2 replica's bit for bit. Options refuse graphs on the
    CPU, so the buckets are given to the layout directly (the CPU runs each part, the
    function a graph records)."""
    options = dict(
        block_size=32,
        max_num_seqs=4,
        max_num_batched_tokens=48,
        enable_prefix_caching=False,
        num_pages=64,
        decoder_swa_bounded_replay=decoder_replay,
    )
    workload = dict(seed=7, requests=8, longest=10, longest_prompt=90)
    eager = _workload(Engine.in_process(tiny_dir, DPLayout(2, "ep"), **options), **workload)
    monkeypatch.setattr(RankLayout, "token_buckets", lambda self, options: (2, 4, 8, 16, 24))
    engine = Engine.in_process(tiny_dir, DPLayout(2, "ep"), **options)
    chosen: list[list[tuple[int | None, int | None]]] = []
    padded: list[int] = []
    for rank in engine.executor.ranks:
        graphs = rank.runner.token_graphs
        assert isinstance(graphs, TokenGraphs)
        seen: list[tuple[int | None, int | None]] = []
        chosen.append(seen)
        use, pad = graphs.use_step_buckets, graphs.pad_layer

        def using(encoder: int | None, decoder: int | None, _use=use, _seen=seen) -> None:
            _seen.append((encoder, decoder))
            _use(encoder, decoder)

        def padding(layer: object, moe: object, _pad=pad, _graphs=graphs) -> object:
            if _graphs._step_buckets is not None and any(_graphs._step_buckets):
                padded.append(1)
            return _pad(layer, moe)

        graphs.use_step_buckets, graphs.pad_layer = using, padding  # type: ignore[method-assign]
    _assert_same_outputs(_workload(engine, **workload), eager)
    first, second = chosen
    assert first == second, "every step's buckets were the same on both ranks"
    assert any(encoder is not None for encoder, _ in first), "some steps ran the token graphs"
    assert any(encoder is None for encoder, _ in first), "some steps were beyond the largest bucket"
    if decoder_replay:
        assert any(
            encoder is not None and (decoder is None or decoder < encoder) for encoder, decoder in first
        ), "some steps ran the decoder on fewer rows, at a bucket of their own"
    assert padded, "a rank whose rows did not reach a layer replayed its close part on padding"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_replayed_token_graphs_give_the_eager_engines_tokens_on_cuda(
    tiny_dir: Path, cuda_engine_options: dict[str, object]
) -> None:
    """On a GPU (Triton kernels, batch-invariant): the engine with cudagraph_mode
    'tr_hybrid' records every layer's two parts at every bucket at startup, and its
    steps, prefill and decode alike, give the eager engine's tokens and logprobs bit
    for bit."""
    options = dict(cuda_engine_options, max_num_batched_tokens=64)
    workload = dict(seed=11, requests=6, longest=12, longest_prompt=90)
    eager = _workload(Engine.from_pretrained(tiny_dir, **options), **workload)
    engine = Engine.from_pretrained(tiny_dir, cudagraph_mode="tr_hybrid", cudagraph_batch_sizes=(2, 8, 32), **options)
    graphs = engine.runner.token_graphs
    assert graphs is not None and graphs.report is not None
    assert graphs.report.graphs == 3 * 2 * len(engine.runner.params.layers)
    replayed = _workload(engine, **workload)
    _assert_same_outputs(replayed, eager)
