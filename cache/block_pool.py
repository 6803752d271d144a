"""The PAGEs of one pool: reference counts, the free list, the prefix index's entries,
the checkpoint images attached to them, and reclaiming under pressure.

Owns every PAGE's state (free, referenced, or cached and unreferenced), the one-to-one
map between chain hashes and the PAGEs that hold those rows, the STATE images attached
to hash entries (and which of them a restore holds), the PAGEs handed out to a caller
outside any request (``allocate_private``), and one least-recently-used order over
everything allocation may reclaim: unreferenced cached PAGEs (evicting one drops its
hash entry and the image attached there) and attached images no restore holds (the
entry stays). It knows nothing of requests, prompts or slots: cache/block_manager.py
decides what to reference, cache and attach, as vLLM's KVCacheManager drives its
BlockPool.

Must not import: torch, anything of this project, ray.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable, Sequence


class BlockManagerError(ValueError):
    """A call that breaks the PAGE bookkeeping's contract (cache/block_manager.py's or
    its pool's); the message says which."""


@dataclass(frozen=True)
class StateImage:
    """A STATE checkpoint (rings + cursor of a slot whose committed position was
    ``num_tokens``) stored in ``pages`` under the geometry named ``layout_id``."""

    layout_id: str
    pages: tuple[int, ...]
    image_bytes: int
    num_tokens: int

    def __post_init__(self) -> None:
        if not self.layout_id:
            raise BlockManagerError("layout_id: empty (allowed: a geometry's layout_id)")
        if not self.pages or len(set(self.pages)) != len(self.pages) or min(self.pages) < 0:
            raise BlockManagerError(f"pages: {self.pages} (allowed: distinct PAGE ids, at least one)")
        if self.image_bytes <= 0:
            raise BlockManagerError(f"image_bytes: {self.image_bytes} (allowed: > 0)")
        if self.num_tokens < 0:
            raise BlockManagerError(f"num_tokens: {self.num_tokens} (allowed: >= 0)")


@dataclass(frozen=True)
class Kept:
    """Reclaimable units an allocation must not reclaim: a hit's own PAGEs and the
    image it restores (by hash entry), taken in the same step."""

    pages: frozenset[int] = frozenset()
    images: frozenset[bytes] = frozenset()


NOTHING_KEPT = Kept()


class BlockPool:
    """``num_pages`` PAGEs. A PAGE is free, referenced (by requests, attached images or
    the caller's private PAGEs), or cached and unreferenced (idle: reclaimable)."""

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages <= 0:
            raise BlockManagerError(f"num_pages: {num_pages!r} (allowed: a positive integer)")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free_pages: deque[int] = deque(range(num_pages))
        # Both reclaimable kinds, each oldest first, stamped from one clock so the least
        # recently used of either goes first: an image was last used when attached or
        # restored, or when its entry's PAGE was last released.
        self._clock = itertools.count()
        self._idle_pages: OrderedDict[int, int] = OrderedDict()
        self._idle_images: OrderedDict[bytes, int] = OrderedDict()
        self._idle_image_pages = 0
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}
        self._images: dict[bytes, StateImage] = {}
        self._restores: Counter[bytes] = Counter()  # image -> restores holding it
        self._private_pages: set[int] = set()
        self.evictions = 0  # cached PAGEs evicted
        self.image_evictions = 0  # images dropped on their own (their entries stay)

    # -- PAGEs ----------------------------------------------------------------------

    def take(self, count: int, kept: Kept = NOTHING_KEPT) -> list[int]:
        """``count`` fresh PAGEs, each referenced once, reclaiming least recently used
        units not ``kept`` as needed; the caller checks ``reclaimable`` first."""
        if count > self.reclaimable(kept):
            raise BlockManagerError(f"count: {count} PAGEs, {self.reclaimable(kept)} reclaimable (check first)")
        while len(self._free_pages) < count:
            self._evict_oldest(kept)
        pages = [self._free_pages.popleft() for _ in range(count)]
        for page in pages:
            self._refcount[page] = 1
        return pages

    def reference(self, page: int) -> None:
        """One more holder of ``page`` (a cached PAGE a hit shares)."""
        if self._refcount[page] == 0:
            if page not in self._idle_pages:
                raise BlockManagerError(f"page: PAGE {page} is free (allowed: a referenced or cached PAGE)")
            del self._idle_pages[page]
        self._refcount[page] += 1

    def release(self, page: int) -> None:
        """One holder fewer; an unreferenced PAGE becomes idle if cached, else free."""
        if self._refcount[page] <= 0:
            raise BlockManagerError(f"page: PAGE {page} released more often than it was taken")
        self._refcount[page] -= 1
        if self._refcount[page]:
            return
        h = self._hash_of_page.get(page)
        if h is None:
            self._free_pages.append(page)
            return
        if h in self._idle_images:
            # The image is as recent as the entry it hangs off (and goes just before
            # it): a chain is reclaimed from its tail, each image with its PAGE.
            del self._idle_images[h]
            self._idle_images[h] = next(self._clock)
        self._idle_pages[page] = next(self._clock)

    def release_all(self, pages: Iterable[int]) -> None:
        for page in pages:
            self.release(page)

    def reclaimable(self, kept: Kept = NOTHING_KEPT) -> int:
        """PAGEs free or reclaimable, less those ``kept`` holds."""
        taken = sum(1 for page in kept.pages if page in self._idle_pages)
        taken += sum(len(self._images[h].pages) for h in kept.images if h in self._idle_images)
        return len(self._free_pages) + len(self._idle_pages) + self._idle_image_pages - taken

    def allocate_private(self, count: int, kept: Kept = NOTHING_KEPT) -> list[int]:
        """``count`` PAGEs owned by the caller (an image being taken or fetched) until
        they are attached (``attach``) or handed back (``free_private``)."""
        pages = self.take(count, kept)
        self._private_pages.update(pages)
        return pages

    def free_private(self, pages: Sequence[int]) -> None:
        if len(set(pages)) != len(pages):
            raise BlockManagerError(f"pages: {list(pages)} repeats a PAGE")
        for page in pages:
            if page not in self._private_pages:
                raise BlockManagerError(
                    f"pages: PAGE {page} was not handed out by allocate_pages (or an attached image owns it)"
                )
        for page in pages:
            self._private_pages.discard(page)
            self.release(page)

    def is_private(self, pages: Iterable[int]) -> bool:
        """Whether every PAGE is the caller's, handed out and not attached."""
        return all(page in self._private_pages for page in pages)

    def evict(self, num_pages: int) -> int:
        """Reclaims at least ``num_pages`` PAGEs where it can, least recently used
        first; returns how many it freed."""
        before = len(self._free_pages)
        while len(self._free_pages) - before < num_pages and (self._idle_pages or self._idle_images):
            self._evict_oldest(NOTHING_KEPT)
        return len(self._free_pages) - before

    # -- the prefix index's entries ----------------------------------------------------

    def cached_page(self, chain_hash: bytes) -> int | None:
        return self._page_of_hash.get(chain_hash)

    def cache(self, chain_hash: bytes, page: int) -> bool:
        """Enters ``page`` under ``chain_hash``; False (nothing changed) when another
        PAGE already holds that hash."""
        if chain_hash in self._page_of_hash:
            return False
        if page in self._hash_of_page or not self._refcount[page]:
            raise BlockManagerError(f"page: PAGE {page} is cached already or unreferenced (allowed: a held, uncached PAGE)")
        self._page_of_hash[chain_hash] = page
        self._hash_of_page[page] = chain_hash
        return True

    def is_cached(self, page: int) -> bool:
        return page in self._hash_of_page

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    # -- images ---------------------------------------------------------------------

    def image(self, chain_hash: bytes) -> StateImage | None:
        return self._images.get(chain_hash)

    def attach(self, chain_hash: bytes, image: StateImage, *, held: bool = False) -> None:
        """Attaches ``image`` (its PAGEs from ``allocate_private``) to a cached entry;
        the pool owns its PAGEs from now on. ``held``: a restore holds it already."""
        if chain_hash not in self._page_of_hash or chain_hash in self._images:
            raise BlockManagerError("chain_hash: not a cached entry, or one with an image already")
        if not self.is_private(image.pages):
            raise BlockManagerError("image: its PAGEs must come from allocate_pages and not be attached already")
        self._private_pages.difference_update(image.pages)
        self._images[chain_hash] = image
        if held:
            self._restores[chain_hash] += 1
        else:
            self._mark_image_idle(chain_hash)

    def hold(self, chain_hash: bytes) -> None:
        """A restore holds the image: it is not reclaimed until ``let_go``."""
        if chain_hash not in self._images:
            raise BlockManagerError("chain_hash: no image attached there")
        if chain_hash in self._idle_images:
            del self._idle_images[chain_hash]
            self._idle_image_pages -= len(self._images[chain_hash].pages)
        self._restores[chain_hash] += 1

    def let_go(self, chain_hash: bytes) -> None:
        self._restores[chain_hash] -= 1
        if not self._restores[chain_hash]:
            del self._restores[chain_hash]
            self._mark_image_idle(chain_hash)

    # -- introspection ----------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free_pages)

    @property
    def num_idle(self) -> int:
        return len(self._idle_pages)

    @property
    def num_images(self) -> int:
        return len(self._images)

    @property
    def image_pages(self) -> int:
        return sum(len(image.pages) for image in self._images.values())

    @property
    def idle_image_pages(self) -> int:
        return self._idle_image_pages

    def check_invariants(self, request_pages: Iterable[int], restores: Counter[bytes]) -> None:
        """Raises BlockManagerError naming the first broken invariant, given every PAGE the
        requests hold (with repeats) and the images their restores hold: every PAGE's
        reference count equals its holders (requests, attached images, private PAGEs);
        free, idle and referenced PAGEs partition the pool; the prefix index is
        one-to-one; images hang off cached entries, hold PAGEs no one else does, and are
        idle exactly when no restore holds them (then their host PAGE is referenced)."""
        holders = Counter(request_pages)
        holders.update(page for image in self._images.values() for page in image.pages)
        holders.update(self._private_pages)
        for page in range(self.num_pages):
            if self._refcount[page] != holders[page]:
                raise BlockManagerError(f"invariant: PAGE {page} has refcount {self._refcount[page]}, {holders[page]} holders")
        free, idle = set(self._free_pages), set(self._idle_pages)
        referenced = {page for page in range(self.num_pages) if self._refcount[page]}
        if len(free) != len(self._free_pages) or free & idle or (free | idle) & referenced:
            raise BlockManagerError("invariant: a PAGE is in more than one of free / idle / referenced")
        if len(free) + len(idle) + len(referenced) != self.num_pages:
            raise BlockManagerError("invariant: a PAGE is neither free, idle nor referenced (leaked)")
        if free & set(self._hash_of_page) or any(page not in self._hash_of_page for page in idle):
            raise BlockManagerError("invariant: a free PAGE is cached, or an idle one is not")
        if {page: h for h, page in self._page_of_hash.items()} != self._hash_of_page:
            raise BlockManagerError("invariant: the prefix index and its inverse disagree")
        image_pages = [page for image in self._images.values() for page in image.pages]
        if len(set(image_pages)) != len(image_pages) or set(image_pages) & set(self._hash_of_page):
            raise BlockManagerError("invariant: an image PAGE is shared or cached")
        if +restores != +self._restores:
            raise BlockManagerError(f"invariant: image holds {dict(self._restores)}, requests restoring {dict(restores)}")
        for h in self._images:
            if h not in self._page_of_hash:
                raise BlockManagerError("invariant: an image hangs off no cached PAGE")
            if (h in self._idle_images) == (h in self._restores):
                raise BlockManagerError("invariant: an image is idle while held for a restore, or neither")
            if h in self._restores and not self._refcount[self._page_of_hash[h]]:
                raise BlockManagerError("invariant: an image held for a restore sits on an unreferenced PAGE")
        if set(self._idle_images) - set(self._images):
            raise BlockManagerError("invariant: an idle image is not attached")
        if self._idle_image_pages != sum(len(self._images[h].pages) for h in self._idle_images):
            raise BlockManagerError("invariant: the idle image PAGE count is off")

    # -- internals --------------------------------------------------------------------

    def _mark_image_idle(self, h: bytes) -> None:
        self._idle_images[h] = next(self._clock)
        self._idle_image_pages += len(self._images[h].pages)

    def _evict_oldest(self, kept: Kept) -> None:
        """Evicts the least recently used cached PAGE or idle image not kept."""
        page = next((p for p in self._idle_pages if p not in kept.pages), None)
        image = next((h for h in self._idle_images if h not in kept.images), None)
        if image is not None and (page is None or self._idle_images[image] < self._idle_pages[page]):
            self._drop_image(image)
            self.image_evictions += 1
            return
        if page is None:
            raise BlockManagerError(f"internal: {len(self._free_pages)} PAGEs free and nothing left to reclaim")
        del self._idle_pages[page]
        h = self._hash_of_page.pop(page)
        del self._page_of_hash[h]
        if h in self._images:
            # Idle (a held image's PAGE is referenced): with its entry gone no lookup reaches it.
            self._drop_image(h)
        self._free_pages.append(page)
        self.evictions += 1

    def _drop_image(self, h: bytes) -> None:
        del self._idle_images[h]
        image = self._images.pop(h)
        self._idle_image_pages -= len(image.pages)
        self.release_all(image.pages)
