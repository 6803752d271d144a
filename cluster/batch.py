"""What the scheduler hands a rank for one step: ``ScheduledBatch`` and its segments.

Owns the step's declaration — per request: which positions run, on which STATE slot
and PAGEs, what the slot must hold before the forward (reset with an Engram history,
or a checkpoint image restored; PAGEs filled from the offload store) and what is
stored after it (an image at a PAGE boundary; PAGEs and images published to the
offload store), and how its next token is sampled; and ``DPMetadata``, what every DP rank
learns of the others in a step, packed into one flat tensor. It holds only plain
values, so one scheduler can drive ranks in other processes.

A batch is a delta against what the rank keeps between steps (its PersistentBatch,
cluster/persistent_batch.py), as vLLM's NewRequestData / CachedRequestData: a
request's first segment on the rank brings its ``NewRequestData`` (sampling
parameters, seed) and its whole PAGE table; each later one only the PAGEs its table
gained since (``new_pages`` after the ``kept_pages`` the rank keeps: fewer than it
holds after a speculative verify handed lookahead PAGEs back); and the batch names the
requests that left the rank since its last batch (``released_request_ids``:
finished, aborted, preempted), which the rank drops before anything else.

Must not import: model, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from dsv41.cache.block_manager import StateImage
from dsv41.cluster.offload_connector import PageFill, PagePublish
from dsv41.cluster.sampling_guide import SamplingGuide
from dsv41.cluster.sampling_params import SamplingParams


# The token of a row whose token the host does not know yet (async scheduling): the
# one its request's previous step samples, which the rank reads from that step's
# draws on the device (cluster/cuda_graphs.DeviceStepState.feed).
PLACEHOLDER_TOKEN = -1


@dataclass(frozen=True)
class SlotReset:
    """A fresh slot for a forward that starts at ``position`` without an image: rings
    and tails cleared, cursor at ``position`` with the Engram history of the tokens
    just before it (fewer than the history length near the start: the rest is DEAD)."""

    position: int
    history_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class NewRequestData:
    """What a rank keeps of a request while it runs there, sent once: in the request's
    first segment after its admission to the rank (a readmission after preemption
    too), until the rank is told it left (``ScheduledBatch.released_request_ids``)."""

    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class ScheduledSegment:
    request_id: str
    slot: int
    start: int
    token_ids: tuple[int, ...]  # the tokens at positions [start, start + len)
    write_from: int  # compressed groups ending at or below it are cached: read, not rewritten
    window_start: int  # first position a window may read
    sample: bool  # the chunk reaches the last known token: sample the next one
    output_index: int  # how many tokens the request has generated (the sampler's counter)
    # The request's prompt length: decoder SWA bounded replay runs the decoder on its
    # last rows (and every row after), in whichever forward computes them.
    num_prompt_tokens: int
    # The request's PAGE table on the rank: its first kept_pages PAGEs as the rank
    # holds them, then new_pages (a new request: none kept, its whole table).
    new_pages: tuple[int, ...]
    kept_pages: int
    new_request: NewRequestData | None = None  # the request's first segment on the rank
    reset: SlotReset | None = None
    restore: StateImage | None = None
    store_after: StateImage | None = None  # write the slot's image here after the forward
    fetch: tuple[PageFill, ...] = ()  # offloaded PAGEs/images to write before the forward
    publish: tuple[PagePublish, ...] = ()  # PAGEs/images to send to the offload store after it
    want_prompt_logits: bool = False  # return logits of every row (prompt logprobs, parity)
    # A speculative verify: the last num_draft_tokens tokens are drafts, run
    # tentatively after the anchor (the last sampled token); only the accepted prefix
    # is committed (cluster/speculative.py).
    num_draft_tokens: int = 0
    # What sampling needs beyond params (grammar mask, penalty counts); set by the
    # engine on sampling segments whose request has a grammar or penalties.
    guide: SamplingGuide | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"ScheduledSegment {self.request_id}: no tokens")
        if self.num_draft_tokens and not (
            0 < self.num_draft_tokens < len(self.token_ids)
            and self.sample
            and self.store_after is None
            and not self.want_prompt_logits
        ):
            raise ValueError(
                f"ScheduledSegment {self.request_id}: num_draft_tokens {self.num_draft_tokens} (allowed: 0, or "
                f"1..{len(self.token_ids) - 1} on a sampling segment that stores no image and wants no prompt logits)"
            )
        if self.has_placeholder and not (self.length == 1 and self.sample and self.start >= self.num_prompt_tokens):
            raise ValueError(
                f"ScheduledSegment {self.request_id}: PLACEHOLDER_TOKEN in {self.length} rows from {self.start} "
                "(allowed: as the one row of a sampled decode, after the prompt)"
            )
        if self.num_prompt_tokens < 1:
            raise ValueError(
                f"ScheduledSegment {self.request_id}: num_prompt_tokens {self.num_prompt_tokens} (allowed: >= 1)"
            )
        if self.reset is not None and self.restore is not None:
            raise ValueError(f"ScheduledSegment {self.request_id}: reset and restore are exclusive")
        if self.kept_pages < 0 or (self.new_request is not None and self.kept_pages):
            raise ValueError(
                f"ScheduledSegment {self.request_id}: kept_pages {self.kept_pages} (allowed: >= 0, and 0 with "
                "new_request: a request new to the rank brings its whole table)"
            )

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def has_placeholder(self) -> bool:
        """Its row's token is its request's previous step's draw, not known yet."""
        return PLACEHOLDER_TOKEN in self.token_ids

    @property
    def is_plain_decode(self) -> bool:
        """One committed output row, sampled: no prefill row, no prompt logits, no
        drafts, no slot reset or restore (what a decode graph runs)."""
        return (
            self.length == 1
            and self.sample
            and self.start >= self.num_prompt_tokens
            and not self.want_prompt_logits
            and not self.num_draft_tokens
            and self.reset is None
            and self.restore is None
        )


@dataclass(frozen=True)
class ScheduledBatch:
    step_id: int
    segments: tuple[ScheduledSegment, ...] = field(default_factory=tuple)
    # Requests that left the rank since its last batch (finished, aborted, preempted):
    # the rank drops what it keeps of them before this batch's segments, one of which
    # may bring a request of the same id, or on the same slot, anew.
    released_request_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def is_empty(self) -> bool:
        return not self.segments

    def decode_pages(self, block_size: int) -> int:
        """The PAGEs (of ``block_size`` positions) the longest row covers when every
        segment is a plain decode (what cache/addressing.decode_pages measures), 0 for
        a batch of no segment, -1 when a segment is not a plain decode."""
        if not all(seg.is_plain_decode for seg in self.segments):
            return -1
        return max((-(-seg.end // block_size) for seg in self.segments), default=0)


DP_METADATA_LAYOUT = 4  # bump when the wire layout below changes


class DPMetadataError(ValueError):
    """A packed DP metadata tensor this build cannot read; the message says why."""


@dataclass(frozen=True)
class MicrobatchRows:
    """One microbatch of a rank's step under prefill two-batch overlap: its rows, and
    how many of them the decoder's layers run and how many reach the LM head."""

    num_tokens: int
    decoder_rows: int
    query_rows: int

    def __post_init__(self) -> None:
        if not 0 <= self.query_rows <= self.decoder_rows <= self.num_tokens or self.num_tokens < 1:
            raise DPMetadataError(
                f"MicrobatchRows: {self.num_tokens} rows, {self.decoder_rows} decoder, {self.query_rows} query "
                "(allowed: 0 <= query_rows <= decoder_rows <= num_tokens, num_tokens >= 1)"
            )


@dataclass(frozen=True)
class RankStepInfo:
    """One DP rank's share of a step: its rows, whether any of them is prefill (not a
    one-token decode), the requests whose prompt this step finishes there (their
    first token is sampled), and how many of its rows the decoder's layers run and
    how many reach the LM head (the last layer's FFN): under decoder SWA bounded
    replay fewer than its rows (None: every row). ``microbatches``: where prefill
    two-batch overlap is on, the two microbatches the rank's rows split into (none:
    the rank cannot split them); whether the step runs split is every rank's to
    agree (cluster/tbo.runs_split). ``decode_pages``: ``ScheduledBatch.decode_pages``
    of the rank's batch (-1: not a plain decode; 0: no row), from which every rank of a
    replica with decode graphs picks the same graph width, or none
    (cluster/ranks.DPRank._common_decode_width)."""

    num_tokens: int
    is_prefill: bool
    finished_prompts: tuple[str, ...] = ()
    decoder_rows: int | None = None
    query_rows: int | None = None
    microbatches: tuple[MicrobatchRows, ...] = ()
    decode_pages: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.num_tokens, int) or self.num_tokens < 0:
            raise DPMetadataError(f"RankStepInfo.num_tokens: {self.num_tokens!r} (allowed: an int >= 0)")
        pages = self.decode_pages
        fits_rows = pages == -1 or (pages == 0) == (self.num_tokens == 0)
        if not isinstance(pages, int) or pages < -1 or not fits_rows:
            raise DPMetadataError(
                f"RankStepInfo.decode_pages: {pages!r} with {self.num_tokens} rows (allowed: -1; 0 for a rank of no "
                "row; a PAGE count >= 1 for a rank of rows)"
            )
        if self.decoder_rows is None:
            object.__setattr__(self, "decoder_rows", self.num_tokens)
        if self.query_rows is None:
            object.__setattr__(self, "query_rows", self.decoder_rows)
        if not 0 <= self.query_rows <= self.decoder_rows <= self.num_tokens:
            raise DPMetadataError(
                f"RankStepInfo.decoder_rows / query_rows: {self.decoder_rows} / {self.query_rows} "
                f"(allowed: 0 <= query_rows <= decoder_rows <= num_tokens {self.num_tokens})"
            )
        if self.microbatches:
            sums = tuple(sum(getattr(mb, f) for mb in self.microbatches) for f in MICROBATCH_FIELDS)
            if len(self.microbatches) != 2 or sums != (self.num_tokens, self.decoder_rows, self.query_rows):
                raise DPMetadataError(
                    f"RankStepInfo.microbatches: {len(self.microbatches)} summing to {sums} (allowed: none, or two "
                    f"summing to the rank's rows, decoder rows and query rows "
                    f"{(self.num_tokens, self.decoder_rows, self.query_rows)})"
                )

    @classmethod
    def of(
        cls,
        batch: ScheduledBatch,
        decoder_rows: int | None = None,
        query_rows: int | None = None,
        microbatches: tuple[MicrobatchRows, ...] = (),
        block_size: int | None = None,
    ) -> "RankStepInfo":
        """``block_size``: the PAGE size ``decode_pages`` is counted in (None: the
        replica has no decode graphs, -1)."""
        decode = [s.sample and s.length == 1 and s.output_index > 0 for s in batch.segments]
        return cls(
            num_tokens=batch.num_tokens,
            is_prefill=not all(decode),
            finished_prompts=tuple(s.request_id for s in batch.segments if s.sample and s.output_index == 0),
            decoder_rows=decoder_rows,
            query_rows=query_rows,
            microbatches=microbatches,
            decode_pages=-1 if block_size is None else batch.decode_pages(block_size),
        )


@dataclass(frozen=True)
class DPMetadata:
    """What every DP rank knows of every other rank in a step, sent to all of them:
    the MoE exchange pads to the largest rank's rows at each layer and cuts each
    rank's rows out.

    Wire layout 4 (one flat int64 tensor): ``[layout, step_id, world]`` then per rank
    ``[num_tokens, is_prefill, decoder_rows, query_rows, decode_pages, num_microbatches]``, per
    microbatch ``[num_tokens, decoder_rows, query_rows]``, ``[num_finished]`` and per
    finished request ``[num_bytes, *utf8_bytes]``."""

    step_id: int
    ranks: tuple[RankStepInfo, ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise DPMetadataError("DPMetadata.ranks: empty (allowed: one entry per DP rank)")

    @classmethod
    def of(
        cls,
        step_id: int,
        batches: tuple[ScheduledBatch, ...],
        stage_rows: Sequence[tuple[int, int]] | None = None,
        microbatches: Sequence[tuple[MicrobatchRows, ...]] | None = None,
        block_size: int | None = None,
    ) -> "DPMetadata":
        """``stage_rows``: each rank's (decoder rows, query rows) under decoder replay
        (None: every row runs every layer); ``microbatches``: each rank's two-batch
        overlap split (None: overlap is off); ``block_size``: the replica's PAGE size
        when its ranks have decode graphs (None: they have none)."""
        stages = stage_rows if stage_rows is not None else [(None, None)] * len(batches)
        splits = microbatches if microbatches is not None else [()] * len(batches)
        if len(stages) != len(batches) or len(splits) != len(batches):
            raise DPMetadataError(
                f"stage_rows / microbatches: {len(stages)} / {len(splits)} entries for {len(batches)} ranks"
            )
        return cls(
            step_id=step_id,
            ranks=tuple(
                RankStepInfo.of(b, *stage, split, block_size) for b, stage, split in zip(batches, stages, splits)
            ),
        )

    @property
    def row_counts(self) -> tuple[int, ...]:
        return tuple(r.num_tokens for r in self.ranks)

    def decoder_row_counts(self, decoder_layers: Sequence[int]) -> dict[int, tuple[int, ...]]:
        """Every rank's MoE rows at each of ``decoder_layers`` (the decoder's layer
        ids, in order): its decoder rows, and at the last layer its query rows."""
        return _decoder_counts(self.ranks, decoder_layers)

    def microbatch_counts(
        self, index: int, decoder_layers: Sequence[int]
    ) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]]]:
        """Microbatch ``index``'s every-rank row counts and, at ``decoder_layers``,
        decoder row counts (as row_counts / decoder_row_counts are the step's); every
        rank must have split."""
        if not all(r.microbatches for r in self.ranks):
            raise DPMetadataError("microbatch_counts: a rank did not split this step")
        split = [r.microbatches[index] for r in self.ranks]
        return tuple(mb.num_tokens for mb in split), _decoder_counts(split, decoder_layers)

    def to_wire(self) -> torch.Tensor:
        words = [DP_METADATA_LAYOUT, self.step_id, len(self.ranks)]
        for rank in self.ranks:
            words += [rank.num_tokens, int(rank.is_prefill), rank.decoder_rows, rank.query_rows, rank.decode_pages]
            words.append(len(rank.microbatches))
            for mb in rank.microbatches:
                words += [getattr(mb, f) for f in MICROBATCH_FIELDS]
            words.append(len(rank.finished_prompts))
            for request_id in rank.finished_prompts:
                raw = request_id.encode()
                words += [len(raw), *raw]
        return torch.tensor(words, dtype=torch.int64)

    @classmethod
    def from_wire(cls, wire: torch.Tensor) -> "DPMetadata":
        if wire.dtype != torch.int64 or wire.dim() != 1:
            raise DPMetadataError(f"wire: {wire.dtype} of shape {tuple(wire.shape)} (allowed: a flat int64 tensor)")
        words = wire.tolist()
        if len(words) < 3 or words[0] != DP_METADATA_LAYOUT:
            layout = words[0] if words else None
            raise DPMetadataError(f"wire: layout {layout!r} (allowed: {DP_METADATA_LAYOUT})")
        step_id, world = words[1], words[2]
        at = 3
        ranks = []
        try:
            for _ in range(world):
                num_tokens, is_prefill, decoder_rows, query_rows, decode_pages, num_microbatches = words[at : at + 6]
                at += 6
                microbatches = []
                for _ in range(num_microbatches):
                    microbatches.append(MicrobatchRows(*words[at : at + len(MICROBATCH_FIELDS)]))
                    at += len(MICROBATCH_FIELDS)
                num_finished = words[at]
                at += 1
                finished = []
                for _ in range(num_finished):
                    size = words[at]
                    finished.append(bytes(words[at + 1 : at + 1 + size]).decode())
                    at += 1 + size
                ranks.append(
                    RankStepInfo(
                        num_tokens,
                        bool(is_prefill),
                        tuple(finished),
                        decoder_rows,
                        query_rows,
                        tuple(microbatches),
                        decode_pages,
                    )
                )
        except (IndexError, TypeError, ValueError, UnicodeDecodeError) as exc:
            raise DPMetadataError(f"wire: truncated or corrupt layout-{DP_METADATA_LAYOUT} tensor ({exc})") from exc
        if at != len(words):
            raise DPMetadataError(f"wire: {len(words) - at} words after the last rank (a corrupt tensor)")
        return cls(step_id=step_id, ranks=tuple(ranks))


MICROBATCH_FIELDS = ("num_tokens", "decoder_rows", "query_rows")


def _decoder_counts(
    ranks: Sequence[RankStepInfo | MicrobatchRows], decoder_layers: Sequence[int]
) -> dict[int, tuple[int, ...]]:
    counts = {layer: tuple(r.decoder_rows for r in ranks) for layer in decoder_layers[:-1]}
    if decoder_layers:
        counts[decoder_layers[-1]] = tuple(r.query_rows for r in ranks)
    return counts
