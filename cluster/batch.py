"""What the scheduler hands a rank for one step: ``ScheduledBatch`` and its segments.

Owns the step's declaration — per request: which positions run, on which STATE slot
and PAGEs, what the slot must hold before the forward (reset with an Engram history,
or a checkpoint image restored) and what is stored after it (an image at a PAGE
boundary), and how its next token is sampled. It holds only plain values, so one
scheduler can drive ranks in other processes.

Must not import: model, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache.block_manager import StateImage
from cluster.request import SamplingParams


@dataclass(frozen=True)
class SlotReset:
    """A fresh slot for a forward that starts at ``position`` without an image: rings
    and tails cleared, cursor at ``position`` with the Engram history of the tokens
    just before it (fewer than the history length near the start: the rest is DEAD)."""

    position: int
    history_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ScheduledSegment:
    request_id: str
    slot: int
    page_table: tuple[int, ...]
    start: int
    token_ids: tuple[int, ...]  # the tokens at positions [start, start + len)
    write_from: int  # compressed groups ending at or below it are cached: read, not rewritten
    window_start: int  # first position a window may read
    sample: bool  # the chunk reaches the last known token: sample the next one
    params: SamplingParams
    seed: int
    output_index: int  # how many tokens the request has generated (the sampler's counter)
    reset: SlotReset | None = None
    restore: StateImage | None = None
    store_after: StateImage | None = None  # write the slot's image here after the forward
    want_prompt_logits: bool = False  # return logits of every row (prompt logprobs, parity)

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"ScheduledSegment {self.request_id}: no tokens")
        if self.reset is not None and self.restore is not None:
            raise ValueError(f"ScheduledSegment {self.request_id}: reset and restore are exclusive")

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class ScheduledBatch:
    step_id: int
    segments: tuple[ScheduledSegment, ...] = field(default_factory=tuple)

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def is_empty(self) -> bool:
        return not self.segments
