"""Decoder SWA bounded replay in the paged runtime == its dense oracle, bit for bit
(batch-invariant mode, fp32, CPU).

The runner derives each segment's decoder rows (cluster/runner.decoder_view): where a
segment states its prompt's length, the decoder runs every prompt row from the tail
on in whichever forward computes it, so every chunking gives the oracle's last logits,
decoder rings and selections; where it does not (what today's scheduler sends), only
the forward finishing the prompt runs the decoder, and it must hold the tail. With the
option off nothing changes (tests/cluster/test_runtime_parity.py runs that way); the
prompt logits of ``Engine.prompt_logits`` and of prompt-logprobs requests are the full
prefill's either way. Through the real scheduler: generation and a preempted request's
recompute equal the oracle / the uninterrupted run, and a threaded DP2 replica equals
one rank.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Sequence

import pytest
import torch

from dsv41.cluster.batch import NewRequestData, ScheduledBatch, ScheduledSegment, SlotReset
from dsv41.cluster.engine import Engine
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.request import CumulativeOutputs, RequestOutput
from dsv41.cluster.runner import DecoderReplayError, ModelRunner
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.indexer import EMPTY
from dsv41.model.kernels.torch_backend import gather_plane_rows
from dsv41.model.reference import ReferenceModel, ReferenceOutput
from dsv41.model.runtime import StepOutput

REPLAY = dict(block_size=32, enable_prefix_caching=False, max_num_seqs=4, decoder_swa_bounded_replay=True)
RAGGED = ((3, 1, 129, 7, 128), (3, 1, 29, 7))


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    replay = Engine.from_pretrained(tiny_dir, **REPLAY)
    assert replay.options.batch_invariant, "the CPU default"
    return replay


def _runner(engine: Engine) -> ModelRunner:
    return engine.runner


def _prefill(engine: Engine, prompt: list[int], chunks: Sequence[int] | None) -> tuple[list[StepOutput], int]:
    """Feeds ``prompt`` to the runner in ``chunks`` (cycling; None: one chunk), the
    last one sampling, outside the scheduler. Returns every forward's StepOutput (the
    real forward, recorded on its way out) and the slot, which the caller frees with
    the request."""
    runner = _runner(engine)
    outputs: list[StepOutput] = []
    forward = runner.runtime.forward

    @functools.wraps(forward)
    def recording(*args: object, **kwargs: object) -> StepOutput:
        out = forward(*args, **kwargs)
        outputs.append(out)
        return out

    bm = engine.block_manager
    assert bm.allocate_prompt("replay", prompt, bm.miss(prompt))
    table = bm.page_table("replay")
    sizes = itertools.cycle(chunks or (len(prompt),))
    runner.runtime.forward = recording  # type: ignore[method-assign]
    try:
        start = 0
        while start < len(prompt):
            end = min(start + next(sizes), len(prompt))
            seg = ScheduledSegment(
                request_id="replay",
                slot=bm.slot("replay"),
                start=start,
                token_ids=tuple(prompt[start:end]),
                write_from=0,
                window_start=0,
                sample=end == len(prompt),
                output_index=0,
                num_prompt_tokens=len(prompt),
                new_pages=table if start == 0 else (),
                kept_pages=0 if start == 0 else len(table),
                new_request=NewRequestData(SamplingParams(max_tokens=1, temperature=0.0), 0) if start == 0 else None,
                reset=SlotReset(position=0, history_token_ids=()) if start == 0 else None,
            )
            engine.runner.execute(ScheduledBatch(step_id=-1, segments=(seg,)))
            start = end
    finally:
        del runner.runtime.forward
        runner.requests.release(("replay",))
    return outputs, bm.slot("replay")


def _ring_rows(engine: Engine, layer: int, slot: int, positions: range) -> torch.Tensor:
    runner = _runner(engine)
    ring = runner.shape.ring_rows
    flat = torch.tensor([slot * ring + p % ring for p in positions])
    return gather_plane_rows(runner.store.window_plane(layer), flat).float()


def _assert_replay_equals_oracle(
    engine: Engine, prompt: list[int], want: ReferenceOutput, outputs: list[StepOutput], slot: int
) -> None:
    cfg = engine.config
    topology = cfg.topology
    length = len(prompt)
    tail = want.tail_start
    assert torch.equal(outputs[-1].logits, want.logits)
    window = min(cfg.sliding_window, _runner(engine).shape.ring_rows)
    for layer in topology.target_layers:
        first = tail if layer.is_decoder else 0
        held = range(max(first, length - window), length)
        kv = want.window_kv[layer.layer_id][held.start - first :]
        assert torch.equal(_ring_rows(engine, layer.layer_id, slot, held), kv.float()), f"ring of layer {layer.layer_id}"
    for layer, selected in want.selections.items():
        got = torch.cat([out.selections[layer] for out in outputs if layer in out.selections])
        rows = got.shape[0] - selected.shape[0]
        assert torch.equal(got[rows:], selected), f"selections of layer {layer}"
        assert bool((got[:rows] == EMPTY).all()), f"layer {layer} selected for a row it did not run"


@pytest.mark.parametrize("chunks", [*RAGGED, (16,), (1,), None], ids=str)
def test_paged_replay_equals_the_oracle_at_every_chunking(engine: Engine, chunks: tuple[int, ...] | None) -> None:
    """Segments stating the prompt's length: whatever the chunking (short last
    chunks, a tail split across forwards, one row per forward), the finishing
    forward's logits, every layer's ring rows and every selection (over the rows each
    layer ran; EMPTY elsewhere) equal the oracle's bit for bit."""
    length = 120 if chunks == (1,) else 300
    prompt = _prompt(engine.config.vocab_size, length, 7)
    want = ReferenceModel(engine.params).forward(prompt, decoder_replay=True)
    assert want.tail_start == length - engine.config.sliding_window
    try:
        outputs, slot = _prefill(engine, prompt, chunks)
        _assert_replay_equals_oracle(engine, prompt, want, outputs, slot)
    finally:
        engine.block_manager.free("replay")


def test_a_fresh_slot_resuming_above_the_tail_is_refused(engine: Engine) -> None:
    """A forward that resets (or restores) its slot above the prompt's tail would need
    decoder rows nothing computed: the runner refuses it before anything is written,
    naming the positions."""
    prompt = _prompt(engine.config.vocab_size, 100, 10)
    bm = engine.block_manager
    assert bm.allocate_prompt("above-tail", prompt, bm.miss(prompt))
    start = len(prompt) - engine.config.sliding_window + 4
    seg = ScheduledSegment(
        request_id="above-tail",
        slot=bm.slot("above-tail"),
        start=start,
        token_ids=tuple(prompt[start:]),
        write_from=0,
        window_start=start,
        sample=True,
        output_index=0,
        num_prompt_tokens=len(prompt),
        new_pages=bm.page_table("above-tail"),
        kept_pages=0,
        new_request=NewRequestData(SamplingParams(max_tokens=1, temperature=0.0), 0),
        reset=SlotReset(position=start, history_token_ids=tuple(prompt[start - 2 : start])),
    )
    try:
        with pytest.raises(DecoderReplayError, match=rf"\[{start - 4}, {start}\)"):
            engine.runner.execute(ScheduledBatch(step_id=-1, segments=(seg,)))
    finally:
        bm.free("above-tail")
        engine.runner.requests.release(("above-tail",))


def test_a_short_prompt_replays_as_the_full_prefill(engine: Engine) -> None:
    """A prompt of at most W tokens is its own tail: chunked or whole, the replayed
    logits are the full prefill's last row."""
    prompt = _prompt(engine.config.vocab_size, 30, 9)
    full = ReferenceModel(engine.params).forward(prompt)
    for chunks in ((7,), None):
        try:
            outputs, _ = _prefill(engine, prompt, chunks)
            assert torch.equal(outputs[-1].logits, full.logits[-1:])
        finally:
            engine.block_manager.free("replay")


def test_prompt_logits_and_prompt_logprobs_run_the_full_prefill(engine: Engine, tiny_dir: Path) -> None:
    """Prompt logits need every row: Engine.prompt_logits under replay equals the
    full reference at a ragged chunking, and a prompt-logprobs request generates what
    it generates with replay off (its whole prompt runs the full prefill)."""
    prompt = _prompt(engine.config.vocab_size, 150, 10)
    full = ReferenceModel(engine.params).forward(prompt)
    assert torch.equal(engine.prompt_logits(prompt, chunk_sizes=RAGGED[0]).logits, full.logits)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    off = Engine.from_pretrained(tiny_dir, **{**REPLAY, "decoder_swa_bounded_replay": False})
    got, expected = engine.generate([prompt], params)[0], off.generate([prompt], params)[0]
    assert (got.token_ids, got.logprobs, got.prompt_logprobs) == (
        expected.token_ids,
        expected.logprobs,
        expected.prompt_logprobs,
    )


def _oracle_logprobs(reference: ReferenceModel, prompt: list[int], out: RequestOutput) -> torch.Tensor:
    tokens = list(prompt) + list(out.token_ids[:-1])
    return torch.log_softmax(reference.forward(tokens, decoder_replay=True, prompt_len=len(prompt)).logits, dim=-1)


def test_generation_equals_the_oracle_through_the_scheduler(engine: Engine) -> None:
    """Requests arriving while others decode (a prefill's tail beside decode rows in
    one step) generate the oracle's greedy tokens, and their logprobs are the log
    softmax of the oracle's logits: prefill by replay, then decode steps reading the
    rings the tail wrote."""
    vocab = engine.config.vocab_size
    prompts = {f"r{i}": _prompt(vocab, n, 20 + i) for i, n in enumerate((150, 20, 77, 33))}
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    finished: dict[str, RequestOutput] = {}
    whole = CumulativeOutputs()

    def step() -> None:
        for out in engine.step():
            cumulative = whole.add(out)
            if out.finished:
                finished[out.request_id] = cumulative

    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
        step()
    while engine.has_unfinished_requests():
        step()
    reference = ReferenceModel(engine.params)
    for rid, prompt in prompts.items():
        out = finished[rid]
        logp = _oracle_logprobs(reference, prompt, out)
        assert list(out.token_ids) == logp.argmax(dim=-1).tolist(), rid
        for i, token in enumerate(out.token_ids):
            assert out.logprobs[i][token] == float(logp[i, token]), (rid, i)


def test_a_preempted_request_recomputes_its_replayed_state_exactly(tiny_dir: Path) -> None:
    """PAGEs for one request's growth only: the newer of two is preempted while
    decoding and recomputes its prompt and generated tokens in one forward, whose
    decoder runs from the prompt's tail (not the recompute's last W rows), so both
    finish with the tokens and logprobs of their uninterrupted runs."""
    options = {**REPLAY, "max_num_batched_tokens": 512}
    vocab = Engine.from_pretrained(tiny_dir, **options).config.vocab_size
    prompts = [_prompt(vocab, 60, 30), _prompt(vocab, 58, 31)]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    alone = [Engine.from_pretrained(tiny_dir, **options).generate([p], params)[0] for p in prompts]
    tight = Engine.from_pretrained(tiny_dir, **{**options, "num_pages": 5})
    together = tight.generate(prompts, params)
    assert tight.stats().preemptions[0] > 0
    assert [(o.token_ids, o.logprobs) for o in together] == [(o.token_ids, o.logprobs) for o in alone]


def test_threaded_dp2_with_replay_equals_one_rank(tiny_dir: Path) -> None:
    """An EP DP2 replica in threads with replay on generates the one-rank engine's
    tokens and logprobs for requests arriving at set steps: steps where a rank runs
    a tail while the other idles (padding) or runs only a first chunk (no decoder
    row: its decoder MoE on zero rows), and steps no rank's rows reach the decoder in
    (its collectives skipped alike)."""
    options = {**REPLAY, "max_num_batched_tokens": 256}
    engine = Engine.from_pretrained(tiny_dir, **options)
    vocab = engine.config.vocab_size
    arrivals = {0: 300, 1: 20, 8: 40, 9: 290, 10: 70}
    prompts = {step: _prompt(vocab, n, 40 + step) for step, n in arrivals.items()}
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True)
    want = dict(zip(prompts, engine.generate(list(prompts.values()), params)))
    dp = Engine.in_process(tiny_dir, DPLayout(2, "ep"), **options)
    got: dict[int, RequestOutput] = {}
    whole = CumulativeOutputs()
    step = 0
    while step <= max(arrivals) or dp.has_unfinished_requests():
        if step in prompts:
            dp.add_request(f"r{step}", prompts[step], params)
        for out in dp.step():
            cumulative = whole.add(out)
            if out.finished:
                got[int(out.request_id[1:])] = cumulative
        step += 1
    assert {k: (o.token_ids, o.logprobs) for k, o in got.items()} == {
        k: (o.token_ids, o.logprobs) for k, o in want.items()
    }
