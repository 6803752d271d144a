"""Tests of the sampler's logits transforms: the grammar's token mask, logit bias,
min_tokens, repetition / presence / frequency penalties and min-p, each against a
direct formula, and every one batch-invariant and reproducible under seeded sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cluster.sampler import Sampler, SamplerError, SamplingMetadata, unpack_token_mask
from dsv41.cluster.sampling_guide import SamplingGuide, bitmask_words, penalty_counts
from dsv41.cluster.sampling_params import SamplingParams, SamplingParamsError

VOCAB = 70  # not a multiple of 32: the last mask word is partial
EOS = 1


def _packed(allowed: set[int], vocab: int = VOCAB) -> bytes:
    words = np.zeros(bitmask_words(vocab), dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words.astype("<u4").tobytes()


def _run(params, seeds, indices, guides, logits):
    metadata = SamplingMetadata.from_params(params, seeds, indices, guides=guides, vocab_size=VOCAB, eos_token_id=EOS)
    return Sampler(VOCAB)(logits, metadata)


_params = st.builds(
    SamplingParams,
    max_tokens=st.just(64),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]),
    top_k=st.sampled_from([-1, 5]),
    top_p=st.sampled_from([1.0, 0.8]),
    min_p=st.sampled_from([0.0, 0.1, 0.5]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3, 2.0]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.7]),
    min_tokens=st.sampled_from([0, 3]),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, -5.0, 2.5, 100.0]), max_size=4),
)


@st.composite
def _rows(draw):
    """A row: its params, seed, output index, a guide (grammar mask and token counts)
    and logits."""
    params = draw(_params)
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
    output = draw(st.lists(st.integers(0, VOCAB - 1), max_size=12))
    allowed = draw(st.none() | st.sets(st.integers(0, VOCAB - 1), min_size=1, max_size=VOCAB))
    ids, counts = penalty_counts(prompt, output)
    guide = SamplingGuide(None if allowed is None else _packed(allowed), ids if params.uses_penalties else (), counts if params.uses_penalties else ())
    logits = draw(st.lists(st.integers(-40, 40), min_size=VOCAB, max_size=VOCAB))
    return params, draw(st.integers(0, 2**63)), len(output), guide, logits, allowed


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(_rows(), min_size=1, max_size=6), order=st.randoms(use_true_random=False))
def test_a_rows_sample_is_independent_of_the_batch_and_the_mask_holds(rows, order) -> None:
    """Each row samples the same token alone and in any batch at any position, and the
    token is one its grammar allows and, before min_tokens, no stop token (unless the
    grammar allows nothing else)."""
    def batch(chosen):
        params, seeds, indices, guides, logits, _ = zip(*chosen)
        return _run(list(params), list(seeds), list(indices), list(guides), torch.tensor(logits, dtype=torch.float32) / 4)

    together = batch(rows).token_ids.tolist()
    alone = [batch([row]).token_ids.item() for row in rows]
    assert together == alone
    shuffled = list(range(len(rows)))
    order.shuffle(shuffled)
    assert [batch([rows[i] for i in shuffled]).token_ids.tolist()[shuffled.index(k)] for k in range(len(rows))] == alone
    for (params, _, index, _, _, allowed), token in zip(rows, alone):
        if allowed is not None:
            assert token in allowed
        stops = {EOS, *params.stop_token_ids}
        if index < params.min_tokens and (allowed is None or allowed - stops):
            assert token not in stops


def _reference_processed(params: SamplingParams, prompt: list[int], output: list[int], logits: list[float]) -> list[float]:
    """vLLM's formulas, token by token, in float32 scalars."""
    f32 = np.float32
    out = [f32(v) for v in logits]
    for token, bias in params.logit_bias:
        out[token] = f32(out[token] + f32(bias))
    for t in set(prompt) | set(output):
        r = f32(params.repetition_penalty)
        out[t] = f32(out[t] / r) if out[t] > 0 else f32(out[t] * r)
    for t in set(output):
        count = output.count(t)
        out[t] = f32(out[t] - f32(f32(params.frequency_penalty) * f32(count)))
        out[t] = f32(out[t] - f32(params.presence_penalty))
    return [float(v) for v in out]


@settings(max_examples=80, deadline=None)
@given(
    params=_params.filter(lambda p: p.min_tokens == 0),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
    output=st.lists(st.integers(0, VOCAB - 1), max_size=10),
    logits=st.lists(st.floats(-30, 30, width=32), min_size=VOCAB, max_size=VOCAB),
)
def test_greedy_after_bias_and_penalties_is_the_argmax_of_the_direct_formula(params, prompt, output, logits) -> None:
    """A greedy row takes the argmax (smallest id on ties) of vLLM's formula: bias,
    then the repetition penalty on prompt and output tokens, then frequency times the
    output count and presence once per output token subtracted."""
    greedy = SamplingParams(**{**_fields(params), "temperature": 0.0, "min_p": 0.0})
    ids, counts = penalty_counts(prompt, output)
    guide = SamplingGuide(None, ids, counts) if greedy.uses_penalties else None
    got = _run([greedy], [0], [len(output)], [guide], torch.tensor([logits], dtype=torch.float32)).token_ids.item()
    expected = _reference_processed(greedy, prompt, output, logits)
    assert got == int(np.argmax(np.array(expected, dtype=np.float32)))


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_min_p_keeps_exactly_the_tokens_within_its_ratio_of_the_top() -> None:
    """With min_p, the tokens a row can draw are those whose probability (after
    temperature) is at least min_p times the top token's; drawn over many seeds."""
    logits = torch.tensor([[math.log(p) for p in (0.5, 0.3, 0.12, 0.08)] + [-50.0] * (VOCAB - 4)], dtype=torch.float32)
    params = SamplingParams(temperature=1.0, min_p=0.2, max_tokens=4)
    drawn = {
        _run([params], [seed], [0], [None], logits).token_ids.item()
        for seed in range(400)
    }
    assert drawn == {0, 1, 2}  # 0.12 >= 0.2 * 0.5, 0.08 < 0.1


def test_logprobs_report_the_masked_logits_before_penalties() -> None:
    """Logprobs are the log-softmax after the grammar's mask (as vLLM masks before its
    sampler) and before bias and penalties."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.0, logprobs=3, logit_bias={5: 50.0}, presence_penalty=1.0, max_tokens=4)
    allowed = {2, 5, 9, 40}
    guide = SamplingGuide(_packed(allowed), *penalty_counts([5], [9]))
    out = _run([params], [0], [1], [guide], logits)
    masked = logits.masked_fill(~unpack_token_mask(torch.frombuffer(bytearray(_packed(allowed)), dtype=torch.int32).unsqueeze(0), VOCAB), float("-inf"))
    expected = torch.log_softmax(masked, dim=-1)[0]
    assert out.token_ids.item() == 5
    for token, value in out.logprobs[0].items():
        assert token in allowed
        assert value == pytest.approx(expected[token].item(), abs=1e-6)


def test_unpacked_mask_reads_xgrammars_bit_order() -> None:
    """Bit t % 32 of word t // 32 is token t, the last word partial."""
    allowed = {0, 31, 32, 63, 64, VOCAB - 1}
    mask = unpack_token_mask(torch.frombuffer(bytearray(_packed(allowed)), dtype=torch.int32).unsqueeze(0), VOCAB)
    assert set(torch.nonzero(mask[0]).squeeze(1).tolist()) == allowed


def test_penalised_rows_need_their_guides_and_masks_need_the_vocabulary() -> None:
    """No silent skip: a penalised row without a guide, a mask without the vocabulary
    size, or a mask of another size, is refused."""
    with pytest.raises(SamplerError, match="^guides: row 0 has penalties"):
        SamplingMetadata.from_params([SamplingParams(presence_penalty=1.0)], [0], [0])
    with pytest.raises(SamplerError, match="^vocab_size"):
        SamplingMetadata.from_params([SamplingParams()], [0], [0], guides=[SamplingGuide(_packed({1}))])
    with pytest.raises(SamplerError, match=r"^guides: token masks of \[1\] words \(allowed: 3\)"):
        SamplingMetadata.from_params([SamplingParams()], [0], [0], guides=[SamplingGuide(b"\0" * 4)], vocab_size=VOCAB)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ],
)
def test_out_of_range_fields_are_refused_naming_the_field(fields: dict, field: str) -> None:
    """Each new field's range is checked on construction, the message naming it."""
    with pytest.raises(SamplingParamsError, match=f"^{field}:"):
        SamplingParams(**fields)


def test_logit_bias_token_ids_are_checked_against_the_vocabulary() -> None:
    """A logit bias on a token past the vocabulary is refused by validate_for."""
    with pytest.raises(SamplingParamsError, match=r"^logit_bias: \[70\] outside the vocabulary"):
        SamplingParams(logit_bias={70: 1.0}).validate_for(vocab_size=VOCAB, max_model_len=64, prompt_len=4)
