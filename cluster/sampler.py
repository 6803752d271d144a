"""Sampling: one step's logits to token ids and logprobs, vectorised over rows.

Owns: :class:`SamplingMetadata` (a step's per-row sampling parameters as tensors),
:class:`Sampler` (the grammar's token mask, logit bias, min_tokens, repetition /
presence / frequency penalties, greedy, temperature, min-p, top-k, top-p, seeded
draws, logprobs), :func:`prompt_logprobs`, and the counter-based random draw they use.

Batch invariance is the design constraint: a row's draw depends only on (its seed,
its output index, the token id), through a splitmix64 hash evaluated in int64 tensor
arithmetic, never on a generator whose state other rows advance. So a request samples
the same tokens alone, in any batch, at any row, on any rank. Every logits transform
is elementwise or a row's own max (no transcendental function: min-p compares in log
space against a threshold computed per row on the host), so a row's result does not
depend on the step's other rows either.

Must not import: ray, tokenizers, ``model``, ``cache``, ``actors``, ``deploy``; from
``cluster`` only ``cluster.request`` and ``cluster.sampling_guide``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dsv41.cluster.sampling_guide import BITMASK_WORD_BITS, BITMASK_WORD_BYTES, SamplingGuide, bitmask_words
from dsv41.cluster.sampling_params import SamplingParams

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

    ``temperature`` 0 marks a greedy row, and ``random_rows`` [N] int64 lists the
    others (known on the host, so a step need not ask the device which they are);
    ``top_k`` -1 is off; ``output_indices`` is the
    index, among the request's generated tokens, of the token each row samples.
    ``num_logprobs`` is the request's ``params.logprobs`` per row. ``min_p_log`` is
    log(min_p) per row (-inf: off). The sparse tensors name (row, token) pairs:
    ``bias_*`` a value added to the logit (logit bias; -inf for a stop token masked by
    min_tokens), ``penalty_*`` a token of the row's prompt or output with its count in
    the output. ``allowed_tokens`` [G, bitmask words] int32 holds the packed masks of
    the ``allowed_rows`` [G] that have a grammar (None when no row has one).
    """

    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64
    top_p: torch.Tensor  # [R] float32
    seeds: torch.Tensor  # [R] int64
    output_indices: torch.Tensor  # [R] int64
    random_rows: torch.Tensor  # [N] int64
    num_logprobs: tuple[int | None, ...]
    min_p_log: torch.Tensor | None = None  # [R] float32
    repetition_penalty: torch.Tensor | None = None  # [R] float32
    presence_penalty: torch.Tensor | None = None  # [R] float32
    frequency_penalty: torch.Tensor | None = None  # [R] float32
    bias_rows: torch.Tensor | None = None  # [B] int64
    bias_tokens: torch.Tensor | None = None  # [B] int64
    bias_values: torch.Tensor | None = None  # [B] float32
    penalty_rows: torch.Tensor | None = None  # [N] int64
    penalty_tokens: torch.Tensor | None = None  # [N] int64
    penalty_counts: torch.Tensor | None = None  # [N] int32
    allowed_rows: torch.Tensor | None = None  # [G] int64
    allowed_tokens: torch.Tensor | None = None  # [G, W] int32

    def __post_init__(self) -> None:
        rows = len(self.num_logprobs)
        for name, dtype in (
            ("temperature", torch.float32),
            ("top_k", torch.int64),
            ("top_p", torch.float32),
            ("seeds", torch.int64),
            ("output_indices", torch.int64),
            ("min_p_log", torch.float32),
            ("repetition_penalty", torch.float32),
            ("presence_penalty", torch.float32),
            ("frequency_penalty", torch.float32),
        ):
            value = getattr(self, name)
            if value is None:
                continue
            if value.dtype != dtype or tuple(value.shape) != (rows,):
                raise SamplerError(
                    f"{name}: must be a {dtype} tensor of shape ({rows},), "
                    f"got {value.dtype} {tuple(value.shape)}"
                )
        if self.random_rows.dtype != torch.int64 or self.random_rows.dim() != 1:
            raise SamplerError(
                f"random_rows: must be a one-dimensional int64 tensor, got {self.random_rows.dtype} "
                f"{tuple(self.random_rows.shape)}"
            )
        for group, dtypes in (
            ("bias", (torch.int64, torch.int64, torch.float32)),
            ("penalty", (torch.int64, torch.int64, torch.int32)),
        ):
            names = [f"{group}_{part}" for part in ("rows", "tokens", "values" if group == "bias" else "counts")]
            values = [getattr(self, name) for name in names]
            if all(v is None for v in values):
                continue
            if any(v is None for v in values) or len({v.shape for v in values}) != 1 or values[0].dim() != 1:
                raise SamplerError(f"{', '.join(names)}: give all three, one-dimensional and of one length")
            for name, value, dtype in zip(names, values, dtypes):
                if value.dtype != dtype:
                    raise SamplerError(f"{name}: must be {dtype}, got {value.dtype}")
        if (self.allowed_rows is None) != (self.allowed_tokens is None):
            raise SamplerError("allowed_rows, allowed_tokens: give both or neither")
        if self.allowed_tokens is not None and (
            self.allowed_rows.dtype != torch.int64
            or self.allowed_rows.dim() != 1
            or self.allowed_tokens.dtype != torch.int32
            or self.allowed_tokens.dim() != 2
            or self.allowed_tokens.shape[0] != self.allowed_rows.shape[0]
        ):
            raise SamplerError(
                f"allowed_tokens: must be an int32 tensor of shape (len(allowed_rows), words) beside int64 "
                f"allowed_rows, got {self.allowed_tokens.dtype} {tuple(self.allowed_tokens.shape)} and "
                f"{self.allowed_rows.dtype} {tuple(self.allowed_rows.shape)}"
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
        *,
        guides: Sequence[SamplingGuide | None] | None = None,
        vocab_size: int | None = None,
        eos_token_id: int | None = None,
    ) -> SamplingMetadata:
        """Gather one row per (params, sampling seed, output index, guide); seeds are
        taken modulo 2**64. ``vocab_size`` is needed when a guide carries a grammar
        mask, ``eos_token_id`` when a row has ``min_tokens``."""
        guides = [None] * len(params) if guides is None else list(guides)
        if not len(params) == len(seeds) == len(output_indices) == len(guides):
            raise SamplerError(
                f"rows: params, seeds, output_indices and guides must have one entry per row, "
                f"got {len(params)}, {len(seeds)}, {len(output_indices)}, {len(guides)}"
            )

        def row_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype)

        fields: dict[str, torch.Tensor | None] = {}
        if any(p.min_p > 0 for p in params):
            fields["min_p_log"] = row_tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], torch.float32)
        if any(p.uses_penalties for p in params):
            for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
                fields[name] = row_tensor([getattr(p, name) for p in params], torch.float32)
        bias: list[tuple[int, int, float]] = []
        penalty: list[tuple[int, int, int]] = []
        for row, (p, index, guide) in enumerate(zip(params, output_indices, guides)):
            row_bias = dict(p.logit_bias)
            if index < p.min_tokens:
                # A stop token's bias is replaced, not added to: -inf either way.
                row_bias.update(dict.fromkeys(p.stop_token_ids, -math.inf))
                if eos_token_id is not None:
                    row_bias[eos_token_id] = -math.inf
            bias.extend((row, token, value) for token, value in sorted(row_bias.items()))
            if p.uses_penalties:
                if guide is None:
                    raise SamplerError(f"guides: row {row} has penalties but no guide carrying its token counts")
                penalty.extend((row, t, c) for t, c in zip(guide.penalty_token_ids, guide.penalty_output_counts))
        if bias:
            rows_, tokens_, values_ = zip(*bias)
            fields["bias_rows"] = row_tensor(list(rows_), torch.int64)
            fields["bias_tokens"] = row_tensor(list(tokens_), torch.int64)
            fields["bias_values"] = row_tensor(list(values_), torch.float32)
        if penalty:
            rows_, tokens_, counts_ = zip(*penalty)
            fields["penalty_rows"] = row_tensor(list(rows_), torch.int64)
            fields["penalty_tokens"] = row_tensor(list(tokens_), torch.int64)
            fields["penalty_counts"] = row_tensor(list(counts_), torch.int32)
        masked = [row for row, g in enumerate(guides) if g is not None and g.allowed_tokens is not None]
        if masked:
            if vocab_size is None:
                raise SamplerError("vocab_size: needed to read the guides' token masks")
            fields["allowed_rows"] = row_tensor(masked, torch.int64)
        fields.update(
            temperature=row_tensor([p.temperature for p in params], torch.float32),
            top_k=row_tensor([p.top_k for p in params], torch.int64),
            top_p=row_tensor([p.top_p for p in params], torch.float32),
            seeds=row_tensor([_as_int64(s) for s in seeds], torch.int64),
            output_indices=row_tensor(list(output_indices), torch.int64),
            random_rows=row_tensor([row for row, p in enumerate(params) if p.temperature > 0], torch.int64),
        )
        fields = _moved_rows(fields, device)
        if masked:
            fields["allowed_tokens"] = _packed_masks([guides[row] for row in masked], bitmask_words(vocab_size), device)
        return cls(num_logprobs=tuple(p.logprobs for p in params), **fields)


def _moved_rows(rows: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """The host row tensors on ``device``: one copy per dtype (a decode step's sampling
    inputs travel in two copies, not one per field), each tensor a view of its copy."""
    moved: dict[str, torch.Tensor] = {}
    for dtype in {t.dtype for t in rows.values()}:
        names = [name for name, t in rows.items() if t.dtype == dtype]
        joined = _to_device(torch.cat([rows[name] for name in names]), device)
        for name, part in zip(names, joined.split([rows[name].numel() for name in names])):
            moved[name] = part
    return moved


def _packed_masks(guides: Sequence[SamplingGuide], words: int, device: torch.device | str) -> torch.Tensor:
    """The guides' packed masks [len(guides), words] int32, moved once to ``device``."""
    data = b"".join(guide.allowed_tokens for guide in guides)
    if len(data) != len(guides) * words * BITMASK_WORD_BYTES:
        sizes = sorted({len(guide.allowed_tokens) // BITMASK_WORD_BYTES for guide in guides})
        raise SamplerError(f"guides: token masks of {sizes} words (allowed: {words})")
    return _to_device(torch.frombuffer(bytearray(data), dtype=torch.int32).view(len(guides), words), device)


def _to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device``; on a CUDA device copied from page-locked memory without
    waiting: a blocking copy would wait for every launch before it (a graph replay
    whose draws these rows make), and the host would stop feeding the device."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def unpack_token_mask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, words] int32 packed masks -> [R, vocab_size] bool (True: allowed)."""
    shifts = torch.arange(BITMASK_WORD_BITS, dtype=torch.int32, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(packed.shape[0], -1)[:, :vocab_size].bool()


@dataclass(frozen=True)
class SamplerOutput:
    """One step's samples: a token id per row and, where the row asked, its logprobs
    (``{token_id: logprob}`` of the chosen token and the top ``num_logprobs``)."""

    token_ids: torch.Tensor  # [R] int64, on the host (the step's one copy back)
    logprobs: tuple[dict[int, float] | None, ...]


@dataclass(frozen=True)
class _LogprobRows:
    """Log-softmax entries of some rows: each row's chosen token and its logprob,
    and its top ``counts[i]`` values and ids (``[n, max count]``), on the device they
    were computed on or (``to_host``) copied to the host."""

    counts: tuple[int, ...]
    chosen_ids: torch.Tensor
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    @classmethod
    def of(cls, logprobs: torch.Tensor, chosen_ids: torch.Tensor, counts: Sequence[int]) -> "_LogprobRows":
        chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
        top_values, top_ids = logprobs.topk(min(max(counts, default=0), logprobs.shape[1]), dim=-1)
        return cls(tuple(counts), chosen_ids, chosen, top_values, top_ids)

    def to_host(self, pinned: bool) -> "_LogprobRows":
        tensors = (self.chosen_ids, self.chosen, self.top_values, self.top_ids)
        return _LogprobRows(self.counts, *(_to_host(t, pinned) for t in tensors))

    def entries(self) -> list[dict[int, float]]:
        """Per row ``{token: logprob}``: the top ``counts[i]`` tokens and the chosen one
        (of host tensors)."""
        top_values, top_ids = self.top_values.tolist(), self.top_ids.tolist()
        out = []
        for i, (count, token, logprob) in enumerate(zip(self.counts, self.chosen_ids.tolist(), self.chosen.tolist())):
            entry = dict(zip(top_ids[i][:count], top_values[i][:count]))
            entry[token] = logprob
            out.append(entry)
        return out


def _to_host(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A host copy of ``tensor``; ``pinned`` (a CUDA tensor): into page-locked memory,
    issued without waiting (whoever reads it waits on an event recorded after it)."""
    if not pinned:
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


class PendingSamples:
    """A step's draws with their copy to the host in flight: ``token_ids`` on the
    logits' device (-1 where a row had no distribution), which the next step may read
    there before the host has them; ``output`` waits for the copies, refuses such rows
    and returns the SamplerOutput (once; later calls return it again)."""

    def __init__(self, token_ids: torch.Tensor, logprobs: tuple[list[int], _LogprobRows] | None, num_rows: int) -> None:
        pinned = token_ids.device.type == "cuda"
        self.token_ids = token_ids
        self._host_ids = _to_host(token_ids, pinned)
        self._logprobs = None if logprobs is None else (logprobs[0], logprobs[1].to_host(pinned))
        self._num_rows = num_rows
        self._copied = torch.cuda.Event() if pinned else None
        if self._copied is not None:
            self._copied.record()
        self._output: SamplerOutput | None = None

    def output(self) -> SamplerOutput:
        if self._output is None:
            if self._copied is not None:
                self._copied.synchronize()
            _refuse_rows((self._host_ids < 0).nonzero().squeeze(1).tolist())
            entries: list[dict[int, float] | None] = [None] * self._num_rows
            if self._logprobs is not None:
                rows, logprobs = self._logprobs
                for row, entry in zip(rows, logprobs.entries()):
                    entries[row] = entry
            self._output = SamplerOutput(token_ids=self._host_ids, logprobs=tuple(entries))
        return self._output


class Sampler:
    """Turns a step's logits [R, vocab_size] (float32) into one token per row.

    In vLLM's order: the grammar's mask first (a token it forbids is -inf); then the
    logit bias and min_tokens' masked stop tokens (which give way in a row where the
    grammar allows nothing else, so a grammar that is complete can end its request);
    then the repetition penalty over prompt and output tokens and the presence and
    frequency penalties over output tokens. Greedy rows (temperature 0) take the
    argmax of that, the smallest id on ties. Other rows divide by their temperature,
    drop tokens below min-p, keep their top_k tokens (ties at the cut go to the
    smaller id), then the smallest set of those whose renormalised mass reaches top_p
    (at least one token), and draw by Gumbel-max with the row's counter-based noise.
    Logprobs are the log-softmax of the logits after the grammar's mask and before
    everything else (vLLM masks before its sampler and reports raw logprobs).
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise SamplerError(f"vocab_size: must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.launch(logits, metadata).output()

    def launch(self, logits: torch.Tensor, metadata: SamplingMetadata) -> PendingSamples:
        """The step's draws issued on the logits' device and their copy to the host,
        nothing waiting for the device (``PendingSamples.output`` does)."""
        _check_logits_shape(logits, self.vocab_size, metadata.num_rows)
        raw = logits
        if metadata.allowed_rows is not None:
            allowed = unpack_token_mask(metadata.allowed_tokens, self.vocab_size)
            masked = logits.index_select(0, metadata.allowed_rows).masked_fill(~allowed, float("-inf"))
            logits = logits.index_copy(0, metadata.allowed_rows, masked)
        reported = logits
        logits = _apply_penalties(_apply_bias(logits, metadata), metadata)
        if logits is raw:
            # Nothing changed the logits: one reduction gives the greedy tokens and the
            # maxima the check below reads.
            raw_max, token_ids = logits.max(dim=-1)
        else:
            raw_max, token_ids = raw.amax(dim=-1), logits.argmax(dim=-1)
        random_rows = metadata.random_rows
        if random_rows.numel() > 0:
            temperature = metadata.temperature.index_select(0, random_rows).unsqueeze(1)
            scaled = logits.index_select(0, random_rows) / temperature
            if metadata.min_p_log is not None:
                scaled = _mask_min_p(scaled, metadata.min_p_log.index_select(0, random_rows))
            filtered = _mask_top_k_top_p(
                scaled,
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
        # A row whose max is not finite is marked -1 and refused once the tokens are on
        # the host: the step's one copy back, with no sync before it.
        marked = torch.where(_has_distribution(raw_max), token_ids, -1)
        return PendingSamples(marked, _row_logprobs(reported, token_ids, metadata.num_logprobs), metadata.num_rows)


def _apply_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Logit bias and min_tokens' -inf, except in a row they would leave empty."""
    if metadata.bias_rows is None:
        return logits
    biased = logits.index_put((metadata.bias_rows, metadata.bias_tokens), metadata.bias_values, accumulate=True)
    emptied = ~torch.isfinite(biased.amax(dim=-1, keepdim=True))
    return torch.where(emptied, logits, biased)


def _apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """vLLM's penalties on the rows' prompt and output tokens: the penalised rows' sparse
    counts scattered into a dense [rows with penalties, vocab] block (the other rows
    are left as they are)."""
    if metadata.penalty_rows is None:
        return logits
    rows = torch.unique(metadata.penalty_rows)
    index = (torch.searchsorted(rows, metadata.penalty_rows), metadata.penalty_tokens)
    block = logits.index_select(0, rows)
    seen = torch.zeros_like(block, dtype=torch.bool).index_put(index, torch.ones_like(metadata.penalty_rows, dtype=torch.bool))
    counts = torch.zeros_like(block).index_put(index, metadata.penalty_counts.to(block.dtype))
    repetition = metadata.repetition_penalty.index_select(0, rows).unsqueeze(1)
    penalised = torch.where(block > 0, block / repetition, block * repetition)
    block = torch.where(seen, penalised, block)
    block = block - metadata.frequency_penalty.index_select(0, rows).unsqueeze(1) * counts
    block = block - metadata.presence_penalty.index_select(0, rows).unsqueeze(1) * (counts > 0).to(block.dtype)
    return logits.index_copy(0, rows, block)


def _mask_min_p(logits: torch.Tensor, min_p_log: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top one's: compared as
    logit - max logit < log(min_p), which needs no softmax."""
    keep = logits - logits.amax(dim=-1, keepdim=True) >= min_p_log.unsqueeze(1)
    return logits.masked_fill(~keep, float("-inf"))


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: Sequence[int] | torch.Tensor, num_logprobs: int
) -> list[dict[int, float]]:
    """Logprobs of a prompt block: row i of ``logits`` [L, vocab] predicts
    ``next_token_ids[i]`` (the prompt token after position i); each entry holds that
    token's logprob and the top ``num_logprobs`` of the raw log-softmax."""
    if logits.dim() != 2:
        raise SamplerError(f"logits: must be [L, vocab], got shape {tuple(logits.shape)}")
    _check_logits_shape(logits, logits.shape[1], logits.shape[0])
    _refuse_rows(torch.nonzero(~_has_distribution(logits.amax(dim=-1))).squeeze(1).tolist())
    targets = torch.as_tensor(next_token_ids, dtype=torch.int64, device=logits.device)
    if tuple(targets.shape) != (logits.shape[0],):
        raise SamplerError(
            f"next_token_ids: one per logits row ({logits.shape[0]}), got shape {tuple(targets.shape)}"
        )
    if targets.numel() and not bool(((targets >= 0) & (targets < logits.shape[1])).all()):
        raise SamplerError(f"next_token_ids: must lie in 0..{logits.shape[1] - 1}")
    counts = [num_logprobs] * logits.shape[0]
    return _LogprobRows.of(torch.log_softmax(logits, dim=-1), targets, counts).to_host(pinned=False).entries()


def _check_logits_shape(logits: torch.Tensor, vocab_size: int, num_rows: int) -> None:
    if logits.dtype != torch.float32 or tuple(logits.shape) != (num_rows, vocab_size):
        raise SamplerError(
            f"logits: must be float32 of shape ({num_rows}, {vocab_size}), "
            f"got {logits.dtype} {tuple(logits.shape)}"
        )


def _has_distribution(row_max: torch.Tensor) -> torch.Tensor:
    """Rows whose max is finite: |max| < inf is false for NaN, +inf and a row of -inf
    alike, in two kernels (isfinite takes four)."""
    return row_max.abs() < float("inf")


def _refuse_rows(bad_rows: list[int]) -> None:
    """A NaN or +inf anywhere, or a row of -inf, makes the row's max non-finite: such a
    row has no distribution to sample or score, and the model that produced it is broken."""
    if bad_rows:
        raise SamplerError(f"logits: rows {bad_rows} hold NaN, +inf or only -inf")


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
) -> tuple[list[int], _LogprobRows] | None:
    """The rows that ask for logprobs and their entries of the raw log-softmax,
    computed on the logits' device (None when no row asks)."""
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return None
    index = _to_device(torch.tensor(rows, dtype=torch.int64), logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index), dim=-1)
    counts = [int(num_logprobs[i]) for i in rows]
    return rows, _LogprobRows.of(logprobs, token_ids.index_select(0, index), counts)
