"""Tests of cluster.sampler: greedy, filters, seeded batch-invariant draws, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cluster.sampler import (
    Sampler,
    SamplerError,
    SamplingMetadata,
    prompt_logprobs,
    splitmix64_draw,
)
from dsv41.cluster.sampling_params import SamplingParams

U64 = (1 << 64) - 1


def _reference_splitmix64(state: int, index: int) -> int:
    """The textbook generator in unbounded integers: advance index + 1 times, mix."""
    z = (state + (index + 1) * 0x9E3779B97F4A7C15) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def test_splitmix64_known_first_output() -> None:
    """State 0's first output is splitmix64's published first value."""
    assert splitmix64_draw(torch.tensor(0), torch.tensor(0)).item() & U64 == 0xE220A8397B1DCDAF


@given(
    states=st.lists(st.integers(0, U64), min_size=1, max_size=16),
    indices=st.lists(st.integers(0, 2**40), min_size=1, max_size=16),
)
def test_splitmix64_int64_arithmetic_equals_unsigned_reference(states: list[int], indices: list[int]) -> None:
    """The int64 tensor evaluation (wrapping products, emulated logical shifts) gives
    the unsigned 64-bit generator's bits for every state and index."""
    got = splitmix64_draw(
        torch.tensor([_signed(s) for s in states]).unsqueeze(1), torch.tensor(indices).unsqueeze(0)
    )
    expected = [[_reference_splitmix64(s, i) for i in indices] for s in states]
    assert [[v & U64 for v in row] for row in got.tolist()] == expected


def _metadata(params: list[SamplingParams], seeds: list[int], output_indices: list[int]) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, seeds, output_indices)


# Logits on a coarse grid so that ties are common and the tie rule is exercised.
tied_logits = st.integers(1, 6).flatmap(
    lambda rows: st.integers(2, 40).flatmap(
        lambda vocab: st.lists(
            st.lists(st.integers(-4, 4).map(lambda v: v / 2), min_size=vocab, max_size=vocab),
            min_size=rows,
            max_size=rows,
        )
    )
)


@given(tied_logits)
def test_greedy_is_argmax_with_smallest_id_on_ties(rows: list[list[float]]) -> None:
    """Temperature 0 takes the first (smallest-id) maximum of each row."""
    logits = torch.tensor(rows, dtype=torch.float32)
    params = [SamplingParams(temperature=0)] * len(rows)
    out = Sampler(logits.shape[1])(logits, _metadata(params, [0] * len(rows), [0] * len(rows)))
    assert out.token_ids.tolist() == [int(np.argmax(np.array(r))) for r in rows]
    assert out.logprobs == (None,) * len(rows)


@given(
    tied_logits,
    st.floats(0.05, 5.0),
    st.lists(st.integers(0, 2**63 - 1), min_size=6, max_size=6),
    st.sampled_from(["top_k", "top_p"]),
)
def test_top_k_one_and_tiny_top_p_equal_greedy(
    rows: list[list[float]], temperature: float, seeds: list[int], which: str
) -> None:
    """top_k=1, or a top_p too small to admit a second token, leaves only the greedy
    token (ties included: the cut keeps the smallest id), whatever the seed and
    temperature."""
    logits = torch.tensor(rows, dtype=torch.float32)
    filter_kwargs = {"top_k": 1} if which == "top_k" else {"top_p": 1e-9}
    params = [SamplingParams(temperature=temperature, **filter_kwargs)] * len(rows)
    out = Sampler(logits.shape[1])(logits, _metadata(params, seeds[: len(rows)], list(range(len(rows)))))
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


VOCAB = 64
STEPS = 20
TARGET = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234)
OTHER_PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.3, seed=7),
    SamplingParams(temperature=0.5, top_p=0.5, seed=99),
    SamplingParams(temperature=1.0, top_k=5, seed=1234),
]


def _target_logits(step: int, previous_token: int) -> torch.Tensor:
    """A stand-in model: the row depends on the step and the previous token, so one
    differing draw changes every later row."""
    generator = torch.Generator().manual_seed(step * 1000 + previous_token)
    return torch.randn(VOCAB, generator=generator) * 2


def _generate(target_row: int | None, shuffle_seed: int | None) -> list[int]:
    """Run the target request for STEPS steps, alone (target_row None) or in a batch of
    five at target_row, optionally with a fresh random row order every step; the
    other rows have their own params, seeds, output indices and random logits."""
    sampler = Sampler(VOCAB)
    filler = torch.Generator().manual_seed(5)
    order_rng = np.random.default_rng(shuffle_seed)
    tokens: list[int] = []
    previous = 0
    for step in range(STEPS):
        target = (TARGET, TARGET.seed, step, _target_logits(step, previous))
        if target_row is None:
            rows = [target]
        else:
            others = [
                (p, p.seed or 0, 3 * step + i, torch.randn(VOCAB, generator=filler) * 3)
                for i, p in enumerate(OTHER_PARAMS)
            ]
            rows = others[:target_row] + [target] + others[target_row:]
            if shuffle_seed is not None:
                rows = [rows[i] for i in order_rng.permutation(len(rows))]
        logits = torch.stack([r[3] for r in rows])
        out = sampler(logits, _metadata([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]))
        previous = out.token_ids[next(i for i, r in enumerate(rows) if r is target)].item()
        tokens.append(previous)
    return tokens


def test_seeded_sampling_is_reproducible_and_batch_invariant() -> None:
    """A seeded request draws the same 20 tokens alone, at row 3 of a batch of five,
    and with the batch shuffled every step (different shuffles too): its draw depends
    only on its seed, its output index and the token id."""
    alone = _generate(None, None)
    assert _generate(None, None) == alone
    assert _generate(3, None) == alone
    assert _generate(0, shuffle_seed=1) == alone
    assert _generate(2, shuffle_seed=2) == alone
    assert len(set(alone)) > 1


def test_different_seeds_draw_different_sequences() -> None:
    """Over 20 steps of near-uniform logits, distinct seeds give distinct sequences."""
    sampler = Sampler(1000)
    logits = torch.zeros(8, 1000)
    seeds = [0, 1, 2, 3, 1 << 40, -1, 2**63 - 1, 12345]
    params = [SamplingParams(temperature=1.0)] * len(seeds)
    sequences = [
        sampler(logits, _metadata(params, seeds, [step] * len(seeds))).token_ids.tolist() for step in range(STEPS)
    ]
    per_seed = {tuple(column) for column in zip(*sequences)}
    assert len(per_seed) == len(seeds)


def _filtered_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution the parameters define: softmax(logits / T), restricted to the
    top_k tokens, then to the smallest top-ranked set whose renormalised mass reaches
    top_p; renormalised."""
    probs = np.exp((logits - logits.max()) / temperature)
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros(len(logits), dtype=bool)
    kept_order = order[: top_k if top_k > 0 else len(logits)]
    mass = probs[kept_order] / probs[kept_order].sum()
    cut = int(np.searchsorted(np.cumsum(mass), top_p - 1e-12)) + 1
    keep[kept_order[:cut]] = True
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


# 99.9% quantiles of the chi-square distribution by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.5, 4, 1.0), (1.0, -1, 0.8), (2.0, 6, 0.9)],
)
def test_empirical_distribution_matches_the_filtered_softmax(temperature: float, top_k: int, top_p: float) -> None:
    """20000 draws over distinct (seed, output index) keys follow the filtered softmax:
    no draw outside the kept set, and the chi-square statistic over the kept tokens
    stays under its 99.9% quantile (fixed seeds: deterministic)."""
    logits = np.array([1.2, -0.3, 0.5, 2.0, 0.0, -1.0, 0.9, 1.6], dtype=np.float32)
    expected = _filtered_distribution(logits.astype(np.float64), temperature, top_k, top_p)
    draws = 20_000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * draws
    seeds = [1000 + i // 4 for i in range(draws)]
    output_indices = [i % 4 for i in range(draws)]
    batch = torch.from_numpy(logits).expand(draws, -1).contiguous()
    tokens = Sampler(len(logits))(batch, _metadata(params, seeds, output_indices)).token_ids.numpy()
    counts = np.bincount(tokens, minlength=len(logits))
    kept = expected > 0
    assert counts[~kept].sum() == 0
    chi2 = float((((counts - draws * expected) ** 2)[kept] / (draws * expected[kept])).sum())
    assert chi2 < CHI2_999[int(kept.sum()) - 1]


@given(
    rows=st.lists(st.lists(st.floats(-20, 20, width=32), min_size=30, max_size=30), min_size=1, max_size=5),
    temperature=st.floats(0.1, 3.0),
    top_k=st.one_of(st.just(-1), st.integers(1, 40)),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**63 - 1),
)
@settings(max_examples=50)
def test_draws_stay_inside_the_kept_set(
    rows: list[list[float]], temperature: float, top_k: int, top_p: float, seed: int
) -> None:
    """A sampled token is always one the filters keep: among the top_k logits and
    inside the nucleus of the temperature-scaled, top-k-renormalised distribution."""
    logits = torch.tensor(rows, dtype=torch.float32)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * len(rows)
    tokens = Sampler(30)(logits, _metadata(params, [seed] * len(rows), list(range(len(rows))))).token_ids.tolist()
    for row, token in zip(rows, tokens):
        # Slack for float32 vs float64 at the nucleus boundary.
        allowed = _filtered_distribution(np.array(row, dtype=np.float64), temperature, top_k, min(top_p + 1e-5, 1.0))
        assert allowed[token] > 0


@given(
    rows=st.lists(st.lists(st.floats(-30, 30, width=32), min_size=25, max_size=25), min_size=1, max_size=6),
    counts=st.lists(st.one_of(st.none(), st.integers(0, 20)), min_size=6, max_size=6),
    temperature=st.sampled_from([0.0, 0.5, 2.0]),
)
@settings(max_examples=50)
def test_logprobs_are_raw_log_softmax(rows: list[list[float]], counts: list[int | None], temperature: float) -> None:
    """A row that asks for k logprobs gets the chosen token's and the k largest values
    of log_softmax(raw logits) (temperature plays no part); other rows get None."""
    logits = torch.tensor(rows, dtype=torch.float32)
    params = [SamplingParams(temperature=temperature, logprobs=k) for k in counts[: len(rows)]]
    out = Sampler(25)(logits, _metadata(params, [3] * len(rows), [0] * len(rows)))
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, (k, token, entry) in enumerate(zip(counts, out.token_ids.tolist(), out.logprobs)):
        if k is None:
            assert entry is None
            continue
        assert token in entry and len(entry) in (k, k + 1)
        for t, value in entry.items():
            assert value == pytest.approx(reference[row, t].item(), abs=1e-5)
        k_largest = sorted(reference[row].tolist(), reverse=True)[:k]
        assert sorted(entry.values(), reverse=True)[:k] == pytest.approx(k_largest, abs=1e-5)


@given(
    length=st.integers(1, 12),
    k=st.integers(0, 20),
    seed=st.integers(0, 1000),
)
@settings(max_examples=30)
def test_prompt_logprobs_score_the_next_prompt_token(length: int, k: int, seed: int) -> None:
    """Entry i holds log_softmax(logits[i])[next_token_ids[i]] and the top k of row i."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(length, 16, generator=generator) * 4
    next_ids = torch.randint(0, 16, (length,), generator=generator)
    entries = prompt_logprobs(logits, next_ids.tolist(), k)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert len(entries) == length
    for i, entry in enumerate(entries):
        expected_ids = set(reference[i].topk(min(k, 16)).indices.tolist()) | {int(next_ids[i])}
        assert set(entry) == expected_ids
        for token, value in entry.items():
            assert value == pytest.approx(reference[i, token].item(), abs=1e-5)


def test_bad_logits_and_metadata_are_refused() -> None:
    """NaN, +inf or all -inf rows, a wrong shape or dtype, and mismatched metadata
    raise SamplerError naming what is wrong."""
    sampler = Sampler(4)
    meta = _metadata([SamplingParams()] * 2, [1, 2], [0, 0])
    good = torch.zeros(2, 4)
    for row, value in ((1, float("nan")), (0, float("inf"))):
        bad = good.clone()
        bad[row, 2] = value
        with pytest.raises(SamplerError, match=rf"^logits: rows \[{row}\]"):
            sampler(bad, meta)
    with pytest.raises(SamplerError, match=r"^logits: rows \[1\]"):
        sampler(torch.tensor([[0.0] * 4, [-math.inf] * 4]), meta)
    with pytest.raises(SamplerError, match=r"^logits: must be float32 of shape \(2, 4\)"):
        sampler(torch.zeros(2, 5), meta)
    with pytest.raises(SamplerError, match=r"^logits: must be float32"):
        sampler(good.double(), meta)
    with pytest.raises(SamplerError, match=r"^rows:"):
        SamplingMetadata.from_params([SamplingParams()], [1, 2], [0])
    with pytest.raises(SamplerError, match=r"^next_token_ids: must lie in 0..3"):
        prompt_logprobs(good, [0, 4], 1)
