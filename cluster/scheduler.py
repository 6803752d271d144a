"""The scheduler: which rows of which requests run in each step.

Owns the waiting and running queues and each request's progress through its prompt:
admission under ``max_num_seqs`` and the token budget, chunked prefill mixed with
decodes in one ragged batch, continuous decode, preemption by recompute when PAGEs run
out, cancellation at any point, and prefix hits through the block manager (a restored
checkpoint image under ``copy``, a replay from ``replay_start`` under ``replay``),
extended on admission by the PAGEs and images an offload store holds past the local
hit, and which completed PAGEs and stored images each forward publishes to it.
Liveness: the block manager reclaims cached PAGEs and images under pressure, and an
admission whose image does not fit beside its prompt resumes without it, so with
nothing running the head of the queue is always admitted when it fits the empty
pools (the engine refuses one that does not); a step that can admit nothing with
nothing running raises instead of idling.
It moves no bytes: each ``ScheduledSegment`` tells the rank what to do to the slot
before and after the forward, and only what changed since the rank last heard of the
request (cluster/batch.py: its data and PAGE table in its first segment there, then
the PAGEs appended, counted per request so no table is copied or compared; the
requests that left the rank are named in the next batch). A request resumes only
where its state is exact (a restored image, or a reset slot at the hit's forward
start), so a scheduled run produces the tokens of an uninterrupted one; under
``replay`` a hit legitimately changes logits (the spec's accuracy note).
With speculation (drafts from the runner) a decoding request's step is a verify:
its anchor and the drafts its last step left (cut to the token budget and to what the
request may still generate), PAGEs grown for every row, and the commit keeps the
accepted prefix alone, handing back lookahead PAGEs no kept row reaches.
Under async scheduling (``SchedulerConfig.async_scheduling``) a step is scheduled while
the previous one runs: a request's cursor advances when its rows are scheduled, a
decode row whose token the step in flight draws carries PLACEHOLDER_TOKEN at the
output index that token will have, a request whose last allowed token is in flight
gets no row, and a preempted request is readmitted only once its draw is in.

Must not import: model arithmetic, actors, deploy, ray.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from dsv41.cache.block_manager import BlockManager, PrefixHit, StateImage, StateTransfer
from dsv41.cache.offload import OffloadKey, UnitKind
from dsv41.cluster.batch import PLACEHOLDER_TOKEN, NewRequestData, ScheduledBatch, ScheduledSegment, SlotReset
from dsv41.cluster.offload_connector import OffloadConnector, PageFill, PagePublish
from dsv41.cluster.request import Request, RequestStatus
from dsv41.model.bounded_replay import tail_start


class SchedulerError(ValueError):
    """A scheduler option outside its allowed values; the message names it."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Per-request cap on the prefill tokens of one step (0: only the step budget).
    long_prefill_token_threshold: int = 0
    engram_history: int = 3  # tokens a reset slot's cursor needs before its first row
    # Decoder SWA bounded replay's window (None: off). Under it a forward resumes from
    # no image above its prompt's tail: a slot restored there would hold no decoder
    # row of the tail below the image.
    decoder_replay_window: int | None = None
    # Async scheduling: a step is scheduled while the previous one runs, so a
    # request's rows advance its cursor when scheduled (not when its results are
    # committed), and a decode row whose token the previous step draws carries
    # PLACEHOLDER_TOKEN (Request.num_pending_tokens counts those draws).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
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
    fills: tuple[PageFill, ...] = ()  # offloaded units the first forward writes first
    drafts: tuple[int, ...] = ()  # speculation: the drafts after the request's last token
    # PAGEs of its table the rank holds as they are (None: the rank holds nothing of
    # the request yet: its next segment is its first there).
    pages_sent: int | None = None


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
        offload: OffloadConnector | None = None,
    ) -> None:
        if offload is not None:
            if not block_manager.config.enable_prefix_caching:
                raise SchedulerError("offload: needs enable_prefix_caching (units are keyed by prefix hashes)")
            if offload.layout_id != layout_id:
                raise SchedulerError(
                    f"offload: its store serves layout {offload.layout_id!r} (allowed: {layout_id!r}, these pools')"
                )
        self.config = config
        self.cache = block_manager.config
        self.offload = offload
        self.block_manager = block_manager
        self.layout_id = layout_id
        self.image_pages = image_pages
        self.image_bytes = image_bytes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._progress: dict[str, _Progress] = {}
        self._released: list[str] = []  # left the rank since the last batch (finished, aborted, preempted)
        self._step_id = 0
        self.num_preemptions = 0
        # Speculation: verify steps committed, drafts they verified, drafts accepted.
        self.num_verifies = 0
        self.num_drafts_verified = 0
        self.num_drafts_accepted = 0

    @property
    def copies_images(self) -> bool:
        return self.cache.state_transfer is StateTransfer.COPY and self.cache.enable_prefix_caching

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_releases(self) -> bool:
        """True while the rank still holds requests that left it: its next batch,
        even one with no rows, tells it to drop them."""
        return bool(self._released)

    def take_releases(self) -> tuple[str, ...]:
        """The requests that left the rank since its last batch, which the caller's next
        batch to the rank must release; the scheduler forgets them."""
        released, self._released = tuple(self._released), []
        return released

    # -- scheduling -------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        self._step_id += 1
        preemptions_before = self.num_preemptions
        budget = self.config.max_num_batched_tokens
        plans: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_output_tokens + request.num_pending_tokens >= request.params.max_tokens:
                # Its last token is still being drawn (async scheduling): nothing to run.
                i += 1
                continue
            count = self._chunk(request, budget)
            if self._grow_or_preempt(request, request.num_computed_tokens + count):
                plans.append((request, count))
                budget -= count
                i += 1
        # Like vLLM, no admission in a step that had to preempt: the pools are full.
        preempted = self.num_preemptions > preemptions_before
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            request = self.waiting[0]
            # A request preempted while a step in flight draws for it waits for the draw.
            if request.num_pending_tokens or not self._admit(request):
                break
            self.waiting.popleft()
            self.running.append(request)
            count = self._chunk(request, budget)
            plans.append((request, count))
            budget -= count
        if self.waiting and not self.running and not preempted and not self.waiting[0].num_pending_tokens:
            request = self.waiting[0]
            raise SchedulerError(
                f"request {request.request_id!r}: {request.num_tokens} tokens cannot be admitted into empty pools "
                f"({self.block_manager.stats()}); the engine should have refused it"
            )
        segments = tuple(self._segment(request, count) for request, count in plans)
        if self.config.async_scheduling:
            for (request, _), seg in zip(plans, segments):
                request.num_computed_tokens = seg.end
                request.num_pending_tokens += seg.sample
        return ScheduledBatch(step_id=self._step_id, segments=segments, released_request_ids=self.take_releases())

    def _chunk(self, request: Request, budget: int) -> int:
        """The rows of ``request`` this step runs: its next prefill chunk, or its
        decode row and the drafts it verifies."""
        start = request.num_computed_tokens
        pending = request.num_pending_tokens
        if start == request.num_tokens + pending - 1 and request.num_output_tokens + pending:
            return 1 + self._num_drafts(request, budget)
        count = min(request.num_tokens - start, budget)
        if self.config.long_prefill_token_threshold and count > 1:
            count = min(count, self.config.long_prefill_token_threshold)
        cut = self._progress[request.request_id].image_cut
        if self.copies_images and start < cut < start + count:
            count = cut - start
        return count

    def _num_drafts(self, request: Request, budget: int) -> int:
        """The drafts a decoding request's step verifies: those its last step left,
        within the step's token budget (the anchor's row counts too) and below its
        last token to generate (the rows verified never pass what decoding computes)."""
        drafts = self._progress[request.request_id].drafts
        left = request.params.max_tokens - request.num_output_tokens
        return max(0, min(len(drafts), budget - 1, left - 1))

    def _grow_or_preempt(self, request: Request, num_tokens: int) -> bool:
        """Gives ``request`` PAGEs for ``num_tokens``, preempting the newest running
        requests until it fits; False when it had to preempt itself."""
        while not self.block_manager.grow(request.request_id, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request) -> bool:
        tokens = request.all_token_ids
        bm = self.block_manager
        image_limit = self._image_limit(request)
        hit = bm.lookup(tokens, image_limit)
        page_handles: list[object] = []
        image_handle = None
        if request.params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt row computed: take no hit.
            hit = dataclasses.replace(hit, hit_tokens=0, forward_start=0, restore_image=None, pages=())
        elif self.offload is not None and bm.has_room(len(tokens), hit):
            # Only a prompt that fits now asks the store: one left waiting would pin
            # units (and make a round trip) at every step.
            hit, page_handles, image_handle = self._extend_from_offload(self.offload, hit, len(tokens), image_limit)
        if not bm.allocate_prompt(request.request_id, tokens, hit):
            # A fetched image was taken only with room for it. A local one that does
            # not fit beside the prompt is let go: waiting for it could wait forever.
            if hit.restore_image is None:
                return False
            hit = bm.without_image(hit)
            if not bm.allocate_prompt(request.request_id, tokens, hit):
                return False
        fetched = bm.page_table(request.request_id, len(hit.pages), len(hit.pages) + len(page_handles))
        fills = [PageFill(pages=(page,), handle=h) for page, h in zip(fetched, page_handles)]
        if image_handle is not None and hit.restore_image is not None:
            fills.append(PageFill(pages=hit.restore_image.pages, handle=image_handle))
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit.forward_start
        self._progress[request.request_id] = _Progress(
            write_from=hit.hit_tokens,
            # A restored image holds the exact rings below its boundary; a reset slot
            # holds nothing below the forward's first row.
            window_start=0 if hit.restore_image is not None else hit.forward_start,
            prep=self._slot_prep(hit, tokens),
            image_cut=(len(tokens) - 1) // self.cache.block_size * self.cache.block_size,
            fills=tuple(fills),
        )
        return True

    def _image_limit(self, request: Request) -> int | None:
        """The last boundary an admission may resume an image at (None: any)."""
        window = self.config.decoder_replay_window
        return None if window is None else tail_start(request.num_prompt_tokens, window)

    def _extend_from_offload(
        self, offload: OffloadConnector, hit: PrefixHit, num_tokens: int, image_limit: int | None
    ) -> tuple[PrefixHit, list[object], object]:
        """``hit`` extended by the PAGEs the offload store holds right after it (up to
        the first one cached here or missing there), resuming under COPY from the
        newest offloaded image among them (at most ``image_limit`` tokens in) when
        PAGEs for it are free. Returns the hit, a handle per fetched PAGE and the
        image's handle (or None)."""
        bm = self.block_manager
        limit = (num_tokens - 1) // self.cache.block_size
        wanted: list[bytes] = []
        for h in hit.prompt_hashes[len(hit.pages) : limit]:
            if bm.has_hash(h):
                break
            wanted.append(h)
        if not wanted:
            return hit, [], None
        kinds = (UnitKind.PAGE, UnitKind.IMAGE) if self.copies_images else (UnitKind.PAGE,)
        handles = offload.lookup([OffloadKey(self.layout_id, h, kind) for kind in kinds for h in wanted])
        page_handles: list[object] = []
        for handle in handles[: len(wanted)]:
            if handle is None:
                break
            page_handles.append(handle)
        if not page_handles:
            return hit, [], None
        image_handles = handles[len(wanted) : len(wanted) + len(page_handles)]
        for j in reversed(range(len(image_handles))):
            boundary = (len(hit.pages) + j + 1) * self.cache.block_size
            if image_handles[j] is None or (image_limit is not None and boundary > image_limit):
                continue
            pages = bm.allocate_pages(self.image_pages, keep=hit)
            if pages is None:
                break
            image = StateImage(
                layout_id=self.layout_id,
                pages=tuple(pages),
                image_bytes=self.image_bytes,
                num_tokens=boundary,
            )
            extended = bm.extend_hit(hit, len(page_handles), image)
            if bm.has_room(num_tokens, extended):
                return extended, page_handles, image_handles[j]
            bm.free_pages(pages)
            break
        return bm.extend_hit(hit, len(page_handles), None), page_handles, None

    def _slot_prep(self, hit: PrefixHit, tokens: Iterable[int]) -> SlotReset | StateImage:
        if hit.restore_image is not None:
            return hit.restore_image
        history = tuple(list(tokens)[max(0, hit.forward_start - self.config.engram_history) : hit.forward_start])
        return SlotReset(position=hit.forward_start, history_token_ids=history)

    def _segment(self, request: Request, count: int) -> ScheduledSegment:
        rid = request.request_id
        progress = self._progress[rid]
        new_request = None
        if progress.pages_sent is None:
            new_request = NewRequestData(params=request.params, seed=request.sampling_seed)
        kept = progress.pages_sent or 0
        new_pages = self.block_manager.page_table(rid, kept)
        progress.pages_sent = kept + len(new_pages)
        start = request.num_computed_tokens
        end = start + count
        prep, progress.prep = progress.prep, None
        fills, progress.fills = progress.fills, ()
        known = min(end, request.num_tokens)
        placeholders = (PLACEHOLDER_TOKEN,) * (min(end, request.num_tokens + request.num_pending_tokens) - known)
        drafts = progress.drafts[: end - known - len(placeholders)]
        store_after = None
        if self.copies_images and end % self.cache.block_size == 0 and not drafts:
            pages = self.block_manager.allocate_pages(self.image_pages)
            if pages is not None:
                store_after = StateImage(
                    layout_id=self.layout_id, pages=tuple(pages), image_bytes=self.image_bytes, num_tokens=end
                )
        return ScheduledSegment(
            request_id=rid,
            slot=self.block_manager.slot(rid),
            start=start,
            token_ids=tuple(request.all_token_ids[start:known]) + placeholders + drafts,
            write_from=progress.write_from,
            window_start=progress.window_start,
            sample=known + len(placeholders) == request.num_tokens + request.num_pending_tokens,
            output_index=request.num_output_tokens + request.num_pending_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            new_pages=new_pages,
            kept_pages=kept,
            new_request=new_request,
            reset=prep if isinstance(prep, SlotReset) else None,
            restore=prep if isinstance(prep, StateImage) else None,
            store_after=store_after,
            fetch=fills,
            # A verify's drafts are tentative: only the anchor's row is sure to be kept.
            publish=self._publications(request, start, known, progress.write_from, store_after),
            want_prompt_logits=request.params.prompt_logprobs is not None and start < request.num_prompt_tokens,
            num_draft_tokens=len(drafts),
        )

    def _publications(
        self, request: Request, start: int, end: int, write_from: int, store_after: StateImage | None
    ) -> tuple[PagePublish, ...]:
        """What the forward of positions [start, end) completes for the offload store:
        each PAGE whose last row it computes and whose KV it writes (PAGEs below
        ``write_from`` were cached already), and the image it stores."""
        if self.offload is None:
            return ()
        b = self.cache.block_size
        first = max(start, write_from) // b
        if end // b <= first and store_after is None:
            return ()
        rid = request.request_id
        hashes = self.block_manager.page_hashes(rid, request.all_token_ids, end // b)
        pages = self.block_manager.page_table(rid, first, end // b)
        out = [
            PagePublish(pages=(page,), key=OffloadKey(self.layout_id, hashes[i], UnitKind.PAGE))
            for i, page in enumerate(pages, start=first)
        ]
        if store_after is not None:
            key = OffloadKey(self.layout_id, hashes[end // b - 1], UnitKind.IMAGE)
            out.append(PagePublish(pages=store_after.pages, key=key))
        return tuple(out)

    # -- results ------------------------------------------------------------------------

    def commit(
        self,
        segment: ScheduledSegment,
        request: Request | None,
        committed_end: int | None = None,
        drafts: tuple[int, ...] = (),
    ) -> None:
        """Records that ``segment``'s forward ran: the image it restored is let go,
        the request's cursor advances to ``committed_end`` (None: the segment's end; a
        verify keeps its accepted prefix and hands back lookahead PAGEs past it; under
        async scheduling it advanced when the segment was scheduled), its
        full PAGEs are published and a checkpoint image taken at a PAGE boundary is
        attached to the prefix index (or handed back when nothing wants it).
        ``drafts``: what the request's next step verifies (speculation)."""
        image_kept = False
        if request is not None and request.request_id in self._progress:
            end = segment.end if committed_end is None else committed_end
            if not segment.start < end <= segment.end:
                raise SchedulerError(
                    f"committed_end: {committed_end} (allowed: in ({segment.start}, {segment.end}], the rows that ran)"
                )
            if segment.restore is not None:
                self.block_manager.restored(request.request_id)
            if not self.config.async_scheduling:
                request.num_computed_tokens = end
            self._progress[request.request_id].drafts = drafts
            if segment.num_draft_tokens:
                self.num_verifies += 1
                self.num_drafts_verified += segment.num_draft_tokens
                self.num_drafts_accepted += end - (segment.end - segment.num_draft_tokens)
            if end < segment.end:
                # The next step's anchor row is the first a later forward computes.
                self.block_manager.shrink(request.request_id, end + 1)
                # The rank keeps its longer row until the next segment says how much of it stays.
                progress = self._progress[request.request_id]
                if progress.pages_sent is not None:
                    progress.pages_sent = min(progress.pages_sent, self.block_manager.num_pages(request.request_id))
            self.block_manager.publish(request.request_id, request.all_token_ids, end)
            if segment.store_after is not None:
                image_kept = self.block_manager.attach_image(request.request_id, segment.end, segment.store_after)
        if segment.store_after is not None and not image_kept:
            self.block_manager.free_pages(segment.store_after.pages)

    def finish(self, request: Request) -> None:
        """Frees a finished request's PAGEs and slot and drops it from the queues."""
        if request.request_id in self._progress:
            del self._progress[request.request_id]
            self.block_manager.free(request.request_id)
            self._released.append(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def requests_on_rank(self) -> tuple[str, ...]:
        """The requests the rank holds until its next batch: each one whose first
        segment it got, and each one that batch releases."""
        sent = (rid for rid, progress in self._progress.items() if progress.pages_sent is not None)
        return (*self._released, *sent)

    def release_on_rank(self, request_ids: Iterable[str]) -> None:
        """Has the next batch tell the rank to drop ``request_ids``: what an earlier
        scheduler of the same rank sent it (an engine that restarted its bookkeeping
        beside running ranks)."""
        self._released.extend(request_ids)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: the request gives up its PAGEs and slot and waits at
        the front; it resumes from whatever the prefix cache then holds."""
        self.running.remove(request)
        del self._progress[request.request_id]
        self.block_manager.free(request.request_id)
        self._released.append(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1
