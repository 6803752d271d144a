"""Requests' PAGEs and STATE slots over a block pool, and the prefix cache's lookups.

Owns: which PAGEs and which STATE slot each request holds; the chain hash of every
full PAGE (the PAGE is the hash block) and so what a prompt hits; where a hit's forward
starts (the newest checkpoint image under ``StateTransfer.COPY``, ``replay_start``
under ``StateTransfer.REPLAY``); hits extended by PAGEs and images fetched from an
offload store (registered at allocation, filled by the rank before the forward); when
an image is wanted and attached; the lookup counters, ``stats`` and
``check_invariants``. The PAGEs themselves (reference counts, the free list, the hash
entries, the images on them and least-recently-used reclaiming) are
cache/block_pool.py's ``BlockPool``. It moves no bytes: copying a STATE in or out of
PAGEs is ``cache.checkpoints``', resetting a slot ``cache.pools``', fetching
``cache.offload``'s.

Must not import: torch, anything of this project but cache.block_pool, the scheduler,
ray. The keys are
blake2b digests, never Python's ``hash()``, so every process and node computes the
same key for the same tokens.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import struct
from collections import Counter, deque
from dataclasses import dataclass
from typing import Sequence

from dsv41.cache.block_pool import BlockManagerError, BlockPool, Kept, StateImage

ROOT_HASH = b""
_HASH_PERSON = b"dsv41-prefix"
_HASH_BYTES = 16


def prefix_hashes(token_ids: Sequence[int], block_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """Chain hashes of every full PAGE of ``token_ids``: hash i covers the parent hash
    (``ROOT_HASH`` for the first PAGE) and the PAGE's token ids as little-endian
    int64. ``known`` are hashes of the first PAGEs already computed; only the rest are
    hashed."""
    hashes = list(known)
    page_tokens = struct.Struct(f"<{block_size}q")
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=_HASH_BYTES, person=_HASH_PERSON)
        digest.update(page_tokens.pack(*token_ids[start : start + block_size]))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class StateTransfer(enum.Enum):
    """How a request resumes the STATE of a cached prefix.

    COPY: checkpoint images are taken at PAGE boundaries and attached to the prefix
    index; a hit restores the newest image at or below it. REPLAY: no images; the
    hit's forward starts one whole hash block below it in a reset slot and rebuilds
    the windows (encoder bounded replay)."""

    COPY = "copy"
    REPLAY = "replay"

    @classmethod
    def _missing_(cls, value: object) -> "StateTransfer":
        raise BlockManagerError(f"state_transfer: {value!r} (allowed: 'copy', 'replay')")


@dataclass(frozen=True)
class PrefixHit:
    """What a prompt reuses from the prefix cache, under either state transfer.

    ``pages`` hold the prompt's first tokens (whole PAGEs, never the prompt's last
    PAGE); ``fetched_pages`` more PAGEs after them come from an offload store: the
    allocation takes fresh PAGEs for them and the rank writes their bytes before the
    forward, so ``hit_tokens`` covers both. The runtime's forward starts at
    ``forward_start`` in a slot that is either restored from ``restore_image`` (COPY,
    taken at ``forward_start``; ``fetched_image`` when its PAGEs come from
    ``allocate_pages`` and are filled from the offload store) or reset (REPLAY, or
    COPY with no image: "replay from a recoverable boundary"). Rows in
    ``[forward_start, hit_tokens)`` are recomputed for the rings only; the cached
    global KV is not rewritten (the runtime's write_from is ``hit_tokens``).
    ``prompt_hashes`` are the chain hashes of all the prompt's full PAGEs, kept for
    publishing them.
    """

    hit_tokens: int
    forward_start: int
    restore_image: StateImage | None
    pages: tuple[int, ...]
    prompt_hashes: tuple[bytes, ...]
    fetched_pages: int = 0
    fetched_image: bool = False

    @property
    def num_hit_pages(self) -> int:
        return len(self.pages) + self.fetched_pages

    def __post_init__(self) -> None:
        if not 0 <= self.forward_start <= self.hit_tokens:
            raise BlockManagerError(
                f"forward_start: {self.forward_start} (allowed: 0..hit_tokens={self.hit_tokens})"
            )
        if self.fetched_pages < 0:
            raise BlockManagerError(f"fetched_pages: {self.fetched_pages} (allowed: >= 0)")
        if (self.hit_tokens == 0) != (self.num_hit_pages == 0):
            raise BlockManagerError(f"pages: {self.num_hit_pages} PAGEs for hit_tokens={self.hit_tokens}")
        if self.num_hit_pages > len(self.prompt_hashes):
            raise BlockManagerError(
                f"prompt_hashes: {len(self.prompt_hashes)} for {self.num_hit_pages} hit PAGEs (allowed: >= pages)"
            )
        if self.fetched_image and self.restore_image is None:
            raise BlockManagerError("fetched_image: True without a restore_image")
        if self.restore_image is not None and self.restore_image.num_tokens != self.forward_start:
            raise BlockManagerError(
                f"restore_image: taken at {self.restore_image.num_tokens} tokens, "
                f"but forward_start is {self.forward_start}"
            )


@dataclass(frozen=True)
class CacheConfig:
    """The pools' settings, read by the block manager and the scheduler above it
    (one declaration, never copied): how many PAGEs and STATE slots, tokens per PAGE,
    how a prefix hit gets its STATE, and whether prefixes are cached at all."""

    num_pages: int
    num_slots: int
    block_size: int
    state_transfer: StateTransfer = StateTransfer.REPLAY
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("num_pages", "num_slots", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BlockManagerError(f"CacheConfig.{name}: {value!r} (allowed: a positive integer)")
        if not isinstance(self.state_transfer, StateTransfer):
            raise BlockManagerError(
                f"CacheConfig.state_transfer: {self.state_transfer!r} (allowed: {', '.join(repr(t) for t in StateTransfer)})"
            )


@dataclass(frozen=True)
class BlockManagerStats:
    """A snapshot of the counters. ``pages_used`` are referenced (by requests or
    images), ``pages_cached`` unreferenced but in the prefix index, ``pages_free``
    neither; ``image_pages_idle`` are the PAGEs of attached images no restore holds.
    Cached PAGEs and idle images' PAGEs are what allocation reclaims: ``evictions``
    counts cached PAGEs evicted, ``image_evictions`` images dropped on their own
    (their hash entries stay). Lookups count every ``lookup()`` call."""

    num_pages: int
    pages_used: int
    pages_cached: int
    pages_free: int
    images: int
    image_pages: int
    image_pages_idle: int
    num_slots: int
    slots_used: int
    requests: int
    lookups: int
    hits: int
    lookup_tokens: int
    hit_tokens: int
    evictions: int
    image_evictions: int
    fetched_pages: int  # PAGEs of hits taken from an offload store
    fetched_images: int
    # Cached tokens of admitted hits computed again to rebuild their STATE (a hit's
    # hit_tokens - forward_start: replay's windows, or copy's rows past its image).
    replayed_tokens: int

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served by the prefix cache."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass
class _RequestBlocks:
    pages: list[int]
    slot: int
    hashes: list[bytes]  # chain hashes known so far (the prompt's full PAGEs, then published ones)
    num_published: int  # leading PAGEs registered in (or taken from) the prefix index
    restoring: bytes | None = None  # the hash entry whose image the first forward restores


class BlockManager:
    """PAGE and STATE-slot allocation of one engine group's pools.

    The scheduler drives it: ``lookup`` then, in the same step, ``allocate_prompt``
    (PAGEs for the whole prompt, sharing the hit's, and a STATE slot; the hit's
    image is held until ``restored``); ``grow`` as decode proceeds; ``publish`` once
    tokens are computed; ``free`` when the request stops or is preempted.
    ``allocate_prompt`` and ``grow`` answer False, changing nothing, when the pools
    cannot hold the request: the scheduler preempts or waits. Allocation reclaims,
    least recently used first, unreferenced cached PAGEs (an evicted PAGE takes its
    hash entry and the image attached there: nothing can reach that image any more)
    and attached images no restore holds (the hash entry stays: a later hit there
    recomputes the windows instead). So with no request holding anything, every PAGE
    is reclaimable: a prompt that fits the empty pools is always admitted.
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.num_pages)
        self._free_slots: deque[int] = deque(range(config.num_slots))
        self._requests: dict[str, _RequestBlocks] = {}
        self._lookups = 0
        self._hits = 0
        self._lookup_tokens = 0
        self._hit_tokens = 0
        self._fetched_pages = 0
        self._fetched_images = 0
        self._replayed_tokens = 0

    # -- prefix lookup ----------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], image_limit: int | None = None) -> PrefixHit:
        """The longest cached prefix of a prompt in whole PAGEs, at most
        floor((len - 1) / block_size) of them so at least one prompt token is
        computed, and where its forward starts (see ``PrefixHit``): under COPY the
        newest image at most ``image_limit`` tokens in (None: any; decoder bounded
        replay cannot resume above the prompt's tail). Changes nothing but the lookup
        counters."""
        if len(token_ids) == 0:
            raise BlockManagerError("token_ids: empty prompt (allowed: at least one token)")
        self._lookups += 1
        self._lookup_tokens += len(token_ids)
        if not self.config.enable_prefix_caching:
            return self.miss(token_ids)
        hashes = prefix_hashes(token_ids, self.config.block_size)
        pages = self._cached_pages(token_ids, hashes)
        hit_tokens = len(pages) * self.config.block_size
        image: StateImage | None = None
        if self.config.state_transfer is StateTransfer.REPLAY:
            forward_start = self.replay_start(hit_tokens)
        else:
            forward_start = 0
            for i in reversed(range(len(pages))):
                if image_limit is not None and (i + 1) * self.config.block_size > image_limit:
                    continue
                image = self.pool.image(hashes[i])
                if image is not None:
                    forward_start = (i + 1) * self.config.block_size
                    break
        if hit_tokens:
            self._hits += 1
            self._hit_tokens += hit_tokens
        return PrefixHit(
            hit_tokens=hit_tokens,
            forward_start=forward_start,
            restore_image=image,
            pages=tuple(pages),
            prompt_hashes=tuple(hashes),
        )

    def miss(self, token_ids: Sequence[int]) -> PrefixHit:
        """The PrefixHit of a prompt computed from its first token, reusing nothing
        (what ``lookup`` finds with nothing cached), without counting a lookup."""
        hashes = tuple(prefix_hashes(token_ids, self.config.block_size)) if self.config.enable_prefix_caching else ()
        return PrefixHit(hit_tokens=0, forward_start=0, restore_image=None, pages=(), prompt_hashes=hashes)

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many tokens of ``token_ids`` a ``lookup`` would hit, without counting a
        lookup: a question placement asks every rank, of which one admits."""
        if not self.config.enable_prefix_caching or len(token_ids) == 0:
            return 0
        return len(self._cached_pages(token_ids, prefix_hashes(token_ids, self.config.block_size))) * self.config.block_size

    def _cached_pages(self, token_ids: Sequence[int], hashes: Sequence[bytes]) -> list[int]:
        pages: list[int] = []
        for h in hashes[: (len(token_ids) - 1) // self.config.block_size]:
            page = self.pool.cached_page(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def has_hash(self, chain_hash: bytes) -> bool:
        """Whether a PAGE with this chain hash is in the prefix index."""
        return self.pool.cached_page(chain_hash) is not None

    def extend_hit(self, hit: PrefixHit, fetched_pages: int, image: StateImage | None) -> PrefixHit:
        """``hit`` (from ``lookup`` in this step) followed by ``fetched_pages`` PAGEs an
        offload store holds, resuming from ``image`` when given (its PAGEs from
        ``allocate_pages``, filled from the store; taken at a boundary inside the
        fetched range) or else as ``hit`` would: under REPLAY from ``replay_start`` of
        the longer hit, under COPY from the hit's own image."""
        if fetched_pages <= 0:
            raise BlockManagerError(f"fetched_pages: {fetched_pages} (allowed: > 0)")
        if hit.fetched_pages:
            raise BlockManagerError("hit: already extended")
        hit_tokens = (len(hit.pages) + fetched_pages) * self.config.block_size
        if image is not None:
            if self.config.state_transfer is StateTransfer.REPLAY:
                raise BlockManagerError("image: state_transfer is 'replay', which restores no images")
            if not hit.hit_tokens < image.num_tokens <= hit_tokens:
                raise BlockManagerError(
                    f"image: taken at {image.num_tokens} tokens (allowed: {hit.hit_tokens + 1}..{hit_tokens}, "
                    "a boundary of the fetched PAGEs)"
                )
            return dataclasses.replace(
                hit,
                hit_tokens=hit_tokens,
                forward_start=image.num_tokens,
                restore_image=image,
                fetched_pages=fetched_pages,
                fetched_image=True,
            )
        forward_start = self.replay_start(hit_tokens) if self.config.state_transfer is StateTransfer.REPLAY else hit.forward_start
        return dataclasses.replace(hit, hit_tokens=hit_tokens, forward_start=forward_start, fetched_pages=fetched_pages)

    def replay_start(self, resume_tokens: int) -> int:
        """Where a forward resuming at ``resume_tokens`` starts under bounded replay:
        one whole hash block below the PAGE boundary at or below it (never below 0), so
        it recomputes at least a PAGE of rows to rebuild the windows from."""
        if resume_tokens < 0:
            raise BlockManagerError(f"resume_tokens: {resume_tokens} (allowed: >= 0)")
        return max(0, (resume_tokens // self.config.block_size - 1) * self.config.block_size)

    def without_image(self, hit: PrefixHit) -> PrefixHit:
        """``hit`` (COPY) resumed without a checkpoint image: the same PAGEs, local
        and fetched, and the forward from 0 in a reset slot, the replay from a
        recoverable boundary. What an admission takes when the pools cannot hold the
        image beside the prompt, so an image is never what keeps a request waiting."""
        if self.config.state_transfer is StateTransfer.REPLAY:
            raise BlockManagerError("without_image: state_transfer is 'replay', whose hits restore no images")
        return dataclasses.replace(hit, forward_start=0, restore_image=None, fetched_image=False)

    # -- requests ---------------------------------------------------------------------

    def allocate_prompt(self, request_id: str, token_ids: Sequence[int], hit: PrefixHit) -> bool:
        """PAGEs for the whole prompt (the hit's shared, the rest fresh) and a STATE
        slot. ``hit`` must come from ``lookup(token_ids)`` in this step (or its
        ``extend_hit`` / ``without_image``). False, with nothing changed, when the
        pools cannot hold it. The fetched PAGEs of an extended hit enter the prefix
        index at once, and a fetched image is attached to it: the caller must fill
        both before any forward reads them (the rank does, first thing in the step).
        The caller then readies the slot: restore ``hit.restore_image`` into it (the
        image is not reclaimed until ``restored`` or ``free``), or reset it."""
        if request_id in self._requests:
            raise BlockManagerError(f"request_id: {request_id!r} already holds PAGEs (free it first)")
        self._check_hit(token_ids, hit)
        if not self.has_room(len(token_ids), hit):
            return False
        fresh = -(-len(token_ids) // self.config.block_size) - len(hit.pages)
        for page in hit.pages:
            self.pool.reference(page)
        restoring = self._restore_entry(hit)
        if restoring is not None and not hit.fetched_image:
            self.pool.hold(restoring)
        pages = list(hit.pages) + self.pool.take(fresh)
        for i in range(len(hit.pages), hit.num_hit_pages):
            self.pool.cache(hit.prompt_hashes[i], pages[i])
        self._fetched_pages += hit.fetched_pages
        self._replayed_tokens += hit.hit_tokens - hit.forward_start
        if hit.fetched_image and hit.restore_image is not None and restoring is not None:
            self.pool.attach(restoring, hit.restore_image, held=True)
            self._fetched_images += 1
        self._requests[request_id] = _RequestBlocks(
            pages=pages,
            slot=self._free_slots.popleft(),
            hashes=list(hit.prompt_hashes),
            num_published=hit.num_hit_pages,
            restoring=restoring,
        )
        return True

    def has_room(self, num_tokens: int, hit: PrefixHit) -> bool:
        """Whether a prompt of ``num_tokens`` with ``hit`` would get its PAGEs and a
        STATE slot now (what ``allocate_prompt`` answers, without allocating): the
        fresh PAGEs must come from what is reclaimable besides the hit's own PAGEs
        and the image it restores."""
        if not self._free_slots:
            return False
        fresh = -(-num_tokens // self.config.block_size) - len(hit.pages)
        return fresh <= self.pool.reclaimable(self._kept(hit))

    def restored(self, request_id: str) -> None:
        """The request's first forward has restored its image into the slot: the
        image is reclaimable again (least recently used last)."""
        blocks = self._request(request_id)
        if blocks.restoring is None:
            raise BlockManagerError(f"request_id: {request_id!r} restores no image")
        self.pool.let_go(blocks.restoring)
        blocks.restoring = None

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Appends PAGEs until the request holds ``num_tokens`` tokens. False, with
        nothing changed, when there are not enough: the scheduler should preempt."""
        blocks = self._request(request_id)
        missing = -(-num_tokens // self.config.block_size) - len(blocks.pages)
        if missing <= 0:
            return True
        if missing > self.pool.reclaimable():
            return False
        blocks.pages.extend(self.pool.take(missing))
        return True

    def shrink(self, request_id: str, num_tokens: int) -> None:
        """Hands back the request's trailing PAGEs past what ``num_tokens`` tokens need
        (a speculative verify's lookahead its rejected rows alone reached); a published
        PAGE is never among them."""
        blocks = self._request(request_id)
        keep = max(-(-num_tokens // self.config.block_size), blocks.num_published)
        if keep >= len(blocks.pages):
            return
        extra = blocks.pages[keep:]
        del blocks.pages[keep:]
        self.pool.release_all(reversed(extra))

    def publish(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Registers every PAGE whose tokens are all computed in the prefix index.
        ``token_ids`` are all the request's tokens so far (prompt, then output). A
        PAGE whose hash another PAGE already holds stays private to the request."""
        blocks = self._request(request_id)
        if not 0 <= num_computed_tokens <= len(token_ids):
            raise BlockManagerError(
                f"num_computed_tokens: {num_computed_tokens} (allowed: 0..len(token_ids)={len(token_ids)})"
            )
        full = num_computed_tokens // self.config.block_size
        if full > len(blocks.pages):
            raise BlockManagerError(
                f"num_computed_tokens: {num_computed_tokens} needs {full} PAGEs, request {request_id!r} "
                f"holds {len(blocks.pages)} (grow it first)"
            )
        if not self.config.enable_prefix_caching or full <= blocks.num_published:
            return
        self.page_hashes(request_id, token_ids, full)
        for i in range(blocks.num_published, full):
            self.pool.cache(blocks.hashes[i], blocks.pages[i])
        blocks.num_published = full

    def page_hashes(self, request_id: str, token_ids: Sequence[int], num_pages: int) -> list[bytes]:
        """The chain hashes of the request's first ``num_pages`` PAGEs (``token_ids``
        are all its tokens so far and must fill them); computed once per PAGE."""
        blocks = self._request(request_id)
        if num_pages * self.config.block_size > len(token_ids):
            raise BlockManagerError(
                f"num_pages: {num_pages} PAGEs need {num_pages * self.config.block_size} tokens, {len(token_ids)} given"
            )
        if len(blocks.hashes) < num_pages:
            blocks.hashes = prefix_hashes(token_ids[: num_pages * self.config.block_size], self.config.block_size, blocks.hashes)
        return blocks.hashes[:num_pages]

    def free(self, request_id: str) -> None:
        """Drops the request's hold on an image it had yet to restore, its PAGE
        references (last PAGE first, so a prefix's tail is evicted before its head)
        and its STATE slot. Cached PAGEs become reclaimable, others free."""
        blocks = self._request(request_id)
        del self._requests[request_id]
        if blocks.restoring is not None:
            self.pool.let_go(blocks.restoring)
        self.pool.release_all(reversed(blocks.pages))
        self._free_slots.append(blocks.slot)

    def page_table(self, request_id: str, first: int = 0, end: int | None = None) -> tuple[int, ...]:
        """The request's PAGE ids [first, end) (default: all of them); copies only those."""
        return tuple(self._request(request_id).pages[first:end])

    def num_pages(self, request_id: str) -> int:
        return len(self._request(request_id).pages)

    def slot(self, request_id: str) -> int:
        return self._request(request_id).slot

    # -- checkpoint images (StateTransfer.COPY) ---------------------------------------

    def allocate_pages(self, count: int, keep: PrefixHit | None = None) -> list[int] | None:
        """``count`` PAGEs outside any request (checkpoint images), owned by the caller
        until attached or handed back with ``free_pages``; None if there are not
        enough. With ``keep`` (a hit of this step not yet allocated), the hit's PAGEs
        and the image it restores are not reclaimed for them."""
        if count <= 0:
            raise BlockManagerError(f"count: {count} (allowed: > 0)")
        kept = self._kept(keep)
        if count > self.pool.reclaimable(kept):
            return None
        return self.pool.allocate_private(count, kept)

    def free_pages(self, pages: Sequence[int]) -> None:
        """Hands back PAGEs from ``allocate_pages`` that no attached image holds."""
        self.pool.free_private(pages)

    def wants_image(self, request_id: str, boundary: int) -> bool:
        """Whether a checkpoint at ``boundary`` tokens of the request would be kept:
        the PAGE ending there is in the prefix index and carries no image yet."""
        if self.config.state_transfer is StateTransfer.REPLAY or not self.config.enable_prefix_caching:
            return False
        h = self._boundary_hash(self._request(request_id), boundary)
        return self.pool.cached_page(h) is not None and self.pool.image(h) is None

    def attach_image(self, request_id: str, boundary: int, image: StateImage) -> bool:
        """Attaches ``image`` (taken at ``boundary`` tokens of the request) to the hash
        entry of the PAGE ending there; the block manager then owns its PAGEs, and
        drops them when the image or that entry is evicted. False, leaving the image
        the caller's, when ``wants_image`` is no longer true."""
        if self.config.state_transfer is StateTransfer.REPLAY:
            raise BlockManagerError("attach_image: state_transfer is 'replay', which keeps no checkpoint images")
        if image.num_tokens != boundary:
            raise BlockManagerError(f"image: taken at {image.num_tokens} tokens, not at boundary {boundary}")
        if not self.pool.is_private(image.pages):
            raise BlockManagerError("image: its PAGEs must come from allocate_pages and not be attached already")
        if not self.wants_image(request_id, boundary):
            return False
        self.pool.attach(self._boundary_hash(self._request(request_id), boundary), image)
        return True

    # -- eviction ---------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Reclaims at least ``num_pages`` PAGEs where it can, evicting cached PAGEs
        (with their hash entries and images) and idle images, least recently used
        first; returns how many PAGEs it freed."""
        return self.pool.evict(num_pages)

    # -- introspection ----------------------------------------------------------------

    def refcount(self, page: int) -> int:
        return self.pool.refcount(page)

    def is_cached(self, page: int) -> bool:
        """Whether the PAGE is in the prefix index."""
        return self.pool.is_cached(page)

    def stats(self) -> BlockManagerStats:
        return BlockManagerStats(
            num_pages=self.config.num_pages,
            pages_used=self.config.num_pages - self.pool.num_free - self.pool.num_idle,
            pages_cached=self.pool.num_idle,
            pages_free=self.pool.num_free,
            images=self.pool.num_images,
            image_pages=self.pool.image_pages,
            image_pages_idle=self.pool.idle_image_pages,
            num_slots=self.config.num_slots,
            slots_used=self.config.num_slots - len(self._free_slots),
            requests=len(self._requests),
            lookups=self._lookups,
            hits=self._hits,
            lookup_tokens=self._lookup_tokens,
            hit_tokens=self._hit_tokens,
            evictions=self.pool.evictions,
            image_evictions=self.pool.image_evictions,
            fetched_pages=self._fetched_pages,
            fetched_images=self._fetched_images,
            replayed_tokens=self._replayed_tokens,
        )

    def check_invariants(self) -> None:
        """Raises BlockManagerError naming the first broken invariant: the pool's own
        (every PAGE's reference count equals its holders: the requests' tables, attached
        images and private PAGEs; see BlockPool.check_invariants), given the PAGEs the
        requests hold and the images their first forwards restore; slots are each held
        once."""
        self.pool.check_invariants(
            (page for blocks in self._requests.values() for page in blocks.pages),
            Counter(b.restoring for b in self._requests.values() if b.restoring is not None),
        )
        slots = [blocks.slot for blocks in self._requests.values()] + list(self._free_slots)
        if sorted(slots) != list(range(self.config.num_slots)):
            raise BlockManagerError(
                f"invariant: slots {sorted(slots)} (allowed: each of 0..{self.config.num_slots - 1} once)"
            )

    # -- internals --------------------------------------------------------------------

    def _request(self, request_id: str) -> _RequestBlocks:
        blocks = self._requests.get(request_id)
        if blocks is None:
            raise BlockManagerError(f"request_id: {request_id!r} holds no PAGEs")
        return blocks

    def _check_hit(self, token_ids: Sequence[int], hit: PrefixHit) -> None:
        b = self.config.block_size
        expected_hashes = len(token_ids) // b if self.config.enable_prefix_caching else 0
        if len(token_ids) == 0 or len(hit.prompt_hashes) != expected_hashes:
            raise BlockManagerError("hit: not the lookup() of these token_ids")
        if hit.hit_tokens != hit.num_hit_pages * b or hit.num_hit_pages > (len(token_ids) - 1) // b:
            raise BlockManagerError(f"hit: {hit.num_hit_pages} PAGEs for hit_tokens={hit.hit_tokens}")
        for i, page in enumerate(hit.pages):
            if self.pool.cached_page(hit.prompt_hashes[i]) != page:
                raise BlockManagerError(
                    f"hit: PAGE {page} was evicted since lookup() (look up and allocate in the same step)"
                )
        for h in hit.prompt_hashes[len(hit.pages) : hit.num_hit_pages]:
            if self.pool.cached_page(h) is not None:
                raise BlockManagerError("hit: a fetched PAGE's hash is cached here (use the cached PAGE)")
        if self.config.state_transfer is StateTransfer.REPLAY:
            if hit.restore_image is not None or hit.forward_start != self.replay_start(hit.hit_tokens):
                raise BlockManagerError("hit: not a replay hit (state_transfer is 'replay')")
        elif hit.fetched_image and hit.restore_image is not None:
            if not self.pool.is_private(hit.restore_image.pages):
                raise BlockManagerError("hit: a fetched image's PAGEs must come from allocate_pages")
        elif hit.restore_image is not None:
            if self.pool.image(hit.prompt_hashes[hit.forward_start // b - 1]) != hit.restore_image:
                raise BlockManagerError("hit: its restore_image was evicted since lookup()")

    def _boundary_hash(self, blocks: _RequestBlocks, boundary: int) -> bytes:
        if boundary <= 0 or boundary % self.config.block_size or boundary // self.config.block_size > blocks.num_published:
            raise BlockManagerError(
                f"boundary: {boundary} (allowed: a multiple of block_size={self.config.block_size} in "
                f"1..{blocks.num_published * self.config.block_size}, the published PAGEs)"
            )
        return blocks.hashes[boundary // self.config.block_size - 1]

    def _restore_entry(self, hit: PrefixHit) -> bytes | None:
        """The hash entry of the image ``hit`` restores (None: a reset slot)."""
        if hit.restore_image is None:
            return None
        return hit.prompt_hashes[hit.forward_start // self.config.block_size - 1]

    def _kept(self, hit: PrefixHit | None) -> Kept:
        """The reclaimable units a hit's allocation takes: its PAGEs, and the local
        image it restores (by hash entry)."""
        if hit is None:
            return Kept()
        entry = None if hit.fetched_image else self._restore_entry(hit)
        return Kept(frozenset(hit.pages), frozenset(() if entry is None else (entry,)))
