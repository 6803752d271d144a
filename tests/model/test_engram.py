"""Engram (MODEL_FACTS.md section 6): hashing declarations, n-grams, rows, table, gate."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dsv41.model.config import FLASH_CONFIG_DIR, ConfigError, V41Config
from dsv41.model.engram import (
    DEAD,
    EngramHashing,
    EngramTable,
    build_compressed_token_map,
    engram_multipliers,
    engram_primes,
    engram_row_counts,
    engram_update,
)
from dsv41.model.formats import dequantize_fp8, quantize_fp8

FLASH_DIR = FLASH_CONFIG_DIR
INT64_MIN = -(2**63)


@pytest.fixture(scope="module")
def flash_config() -> V41Config:
    return V41Config.from_pretrained(FLASH_DIR, text_only=True)


# -- declarations ---------------------------------------------------------------------------


def test_flash_primes_row_counts_and_multipliers(flash_config: V41Config) -> None:
    """The Flash config's Engram declarations are the published ones: the first primes,
    each layer's row count (= its engram_num_embeddings), layer 1's multipliers."""
    c = flash_config
    primes = engram_primes(c.engram_layer_ids, c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size)
    assert primes[1][0][:3] == [16000057, 16000079, 16000081]
    row_counts = engram_row_counts(c.engram_layer_ids, c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size)
    assert row_counts == [384006168, 384016682] == list(c.engram_num_embeddings)
    multipliers = engram_multipliers(1, c.engram_compressed_vocab_size, c.engram_max_ngram_size)
    assert multipliers.dtype == torch.int64
    assert multipliers.tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]


def test_flash_hashing_from_config_and_mismatches(flash_config: V41Config) -> None:
    """from_config accepts the Flash sizes, takes the pad's compressed id from the token
    map, and refuses a compressed vocabulary or a table size that disagrees with the
    config with a ConfigError naming the field and both values."""
    c = flash_config
    token_map = torch.arange(c.vocab_size, dtype=torch.int64) % c.engram_compressed_vocab_size
    token_map[c.engram_pad_token_id] = 777
    hashing = EngramHashing.from_config(c, token_map, c.engram_compressed_vocab_size)
    assert hashing.pad_compressed_id == 777
    assert hashing.primes[1][0, :3].tolist() == [16000057, 16000079, 16000081]
    assert [int(hashing.primes[layer].sum()) for layer in c.engram_layer_ids] == list(c.engram_num_embeddings)

    with pytest.raises(ConfigError, match=r"engram_compressed_vocab_size.*99092.*99091"):
        EngramHashing.from_config(c, token_map, c.engram_compressed_vocab_size - 1)
    wrong = dataclasses.replace(c, engram_num_embeddings=(384006168, 384016683))
    with pytest.raises(ConfigError, match=r"engram_num_embeddings\[1\].*384016683.*384016682"):
        EngramHashing.from_config(wrong, token_map, c.engram_compressed_vocab_size)


def _sieve(limit: int) -> list[int]:
    is_prime = [True] * limit
    is_prime[0] = is_prime[1] = False
    for p in range(2, int(limit**0.5) + 1):
        if is_prime[p]:
            is_prime[p * p :: p] = [False] * len(is_prime[p * p :: p])
    return [p for p in range(limit) if is_prime[p]]


_SMALL_PRIMES = _sieve(20000)


@settings(max_examples=40, deadline=None)
@given(
    num_layers=st.integers(1, 3),
    max_ngram_size=st.integers(2, 5),
    n_heads=st.integers(1, 6),
    vocab_size=st.integers(1, 10000),
)
def test_primes_are_consecutive_primes_from_vocab_size(
    num_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int
) -> None:
    """The primes, read in (layer, n, head) order, are exactly the consecutive primes
    >= vocab_size (a sieve says which numbers are prime), so none is reused and each
    (layer, n) search starts above vocab_size - 1; row counts are the per-layer sums."""
    layer_ids = [3 * i + 1 for i in range(num_layers)]
    primes = engram_primes(layer_ids, max_ngram_size, n_heads, vocab_size)
    flat = [p for layer in layer_ids for per_n in primes[layer] for p in per_n]
    expected = [p for p in _SMALL_PRIMES if p >= vocab_size][: len(flat)]
    assert flat == expected
    assert all(len(primes[layer]) == max_ngram_size - 1 for layer in layer_ids)
    assert engram_row_counts(layer_ids, max_ngram_size, n_heads, vocab_size) == [
        sum(map(sum, primes[layer])) for layer in layer_ids
    ]


# -- n-grams and rows -----------------------------------------------------------------------


def _wrap_int64(value: int) -> int:
    return (value - INT64_MIN) % 2**64 + INT64_MIN


def _ngram_oracle(hashing: EngramHashing, chunk: list[int], history: list[int]) -> list[list[int]]:
    """The facts' n-gram rule, per token: shifts before the sequence start read the pad."""
    live = [h for h in history if h != DEAD]
    assert history[: len(history) - len(live)] == [DEAD] * (len(history) - len(live))
    sequence = live + chunk
    out = []
    for t in range(len(chunk)):
        position = len(live) + t
        shifted = [position - k for k in range(hashing.max_ngram_size)]
        out.append([sequence[p] if p >= 0 else hashing.pad_compressed_id for p in shifted])
    return out


def _row_oracle(hashing: EngramHashing, layer_id: int, ngram: list[int]) -> tuple[list[int], int]:
    """The facts' row formula for one token, in Python integers with explicit int64
    wrapping; also counts the negative hashes it met."""
    multipliers = hashing.multipliers[layer_id].tolist()
    primes = hashing.primes[layer_id].tolist()
    rows, negatives, offset = [], 0, 0
    for n in range(2, hashing.max_ngram_size + 1):
        mixed = 0
        for k in range(n):
            mixed ^= _wrap_int64(ngram[k] * multipliers[k])
        negatives += mixed < 0
        for prime in primes[n - 2]:
            rows.append(mixed % prime + offset)  # Python's % is floor-mod
            offset += prime
    return rows, negatives


@pytest.mark.parametrize(
    "max_ngram_size, n_heads, vocab_size, compressed_vocab_size, history",
    [
        (4, 3, 1000, 5, [DEAD, DEAD, DEAD]),  # the sequence start: pads at every shift >= t + 1
        (4, 2, 20000, 3, [DEAD, 1 << 39, 77]),  # a replayed start two tokens before the chunk
        (2, 4, 97, 1, [123456789]),
        (5, 1, 50, 7, [9, 8, 7, 6]),
    ],
)
def test_row_ids_match_per_token_formula(
    max_ngram_size: int, n_heads: int, vocab_size: int, compressed_vocab_size: int, history: list[int]
) -> None:
    """ngram_ids and row_ids equal a per-token Python transcription of the facts (pad
    substitution at the start, XOR of wrapped int64 products, floor-mod by each head's
    prime, plus the running offset), on random ids large enough that products wrap
    and hashes go negative."""
    generator = torch.Generator().manual_seed(max_ngram_size * 100 + n_heads)
    layer_ids = (1, 6)
    hashing = EngramHashing.from_sizes(layer_ids, max_ngram_size, n_heads, vocab_size, compressed_vocab_size, 4)
    chunk = torch.randint(0, 1 << 40, (33,), generator=generator, dtype=torch.int64)
    history_tensor = torch.tensor(history, dtype=torch.int64)

    ngrams = hashing.ngram_ids(chunk, history_tensor)
    assert ngrams.tolist() == _ngram_oracle(hashing, chunk.tolist(), history)
    negatives = 0
    for layer in layer_ids:
        rows = hashing.row_ids(layer, ngrams)
        assert rows.shape == (33, (max_ngram_size - 1) * n_heads)
        for token, ngram in enumerate(ngrams.tolist()):
            expected, negative = _row_oracle(hashing, layer, ngram)
            assert rows[token].tolist() == expected
            negatives += negative
    assert negatives > 0, "the ids must exercise negative hashes (floor-mod)"


def test_row_ids_are_batch_agnostic() -> None:
    """row_ids of rows from different requests stacked in any order equal each request's
    own row_ids (no row depends on another)."""
    hashing = EngramHashing.from_sizes((2,), 3, 4, 500, 40, 0)
    generator = torch.Generator().manual_seed(0)
    requests = [torch.randint(0, 40, (length,), generator=generator, dtype=torch.int64) for length in (5, 1, 9)]
    history = torch.full((2,), DEAD, dtype=torch.int64)
    ngrams = [hashing.ngram_ids(ids, history) for ids in requests]
    batch = torch.cat(ngrams)
    permutation = torch.randperm(batch.shape[0], generator=generator)
    rows = hashing.row_ids(2, batch[permutation])
    expected = torch.cat([hashing.row_ids(2, n) for n in ngrams])[permutation]
    assert torch.equal(rows, expected)


@settings(max_examples=60, deadline=None)
@given(
    max_ngram_size=st.integers(2, 5),
    tokens=st.lists(st.integers(0, 59), min_size=0, max_size=40),
    chunk_sizes=st.lists(st.integers(1, 9), min_size=1, max_size=8),
)
def test_chunked_equals_whole(max_ngram_size: int, tokens: list[int], chunk_sizes: list[int]) -> None:
    """ngram_ids, row_ids and the final history of a sequence computed in one piece equal
    those computed chunk by chunk with next_history carried between chunks."""
    hashing = EngramHashing.from_sizes((1, 4), max_ngram_size, 2, 300, 60, 2)
    sequence = torch.tensor(tokens, dtype=torch.int64)
    start = torch.full((max_ngram_size - 1,), DEAD, dtype=torch.int64)
    whole = hashing.ngram_ids(sequence, start)

    history, pieces, begin, turn = start, [], 0, 0
    while begin < len(tokens) or turn == 0:
        chunk = sequence[begin : begin + chunk_sizes[turn % len(chunk_sizes)]]
        pieces.append(hashing.ngram_ids(chunk, history))
        history = hashing.next_history(chunk, history)
        begin, turn = begin + len(chunk), turn + 1
    chunked = torch.cat(pieces)

    assert torch.equal(chunked, whole)
    for layer in (1, 4):
        assert torch.equal(hashing.row_ids(layer, chunked), hashing.row_ids(layer, whole))
    assert torch.equal(history, hashing.next_history(sequence, start))
    live = tokens[-(max_ngram_size - 1) :] if tokens else []
    assert history.tolist() == [DEAD] * (max_ngram_size - 1 - len(live)) + live


@st.composite
def _step_chunks(draw: st.DrawFn) -> tuple[int, list[list[int]], list[list[int]], list[int]]:
    """A step of chunks (some empty), each after a history that starts DEAD-padded or
    full, and how many of each chunk's ids a verify keeps."""
    max_ngram_size = draw(st.integers(2, 5))
    history_size = max_ngram_size - 1
    chunks, histories, kept = [], [], []
    for _ in range(draw(st.integers(0, 9))):
        chunk = draw(st.lists(st.integers(0, 1 << 40), min_size=0, max_size=7))
        live = draw(st.lists(st.integers(0, 1 << 40), min_size=0, max_size=history_size))
        chunks.append(chunk)
        histories.append([DEAD] * (history_size - len(live)) + live)
        kept.append(draw(st.integers(0, len(chunk))))
    return max_ngram_size, chunks, histories, kept


@settings(max_examples=200, deadline=None)
@given(step=_step_chunks())
def test_step_ngram_ids_and_histories_equal_each_chunks(
    step: tuple[int, list[list[int]], list[list[int]], list[int]],
) -> None:
    """step_ngram_ids of a step's chunks laid out one after another equal the per-token
    oracle of each chunk after its own history, row for row; step_next_history equals
    each history with the chunk's kept ids appended, cut to its last max_ngram_size - 1."""
    max_ngram_size, chunks, histories, kept = step
    hashing = EngramHashing.from_sizes((1,), max_ngram_size, 2, 300, 60, 7)
    flat = torch.tensor([t for chunk in chunks for t in chunk], dtype=torch.int64)
    history_tensor = torch.tensor(histories, dtype=torch.int64).view(len(chunks), max_ngram_size - 1)
    lengths = torch.tensor([len(chunk) for chunk in chunks], dtype=torch.int64)
    got = hashing.step_ngram_ids(flat, history_tensor, lengths)
    want = [row for chunk, history in zip(chunks, histories) for row in _ngram_oracle(hashing, chunk, history)]
    assert got.dtype == torch.int64 and got.shape == (flat.numel(), max_ngram_size)
    assert got.tolist() == want
    advanced = hashing.step_next_history(flat, history_tensor, lengths, torch.tensor(kept, dtype=torch.int64))
    assert advanced.tolist() == [
        (history + chunk[:k])[-(max_ngram_size - 1) :] for chunk, history, k in zip(chunks, histories, kept)
    ]


@settings(max_examples=100, deadline=None)
@given(step=_step_chunks())
def test_decode_rows_equal_the_general_step(step: tuple[int, list[list[int]], list[list[int]], list[int]]) -> None:
    """decode_ngram_ids and decode_next_history (what a decode graph runs on the
    device) equal step_ngram_ids and step_next_history of one-id chunks kept whole,
    for any histories, DEAD-padded or full."""
    max_ngram_size, chunks, histories, _ = step
    hashing = EngramHashing.from_sizes((1,), max_ngram_size, 2, 300, 60, 7)
    ids = torch.tensor([chunk[0] if chunk else 5 for chunk in chunks], dtype=torch.int64)
    history_tensor = torch.tensor(histories, dtype=torch.int64).view(len(chunks), max_ngram_size - 1)
    ones = torch.ones(len(chunks), dtype=torch.int64)
    assert torch.equal(hashing.decode_ngram_ids(ids, history_tensor), hashing.step_ngram_ids(ids, history_tensor, ones))
    assert torch.equal(
        hashing.decode_next_history(ids, history_tensor), hashing.step_next_history(ids, history_tensor, ones, ones)
    )


def test_bad_chunks_are_refused() -> None:
    """A negative id inside a chunk, a history of the wrong length, or an unknown layer
    is refused with an error naming the argument."""
    hashing = EngramHashing.from_sizes((1,), 4, 2, 100, 10, 0)
    history = torch.full((3,), DEAD, dtype=torch.int64)
    with pytest.raises(ValueError, match="compressed_ids"):
        hashing.ngram_ids(torch.tensor([1, DEAD]), history)
    with pytest.raises(ValueError, match="history"):
        hashing.ngram_ids(torch.tensor([1, 2]), history[:2])
    with pytest.raises(ValueError, match="layer_id"):
        hashing.row_ids(3, hashing.ngram_ids(torch.tensor([1, 2]), history))
    histories = history.unsqueeze(0)
    with pytest.raises(ValueError, match="lengths"):
        hashing.step_ngram_ids(torch.tensor([1, 2]), histories, torch.tensor([1]))
    with pytest.raises(ValueError, match="appended"):
        hashing.step_next_history(torch.tensor([1, 2]), histories, torch.tensor([2]), torch.tensor([3]))


# -- compressed token map -------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_CHAR = _bytes_to_unicode()


def _byte_level(text: str) -> str:
    return "".join(_BYTE_CHAR[b] for b in text.encode("utf-8"))


HELLO_VARIANTS = ["Hello", "hello", " Hello", "HELLO", "h\u00e9llo", "\uff28\uff45\uff4c\uff4c\uff4f", "\thello\n"]
WHITESPACE_ONLY = ["  ", "\t\n ", "\r\n", "   \t"]
WORDS = ["world", " World", "\u0301", "\u0300", "sp ace", "sp  ace"]
SPECIALS = ["<BOS>", "<PAD>", "<EOS>"]


@pytest.fixture(scope="module")
def byte_level_tokenizer() -> Tokenizer:
    """A byte-level BPE: ids 0..255 are the single bytes (so a lone byte >= 0x80
    decodes to U+FFFD), then multi-byte words, then added special and plain tokens."""
    vocab = {_BYTE_CHAR[b]: b for b in range(256)}
    for text in HELLO_VARIANTS + WHITESPACE_ONLY + WORDS:
        vocab[_byte_level(text)] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.add_tokens(["HeLLo"])
    return tokenizer


def test_compressed_token_map(byte_level_tokenizer: Tokenizer) -> None:
    """Case, accent, width and whitespace variants share a compressed id; whitespace-only
    tokens share the one-space id; partial UTF-8 tokens (all decoding to U+FFFD) are
    keyed by their raw strings and stay apart; texts that normalise to nothing keep
    their own ids; special tokens are kept; ids are given in first-seen order."""
    tokenizer = byte_level_tokenizer
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    token_map, num_compressed = build_compressed_token_map(tokenizer, size, pad_token_id=tokenizer.token_to_id("<PAD>"))
    assert token_map.dtype == torch.int64 and token_map.shape == (size,)

    def compressed(text: str) -> int:
        token_id = tokenizer.token_to_id(text)
        if token_id is None:
            token_id = tokenizer.token_to_id(_byte_level(text))
        return int(token_map[token_id])

    hello = {compressed(text) for text in HELLO_VARIANTS + ["HeLLo"]}
    assert len(hello) == 1
    assert compressed("world") == compressed(" World") != hello.pop()
    assert compressed("sp ace") == compressed("sp  ace")

    space = compressed(" ")
    assert all(compressed(text) == space for text in WHITESPACE_ONLY + ["\t", "\n", "\r"])
    # Stripped to nothing, each of these would be keyed by its own decoded text instead.
    assert tokenizer.decode([tokenizer.token_to_id(_byte_level("\t\n "))], skip_special_tokens=False) == "\t\n "

    high_bytes = list(range(0x80, 0x100))
    assert {tokenizer.decode([b], skip_special_tokens=False) for b in high_bytes} == {"\ufffd"}
    assert len({int(token_map[b]) for b in high_bytes}) == len(high_bytes)

    assert compressed("\u0301") != compressed("\u0300")
    assert len({compressed(text) for text in SPECIALS}) == len(SPECIALS)

    values = token_map.tolist()
    assert values[0] == 0
    seen_max = 0
    for value in values[1:]:
        assert value <= seen_max + 1
        seen_max = max(seen_max, value)
    assert num_compressed == seen_max + 1 == len(set(values))


def test_compressed_token_map_padded_vocab(byte_level_tokenizer: Tokenizer) -> None:
    """Model ids past the tokenizer map to the pad token's compressed id, the tokenizer's
    own ids are unchanged, and a vocabulary smaller than the tokenizer is refused."""
    tokenizer = byte_level_tokenizer
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    pad = tokenizer.token_to_id("<PAD>")
    exact, num_exact = build_compressed_token_map(tokenizer, size, pad_token_id=pad)
    padded, num_padded = build_compressed_token_map(tokenizer, size + 7, pad_token_id=pad)
    assert num_padded == num_exact
    assert torch.equal(padded[:size], exact)
    assert padded[size:].tolist() == [int(exact[pad])] * 7
    with pytest.raises(ValueError, match="vocab_size"):
        build_compressed_token_map(tokenizer, size - 1, pad_token_id=pad)
    with pytest.raises(ValueError, match="pad_token_id"):
        build_compressed_token_map(tokenizer, size + 7, pad_token_id=size)


# -- host table -----------------------------------------------------------------------------


def _fp8_rows(num_rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(num_rows)
    source = torch.randn(num_rows, head_dim, generator=generator) * torch.logspace(-3, 2, num_rows).unsqueeze(1)
    return quantize_fp8(source)


@pytest.mark.parametrize("head_dim", [16, 48, 64, 256])
def test_fp8_table_lookup_equals_dequantized_rows(head_dim: int) -> None:
    """Looking up FP8 rows (uint8 or float8 dtypes) gives formats.dequantize_fp8 of
    exactly those rows, concatenated along the last dim in the order of the ids, at
    any width (ceil(head_dim / 32) scales per row, the last group partial at 16 and 48)."""
    values, scales = _fp8_rows(50, head_dim)
    assert tuple(scales.shape) == (50, -(-head_dim // 32))
    row_ids = torch.randint(0, 50, (3, 2, 5), generator=torch.Generator().manual_seed(1))
    expected = dequantize_fp8(values[row_ids], scales[row_ids]).reshape(3, 2, 5 * head_dim)
    for table in (
        EngramTable(values, scales),
        EngramTable(values.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)),
    ):
        assert (table.num_rows, table.head_dim) == (50, head_dim)
        out = table.lookup(row_ids)
        assert out.dtype == torch.float32
        assert torch.equal(out, expected)


@pytest.mark.parametrize("head_dim", [16, 48])
def test_fp8_table_needs_one_scale_per_started_group(head_dim: int) -> None:
    """An FP8 table's scales are [rows, ceil(head_dim / 32)]; one fewer or one more
    per row, or none at all, is refused naming the shape allowed."""
    values, scales = _fp8_rows(10, head_dim)
    groups = scales.shape[1]
    for bad in (scales[:, : groups - 1], torch.cat((scales, scales[:, :1]), dim=1), None):
        with pytest.raises(ValueError, match=rf"scales: .*\(10, {groups}\)"):
            EngramTable(values, bad)


def test_float_table_lookup_and_bad_ids() -> None:
    """A bf16 table looks up its rows as float32; ids outside the table are refused."""
    rows = torch.randn(9, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    table = EngramTable(rows, None)
    row_ids = torch.tensor([[8, 0, 3]])
    assert torch.equal(table.lookup(row_ids), rows[row_ids].float().reshape(1, 3 * 32))
    for bad in (torch.tensor([[9]]), torch.tensor([[-1]])):
        with pytest.raises(ValueError, match="row_ids"):
            table.lookup(bad)


def test_memmapped_table_is_not_copied(file_mapped_table: Callable[..., Any]) -> None:
    """A table over read-only numpy memmaps keeps the mapped memory itself (no copy of
    the table) and looks up the same values as the in-memory table."""
    values, scales = _fp8_rows(200, 96)
    mapped, arrays = file_mapped_table(values, scales)
    assert mapped.values.data_ptr() == arrays["values"].ctypes.data
    assert mapped.scales is not None and mapped.scales.data_ptr() == arrays["scales"].ctypes.data
    row_ids = torch.tensor([[199, 0, 57, 57], [3, 140, 11, 198]])
    assert torch.equal(mapped.lookup(row_ids), EngramTable(values, scales).lookup(row_ids))


# -- gated update ---------------------------------------------------------------------------


def _gate_transcription(
    h: torch.Tensor,
    e: torch.Tensor,
    wkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    stream: int,
    hc: int,
    hidden: int,
    eps: float,
) -> torch.Tensor:
    """MODEL_FACTS section 6's gate for one token and one stream, term by term, in float64."""
    kv = (wkv @ e.to(wkv.dtype)).double()
    key = kv[stream * hidden : (stream + 1) * hidden]
    value = kv[hc * hidden :]
    h = h.double()
    dot = (
        (h * q_weight[stream].double() * k_weight[stream].double() * key).sum()
        / math.sqrt(float((h * h).mean()) + eps)
        / math.sqrt(float((key * key).mean()) + eps)
        / math.sqrt(hidden)
    )
    dot = float(dot)
    sign = (dot > 0) - (dot < 0)
    gate = 1.0 / (1.0 + math.exp(-sign * math.sqrt(max(abs(dot), 1e-6))))
    return h + gate * value


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_engram_update_matches_gate_formula(dtype: torch.dtype, tolerance: float) -> None:
    """engram_update equals, token by token and stream by stream, a direct transcription
    of the gate formula; a stream whose q_weight is zero gets a dot of 0, gate 1/2."""
    tokens, hc, hidden, input_dim, eps = 3, 4, 64, 96, 1e-20
    generator = torch.Generator().manual_seed(3)
    streams = torch.randn(tokens, hc, hidden, generator=generator).to(dtype)
    embeddings = torch.randn(tokens, input_dim, generator=generator)
    wkv = (torch.randn((hc + 1) * hidden, input_dim, generator=generator) / math.sqrt(input_dim)).to(dtype)
    q_weight = torch.rand(hc, hidden, generator=generator) + 0.5
    q_weight[2] = 0.0
    k_weight = torch.rand(hc, hidden, generator=generator) + 0.5

    out = engram_update(streams, embeddings, wkv, q_weight, k_weight, eps)
    assert out.dtype == dtype and out.shape == streams.shape
    for t in range(tokens):
        for s in range(hc):
            expected = _gate_transcription(streams[t, s], embeddings[t], wkv, q_weight, k_weight, s, hc, hidden, eps)
            torch.testing.assert_close(out[t, s].double(), expected, rtol=tolerance, atol=tolerance)
    value = (embeddings.to(dtype) @ wkv.t()).float()[:, hc * hidden :]
    torch.testing.assert_close(out[:, 2].float(), (streams[:, 2].float() + 0.5 * value).to(dtype).float())
