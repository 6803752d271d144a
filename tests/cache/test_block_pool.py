"""cache/block_pool.py: the pool's bookkeeping holds under any sequence of operations,
and reclaiming takes the least recently used unit first.

A random walk over take / reference / release / cache / private PAGEs / attach / hold /
let go / evict keeps its own model of who holds what and checks the pool's invariants
(given that model) after every operation; a second test pins the eviction order.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dsv41.cache.block_pool import BlockManagerError, BlockPool, Kept, StateImage


@pytest.mark.parametrize("seed", range(40))
def test_random_operations_keep_the_pool_consistent(seed: int) -> None:
    """Whatever the operations, reference counts equal the model's holders, free /
    idle / referenced partition the PAGEs, and nothing leaks: releasing every holder
    and evicting frees every PAGE."""
    rng = random.Random(seed)
    pool = BlockPool(rng.randrange(4, 24))
    held: list[int] = []  # PAGE references the walk holds, with repeats
    restores: Counter[bytes] = Counter()
    private: list[int] = []
    hashes = iter(bytes([seed, i]) for i in range(10_000))
    for _ in range(300):
        op = rng.choice(("take", "share", "release", "cache", "private", "attach", "hold", "let_go", "evict"))
        if op == "take" and pool.reclaimable() >= 1:
            held.extend(pool.take(rng.randrange(1, min(3, pool.reclaimable()) + 1)))
        elif op == "share":
            cached = [p for p in range(pool.num_pages) if pool.is_cached(p)]
            if cached:
                page = rng.choice(cached)
                pool.reference(page)
                held.append(page)
        elif op == "release" and held:
            # A restore's request holds its prefix until it lets the image go.
            hosts = {pool.cached_page(h) for h in +restores}
            releasable = [i for i, page in enumerate(held) if page not in hosts or pool.refcount(page) > 1]
            if releasable:
                pool.release(held.pop(rng.choice(releasable)))
        elif op == "cache":
            uncached = [page for page in held if not pool.is_cached(page)]
            if uncached:
                pool.cache(next(hashes), rng.choice(uncached))
        elif op == "private" and pool.reclaimable() >= 2:
            private.append(tuple(pool.allocate_private(2)))
        elif op == "attach" and private:
            entries = [h for h in _entries(pool) if pool.image(h) is None]
            if entries:
                pages = private.pop()
                pool.attach(rng.choice(entries), StateImage("layout", pages, 64, 0))
        elif op == "hold":
            idle = [h for h in _entries(pool) if pool.image(h) is not None and not restores[h]]
            referenced = [h for h in idle if pool.refcount(pool.cached_page(h))]
            if referenced:
                h = rng.choice(referenced)
                pool.hold(h)
                restores[h] += 1
        elif op == "let_go" and +restores:
            h = rng.choice(sorted(+restores))
            pool.let_go(h)
            restores[h] -= 1
        elif op == "evict":
            pool.evict(rng.randrange(1, 4))
        pool.check_invariants(held, restores)
    for h in list(+restores):
        for _ in range(restores[h]):
            pool.let_go(h)
    pool.release_all(held)
    for pages in private:
        pool.free_private(pages)
    pool.evict(pool.num_pages)
    pool.check_invariants([], Counter())
    assert pool.num_free == pool.num_pages and pool.num_images == 0


def _entries(pool: BlockPool) -> list[bytes]:
    return [h for h in pool._page_of_hash]  # the walk's view of the index, read only


def test_reclaiming_takes_the_least_recently_used_unit_first() -> None:
    """Released cached PAGEs go in release order; an image goes just before the PAGE
    it hangs off when that PAGE is released; kept units are skipped."""
    pool = BlockPool(6)
    a, b, c = pool.take(3)
    for h, page in ((b"a", a), (b"b", b), (b"c", c)):
        pool.cache(h, page)
    image_pages = tuple(pool.allocate_private(2))
    pool.attach(b"b", StateImage("layout", image_pages, 64, 0))
    pool.release(a)
    pool.release(b)
    pool.release(c)
    assert pool.reclaimable() == 6
    assert pool.reclaimable(Kept(pages=frozenset({a}))) == 5
    assert pool.take(1, Kept(pages=frozenset({a}))) == [5]  # the one free PAGE first
    assert pool.evictions == 0
    taken = pool.take(2, Kept(pages=frozenset({a})))
    # a is kept; b's image is older than b and c: it goes first and frees its 2 PAGEs.
    assert sorted(taken) == sorted(image_pages) and pool.image_evictions == 1 and pool.cached_page(b"b") == b
    assert pool.take(1, Kept(pages=frozenset({a}))) == [b] and pool.cached_page(b"b") is None
    with pytest.raises(BlockManagerError, match="reclaimable"):
        pool.take(3)
