"""Engram: hashed n-gram memory added to the residual streams (MODEL_FACTS.md section 6).

Owns everything Engram computes: the compressed token map (model token id ->
compressed id), the per-layer hashing declarations (multipliers, primes, offsets),
turning a chunk of compressed ids plus the request's history into n-grams and table
rows, the host-resident table (FP8 rows dequantised after the gather; made readable
by a GPU's kernels in place, ``EngramTable.map_for``), and the gated update of the
streams.

Must not import: ``cache``, ``cluster``, ``actors``, ``deploy``, ``ray``. Within
``model`` it imports only ``config`` and ``formats``.

Everything here is batch-agnostic: a runtime gathers the rows of many requests into
one call, and the only per-request state is the history of the last
``max_ngram_size - 1`` compressed ids (the STATE cursor), advanced with
:meth:`EngramHashing.next_history`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers

from dsv41.model.config import ConfigError, V41Config
from dsv41.model.formats import FP8_BLOCK, dequantize_fp8, row_scale_groups
from dsv41.model.linalg import linear, pointwise, row_mean, row_sum
from dsv41.model.stored_weights import Weight

DEAD: int = -1  # a history slot before the sequence start (the STATE cursor's sentinel)

# A private-use character no normalised token text produces: it shields a text that
# is exactly one space from Strip, so whitespace-only tokens keep one space.
_SINGLE_SPACE_PLACEHOLDER = "\ue000"
_REPLACEMENT_CHARACTER = "\ufffd"
_MULTIPLIER_SEED_STRIDE = 10007
GATE_DOT_FLOOR = 1e-6

# Witnesses that make Miller-Rabin exact for every n < 3.3e24 (far past int64).
_MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


# -- hashing declarations --------------------------------------------------------------


def engram_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram_size: int) -> torch.Tensor:
    """The odd int64 multiplier of each n-gram position of one layer ([max_ngram_size]).

    Bounded so that ``compressed id * multiplier`` never exceeds int64 for a valid id.
    """
    if compressed_vocab_size <= 0:
        raise ValueError(f"compressed_vocab_size: must be > 0, got {compressed_vocab_size}")
    if max_ngram_size < 2:
        raise ValueError(f"max_ngram_size: {max_ngram_size} (allowed: >= 2)")
    half_bound = (np.iinfo(np.int64).max // compressed_vocab_size) // 2
    rng = np.random.default_rng(_MULTIPLIER_SEED_STRIDE * layer_id)
    draws = rng.integers(0, half_bound, max_ngram_size, dtype=np.int64)
    return torch.from_numpy(draws * 2 + 1)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MILLER_RABIN_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_from(start: int) -> Iterator[int]:
    candidate = start
    while True:
        if _is_prime(candidate):
            yield candidate
        candidate += 1


def engram_primes(
    layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, vocab_size: int
) -> dict[int, list[list[int]]]:
    """``primes[layer][n - 2][head]``: the table size of each (layer, n-gram size, head).

    The facts restart the search above ``vocab_size - 1`` for every (layer, n) and skip
    primes used before; the used ones are always the smallest primes >= vocab_size, so
    that is one walk over consecutive primes, handed out in (layer, n, head) order.
    """
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"layer_ids: {list(layer_ids)} must be strictly increasing")
    if max_ngram_size < 2:
        raise ValueError(f"max_ngram_size: {max_ngram_size} (allowed: >= 2)")
    if n_heads <= 0:
        raise ValueError(f"n_heads: must be > 0, got {n_heads}")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size: must be > 0, got {vocab_size}")
    walk = _primes_from(vocab_size)
    return {
        layer: [[next(walk) for _ in range(n_heads)] for _ in range(2, max_ngram_size + 1)]
        for layer in layer_ids
    }


def engram_row_counts(layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, vocab_size: int) -> list[int]:
    """Each layer's table rows: the sum of its primes (config: engram_num_embeddings)."""
    primes = engram_primes(layer_ids, max_ngram_size, n_heads, vocab_size)
    return [sum(sum(per_n) for per_n in primes[layer]) for layer in layer_ids]


# -- compressed tokens -------------------------------------------------------------------


def _compression_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SINGLE_SPACE_PLACEHOLDER),
            normalizers.Strip(),
            normalizers.Replace(_SINGLE_SPACE_PLACEHOLDER, " "),
        ]
    )


def build_compressed_token_map(
    tokenizer: Tokenizer, vocab_size: int, *, pad_token_id: int
) -> tuple[torch.Tensor, int]:
    """int64 ``[vocab_size]`` compressed id of every model token id, and the number of
    compressed ids.

    Every tokenizer id (added tokens included) is decoded alone with special tokens
    kept and keyed by its normalised text (the decoded text where normalising leaves
    nothing), or by its raw token string where the decoded text holds U+FFFD (a partial
    UTF-8 sequence); keys get ids in first-seen order.

    The released embedding is padded past the tokenizer; those model ids never come
    out of the tokenizer, and mapping them to the pad token's compressed id (?) is the
    choice made here, in this one place.
    """
    tokenizer_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size < tokenizer_size:
        raise ValueError(
            f"vocab_size: {vocab_size} is smaller than the tokenizer's {tokenizer_size} ids "
            "(allowed: >= the tokenizer size)"
        )
    if not 0 <= pad_token_id < tokenizer_size:
        raise ValueError(f"pad_token_id: {pad_token_id} is outside the tokenizer's ids [0, {tokenizer_size})")
    normalizer = _compression_normalizer()
    decoded = tokenizer.decode_batch([[token_id] for token_id in range(tokenizer_size)], skip_special_tokens=False)
    compressed_of_key: dict[str, int] = {}
    compressed: list[int] = []
    for token_id, text in enumerate(decoded):
        if _REPLACEMENT_CHARACTER in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        compressed.append(compressed_of_key.setdefault(key, len(compressed_of_key)))
    compressed.extend([compressed[pad_token_id]] * (vocab_size - tokenizer_size))
    return torch.tensor(compressed, dtype=torch.int64), len(compressed_of_key)


# -- n-grams to rows ---------------------------------------------------------------------


def _exclusive_running_sum(primes: torch.Tensor) -> torch.Tensor:
    flat = primes.reshape(-1)
    return (torch.cumsum(flat, 0) - flat).reshape(primes.shape)


@dataclass(frozen=True, eq=False)
class EngramHashing:
    """Everything a layer needs to turn compressed n-grams into table rows.

    ``multipliers[layer]`` is int64 ``[max_ngram_size]``; ``primes[layer]`` and
    ``offsets[layer]`` are int64 ``[max_ngram_size - 1, n_heads]`` (offsets: the
    exclusive running sum of the layer's primes in (n, head) order).
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    pad_compressed_id: int
    multipliers: dict[int, torch.Tensor]
    primes: dict[int, torch.Tensor]
    offsets: dict[int, torch.Tensor]

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("layer_ids: empty (allowed: at least one Engram layer)")
        if self.max_ngram_size < 2:
            raise ValueError(f"max_ngram_size: {self.max_ngram_size} (allowed: >= 2)")
        if self.n_heads <= 0:
            raise ValueError(f"n_heads: must be > 0, got {self.n_heads}")
        if self.pad_compressed_id < 0:
            raise ValueError(f"pad_compressed_id: must be >= 0, got {self.pad_compressed_id}")
        table_shape = (self.max_ngram_size - 1, self.n_heads)
        for name, shape in (
            ("multipliers", (self.max_ngram_size,)),
            ("primes", table_shape),
            ("offsets", table_shape),
        ):
            per_layer: dict[int, torch.Tensor] = getattr(self, name)
            if sorted(per_layer) != sorted(self.layer_ids):
                raise ValueError(f"{name}: layers {sorted(per_layer)}, expected layer_ids {list(self.layer_ids)}")
            for layer, tensor in per_layer.items():
                if tensor.dtype != torch.int64 or tuple(tensor.shape) != shape:
                    raise ValueError(
                        f"{name}[{layer}]: {tensor.dtype} {tuple(tensor.shape)} (allowed: torch.int64 {shape})"
                    )
        for layer in self.layer_ids:
            if not bool((self.primes[layer] > 1).all()):
                raise ValueError(f"primes[{layer}]: every table size must be > 1")
            if not torch.equal(self.offsets[layer], _exclusive_running_sum(self.primes[layer])):
                raise ValueError(f"offsets[{layer}]: not the exclusive running sum of primes[{layer}]")

    @classmethod
    def from_sizes(
        cls,
        layer_ids: Sequence[int],
        max_ngram_size: int,
        n_heads: int,
        vocab_size: int,
        compressed_vocab_size: int,
        pad_compressed_id: int,
    ) -> "EngramHashing":
        """The declarations derived from the sizes alone (no consistency checks against
        a config; :meth:`from_config` adds those)."""
        primes = engram_primes(layer_ids, max_ngram_size, n_heads, vocab_size)
        prime_tensors = {layer: torch.tensor(primes[layer], dtype=torch.int64) for layer in layer_ids}
        return cls(
            layer_ids=tuple(layer_ids),
            max_ngram_size=max_ngram_size,
            n_heads=n_heads,
            pad_compressed_id=pad_compressed_id,
            multipliers={
                layer: engram_multipliers(layer, compressed_vocab_size, max_ngram_size) for layer in layer_ids
            },
            primes=prime_tensors,
            offsets={layer: _exclusive_running_sum(p) for layer, p in prime_tensors.items()},
        )

    @classmethod
    def from_config(cls, config: V41Config, token_map: torch.Tensor, num_compressed: int) -> "EngramHashing":
        """Declarations for ``config``'s Engram layers, checked against the tokenizer's
        compression (``build_compressed_token_map``) and the config's table sizes."""
        if token_map.dtype != torch.int64 or tuple(token_map.shape) != (config.vocab_size,):
            raise ConfigError(
                f"vocab_size: config says {config.vocab_size}, the compressed token map is "
                f"{token_map.dtype} {tuple(token_map.shape)} (allowed: torch.int64 ({config.vocab_size},))"
            )
        if num_compressed != config.engram_compressed_vocab_size:
            raise ConfigError(
                f"engram_compressed_vocab_size: config says {config.engram_compressed_vocab_size}, "
                f"the tokenizer compresses to {num_compressed}"
            )
        layer_ids = config.engram_layer_ids
        row_counts = engram_row_counts(
            layer_ids, config.engram_max_ngram_size, config.engram_n_heads, config.engram_vocab_size
        )
        for index, (layer, declared, derived) in enumerate(zip(layer_ids, config.engram_num_embeddings, row_counts)):
            if declared != derived:
                raise ConfigError(
                    f"engram_num_embeddings[{index}] (layer {layer}): config says {declared}, "
                    f"the primes above engram_vocab_size sum to {derived}"
                )
        return cls.from_sizes(
            layer_ids=layer_ids,
            max_ngram_size=config.engram_max_ngram_size,
            n_heads=config.engram_n_heads,
            vocab_size=config.engram_vocab_size,
            compressed_vocab_size=config.engram_compressed_vocab_size,
            pad_compressed_id=int(token_map[config.engram_pad_token_id]),
        )

    def to(self, device: torch.device | str) -> "EngramHashing":
        """These declarations with their tables on ``device`` (a forward on a GPU hashes
        there; a captured graph cannot copy them from the host)."""
        return dataclasses.replace(
            self,
            **{
                name: {layer: t.to(device) for layer, t in getattr(self, name).items()}
                for name in ("multipliers", "primes", "offsets")
            },
        )

    def layer_rows(self, layer_id: int) -> int:
        """The table rows of an Engram layer: the sum of its primes."""
        return int(self.primes[layer_id].sum())

    @property
    def history_size(self) -> int:
        return self.max_ngram_size - 1

    def _check_history(self, history: torch.Tensor) -> None:
        if history.dtype != torch.int64 or tuple(history.shape) != (self.history_size,):
            raise ValueError(
                f"history: {history.dtype} {tuple(history.shape)} (allowed: torch.int64 ({self.history_size},))"
            )

    def _check_step(self, compressed_ids: torch.Tensor, histories: torch.Tensor) -> None:
        if compressed_ids.dim() != 1 or compressed_ids.dtype != torch.int64:
            raise ValueError(
                f"compressed_ids: {compressed_ids.dtype} {tuple(compressed_ids.shape)} (allowed: torch.int64 [T])"
            )
        if histories.dtype != torch.int64 or histories.dim() != 2 or histories.shape[1] != self.history_size:
            raise ValueError(
                f"history: {histories.dtype} {tuple(histories.shape)} "
                f"(allowed: torch.int64 [S, {self.history_size}])"
            )
        if compressed_ids.numel() and int(compressed_ids.min()) < 0:
            raise ValueError("compressed_ids: negative id (allowed: >= 0; DEAD marks history slots only)")
        if histories.numel() and int(histories.min()) < DEAD:
            raise ValueError(f"history: id below DEAD ({DEAD}) (allowed: compressed ids or DEAD)")

    @staticmethod
    def _chunk_starts(lengths: torch.Tensor, histories: torch.Tensor, compressed_ids: torch.Tensor) -> torch.Tensor:
        """Each chunk's first row in ``compressed_ids``, the chunks laid out one after
        another, one per history."""
        if (
            lengths.dtype != torch.int64
            or tuple(lengths.shape) != (histories.shape[0],)
            or (lengths.numel() and int(lengths.min()) < 0)
            or int(lengths.sum()) != compressed_ids.numel()
        ):
            raise ValueError(
                f"lengths: {lengths.dtype} {tuple(lengths.shape)} summing to {int(lengths.sum())} (allowed: "
                f"torch.int64 ({histories.shape[0]},), >= 0, summing to the {compressed_ids.numel()} compressed ids)"
            )
        return torch.cumsum(lengths, 0) - lengths

    def ngram_ids(self, compressed_ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """``[T, max_ngram_size]``: column k of row t is the compressed id at t - k.

        ``history`` holds the compressed ids just before the chunk, most recent last,
        DEAD before the sequence start. Once a shift reaches DEAD, it and every larger
        shift read ``pad_compressed_id``.
        """
        self._check_history(history)
        lengths = torch.tensor([compressed_ids.numel()], dtype=torch.int64, device=compressed_ids.device)
        return self.step_ngram_ids(compressed_ids, history.unsqueeze(0), lengths)

    def step_ngram_ids(
        self, compressed_ids: torch.Tensor, histories: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """``ngram_ids`` of a step's chunks at once, without a loop over them:
        ``compressed_ids`` [R] holds chunk after chunk, chunk s of ``lengths[s]`` ids
        (summing to R) following ``histories[s]`` ([S, max_ngram_size - 1]); row r is
        the row ``ngram_ids`` gives that id within its own chunk."""
        self._check_step(compressed_ids, histories)
        chunk_starts = self._chunk_starts(lengths, histories, compressed_ids)
        history, device = self.history_size, compressed_ids.device
        chunks = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths).unsqueeze(1)
        rows = torch.arange(compressed_ids.numel(), device=device).unsqueeze(1)
        shifts = torch.arange(self.max_ngram_size, device=device).unsqueeze(0)
        # How far into its own chunk each shifted read lands; below 0 it reads the history.
        into_chunk = rows - chunk_starts[chunks] - shifts
        # One gather from the histories followed by the ids.
        source = torch.cat((histories.reshape(-1), compressed_ids))
        at = torch.where(into_chunk >= 0, histories.numel() + rows - shifts, chunks * history + history + into_chunk)
        ngrams = source[at]
        dead = (ngrams == DEAD).cummax(dim=1).values
        return torch.where(dead, torch.full_like(ngrams, self.pad_compressed_id), ngrams)

    def decode_ngram_ids(self, compressed_ids: torch.Tensor, histories: torch.Tensor) -> torch.Tensor:
        """``step_ngram_ids`` of a step whose every chunk is one id (a decode step):
        row r is ``compressed_ids[r]`` after ``histories[r]``. Reads no value on the
        host and checks nothing (what a captured graph runs; the ids come from the
        device there)."""
        ngrams = torch.cat((compressed_ids.unsqueeze(1), histories.flip(1)), dim=1)
        dead = (ngrams == DEAD).cummax(dim=1).values
        return torch.where(dead, torch.full_like(ngrams, self.pad_compressed_id), ngrams)

    @staticmethod
    def decode_next_history(compressed_ids: torch.Tensor, histories: torch.Tensor) -> torch.Tensor:
        """``step_next_history`` of a decode step that keeps its one id per chunk:
        each history shifted by one, the id appended. Host-free, like
        ``decode_ngram_ids``."""
        return torch.cat((histories[:, 1:], compressed_ids.unsqueeze(1)), dim=1)

    def row_ids(self, layer_id: int, ngram_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[R, (max_ngram_size - 1) * n_heads]`` table rows, ordered by n-gram
        size (2..max) then head: floor-mod(XOR_{k<n} id_k * mult[k], prime) + offset
        with wrapping int64 products. Rows are independent (batch-agnostic)."""
        if layer_id not in self.multipliers:
            raise ValueError(f"layer_id: {layer_id} is not an Engram layer (allowed: {list(self.layer_ids)})")
        if ngram_ids.dim() != 2 or ngram_ids.shape[1] != self.max_ngram_size or ngram_ids.dtype != torch.int64:
            raise ValueError(
                f"ngram_ids: {ngram_ids.dtype} {tuple(ngram_ids.shape)} "
                f"(allowed: torch.int64 [R, {self.max_ngram_size}])"
            )
        device = ngram_ids.device
        products = ngram_ids * self.multipliers[layer_id].to(device)
        hashes = [products[:, 0]]
        for k in range(1, self.max_ngram_size):
            hashes.append(torch.bitwise_xor(hashes[-1], products[:, k]))
        per_size = torch.stack(hashes[1:], dim=1).unsqueeze(2)
        rows = torch.remainder(per_size, self.primes[layer_id].to(device)) + self.offsets[layer_id].to(device)
        return rows.reshape(ngram_ids.shape[0], (self.max_ngram_size - 1) * self.n_heads)

    def next_history(self, compressed_ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """The last ``max_ngram_size - 1`` compressed ids once the chunk is appended."""
        self._check_history(history)
        count = torch.tensor([compressed_ids.numel()], dtype=torch.int64, device=compressed_ids.device)
        return self.step_next_history(compressed_ids, history.unsqueeze(0), count, count)[0]

    def step_next_history(
        self, compressed_ids: torch.Tensor, histories: torch.Tensor, lengths: torch.Tensor, appended: torch.Tensor
    ) -> torch.Tensor:
        """``next_history`` of a step's chunks at once ([S, max_ngram_size - 1]),
        without a loop over them: ``compressed_ids`` holds chunk after chunk, chunk s
        of ``lengths[s]`` ids, of which its first ``appended[s]`` follow
        ``histories[s]`` (a verify: its accepted prefix)."""
        self._check_step(compressed_ids, histories)
        chunk_starts = self._chunk_starts(lengths, histories, compressed_ids)
        if appended.shape != lengths.shape or bool(((appended < 0) | (appended > lengths)).any()):
            raise ValueError(f"appended: {appended.tolist()} (allowed: 0..lengths[s] each, lengths {lengths.tolist()})")
        history, device = self.history_size, compressed_ids.device
        # Where each kept id sits in history ++ appended ids: the last ``history`` of them.
        kept = appended.unsqueeze(1) + torch.arange(history, device=device).unsqueeze(0)
        chunks = torch.arange(histories.shape[0], device=device).unsqueeze(1)
        source = torch.cat((histories.reshape(-1), compressed_ids))
        at = torch.where(
            kept < history, chunks * history + kept, histories.numel() + chunk_starts.unsqueeze(1) + kept - history
        )
        return source[at]


# -- host table --------------------------------------------------------------------------

_FP8_VALUE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
# float8_e8m0fnu exists only in newer torch; formats.e8m0_decode reads it the same way.
_E8M0_SCALE_DTYPES = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
_FLOAT_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# cudaHostRegister's flags: Portable (every device's context) and Mapped (in the device
# address space); ReadOnly besides for a file map registered where it lies (the device
# never writes; a read-only map needs it, and some devices do not support it).
_PAGE_LOCKED = 1 | 2
_PAGE_LOCKED_READ_ONLY = _PAGE_LOCKED | 8
_mapping_lock = threading.Lock()
logger = logging.getLogger(__name__)


def _register(address: int, size: int, flags: int) -> int:
    """cudaHostRegister's error code (0: the range is page-locked and mapped)."""
    return int(torch.cuda.cudart().cudaHostRegister(address, size, flags))


def _unregister(addresses: tuple[int, ...]) -> None:
    for address in addresses:
        torch.cuda.cudart().cudaHostUnregister(address)


def _page_locked_copy(t: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap]:
    """``t``'s values in a new anonymous map of their own pages (page-aligned, shared
    with no other allocation, so its registration overlaps none), registered
    page-locked and mapped; the map must outlive the copy."""
    buffer = mmap.mmap(-1, max(t.nbytes, 1))
    copy = torch.frombuffer(buffer, dtype=torch.uint8, count=t.nbytes).view(t.dtype).view(t.shape)
    copy.copy_(t)
    error = _register(copy.data_ptr(), max(t.nbytes, 1), _PAGE_LOCKED)
    if error:
        raise RuntimeError(
            f"Engram table: cudaHostRegister of a {t.nbytes}-byte page-locked copy failed with CUDA error {error} "
            "(the device reads the table from page-locked host memory)"
        )
    return copy, buffer


class EngramTable:
    """One layer's table rows on the host, never copied whole.

    ``values`` are either float rows ``[rows, head_dim]`` (``scales`` None) or FP8 E4M3
    bytes with E8M0 ``scales`` ``[rows, ceil(head_dim / 32)]`` (a head_dim that 32 does
    not divide ends each row in a partial group with its own scale); either may be a
    read-only tensor over a numpy memmap (``file_mapped``: each tensor is a map of its
    own, as the loader makes them). Only the gathered rows are read and dequantised,
    on the host (``lookup``) or, once ``map_for`` a CUDA device, by its kernels.
    """

    def __init__(self, values: torch.Tensor, scales: torch.Tensor | None, *, file_mapped: bool = False) -> None:
        if values.dim() != 2:
            raise ValueError(f"values: shape {tuple(values.shape)} (allowed: [rows, head_dim])")
        num_rows, head_dim = values.shape
        if values.dtype in _FP8_VALUE_DTYPES:
            expected = (num_rows, row_scale_groups(head_dim, FP8_BLOCK))
            if scales is None:
                raise ValueError(f"scales: None, but values are FP8 bytes (allowed: E8M0 bytes {expected})")
            if scales.dtype not in _E8M0_SCALE_DTYPES or tuple(scales.shape) != expected:
                raise ValueError(
                    f"scales: {scales.dtype} {tuple(scales.shape)} (allowed: uint8 or float8_e8m0fnu {expected})"
                )
            # Reinterpreting the bytes is free and keeps the gather on a plain byte dtype.
            values, scales = values.view(torch.uint8), scales.view(torch.uint8)
        elif values.dtype in _FLOAT_ROW_DTYPES:
            if scales is not None:
                raise ValueError(f"scales: given for {values.dtype} rows (allowed: None unless values are FP8)")
        else:
            raise ValueError(
                f"values: dtype {values.dtype} (allowed: float32, bfloat16, float16, or FP8 as uint8/float8_e4m3fn)"
            )
        for name, t in (("values", values), ("scales", scales)):
            if t is not None and t.device.type != "cpu":
                raise ValueError(f"{name}: on {t.device} (allowed: host memory)")
        self.values = values
        self.scales = scales
        self.num_rows: int = num_rows
        self.head_dim: int = head_dim
        self.file_mapped = file_mapped
        self._device_readable = False
        self._buffers: tuple[mmap.mmap, ...] = ()  # page-locked copies' maps (map_for)

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        """``row_ids [..., k]`` -> float32 ``[..., k * head_dim]``: the rows concatenated
        in the order given."""
        if row_ids.dim() == 0 or row_ids.dtype != torch.int64:
            raise ValueError(f"row_ids: {row_ids.dtype} {tuple(row_ids.shape)} (allowed: torch.int64 [..., k])")
        flat = row_ids.reshape(-1).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_rows):
            raise ValueError(
                f"row_ids: range [{int(flat.min())}, {int(flat.max())}] is outside the table's [0, {self.num_rows})"
            )
        rows = self.values.index_select(0, flat)
        if self.scales is None:
            gathered = rows.float()
        else:
            gathered = dequantize_fp8(rows, self.scales.index_select(0, flat))
        return gathered.reshape(*row_ids.shape[:-1], row_ids.shape[-1] * self.head_dim)

    def map_for(self, device: torch.device | str) -> None:
        """Makes the rows readable by ``device``'s kernels at their host addresses
        (``values`` / ``scales.data_ptr()``, with their strides). For a CUDA device
        they are page-locked and mapped into its address space (unified addressing:
        the same pointers): a file map registered where it lies (read-only: the spec's
        mapped host table storage; its pages are read in now) when the device can
        register read-only memory; otherwise, and for memory that is not a file map of
        its own, the rows are copied once into page-locked memory that the table then
        holds (logged for a file map, with the CUDA error and the bytes). A CPU device
        reads host memory as it is. Once per table; a registration ends when the table
        is freed."""
        if torch.device(device).type != "cuda":
            return
        with _mapping_lock:
            if self._device_readable:
                return
            parts = [t for t in (self.values, self.scales) if t is not None]
            registered: list[int] = []
            error = 0
            if self.file_mapped:
                for t in parts:
                    storage = t.untyped_storage()
                    error = _register(storage.data_ptr(), storage.nbytes(), _PAGE_LOCKED_READ_ONLY)
                    if error:
                        break
                    registered.append(storage.data_ptr())
                if error:
                    _unregister(tuple(registered))
                    registered = []
                    logger.warning(
                        "Engram table: the device does not register its read-only file map (CUDA error %d); its "
                        "%.1f MiB are copied once into page-locked memory",
                        error,
                        sum(t.nbytes for t in parts) / 2**20,
                    )
            if not registered:
                copies = [_page_locked_copy(t) for t in parts]
                self.values = copies[0][0]
                self.scales = copies[1][0] if len(copies) > 1 else None
                self._buffers = tuple(buffer for _, buffer in copies)
                registered = [copy.data_ptr() for copy, _ in copies]
            # The process's exit releases every registration: none is undone then.
            weakref.finalize(self, _unregister, tuple(registered)).atexit = False
            self._device_readable = True

    @property
    def is_fp8(self) -> bool:
        """FP8 bytes with E8M0 scales (else float rows)."""
        return self.scales is not None

    @property
    def device_readable(self) -> bool:
        """Whether ``map_for`` a CUDA device has run (a CPU reads the rows as they are)."""
        return self._device_readable


class EngramKernels(Protocol):
    """How a kernels backend reads an Engram table's rows and applies them.
    ``engram_on_device``: the row ids it takes live on the forward's device (the tables
    mapped for it), else on the host."""

    engram_on_device: bool

    def engram_rows(self, table: EngramTable, row_ids: torch.Tensor) -> torch.Tensor:
        """``table.lookup(row_ids)`` (float32 rows [..., k * head_dim]), on ``row_ids``'
        device."""
        ...

    def engram_gated_add(
        self, streams: torch.Tensor, projected: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``gated_add(streams, projected, q_weight, k_weight, eps)``."""
        ...


def gated_add(
    streams: torch.Tensor, projected: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``h_s + gate_s * value`` per stream s, from ``projected [T, (hc + 1) * hidden]``
    (the looked-up rows through wkv: hc keys then one value, in the compute dtype), in
    fp32; the result has ``streams.dtype``."""
    tokens, hc, hidden = streams.shape
    projected = projected.float()
    keys = projected[:, : hc * hidden].reshape(tokens, hc, hidden)
    value = projected[:, hc * hidden :].unsqueeze(1)
    h = streams.float()
    dot = row_sum(h * q_weight.float() * k_weight.float() * keys)
    dot = dot * torch.rsqrt(row_mean(h.square()) + eps) * torch.rsqrt(row_mean(keys.square()) + eps)
    dot = dot / math.sqrt(hidden)
    gate = pointwise(torch.sigmoid, torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(GATE_DOT_FLOOR)))
    return (h + gate.unsqueeze(-1) * value).to(streams.dtype)


class HostEngram:
    """``EngramKernels`` as the host lookup (the rows gathered and dequantised on the
    CPU, moved to the streams' device by their reader) and this module's gated add."""

    engram_on_device = False

    def engram_rows(self, table: EngramTable, row_ids: torch.Tensor) -> torch.Tensor:
        return table.lookup(row_ids)

    def engram_gated_add(
        self, streams: torch.Tensor, projected: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return gated_add(streams, projected, q_weight, k_weight, eps)


HOST_ENGRAM = HostEngram()


# -- gated update ------------------------------------------------------------------------


def engram_update(
    streams: torch.Tensor,
    embeddings: torch.Tensor,
    wkv: Weight,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    kernels: EngramKernels = HOST_ENGRAM,
) -> torch.Tensor:
    """The streams after Engram: ``h_s + gate_s * value`` per stream s.

    ``streams [T, hc, hidden]``; ``embeddings [T, input_dim]`` (looked-up rows);
    ``wkv [(hc + 1) * hidden, input_dim]`` in the compute dtype or as stored, giving hc keys then one
    value; ``q_weight``, ``k_weight [hc, hidden]``. The projection runs in the compute
    dtype, the gate and the add (``kernels.engram_gated_add``) in fp32; the result has
    ``streams.dtype``.
    """
    if streams.dim() != 3:
        raise ValueError(f"streams: shape {tuple(streams.shape)} (allowed: [T, hc, hidden])")
    tokens, hc, hidden = streams.shape
    if embeddings.dim() != 2 or embeddings.shape[0] != tokens:
        raise ValueError(f"embeddings: shape {tuple(embeddings.shape)} (allowed: [{tokens}, input_dim])")
    if tuple(wkv.shape) != ((hc + 1) * hidden, embeddings.shape[1]):
        raise ValueError(
            f"wkv: shape {tuple(wkv.shape)} (allowed: [{(hc + 1) * hidden}, {embeddings.shape[1]}])"
        )
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(weight.shape) != (hc, hidden):
            raise ValueError(f"{name}: shape {tuple(weight.shape)} (allowed: [{hc}, {hidden}])")
    projected = linear(embeddings.to(wkv.dtype), wkv)
    return kernels.engram_gated_add(streams, projected, q_weight, k_weight, eps)
