"""Tests of cluster.stopping: streamed detokenisation and stop handling, on a small
byte-level BPE tokenizer trained here (the DeepSeek tokenizer's kind: ByteLevel
pre-tokenizer and decoder, with the model's special-token strings)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv41.cluster.request import DETOKENIZE_CONTEXT_TOKENS, CumulativeOutputs, Request, RequestOutput
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.cluster.stopping import StopChecker

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS = [BOS, EOS, "<｜▁pad▁｜>", "<think>", "</think>", "｜DSML｜"]
# "fé", "fè", "fê", "fë" share the bytes "f\xc3" four times as often as any accented
# pair, so BPE merges "f" with a lead byte: a token that ends mid-character.
CORPUS = [
    "hello world, hello again",
    "the quick brown fox jumps over the lazy dog",
    "café crème brûlée",
    "fé fè fê fë",
    "中文 文本",
    "stop here please",
] * 20


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


TOKENIZER = _train_tokenizer()
EOS_ID = TOKENIZER.token_to_id(EOS)
PROMPT = tuple(TOKENIZER.encode(BOS + "stop here please ").ids)
TEXT_PIECES = [
    "a", "b", "x", " ", "\n", "hello", " world", " again", "lo w", "fé", " fè", "café", "😀", "中文",
    "<think>", "</think>", "｜DSML｜",
]  # fmt: skip


def _encode(text: str) -> list[int]:
    return TOKENIZER.encode(text).ids


def _decode(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=False)


def _stream(output_ids: list[int], params: SamplingParams) -> tuple[Request, list[RequestOutput]]:
    """Feed the ids one step at a time, as the engine does; stop when finished. The
    snapshots are each step's delta added up (CumulativeOutputs): the text a client
    has after that step."""
    request = Request("r0", PROMPT, params, sampling_seed=0, arrival_time=0.0)
    checker = StopChecker(TOKENIZER, EOS_ID)
    whole = CumulativeOutputs()
    snapshots = []
    for token_id in output_ids:
        request.append_output_token(token_id)
        finished = checker.check_stop(request)
        delta = request.take_output()
        snapshots.append(whole.add(delta) or whole.output(delta.request_id))
        if finished:
            break
    return request, snapshots


def _assert_monotonic(snapshots: list[RequestOutput]) -> None:
    for earlier, later in zip(snapshots, snapshots[1:]):
        assert later.text.startswith(earlier.text)


texts = st.lists(st.sampled_from(TEXT_PIECES), min_size=1, max_size=12).map("".join)


@settings(max_examples=80)
@given(texts)
def test_streamed_text_is_the_decode_withholding_only_incomplete_characters(text: str) -> None:
    """Streaming a text's tokens: each snapshot is a prefix of the next; a running
    snapshot is the decode of the tokens so far except an incomplete trailing
    character (what it withholds ends in U+FFFD, and it never shows U+FFFD); the final
    text is the whole decode, special tokens kept, finished by "length"."""
    ids = _encode(text)
    assert _decode(ids) == text
    params = SamplingParams(max_tokens=len(ids), ignore_eos=True, skip_special_tokens=False)
    request, snapshots = _stream(ids, params)
    _assert_monotonic(snapshots)
    for count, snapshot in enumerate(snapshots[:-1], start=1):
        decoded = _decode(ids[:count])
        withheld = decoded[len(snapshot.text) :]
        assert decoded.startswith(snapshot.text) and "\ufffd" not in snapshot.text
        assert withheld == "" or withheld.endswith("\ufffd")
    final = snapshots[-1]
    assert final.text == text and final.token_ids == tuple(ids)
    assert final.finish_reason == "length" and final.stop_reason is None


def test_partial_utf8_is_held_back_until_it_resolves() -> None:
    """A 4-byte emoji arriving as four byte tokens shows nothing until its last byte;
    a request cut by length mid-character ends with the replacement character, as the
    tokenizer's own decode of those ids does."""
    ids = _encode("ab😀")
    assert len(ids) == 6 and _decode(ids[:2]) == "ab"
    _, snapshots = _stream(ids, SamplingParams(max_tokens=6))
    assert [s.text for s in snapshots] == ["a", "ab", "ab", "ab", "ab", "ab😀"]
    _, truncated = _stream(ids, SamplingParams(max_tokens=4))
    assert truncated[-1].text == _decode(ids[:4]) and truncated[-1].text.endswith("\ufffd")
    assert truncated[-1].finish_reason == "length"


def test_stop_string_spanning_two_tokens() -> None:
    """"lo w" spans the tokens "hello" and " world": the request stops at " world",
    keeps that token, and its text is cut before the stop string; before, the last
    len("lo w") - 1 characters are held back."""
    ids = _encode("hello world again")
    pieces = [_decode([i]) for i in ids]
    assert pieces == ["hello", " world", " again"]
    request, snapshots = _stream(ids, SamplingParams(stop="lo w"))
    assert [s.text for s in snapshots] == ["he", "hel"]
    final = snapshots[-1]
    assert final.token_ids == tuple(ids[:2]) and final.finished
    assert (final.finish_reason, final.stop_reason) == ("stop", "lo w")


def test_stop_at_the_token_completing_the_string_even_mid_character() -> None:
    """A token that completes a stop string and also starts an incomplete character
    ("f" + a lead byte) stops the request at that token, not one later."""
    ids = _encode("xfè")
    assert _decode(ids[:2]) == "xf\ufffd"
    _, snapshots = _stream(ids, SamplingParams(stop="xf"))
    assert snapshots[-1].token_ids == tuple(ids[:2])
    assert (snapshots[-1].text, snapshots[-1].stop_reason) == ("", "xf")


@settings(max_examples=80)
@given(
    text=texts,
    data=st.data(),
    extra_stop=st.sampled_from(["zz", "o w", "é", "\n", "<think>", "a b"]),
)
def test_stop_strings_cut_at_the_first_token_whose_text_holds_one(
    text: str, data: st.DataObject, extra_stop: str
) -> None:
    """With stop strings (one a substring of the text), the request ends at the first
    token j whose decode ids[:j] contains any of them, keeps tokens ids[:j], and its
    text is that decode cut before the earliest stop string (ties: the one listed
    first); no snapshot ever shows a stop string and snapshots only grow."""
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : data.draw(st.integers(start + 1, min(len(text), start + 6)))]
    stops = [stop, extra_stop]
    ids = _encode(text)
    _, snapshots = _stream(ids, SamplingParams(max_tokens=len(ids), stop=stops, skip_special_tokens=False))
    for count in range(1, len(ids) + 1):
        decoded = _decode(ids[:count])
        hits = [(decoded.find(s), order, s) for order, s in enumerate(stops) if s in decoded]
        if hits:
            index, _, matched = min(hits)
            break
    final = snapshots[-1]
    assert final.token_ids == tuple(ids[:count])
    assert (final.text, final.finish_reason, final.stop_reason) == (decoded[:index], "stop", matched)
    _assert_monotonic(snapshots)
    assert not any(s in snapshot.text for snapshot in snapshots for s in stops)


def test_eos_stops_unless_ignored() -> None:
    """EOS ends the request with "stop" and no stop_reason, stays in token_ids but not
    in the text; with ignore_eos it is an ordinary special token (in the text only when
    special tokens are not skipped)."""
    ids = _encode("hello") + [EOS_ID] + _encode(" world")
    request, snapshots = _stream(ids, SamplingParams())
    final = snapshots[-1]
    assert final.token_ids == tuple(ids[:2]) and final.text == "hello"
    assert (final.finish_reason, final.stop_reason) == ("stop", None)
    _, ignoring = _stream(ids, SamplingParams(max_tokens=len(ids), ignore_eos=True, skip_special_tokens=False))
    assert ignoring[-1].text == "hello" + EOS + " world"
    _, skipping = _stream(ids, SamplingParams(max_tokens=len(ids), ignore_eos=True))
    assert skipping[-1].text == "hello world"
    assert ignoring[-1].finish_reason == "length"


def test_stop_token_ids_report_the_token() -> None:
    """A stop token id ends the request with that id as stop_reason; its text is not
    added (like EOS)."""
    ids = _encode("hello world again")
    _, snapshots = _stream(ids, SamplingParams(stop_token_ids=[ids[1]]))
    final = snapshots[-1]
    assert (final.token_ids, final.text) == (tuple(ids[:2]), "hello")
    assert (final.finish_reason, final.stop_reason) == ("stop", ids[1])


@pytest.mark.parametrize(
    ("last_token", "stop", "expected"),
    [
        (EOS_ID, (), ("stop", None)),
        (_encode(" world")[0], ("lo w",), ("stop", "lo w")),
        (_encode(" world")[0], (), ("length", None)),
    ],
)
def test_stop_beats_length_at_the_same_step(last_token: int, stop: tuple[str, ...], expected: tuple) -> None:
    """At the max_tokens-th token, EOS or a completed stop string reports "stop";
    only an ordinary token reports "length"."""
    ids = _encode("hello") + [last_token]
    _, snapshots = _stream(ids, SamplingParams(max_tokens=2, stop=stop))
    assert len(snapshots) == 2
    assert (snapshots[-1].finish_reason, snapshots[-1].stop_reason) == expected


def test_special_tokens_are_kept_in_the_text_when_not_skipped() -> None:
    """With skip_special_tokens off, <think>, </think> and ｜DSML｜ reach the text."""
    text = "<think>hello</think>｜DSML｜ world"
    ids = _encode(text)
    assert TOKENIZER.token_to_id("｜DSML｜") in ids
    _, snapshots = _stream(ids, SamplingParams(max_tokens=len(ids), skip_special_tokens=False))
    assert snapshots[-1].text == text


MARKERS = ("<think>", "</think>", "｜DSML｜")


@settings(max_examples=60)
@given(pieces=st.lists(st.sampled_from([*TEXT_PIECES, "<｜▁pad▁｜>", BOS]), min_size=1, max_size=12), keep=st.booleans())
def test_skipped_special_tokens_leave_the_text_and_kept_ones_stay(pieces: list[str], keep: bool) -> None:
    """By default (skip_special_tokens, as vLLM) the streamed text adds up to the
    tokenizer's decode with special tokens skipped; with the markers kept
    (kept_special_token_ids), to the decode of the ids without the other special
    tokens. Each running snapshot is a prefix of that final text and never shows U+FFFD."""
    ids = _encode("".join(pieces))
    kept = tuple(TOKENIZER.token_to_id(m) for m in MARKERS) if keep else ()
    params = SamplingParams(max_tokens=len(ids), ignore_eos=True, kept_special_token_ids=kept)
    _, snapshots = _stream(ids, params)
    special = {TOKENIZER.token_to_id(t) for t in SPECIAL_TOKENS}
    expected = _decode([t for t in ids if t not in special or t in kept])
    if not keep:
        assert expected == TOKENIZER.decode(ids, skip_special_tokens=True)
    assert snapshots[-1].text == expected
    for snapshot in snapshots[:-1]:
        assert expected.startswith(snapshot.text) and "\ufffd" not in snapshot.text


def test_a_run_of_skipped_tokens_keeps_the_window_bounded() -> None:
    """Skipped special tokens with nothing pending move the detokeniser's window on: after
    a thousand pads its context is at most DETOKENIZE_CONTEXT_TOKENS tokens, and the text
    that follows still decodes."""
    pad = TOKENIZER.token_to_id("<｜▁pad▁｜>")
    pads, _ = _stream([pad] * 1000, SamplingParams(max_tokens=1001))
    assert pads.text_read_offset - pads.text_prefix_offset <= DETOKENIZE_CONTEXT_TOKENS
    ids = [pad] * 1000 + _encode(" world")
    _, snapshots = _stream(ids, SamplingParams(max_tokens=len(ids)))
    assert snapshots[-1].text == " world"


def test_checker_refuses_misuse() -> None:
    """An EOS id outside the vocabulary is refused; check_stop needs a running request
    with a new token."""
    with pytest.raises(ValueError, match="^eos_token_id:"):
        StopChecker(TOKENIZER, TOKENIZER.get_vocab_size(with_added_tokens=True))
    checker = StopChecker(TOKENIZER, EOS_ID)
    request = Request("r1", PROMPT, SamplingParams(max_tokens=1), sampling_seed=0, arrival_time=0.0)
    with pytest.raises(RuntimeError, match="needs a running request"):
        checker.check_stop(request)
    request.append_output_token(_encode("a")[0])
    assert checker.check_stop(request)
    with pytest.raises(RuntimeError, match="needs a running request"):
        checker.check_stop(request)
