"""The scheduler: which rows of which requests run in each step.

Owns the waiting and running queues and each request's progress through its prompt:
admission under ``max_num_seqs`` and the token budget, chunked prefill mixed with
decodes in one ragged batch, continuous decode, preemption by recompute when PAGEs run
out, cancellation at any point, and prefix hits through the block manager (a restored
checkpoint image under ``copy``, a replay from ``replay_start`` under ``replay``).
It moves no bytes: each ``ScheduledSegment`` tells the rank what to do to the slot
before and after the forward. A request resumes only where its state is exact (a
restored image, or a reset slot at the hit's forward start), so a scheduled run
produces the tokens of an uninterrupted one; under ``replay`` a hit legitimately
changes logits (the spec's accuracy note).

Must not import: model arithmetic, actors, deploy, ray.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from cache.block_manager import BlockManager, PrefixHit, StateImage, StateTransfer
from cluster.batch import ScheduledBatch, ScheduledSegment, SlotReset
from cluster.request import Request, RequestStatus


class SchedulerError(ValueError):
    """A scheduler option outside its allowed values; the message names it."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Per-request cap on the prefill tokens of one step (0: only the step budget).
    long_prefill_token_threshold: int = 0
    block_size: int = 128
    state_transfer: StateTransfer = StateTransfer.REPLAY
    enable_prefix_caching: bool = True
    engram_history: int = 3  # tokens a reset slot's cursor needs before its first row

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise SchedulerError(f"{name}: {value!r} (allowed: a positive integer)")
        if self.long_prefill_token_threshold < 0:
            raise SchedulerError(
                f"long_prefill_token_threshold: {self.long_prefill_token_threshold} (allowed: 0 = off, or > 0)"
            )


@dataclass
class _Progress:
    """What the scheduler knows of a running request beyond its Request record."""

    write_from: int  # compressed groups ending at or below it are cached
    window_start: int  # the first position the request's windows may read
    prep: SlotReset | StateImage | None  # applied to the slot before its next forward
    image_cut: int  # COPY: the prompt's last shareable PAGE boundary, where a chunk ends


@dataclass
class StepReport:
    """What a step changed besides the requests' own records."""

    finished: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """Builds ScheduledBatches and applies their results, over one BlockManager."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        *,
        layout_id: str,
        image_pages: int,
        image_bytes: int,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.layout_id = layout_id
        self.image_pages = image_pages
        self.image_bytes = image_bytes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._progress: dict[str, _Progress] = {}
        self._step_id = 0
        self.num_preemptions = 0

    @property
    def copies_images(self) -> bool:
        return self.config.state_transfer is StateTransfer.COPY and self.config.enable_prefix_caching

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling -------------------------------------------------------------------

    def schedule(self) -> tuple[ScheduledBatch, StepReport]:
        self._step_id += 1
        report = StepReport()
        budget = self.config.max_num_batched_tokens
        plans: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            count = self._chunk(request, budget)
            if self._grow_or_preempt(request, request.num_computed_tokens + count, report):
                plans.append((request, count))
                budget -= count
                i += 1
        # Like vLLM, no admission in a step that had to preempt: the pools are full.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not report.preempted:
            request = self.waiting[0]
            if not self._admit(request):
                break
            self.waiting.popleft()
            self.running.append(request)
            count = self._chunk(request, budget)
            plans.append((request, count))
            budget -= count
        segments = tuple(self._segment(request, count) for request, count in plans)
        return ScheduledBatch(step_id=self._step_id, segments=segments), report

    def _chunk(self, request: Request, budget: int) -> int:
        start = request.num_computed_tokens
        count = min(request.num_tokens - start, budget)
        if self.config.long_prefill_token_threshold and count > 1:
            count = min(count, self.config.long_prefill_token_threshold)
        cut = self._progress[request.request_id].image_cut
        if self.copies_images and start < cut < start + count:
            count = cut - start
        return count

    def _grow_or_preempt(self, request: Request, num_tokens: int, report: StepReport) -> bool:
        """Gives ``request`` PAGEs for ``num_tokens``, preempting the newest running
        requests until it fits; False when it had to preempt itself."""
        while not self.block_manager.grow(request.request_id, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            report.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request) -> bool:
        tokens = request.all_token_ids
        hit = self.block_manager.lookup(tokens)
        if request.params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt row computed: take no hit.
            hit = dataclasses.replace(hit, hit_tokens=0, forward_start=0, restore_image=None, pages=())
        if not self.block_manager.allocate_prompt(request.request_id, tokens, hit):
            return False
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit.forward_start
        self._progress[request.request_id] = _Progress(
            write_from=hit.hit_tokens,
            # A restored image holds the exact rings below its boundary; a reset slot
            # holds nothing below the forward's first row.
            window_start=0 if hit.restore_image is not None else hit.forward_start,
            prep=self._slot_prep(hit, tokens),
            image_cut=(len(tokens) - 1) // self.config.block_size * self.config.block_size,
        )
        return True

    def _slot_prep(self, hit: PrefixHit, tokens: Iterable[int]) -> SlotReset | StateImage:
        if hit.restore_image is not None:
            return hit.restore_image
        history = tuple(list(tokens)[max(0, hit.forward_start - self.config.engram_history) : hit.forward_start])
        return SlotReset(position=hit.forward_start, history_token_ids=history)

    def _segment(self, request: Request, count: int) -> ScheduledSegment:
        progress = self._progress[request.request_id]
        start = request.num_computed_tokens
        end = start + count
        prep, progress.prep = progress.prep, None
        store_after = None
        if self.copies_images and end % self.config.block_size == 0:
            pages = self.block_manager.allocate_pages(self.image_pages)
            if pages is not None:
                store_after = StateImage(
                    layout_id=self.layout_id, pages=tuple(pages), image_bytes=self.image_bytes, num_tokens=end
                )
        return ScheduledSegment(
            request_id=request.request_id,
            slot=self.block_manager.slot(request.request_id),
            page_table=self.block_manager.page_table(request.request_id),
            start=start,
            token_ids=tuple(request.all_token_ids[start:end]),
            write_from=progress.write_from,
            window_start=progress.window_start,
            sample=end == request.num_tokens,
            params=request.params,
            seed=request.sampling_seed,
            output_index=request.num_output_tokens,
            reset=prep if isinstance(prep, SlotReset) else None,
            restore=prep if isinstance(prep, StateImage) else None,
            store_after=store_after,
            want_prompt_logits=request.params.prompt_logprobs is not None and start < request.num_prompt_tokens,
        )

    # -- results ------------------------------------------------------------------------

    def commit(self, segment: ScheduledSegment, request: Request | None) -> None:
        """Records that ``segment``'s forward ran: the request's cursor advances, its
        full PAGEs are published and a checkpoint image taken at a PAGE boundary is
        attached to the prefix index (or handed back when nothing wants it)."""
        image_kept = False
        if request is not None and request.request_id in self._progress:
            request.num_computed_tokens = segment.end
            self.block_manager.publish(request.request_id, request.all_token_ids, segment.end)
            if segment.store_after is not None:
                image_kept = self.block_manager.attach_image(request.request_id, segment.end, segment.store_after)
        if segment.store_after is not None and not image_kept:
            self.block_manager.free_pages(segment.store_after.pages)

    def finish(self, request: Request) -> None:
        """Frees a finished request's PAGEs and slot and drops it from the queues."""
        if request.request_id in self._progress:
            del self._progress[request.request_id]
            self.block_manager.free(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: the request gives up its PAGEs and slot and waits at
        the front; it resumes from whatever the prefix cache then holds."""
        self.running.remove(request)
        del self._progress[request.request_id]
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1
