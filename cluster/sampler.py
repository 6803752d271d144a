"""Sampling: one step's logits to token ids and logprobs, vectorised over rows.

Owns: :class:`SamplingMetadata` (a step's per-row sampling parameters as tensors),
:class:`Sampler` (greedy, temperature, top-k, top-p, seeded draws, logprobs),
:func:`prompt_logprobs`, and the counter-based random draw they use.

Batch invariance is the design constraint: a row's draw depends only on (its seed,
its output index, the token id), through a splitmix64 hash evaluated in int64 tensor
arithmetic, never on a generator whose state other rows advance. So a request samples
the same tokens alone, in any batch, at any row, on any rank.

Must not import: ray, tokenizers, ``model``, ``cache``, ``actors``, ``deploy``; from
``cluster`` only ``cluster.request``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dsv41.cluster.request import SamplingParams

_U64_MASK = (1 << 64) - 1


def _as_int64(value: int) -> int:
    """The int64 with the same low 64 bits (two's complement)."""
    value &= _U64_MASK
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64's increment and finaliser multipliers (Steele, Lea, Flood 2014).
_SPLITMIX_GAMMA = _as_int64(0x9E3779B97F4A7C15)
_SPLITMIX_MUL_1 = _as_int64(0xBF58476D1CE4E5B9)
_SPLITMIX_MUL_2 = _as_int64(0x94D049BB133111EB)
# Doubles carry 53 bits; the uniform keeps the top 53 of 64 so it is never 0 or 1 and
# the Gumbel tail reaches ~37, not the ~17 a float32 uniform would cut it at (a cut
# that would starve low-probability tokens over a 129k vocabulary).
_UNIFORM_BITS = 53


class SamplerError(ValueError):
    """Logits or metadata the sampler cannot use; the message says which and why."""


def _shift_right_logical(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic (sign-extending); splitmix64 needs logical.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64_draw(state: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The ``index``-th (0-based) output of a splitmix64 generator started at ``state``.

    int64 tensors, broadcast together; products wrap modulo 2**64 as the algorithm's
    unsigned arithmetic does, so the bits equal the textbook generator's.
    """
    z = state + (index + 1) * _SPLITMIX_GAMMA
    z = (z ^ _shift_right_logical(z, 30)) * _SPLITMIX_MUL_1
    z = (z ^ _shift_right_logical(z, 27)) * _SPLITMIX_MUL_2
    return z ^ _shift_right_logical(z, 31)


def gumbel_noise(seeds: torch.Tensor, output_indices: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [R, vocab] (float64): row r's value at token t is a pure
    function of (seeds[r], output_indices[r], t).

    The seed's generator yields one state per output index; that state's generator
    yields one draw per token id.
    """
    step_states = splitmix64_draw(seeds, output_indices)
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = splitmix64_draw(step_states.unsqueeze(1), token_ids.unsqueeze(0))
    uniform = (_shift_right_logical(bits, 64 - _UNIFORM_BITS).to(torch.float64) + 0.5) * 2.0**-_UNIFORM_BITS
    return -torch.log(-torch.log(uniform))


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters of one step, as tensors on the logits' device.

    ``temperature`` 0 marks a greedy row; ``top_k`` -1 is off; ``output_indices`` is the
    index, among the request's generated tokens, of the token each row samples.
    ``num_logprobs`` is the request's ``params.logprobs`` per row.
    """

    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64
    top_p: torch.Tensor  # [R] float32
    seeds: torch.Tensor  # [R] int64
    output_indices: torch.Tensor  # [R] int64
    num_logprobs: tuple[int | None, ...]

    def __post_init__(self) -> None:
        rows = len(self.num_logprobs)
        for name, dtype in (
            ("temperature", torch.float32),
            ("top_k", torch.int64),
            ("top_p", torch.float32),
            ("seeds", torch.int64),
            ("output_indices", torch.int64),
        ):
            value = getattr(self, name)
            if value.dtype != dtype or tuple(value.shape) != (rows,):
                raise SamplerError(
                    f"{name}: must be a {dtype} tensor of shape ({rows},), "
                    f"got {value.dtype} {tuple(value.shape)}"
                )

    @property
    def num_rows(self) -> int:
        return len(self.num_logprobs)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        output_indices: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Gather one row per (params, sampling seed, output index); seeds are taken
        modulo 2**64."""
        if not len(params) == len(seeds) == len(output_indices):
            raise SamplerError(
                f"rows: params, seeds and output_indices must have one entry per row, "
                f"got {len(params)}, {len(seeds)}, {len(output_indices)}"
            )
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor([_as_int64(s) for s in seeds], dtype=torch.int64, device=device),
            output_indices=torch.tensor(list(output_indices), dtype=torch.int64, device=device),
            num_logprobs=tuple(p.logprobs for p in params),
        )


@dataclass(frozen=True)
class SamplerOutput:
    """One step's samples: a token id per row and, where the row asked, its logprobs
    (``{token_id: logprob}`` of the chosen token and the top ``num_logprobs``)."""

    token_ids: torch.Tensor  # [R] int64, on the logits' device
    logprobs: tuple[dict[int, float] | None, ...]


class Sampler:
    """Turns a step's logits [R, vocab_size] (float32) into one token per row.

    Greedy rows (temperature 0) take the argmax, the smallest id on ties. Other rows
    divide by their temperature, keep their top_k tokens (ties at the cut go to the
    smaller id), then the smallest set of those whose renormalised mass reaches top_p
    (at least one token), and draw by Gumbel-max with the row's counter-based noise.
    Logprobs are the log-softmax of the raw logits (no temperature, no filtering), as
    vLLM reports by default.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise SamplerError(f"vocab_size: must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        _check_logits(logits, self.vocab_size, metadata.num_rows)
        token_ids = logits.argmax(dim=-1)
        random_rows = torch.nonzero(metadata.temperature > 0).squeeze(1)
        if random_rows.numel() > 0:
            temperature = metadata.temperature.index_select(0, random_rows).unsqueeze(1)
            filtered = _mask_top_k_top_p(
                logits.index_select(0, random_rows) / temperature,
                metadata.top_k.index_select(0, random_rows),
                metadata.top_p.index_select(0, random_rows),
            )
            noise = gumbel_noise(
                metadata.seeds.index_select(0, random_rows),
                metadata.output_indices.index_select(0, random_rows),
                self.vocab_size,
            )
            sampled = (filtered.to(torch.float64) + noise).argmax(dim=-1)
            token_ids = token_ids.index_copy(0, random_rows, sampled)
        return SamplerOutput(token_ids=token_ids, logprobs=_row_logprobs(logits, token_ids, metadata.num_logprobs))


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: Sequence[int] | torch.Tensor, num_logprobs: int
) -> list[dict[int, float]]:
    """Logprobs of a prompt block: row i of ``logits`` [L, vocab] predicts
    ``next_token_ids[i]`` (the prompt token after position i); each entry holds that
    token's logprob and the top ``num_logprobs`` of the raw log-softmax."""
    if logits.dim() != 2:
        raise SamplerError(f"logits: must be [L, vocab], got shape {tuple(logits.shape)}")
    _check_logits(logits, logits.shape[1], logits.shape[0])
    targets = torch.as_tensor(next_token_ids, dtype=torch.int64, device=logits.device)
    if tuple(targets.shape) != (logits.shape[0],):
        raise SamplerError(
            f"next_token_ids: one per logits row ({logits.shape[0]}), got shape {tuple(targets.shape)}"
        )
    if targets.numel() and not bool(((targets >= 0) & (targets < logits.shape[1])).all()):
        raise SamplerError(f"next_token_ids: must lie in 0..{logits.shape[1] - 1}")
    return _logprob_entries(torch.log_softmax(logits, dim=-1), targets, [num_logprobs] * logits.shape[0])


def _check_logits(logits: torch.Tensor, vocab_size: int, num_rows: int) -> None:
    if logits.dtype != torch.float32 or tuple(logits.shape) != (num_rows, vocab_size):
        raise SamplerError(
            f"logits: must be float32 of shape ({num_rows}, {vocab_size}), "
            f"got {logits.dtype} {tuple(logits.shape)}"
        )
    if num_rows == 0:
        return
    # A NaN or +inf anywhere, or a row of -inf, makes the row's max non-finite: such a
    # row has no distribution to sample, and the model that produced it is broken.
    bad_rows = torch.nonzero(~torch.isfinite(logits.amax(dim=-1))).squeeze(1)
    if bad_rows.numel() > 0:
        raise SamplerError(f"logits: rows {bad_rows.tolist()} hold NaN, +inf or only -inf")


def _mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set every token outside a row's top-k / nucleus to -inf (rows independent)."""
    vocab_size = logits.shape[1]
    k = torch.where(top_k < 0, vocab_size, top_k.clamp(max=vocab_size))
    uses_top_p = top_p < 1
    if not bool((k < vocab_size).any()) and not bool(uses_top_p.any()):
        return logits
    # The stable descending sort puts the smaller id first among equal logits, which
    # makes the top-k cut deterministic.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    keep = rank < k.unsqueeze(1)
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # A token stays while the mass ranked above it is below top_p: the smallest set
    # reaching top_p, always including the first token (mass before it is exactly 0).
    # Rows with top_p == 1 skip the test, so float rounding of the cumsum cannot drop
    # their tail.
    keep &= (mass_before < top_p.unsqueeze(1)) | ~uses_top_p.unsqueeze(1)
    keep_by_token = torch.empty_like(keep).scatter_(1, order, keep)
    return logits.masked_fill(~keep_by_token, float("-inf"))


def _row_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int | None]
) -> tuple[dict[int, float] | None, ...]:
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    entries: list[dict[int, float] | None] = [None] * len(num_logprobs)
    if rows:
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        raw_logprobs = torch.log_softmax(logits.index_select(0, index), dim=-1)
        counts = [num_logprobs[i] for i in rows]
        row_entries = _logprob_entries(raw_logprobs, token_ids.index_select(0, index), counts)
        for row, entry in zip(rows, row_entries):
            entries[row] = entry
    return tuple(entries)


def _logprob_entries(
    logprobs: torch.Tensor, chosen: torch.Tensor, top_counts: Sequence[int]
) -> list[dict[int, float]]:
    """Per row: ``{token: logprob}`` of the top ``top_counts[row]`` tokens and the chosen one."""
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    max_count = min(max(top_counts, default=0), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(max_count, dim=-1)
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    entries = []
    for row, (token, token_logprob, count) in enumerate(zip(chosen.tolist(), chosen_logprobs, top_counts)):
        entry = dict(zip(top_ids_list[row][:count], top_values_list[row][:count]))
        entry[token] = token_logprob
        entries.append(entry)
    return entries
