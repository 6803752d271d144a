"""DSpark speculation in the engine (cluster/speculative.py): the tokens are the ones
decoding without it emits, the drafts are the model-level drafter's, rejected rows leave
nothing a later row reads, sampling follows the rejection-sampling rule, and what the
spec refuses is refused before any weight is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2

from dsv41.cluster.engine import Engine
from dsv41.cluster.options import EngineError
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.cluster.validate import SCHEDULER_SCENARIOS, ReplicaShape, run_validation
from dsv41.model.dspark import ReferenceDrafter
from dsv41.model.reference import ReferenceModel

BLOCK = 32


def _engine(model: Path, **options: object) -> Engine:
    settings: dict[str, object] = {"block_size": BLOCK, "num_pages": 64, "max_num_seqs": 16, "max_num_batched_tokens": 64}
    return Engine.from_pretrained(model, **(settings | options))


def _per_step_tokens(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """How many tokens the request gained at each step it gained some."""
    engine.add_request(request_id, prompt, params)
    gained = []
    while engine.has_unfinished_requests():
        gained += [len(out.token_ids) for out in engine.step() if out.request_id == request_id and out.token_ids]
    return gained


def _speculation(engine: Engine) -> tuple[int, int, int]:
    s = engine.scheduler
    return s.num_verifies, s.num_drafts_verified, s.num_drafts_accepted


def test_speculative_greedy_is_plain_greedy_in_every_validation_scenario(trained_tiny_dir: Path) -> None:
    """`dsv41 validate --method dspark`'s scenarios on the trained checkpoint (chunked
    and reordered, prefix forks, replay from a missing image, preemption, a tight pool
    with an abort, cancellation at every point including between a draft and its
    verify, slot recycling, replay hits): every request speculating finishes with the
    tokens of its uninterrupted run without speculation, every PAGE and slot released."""
    report = run_validation(trained_tiny_dir, shape=ReplicaShape(speculative_method="dspark"), block_size=BLOCK)
    failed = {s["name"]: {k: v for k, v in s["checks"].items() if not v} for s in report["scenarios"] if not s["passed"]}
    assert report["passed"], failed
    assert {s["name"] for s in report["scenarios"]} == set(SCHEDULER_SCENARIOS)


def test_the_engines_drafts_are_the_reference_drafters(trained_tiny_dir: Path, code_prompt: str) -> None:
    """With full prefills (decoder replay off) the paged drafter reads what the dense
    ReferenceDrafter reads, so the engine accepts exactly the drafts its speculative
    greedy loop accepts, verification after verification, and emits the same tokens;
    and the drafts are useful: more than one of five accepted per verification on
    this prompt (the reference loop's own figure, tests/model/test_dspark.py)."""
    engine = _engine(trained_tiny_dir, speculative_method="dspark", decoder_swa_bounded_replay=False)
    prompt = engine.tokenizer.encode(code_prompt).ids
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    gained = _per_step_tokens(engine, "code", prompt, params)
    run = ReferenceDrafter(ReferenceModel(engine.params, batch_invariant=True)).speculative_greedy(prompt, 40)
    assert gained[0] == 1  # the prefill's token
    verifies = [n - 1 for n in gained[1:]]
    # The engine drafts no further than max_tokens: its last verification may hold fewer.
    assert verifies[:-1] == run.accepted[: len(verifies) - 1]
    assert sum(run.accepted[: len(verifies) - 1]) / (len(verifies) - 1) > 1.0, run.accepted


def test_random_weights_accept_almost_nothing_and_stay_exact(tiny_dir: Path) -> None:
    """On a random checkpoint (make-tiny) the drafter's stages, Markov and confidence
    heads and feature projection are random, unrelated to the target (only embedding
    and head are shared), so a draft equals the target's argmax about as often as a
    guess: under 5% of the drafts are accepted, and speculative greedy is still plain
    greedy, here with chunked prefills and decoder replay off (every row's stage keys)."""
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 40, 70)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = {"decoder_swa_bounded_replay": False, "max_num_batched_tokens": 24}
    plain = [o.token_ids for o in _engine(tiny_dir, **options).generate(prompts, params)]
    engine = _engine(tiny_dir, speculative_method="dspark", **options)
    assert [o.token_ids for o in engine.generate(prompts, params)] == plain
    verifies, drafts, accepted = _speculation(engine)
    assert verifies > 0 and accepted / drafts < 0.05, (verifies, drafts, accepted)


def _slot_state(engine: Engine, request_id: str) -> tuple[int, dict[str, torch.Tensor]]:
    """A request's committed position and everything of its state a later row can
    read: the cursor, every target ring's last window of rows by position, the
    committed compressor tails (when a token is pending), every visible entry of each
    Full owner's main and index planes."""
    runner, bm = engine.runner, engine.block_manager
    pools, geometry = runner.pools, runner.geometry
    slot, table = bm.slot(request_id), bm.page_table(request_id)
    cursor = pools.cursor[slot].clone()
    end = int(cursor[0])
    window = engine.config.sliding_window
    positions = torch.arange(max(0, end - window), end)
    state = {"cursor": cursor}
    for layer in range(geometry.num_layers):
        state[f"ring {layer}"] = pools.swa_ring(layer)[slot, positions % geometry.ring_rows].clone()
    if end % 2:
        for owner in geometry.tail_owners:
            state[f"tail {owner}"] = pools.compressor_tail(owner)[slot, 0].clone()
    for owner, ratio in zip(geometry.full_owners, geometry.owner_ratios):
        per_page = BLOCK // ratio
        entries = torch.arange(end // ratio)
        pages = torch.tensor(table, dtype=torch.long)[entries // per_page]
        rows = entries % per_page
        state[f"main {owner}"] = pools.main_kv(owner)[pages, rows].clone()
        state[f"index {owner}"] = pools.index_values(owner)[pages, rows].clone()
        state[f"index scales {owner}"] = pools.index_scales(owner)[pages, rows].clone()
    return end, state


def test_rejected_rows_leave_nothing_a_later_row_reads(trained_tiny_dir: Path, code_prompt: str) -> None:
    """After every step of a speculating request, what any later row of it can read —
    cursor (position and Engram history), each ring's window, the committed compressor
    tail, each visible compressed entry and index key — equals, bit for bit, the state
    of the same request decoded without speculation at the same committed position:
    the rejected drafts of every verification left no trace there."""
    prompt = _engine(trained_tiny_dir).tokenizer.encode(code_prompt).ids[:45]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, spec = _engine(trained_tiny_dir), _engine(trained_tiny_dir, speculative_method="dspark")
    expected: dict[int, dict[str, torch.Tensor]] = {}
    plain.add_request("r", prompt, params)
    while plain.has_unfinished_requests():
        plain.step()
        if plain.request("r") is not None:
            end, state = _slot_state(plain, "r")
            expected[end] = state
    spec.add_request("r", prompt, params)
    compared = 0
    while spec.has_unfinished_requests():
        spec.step()
        if spec.request("r") is not None:
            end, state = _slot_state(spec, "r")
            for name, value in state.items():
                assert torch.equal(value, expected[end][name]), (end, name)
            compared += 1
    verifies, drafts, accepted = _speculation(spec)
    assert compared > 2 and 0 < accepted < drafts, (compared, verifies, drafts, accepted)


def test_seeded_sampling_emits_the_tokens_of_decoding_without_speculation(trained_tiny_dir: Path, code_prompt: str) -> None:
    """Each verify row draws the target's token with the request's counter-based noise
    at the output index that token has, so seeded sampling (temperature, top-k, top-p,
    logprobs) speculating emits exactly the tokens and logprobs decoding without it
    does, while drafts are both accepted and rejected."""
    engine = _engine(trained_tiny_dir)
    prompts = [engine.tokenizer.encode(code_prompt).ids[:n] for n in (20, 33, 61)]
    params = SamplingParams(max_tokens=30, temperature=0.7, top_k=20, top_p=0.95, seed=5, logprobs=2, ignore_eos=True)
    plain = engine.generate(prompts, params)
    spec_engine = _engine(trained_tiny_dir, speculative_method="dspark")
    spec = spec_engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.logprobs for o in spec] == [o.logprobs for o in plain]
    _, drafts, accepted = _speculation(spec_engine)
    assert 0 < accepted < drafts


def test_a_stop_inside_the_accepted_drafts_ends_the_request_there(trained_tiny_dir: Path, code_prompt: str) -> None:
    """A stop token or stop string among a verify's accepted drafts ends the request
    at it, as decoding without speculation does: the same tokens, text, finish and
    stop reasons, and the drafts after it are dropped with the request's PAGEs."""
    engine = _engine(trained_tiny_dir)
    prompt = engine.tokenizer.encode(code_prompt).ids[:50]
    free = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].token_ids
    text = engine.tokenizer.decode(list(free[:20]))
    cases = [
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[free[9]]),
        SamplingParams(max_tokens=40, temperature=0.0, stop=[text[-3:]]),
    ]
    spec = _engine(trained_tiny_dir, speculative_method="dspark")
    for params in cases:
        want, got = engine.generate([prompt], params)[0], spec.generate([prompt], params)[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason
        )
        assert len(got.token_ids) < 40
    stats = spec.block_manager.stats()
    assert stats.requests == stats.slots_used == 0


# The distribution test: TRIALS requests with distinct seeds, their first two tokens.
TRIALS = 1200
FALSE_FAILURE_RATE = 1e-3
TEMPERATURE, TOP_K = 1.0, 3


def test_seeded_sampling_follows_the_rejection_sampling_law(trained_tiny_dir: Path, code_prompt: str) -> None:
    """The second token of a request is the first its verify emits: the draft d after
    the first token x1 is kept when the target's draw is d (probability p(d)), else the
    draw, from p without d: the standard rejection rule for a one-hot draft. Over 1,200
    seeds (temperature 1, top-k 3) the histogram of (x1, x2) is tested against p(x1)
    p(x2 | x1), computed from the engine's own logits without speculation, by Pearson's
    chi-square on the cells with expected count >= 5 (the others pooled); the
    threshold is the 1e-3 upper quantile, so a correct rule fails one run in 1,000. The
    check that drafts were both kept and rejected makes both branches count."""
    # Full prefills: the law's logits are Engine.prompt_logits', which are a full prefill's.
    full = {"decoder_swa_bounded_replay": False}
    spec = _engine(trained_tiny_dir, speculative_method="dspark", max_num_seqs=64, max_num_batched_tokens=512, **full)
    prompt = spec.tokenizer.encode(code_prompt).ids[:12]
    # Three tokens: the step after the prefill then verifies one draft (the last token
    # to generate is never drafted past).
    for i in range(TRIALS):
        spec.add_request(f"s{i}", prompt, SamplingParams(max_tokens=3, temperature=TEMPERATURE, top_k=TOP_K, seed=1000 + i))
    pairs: dict[str, list[int]] = {}
    while spec.has_unfinished_requests():
        for out in spec.step():
            pairs.setdefault(out.request_id, []).extend(out.token_ids)
    _, drafts, accepted = _speculation(spec)
    assert 0 < accepted < drafts, (drafts, accepted)

    plain = _engine(trained_tiny_dir, enable_prefix_caching=False, **full)

    def law(prefix: list[int]) -> torch.Tensor:
        logits = plain.prompt_logits(prefix).logits[-1].double() / TEMPERATURE
        top = logits.topk(TOP_K)
        return torch.zeros_like(logits).index_put_((top.indices,), torch.softmax(top.values, -1))

    first = law(prompt)
    cells = {}
    for x1 in torch.nonzero(first).squeeze(1).tolist():
        second = law(prompt + [x1])
        for x2 in torch.nonzero(second).squeeze(1).tolist():
            cells[(x1, x2)] = float(first[x1] * second[x2]) * TRIALS
    observed = {cell: 0 for cell in cells}
    for tokens in pairs.values():
        observed[tuple(tokens[:2])] += 1  # a pair outside the law's support fails here
    big = [c for c, e in cells.items() if e >= 5]
    pooled_expected = sum(e for c, e in cells.items() if c not in big)
    pooled_observed = sum(o for c, o in observed.items() if c not in big)
    statistic = sum((observed[c] - cells[c]) ** 2 / cells[c] for c in big)
    bins = len(big)
    if pooled_expected >= 5:
        statistic += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        bins += 1
    assert bins >= 3, cells
    assert statistic < chi2.isf(FALSE_FAILURE_RATE, df=bins - 1), (statistic, bins, observed, cells)


def test_refusals_come_before_any_weight_is_read(trained_tiny_dir: Path, tmp_path: Path) -> None:
    """Speculation with packed caches, an unknown method, a count without a method or
    other than the checkpoint's block, a checkpoint without DSpark stages, and DP
    ranks are refused naming the reason, from a directory whose weights are gone (so
    nothing was loaded)."""
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(trained_tiny_dir / name, no_weights / name)
    cases = [
        ({"speculative_method": "dspark", "kv_cache_dtype": "fp4"}, "packed speculative caches"),
        ({"speculative_method": "dspark", "index_cache_dtype": "fp4"}, "packed speculative caches"),
        ({"speculative_method": "eagle"}, "speculative_method: 'eagle'"),
        ({"num_speculative_tokens": 5}, "without speculative_method"),
        ({"speculative_method": "dspark", "num_speculative_tokens": 0}, "num_speculative_tokens: 0"),
        ({"speculative_method": "dspark", "num_speculative_tokens": 4}, "allowed: 5, the checkpoint's dspark_block_size"),
    ]
    for options, message in cases:
        with pytest.raises(EngineError, match=message):
            Engine.from_pretrained(no_weights, **options)
    with pytest.raises(EngineError, match="DP ranks"):
        Engine.in_process(no_weights, DPLayout(2), speculative_method="dspark")
    config = json.loads((no_weights / "config.json").read_text())
    text = config.get("text_config", config)
    text["num_nextn_predict_layers"] = 0
    text["compress_ratios"] = text["compress_ratios"][: text["num_hidden_layers"]]
    (no_weights / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match="no DSpark stages"):
        Engine.from_pretrained(no_weights, speculative_method="dspark")
