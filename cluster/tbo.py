"""Prefill two-batch overlap (TBO) under DP attention: the split and its eligibility.

Owns the TBO options a rank runs with (``TBOOptions``), how a rank's prefill step
splits into two microbatches (``split``, ``split_batch``), what each microbatch's rows are for the step's DP metadata
(``microbatch_rows``), and the rule every rank applies to that metadata to agree
whether the step runs split (``runs_split``). The forward of a split step is
model/runtime.PagedRuntime.forward_microbatches (the two interleaved layer by layer,
model/microbatch.py); each microbatch's MoE is the DP exchange's ``microbatch(i)``.

A microbatch is a run of consecutive rows of the step. With ``token_split`` the cut
is the middle row, inside a request if one spans it: the request's rows before the
cut are a chunk of it in the first microbatch, the rest the next chunk in the second,
which reads the first's rows of that request through the slot's rings, ratio-2 tails
and PAGE entries as any next chunk does. That is sound here because the first
microbatch writes them at each layer (ring rows after its attention, entries and
tails at each compressing layer) before the second runs that layer
(model/microbatch.interleave always resumes the first microbatch first), and writes
its last ``ring_rows`` positions, which cover every window the second reads below
the cut. Without ``token_split`` the cut is the request boundary nearest the middle.

Must not import: actors, deploy, ray, cluster.engine, cluster.ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsv41.cluster.batch import DPMetadata, MicrobatchRows, ScheduledBatch, ScheduledSegment
from dsv41.cluster.options import EngineOptions
from dsv41.cluster.runner import stage_rows


@dataclass(frozen=True)
class TBOOptions:
    """How a rank splits its prefill steps (EngineOptions' ``enable_tbo_prefill``,
    ``tbo_prefill_min_tokens``, ``tbo_prefill_token_split``)."""

    min_tokens: int
    token_split: bool

    @classmethod
    def of(cls, options: EngineOptions) -> "TBOOptions | None":
        """The options' TBO (None: off)."""
        if not options.enable_tbo_prefill:
            return None
        return cls(options.tbo_prefill_min_tokens, options.tbo_prefill_token_split)


def split(batch: ScheduledBatch, token_split: bool) -> tuple[ScheduledBatch, ScheduledBatch] | None:
    """``batch``'s two microbatches (None: it does not split into two non-empty
    ones): cut at the middle row with ``token_split``, else at the request boundary
    nearest it."""
    rows = batch.num_tokens
    if token_split:
        return split_batch(batch, rows // 2) if rows >= 2 else None
    boundaries = []
    base = 0
    for seg in batch.segments[:-1]:
        base += seg.length
        boundaries.append(base)
    if not boundaries:
        return None
    return split_batch(batch, min(boundaries, key=lambda b: (abs(2 * b - rows), b)))


def split_batch(batch: ScheduledBatch, row: int) -> tuple[ScheduledBatch, ScheduledBatch]:
    """The two microbatches of ``batch`` cut at step row ``row`` (0 < row < rows), as
    the forward sees them: each segment, or each part of the one the cut falls
    inside, with its own positions, tokens and rows wanted. The request's first part
    keeps the slot preparation and the PAGE delta (which the step applies once,
    before the forward) and samples nothing; the second continues from it, its table
    as the first left it. Everything around the forward (fills, cursors, images,
    publications, sampling) stays the step's."""
    if not 0 < row < batch.num_tokens:
        raise ValueError(f"row: {row} (allowed: 1..{batch.num_tokens - 1}, inside the step's rows)")
    first: list[ScheduledSegment] = []
    second: list[ScheduledSegment] = []
    base = 0
    for seg in batch.segments:
        if base + seg.length <= row:
            first.append(seg)
        elif base >= row:
            second.append(seg)
        else:
            cut = row - base
            first.append(dataclasses.replace(seg, token_ids=seg.token_ids[:cut], sample=False))
            second.append(
                dataclasses.replace(
                    seg,
                    start=seg.start + cut,
                    token_ids=seg.token_ids[cut:],
                    new_pages=(),
                    kept_pages=seg.kept_pages + len(seg.new_pages),
                    new_request=None,
                    reset=None,
                    restore=None,
                )
            )
        base += seg.length
    return (
        ScheduledBatch(step_id=batch.step_id, segments=tuple(first)),
        ScheduledBatch(step_id=batch.step_id, segments=tuple(second)),
    )


def microbatch_rows(
    parts: tuple[ScheduledBatch, ScheduledBatch] | None, window: int | None
) -> tuple[MicrobatchRows, ...]:
    """Each microbatch's rows (none: the batch did not split) and how many of them
    reach the decoder's layers and the LM head (``window``: the sliding window under
    decoder replay; None: off, every row reaches every layer), for the step's DP
    metadata."""
    if parts is None:
        return ()
    rows = [part.num_tokens for part in parts]
    if window is None:
        return tuple(MicrobatchRows(n, n, n) for n in rows)
    return tuple(MicrobatchRows(n, *stage_rows(part, window)) for n, part in zip(rows, parts))


def runs_split(metadata: DPMetadata, min_tokens: int) -> bool:
    """Whether the step runs as two microbatches on every rank: every rank has a
    prefill (decode steps never split), split its rows in two, and has at least
    ``min_tokens`` rows. Every rank evaluates this on the same metadata, so all take
    the same path (their collectives would not meet otherwise); one idle rank, one
    with decodes only or one too small to split makes every rank run the ordinary
    step."""
    return all(r.is_prefill and r.microbatches and r.num_tokens >= min_tokens for r in metadata.ranks)
