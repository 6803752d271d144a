"""The engine's public interface: validation, sampling options, outputs, and the
defaults a CPU replica gets (context limit, prefill chunking)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from dsv41.cluster.engine import Engine

from dsv41.cluster.options import CPU_DEFAULT_MAX_MODEL_LEN, EngineError, EngineOptions
from dsv41.cluster.sampling_params import MAX_INT64, MAX_N, SamplingParams, SamplingParamsError
from dsv41.model.reference import ReferenceModel

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_dir, block_size=32, max_num_seqs=8, max_num_batched_tokens=128)


def _prompt(engine: Engine, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, engine.config.vocab_size, (length,), generator=g).tolist()


def _idle(engine: Engine) -> tuple:
    stats = engine.block_manager.stats()
    return (engine.has_unfinished_requests(), stats.requests, stats.slots_used, stats.pages_used - stats.image_pages)


def test_bad_requests_raise_and_queue_nothing(engine: Engine) -> None:
    """Out-of-vocabulary ids, an empty prompt, a prompt beyond the context limit, a
    duplicate id and a non-SamplingParams are refused before anything is queued."""
    before = _idle(engine)
    vocab = engine.config.vocab_size
    with pytest.raises(EngineError, match="prompt_token_ids"):
        engine.add_request("bad-ids", [1, vocab], GREEDY)
    with pytest.raises(EngineError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(SamplingParamsError, match="max_model_len|context"):
        engine.add_request("too-long", [5] * 10, SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(EngineError, match="SamplingParams"):
        engine.add_request("wrong-type", [5], {"max_tokens": 3})  # type: ignore[arg-type]
    engine.add_request("dup", [5, 6], GREEDY)
    with pytest.raises(EngineError, match="already running"):
        engine.add_request("dup", [5, 6], GREEDY)
    assert engine.abort("dup")
    assert _idle(engine) == before == (False, 0, 0, 0)


def test_work_sized_by_a_request_is_refused_before_anything_is_built(engine: Engine) -> None:
    """n = 10**6 cannot reach add_request (SamplingParams refuses n beyond MAX_N at
    once, before a sample id exists), top_k beyond the vocabulary is refused by
    add_request with nothing queued, and top_k beyond int64 by SamplingParams itself,
    before it could reach a tensor."""
    before = _idle(engine)
    start = time.perf_counter()
    with pytest.raises(SamplingParamsError, match=rf"^n: must be an integer in 1\.\.{MAX_N}, got 1000000"):
        SamplingParams(max_tokens=1, n=10**6)
    assert time.perf_counter() - start < 0.1
    with pytest.raises(SamplingParamsError, match=rf"^top_k: .*1\.\.{engine.config.vocab_size}\)"):
        engine.add_request("wide", [5, 6], SamplingParams(max_tokens=1, temperature=0.7, top_k=engine.config.vocab_size + 1))
    with pytest.raises(SamplingParamsError, match="^top_k:"):
        SamplingParams(max_tokens=2, temperature=0.7, top_k=MAX_INT64 + 1)
    assert _idle(engine) == before


def test_cpu_defaults_bound_the_context_and_chunk_long_prefills(tiny_dir: Path) -> None:
    """Without options a CPU replica of the tiny model (1,048,576 positions) serves
    CPU_DEFAULT_MAX_MODEL_LEN tokens, an explicit max_model_len wins, and
    long_prefill_token_threshold defaults to half the step budget (0 keeps it off)."""
    assert Engine.from_pretrained(tiny_dir).max_model_len == CPU_DEFAULT_MAX_MODEL_LEN
    assert Engine.from_pretrained(tiny_dir, max_model_len=8192).max_model_len == 8192
    assert EngineOptions(max_num_batched_tokens=512).long_prefill_token_threshold == 256
    assert EngineOptions(long_prefill_token_threshold=0).long_prefill_token_threshold == 0
    with pytest.raises(EngineError, match="long_prefill_token_threshold"):
        EngineOptions(long_prefill_token_threshold=-1)


def test_a_short_request_is_admitted_next_to_a_long_prefill(engine: Engine) -> None:
    """With the default threshold a long prefill takes at most half of a step's token
    budget, so a short request that arrives behind it is admitted at the next step
    and has its first token while the long one is still prefilling."""
    budget = engine.options.max_num_batched_tokens
    long_prompt = _prompt(engine, 6 * budget, 1)
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
    engine.step()
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0.0))
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["short"]
    assert engine.request("long").num_computed_tokens == budget
    assert engine.abort("long")


def test_unknown_engine_options_are_refused(tiny_dir: Path) -> None:
    """A misspelt option is an error naming the allowed ones, not silently ignored."""
    with pytest.raises(EngineError, match="max_num_seq"):
        Engine.from_pretrained(tiny_dir, max_num_seq=4)
    with pytest.raises(EngineError, match="kv_cache_dtype"):
        Engine.from_pretrained(tiny_dir, kv_cache_dtype="fp8")


def test_seeded_sampling_is_reproducible_and_batch_invariant(engine: Engine) -> None:
    """A seeded request draws the same tokens alone and inside a batch of others."""
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    prompt = _prompt(engine, 40, 1)
    alone = engine.generate([prompt], params)[0].token_ids
    others = [_prompt(engine, n, 10 + n) for n in (5, 70, 33)]
    engine.add_request("o1", others[0], GREEDY)
    engine.add_request("o2", others[1], SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True))
    batched = engine.generate([others[2], prompt], params)[1].token_ids
    while engine.has_unfinished_requests():
        engine.step()
    assert alone == batched


def test_n_samples_have_distinct_ids_and_streams(engine: Engine) -> None:
    """n=3 gives three sequences, ids {id}#i, reproducible for a fixed seed."""
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=7, n=3, ignore_eos=True)
    first = engine.generate([_prompt(engine, 20, 2)], params)
    again = engine.generate([_prompt(engine, 20, 2)], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({o.token_ids for o in first}) > 1
    assert all(o.request_id.endswith(f"#{i}") for i, o in enumerate(first))


def test_stop_token_ids_and_stop_strings_end_generation(engine: Engine) -> None:
    """A stop token id ends the request at that token with reason "stop"; a stop
    string cuts the text before it."""
    prompt = _prompt(engine, 30, 3)
    free = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    stop_at = free.token_ids[2]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop_at]))[0]
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    text = free.text
    if len(text) >= 4:
        needle = text[2:4]
        cut = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, stop=[needle], ignore_eos=True))[0]
        assert cut.finish_reason == "stop" and cut.text == text[: text.index(needle)]


def test_logprobs_and_prompt_logprobs_match_the_reference(engine: Engine) -> None:
    """Sampled-token logprobs and prompt logprobs are the log-softmax of the model's
    logits (checked against the dense reference)."""
    prompt = _prompt(engine, 45, 4)
    out = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=1, ignore_eos=True))[0]
    reference = ReferenceModel(engine.params)
    logits = reference.forward(list(prompt) + list(out.token_ids[:-1])).logits
    logp = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(out.token_ids):
        entry = out.logprobs[i]
        assert token in entry and len(entry) >= 2
        assert entry[token] == pytest.approx(float(logp[len(prompt) - 1 + i, token]), abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        assert out.prompt_logprobs[pos][prompt[pos]] == pytest.approx(float(logp[pos - 1, prompt[pos]]), abs=1e-4)


def test_abort_frees_everything_and_reports_unknown_ids(engine: Engine) -> None:
    """Aborting a running request frees its PAGEs and slot; unknown ids answer False.
    The engine has work left until one more step tells the rank the request left
    (``has_unfinished_requests``), and after that step the rank holds nothing."""
    engine.add_request("victim", _prompt(engine, 100, 5), GREEDY)
    engine.step()
    assert engine.request("victim") is not None
    assert engine.abort("victim")
    assert not engine.abort("victim") and not engine.abort("never-seen")
    stats = engine.block_manager.stats()
    assert stats.requests == 0 and stats.slots_used == 0
    assert engine.has_unfinished_requests() and engine.step() == []
    assert not engine.has_unfinished_requests() and len(engine.executor.runner.requests) == 0
