"""Tests of cluster.request: parameter validation, request bookkeeping, outputs, seeds."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cluster.request import (
    CumulativeOutputs,
    FinishReason,
    OutputText,
    Request,
    RequestOutput,
    RequestStatus,
    SeedSource,
)
from dsv41.cluster.sampling_params import (
    MAX_INT64,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)

INVALID_VALUES = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "1"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", float("nan")),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 3.0),
    ("seed", 1.5),
    ("seed", "7"),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["1"]),
    ("stop_token_ids", 3),
    ("ignore_eos", 1),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", 1.0),
    ("n", 0),
    ("prompt_logprobs", MAX_LOGPROBS + 1),
    # Beyond int64 (the sampling metadata's type) and beyond the stop check's bounds.
    ("max_tokens", MAX_INT64 + 1),
    ("max_tokens", 10**5000),
    ("top_k", MAX_INT64 + 1),
    ("n", MAX_N + 1),
    ("n", 10**5000),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
    ("stop", "x" * (MAX_STOP_STRING_CHARS + 1)),
    ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
]


@pytest.mark.parametrize(
    ("field_name", "value"), INVALID_VALUES, ids=[f"{name}-{i}" for i, (name, _) in enumerate(INVALID_VALUES)]
)
def test_invalid_params_raise_naming_the_field(field_name: str, value: object) -> None:
    """Every out-of-range parameter raises SamplingParamsError whose message starts
    with the field's name and states what is allowed."""
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(**{field_name: value})
    assert str(raised.value).startswith(f"{field_name}:")
    assert "must be" in str(raised.value)
    # A refusal quotes what it refuses, briefly: never a megabyte, never int()'s own error.
    assert len(str(raised.value)) < 200


valid_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 10_000),
    temperature=st.floats(0, 10),
    top_p=st.floats(1e-6, 1),
    top_k=st.one_of(st.just(-1), st.integers(1, 1000)),
    seed=st.one_of(st.none(), st.integers(-(2**70), 2**70)),
    stop=st.one_of(st.text(min_size=1), st.lists(st.text(min_size=1), max_size=4)),
    stop_token_ids=st.lists(st.integers(0, 10**6), max_size=4),
    ignore_eos=st.booleans(),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    n=st.integers(1, 8),
    prompt_logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
)


@given(valid_params)
def test_valid_params_normalise_stop_to_tuples(params: SamplingParams) -> None:
    """Any in-range combination is accepted; stop and stop_token_ids come out as tuples
    (a single stop string becomes a one-element tuple), so params are hashable and
    equal params built from lists or tuples compare equal."""
    assert isinstance(params.stop, tuple) and all(isinstance(s, str) and s for s in params.stop)
    assert isinstance(params.stop_token_ids, tuple)
    rebuilt = SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        n=params.n,
        prompt_logprobs=params.prompt_logprobs,
    )
    assert rebuilt == params and hash(rebuilt) == hash(params)
    assert params.max_stop_length == max((len(s) for s in params.stop), default=0)


def test_single_stop_string_is_one_entry() -> None:
    """A str stop is one stop string, not a sequence of characters."""
    assert SamplingParams(stop="</s>").stop == ("</s>",)


@given(
    max_tokens=st.integers(1, 500),
    prompt_len=st.integers(1, 500),
    max_model_len=st.integers(1, 1000),
)
def test_validate_for_enforces_the_context_limit(max_tokens: int, prompt_len: int, max_model_len: int) -> None:
    """validate_for accepts exactly when prompt_len + max_tokens <= max_model_len, and
    a refusal names max_tokens and the largest allowed value."""
    params = SamplingParams(max_tokens=max_tokens)
    if prompt_len + max_tokens <= max_model_len:
        params.validate_for(vocab_size=100, max_model_len=max_model_len, prompt_len=prompt_len)
    else:
        with pytest.raises(SamplingParamsError, match=r"^max_tokens:.*max_tokens <= "):
            params.validate_for(vocab_size=100, max_model_len=max_model_len, prompt_len=prompt_len)


@given(top_k=st.one_of(st.just(-1), st.integers(1, MAX_INT64)), vocab_size=st.integers(1, 1000))
def test_validate_for_bounds_top_k_by_the_vocabulary(top_k: int, vocab_size: int) -> None:
    """top_k is accepted exactly when off (-1) or at most the vocabulary; a refusal
    names the field and its bound."""
    params = SamplingParams(top_k=top_k)
    if top_k <= vocab_size:
        params.validate_for(vocab_size=vocab_size, max_model_len=10**6, prompt_len=1)
    else:
        with pytest.raises(SamplingParamsError, match=rf"^top_k: .*1\.\.{vocab_size}\)"):
            params.validate_for(vocab_size=vocab_size, max_model_len=10**6, prompt_len=1)


def test_validate_for_checks_stop_token_ids_and_empty_prompts() -> None:
    """Stop token ids must lie inside the vocabulary; an empty prompt is refused."""
    SamplingParams(stop_token_ids=[99]).validate_for(vocab_size=100, max_model_len=64, prompt_len=4)
    with pytest.raises(SamplingParamsError, match=r"^stop_token_ids: \[100\] outside the vocabulary"):
        SamplingParams(stop_token_ids=[5, 100]).validate_for(vocab_size=100, max_model_len=64, prompt_len=4)
    with pytest.raises(SamplingParamsError, match=r"^prompt:"):
        SamplingParams().validate_for(vocab_size=100, max_model_len=64, prompt_len=0)


def test_status_finished_and_finish_reasons() -> None:
    """Exactly the FINISHED_* statuses are terminal, each maps to the OpenAI
    finish_reason string, and a FinishReason serialises as that plain string."""
    expected = {
        RequestStatus.FINISHED_STOPPED: "stop",
        RequestStatus.FINISHED_LENGTH: "length",
        RequestStatus.FINISHED_ABORTED: "abort",
        RequestStatus.FINISHED_ERROR: "error",
    }
    for status in RequestStatus:
        assert status.is_finished == (status in expected)
        assert status.finish_reason == expected.get(status)
    assert json.dumps([FinishReason.STOP, FinishReason.LENGTH]) == '["stop", "length"]'


def _request(params: SamplingParams, prompt: tuple[int, ...] = (5, 6, 7)) -> Request:
    return Request("r0", prompt, params, sampling_seed=11, arrival_time=0.0)


@given(
    prompt=st.lists(st.integers(0, 1000), min_size=1, max_size=20),
    outputs=st.lists(st.integers(0, 1000), min_size=1, max_size=20),
    num_logprobs=st.one_of(st.none(), st.integers(0, 3)),
    takes=st.lists(st.booleans(), min_size=20, max_size=20),
)
def test_request_bookkeeping_and_delta_outputs(
    prompt: list[int], outputs: list[int], num_logprobs: int | None, takes: list[bool]
) -> None:
    """Token counts and all_token_ids follow the appended tokens; each output holds
    exactly the tokens (and logprob entries) gained since the last one taken, however
    many steps passed between takes, and their concatenation is every token
    generated; finished/finish_reason appear only at the end; CumulativeOutputs adds
    the deltas up to the whole output (each sum so far a prefix of the next, handed
    back by ``add`` with the finishing delta alone); a finished request takes no more
    tokens."""
    request = _request(SamplingParams(max_tokens=len(outputs), logprobs=num_logprobs), tuple(prompt))
    deltas = []
    for i, token in enumerate(outputs):
        request.append_output_token(token, None if num_logprobs is None else {token: -0.5})
        assert request.num_output_tokens == i + 1
        assert request.num_tokens == len(prompt) + i + 1 == request.num_prompt_tokens + request.num_output_tokens
        assert list(request.all_token_ids) == prompt + outputs[: i + 1]
        if takes[i]:
            deltas.append(request.take_output())
            assert deltas[-1].num_output_tokens == i + 1
    request.finish(RequestStatus.FINISHED_LENGTH)
    deltas.append(request.take_output())
    assert [t for d in deltas for t in d.token_ids] == outputs
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == "length"
    if num_logprobs is None:
        assert all(d.logprobs is None for d in deltas)
    else:
        assert [e for d in deltas for e in d.logprobs] == [{t: -0.5} for t in outputs]
    whole = CumulativeOutputs()
    cumulative = []
    for d in deltas:
        done = whole.add(d)
        assert (done is not None) == d.finished
        cumulative.append(done or whole.output(d.request_id))
    assert cumulative[-1].token_ids == tuple(outputs) and cumulative[-1].finished
    assert all(a.token_ids == b.token_ids[: len(a.token_ids)] for a, b in zip(cumulative, cumulative[1:]))
    with pytest.raises(RuntimeError, match="takes no more tokens"):
        request.append_output_token(1)


def test_request_refuses_inconsistent_use() -> None:
    """A logprobs entry must come exactly when params ask for one; finish needs a
    terminal status and happens once; prompts must be non-empty."""
    request = _request(SamplingParams(logprobs=2))
    with pytest.raises(ValueError, match="^logprobs:"):
        request.append_output_token(3)
    with pytest.raises(ValueError, match="^logprobs:"):
        _request(SamplingParams()).append_output_token(3, {3: 0.0})
    with pytest.raises(ValueError, match="^status: RUNNING"):
        request.finish(RequestStatus.RUNNING)
    request.finish(RequestStatus.FINISHED_ABORTED)
    with pytest.raises(RuntimeError, match="already finished"):
        request.finish(RequestStatus.FINISHED_ERROR)
    with pytest.raises(ValueError, match="^prompt_token_ids:"):
        _request(SamplingParams(), prompt=())


def test_prompt_logprobs_start_with_none() -> None:
    """With prompt_logprobs asked, the first prompt token's entry is None (nothing
    predicts it); without, the field is None."""
    assert _request(SamplingParams(prompt_logprobs=0)).take_output().prompt_logprobs == (None,)
    assert _request(SamplingParams()).take_output().prompt_logprobs is None


@given(stops=st.lists(st.text(min_size=1, max_size=6), max_size=3), text=st.text(max_size=30))
def test_running_text_holds_back_a_possible_stop_prefix(stops: list[str], text: str) -> None:
    """While running, the text handed out omits the last len(longest stop) - 1
    characters (they may begin a stop string); once finished the rest follows, so the
    deltas add up to the whole text."""
    request = _request(SamplingParams(stop=stops))
    request.output_text = OutputText(text)
    held_back = max((len(s) for s in stops), default=1) - 1
    first = request.take_output().text
    assert first == text[: max(len(text) - held_back, 0)]
    request.finish(RequestStatus.FINISHED_ABORTED)
    assert first + request.take_output().text == text


@given(
    steps=st.lists(
        st.one_of(st.tuples(st.just("append"), st.text(max_size=5)), st.tuples(st.just("cut"), st.integers(0, 8))),
        max_size=30,
    ),
    reads=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=5),
)
def test_output_text_is_the_string_it_grows(steps: list[tuple[str, object]], reads: list[tuple[int, int]]) -> None:
    """OutputText after any appends and tail cuts reads (whole, tail, any range) as the
    str built by the same edits."""
    text, expected = OutputText(), ""
    for kind, value in steps:
        if kind == "append":
            text.append(value)
            expected += value
        else:
            keep = max(len(expected) - value, 0)
            text.truncate(keep)
            expected = expected[:keep]
        assert len(text) == len(expected) and str(text) == expected
    for chars, _ in reads:
        assert text.tail(chars) == expected[len(expected) - min(chars, len(expected)) :]
    for a, b in reads:
        start, end = sorted((min(a, len(expected)), min(b, len(expected))))
        assert text.since(start, end) == expected[start:end] and text.since(start) == expected[start:]
    with pytest.raises(ValueError, match="^since:"):
        text.since(len(expected) + 1)


def test_request_output_checks_its_invariants() -> None:
    """finish_reason is set exactly when finished; logprobs has one entry per new
    token; the running count covers at least this output's tokens."""
    with pytest.raises(ValueError, match="^finish_reason:"):
        RequestOutput("r", (1,), True, None, 1)
    with pytest.raises(ValueError, match="^finish_reason:"):
        RequestOutput("r", (1,), False, FinishReason.STOP, 1)
    with pytest.raises(ValueError, match="^logprobs:"):
        RequestOutput("r", (1, 2), False, None, 2, ({1: 0.0},))
    with pytest.raises(ValueError, match="^num_output_tokens:"):
        RequestOutput("r", (1, 2), False, None, 1)


@settings(max_examples=25)
@given(engine_seed=st.integers(0, 2**32), n=st.integers(1, 6), seed=st.integers(-(2**66), 2**66))
def test_seed_source(engine_seed: int, n: int, seed: int) -> None:
    """Seeds are reproducible from the engine seed; unseeded requests get fresh 63-bit
    seeds per draw; an explicit seed is used as is for the first sample and the n
    samples of a request all get distinct seeds."""
    first, second = SeedSource(engine_seed), SeedSource(engine_seed)
    drawn = [first.seeds_for(SamplingParams(n=n)) for _ in range(3)]
    assert drawn == [second.seeds_for(SamplingParams(n=n)) for _ in range(3)]
    flat = [s for seeds in drawn for s in seeds]
    assert len(set(flat)) == len(flat) and all(0 <= s < 2**63 for s in flat)
    explicit = first.seeds_for(SamplingParams(n=n, seed=seed))
    assert explicit[0] == seed and len(set(explicit)) == n
    assert explicit == SeedSource(engine_seed + 1).seeds_for(SamplingParams(n=n, seed=seed))
