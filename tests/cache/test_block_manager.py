"""BlockManager: chain hashes, prefix hits under copy and replay, allocation answers,
LRU eviction and the counters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cache.block_manager import (
    BlockManager,
    BlockManagerError,
    CacheConfig,
    PrefixHit,
    StateImage,
    StateTransfer,
    prefix_hashes,
)

REPO = Path(__file__).resolve().parents[2]
B = 4  # the block manager holds no bytes, so a small hash block keeps examples short


def _manager(
    state_transfer: StateTransfer = StateTransfer.COPY, num_pages: int = 16, num_slots: int = 4
) -> BlockManager:
    return BlockManager(
        CacheConfig(num_pages=num_pages, num_slots=num_slots, block_size=B, state_transfer=state_transfer)
    )


def _run(bm: BlockManager, request_id: str, tokens: list[int]) -> PrefixHit:
    """Admits a prompt, computes it whole and publishes its PAGEs."""
    hit = bm.lookup(tokens)
    assert bm.allocate_prompt(request_id, tokens, hit)
    bm.publish(request_id, tokens, len(tokens))
    return hit


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**40), min_size=3 * B, max_size=3 * B), position=st.integers(0, 3 * B - 1))
def test_chain_hash_covers_the_prefix_up_to_its_page(tokens: list[int], position: int) -> None:
    """Changing one token changes the hash of its PAGE and of every later PAGE, and of
    no earlier PAGE: a hash names the whole prefix up to the end of its PAGE."""
    changed = list(tokens)
    changed[position] += 1
    a, b = prefix_hashes(tokens, B), prefix_hashes(changed, B)
    page = position // B
    assert a[:page] == b[:page]
    assert all(x != y for x, y in zip(a[page:], b[page:]))
    assert prefix_hashes(tokens, B, known=a[:1]) == a


def test_chain_hash_is_the_same_in_another_process() -> None:
    """The prefix key is a stable digest, not Python's hash(): another interpreter with
    another hash seed computes the same keys."""
    tokens = list(range(100, 100 + 3 * B))
    code = f"from cache.block_manager import prefix_hashes; print([h.hex() for h in prefix_hashes({tokens}, {B})])"
    env = {**os.environ, "PYTHONHASHSEED": "4321"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str([h.hex() for h in prefix_hashes(tokens, B)])


@settings(max_examples=50, deadline=None)
@given(cached_len=st.integers(1, 6 * B), prompt_len=st.integers(1, 6 * B))
def test_hit_never_covers_the_prompts_last_page(cached_len: int, prompt_len: int) -> None:
    """With every PAGE of a prompt's prefix cached, the hit is the whole PAGEs of the
    common prefix but at most floor((len - 1) / B) of them, so at least one prompt token
    is computed."""
    bm = _manager(num_pages=32)
    base = list(range(10 * B))
    _run(bm, "cached", base[:cached_len])
    hit = bm.lookup(base[:prompt_len])
    assert hit.hit_tokens == min(cached_len // B, (prompt_len - 1) // B) * B
    assert hit.hit_tokens < prompt_len


@settings(max_examples=30, deadline=None)
@given(hit_pages=st.integers(0, 5))
def test_replay_resumes_one_hash_block_below_the_hit(hit_pages: int) -> None:
    """Under replay a hit of h PAGEs starts its forward at (h - 1) PAGEs (0 at least),
    with no image: the slot is reset and the windows rebuilt from there; admitting it
    counts the cached tokens it computes again (``replayed_tokens``)."""
    bm = _manager(StateTransfer.REPLAY, num_pages=32)
    tokens = list(range(6 * B + 1))
    if hit_pages:
        _run(bm, "cached", tokens[: hit_pages * B])
    hit = bm.lookup(tokens)
    assert hit.hit_tokens == hit_pages * B
    assert hit.forward_start == max(0, (hit_pages - 1) * B) == bm.replay_start(hit.hit_tokens)
    assert hit.restore_image is None
    before = bm.stats().replayed_tokens
    assert bm.allocate_prompt("r", tokens, hit)
    assert bm.stats().replayed_tokens - before == hit.hit_tokens - hit.forward_start == min(hit_pages, 1) * B


def test_replay_start_cuts_to_the_hash_block_grid() -> None:
    """replay_start rounds down to the PAGE grid, then steps one whole PAGE back."""
    bm = _manager(StateTransfer.REPLAY)
    assert [bm.replay_start(n) for n in (0, 3, 4, 7, 8, 9, 13)] == [0, 0, 0, 0, 4, 4, 8]


def _private_image(bm: BlockManager, num_tokens: int) -> StateImage:
    pages = bm.allocate_pages(2)
    assert pages is not None
    return StateImage(layout_id="v41-test", pages=tuple(pages), image_bytes=100, num_tokens=num_tokens)


def test_copy_restores_the_newest_image_at_or_below_the_hit() -> None:
    """Under copy the forward starts at the largest PAGE boundary <= hit_tokens whose
    PAGE carries an image, with that image; with none it starts at 0 in a reset slot."""
    bm = _manager(num_pages=24)
    tokens = list(range(5 * B + 1))
    _run(bm, "a", tokens)
    hit = bm.lookup(tokens)
    assert (hit.hit_tokens, hit.forward_start, hit.restore_image) == (5 * B, 0, None)
    first, third = _private_image(bm, B), _private_image(bm, 3 * B)
    assert bm.attach_image("a", B, first) and bm.attach_image("a", 3 * B, third)
    hit = bm.lookup(tokens)
    assert (hit.hit_tokens, hit.forward_start, hit.restore_image) == (5 * B, 3 * B, third)
    hit = bm.lookup(tokens[: 3 * B])  # a 3-PAGE prompt hits 2 PAGEs: the image at 1 PAGE
    assert (hit.hit_tokens, hit.forward_start, hit.restore_image) == (2 * B, B, first)
    assert not bm.wants_image("a", 3 * B)  # one image per hash entry
    assert not bm.attach_image("a", 3 * B, _private_image(bm, 3 * B))


def test_replay_keeps_no_images() -> None:
    """Under replay no checkpoint is wanted and attaching one is refused."""
    bm = _manager(StateTransfer.REPLAY)
    tokens = list(range(2 * B))
    _run(bm, "a", tokens)
    assert not bm.wants_image("a", B)
    with pytest.raises(BlockManagerError, match="replay"):
        bm.attach_image("a", B, _private_image(bm, B))


def test_allocation_shares_hit_pages_and_answers_false_when_full() -> None:
    """A hit's PAGEs are shared (refcount 2), the rest fresh; when the pools cannot
    hold a prompt or a growth, the answer is False and nothing changes."""
    bm = _manager(num_pages=6, num_slots=3)
    tokens = list(range(3 * B))
    _run(bm, "a", tokens)
    hit = bm.lookup(tokens + [7])
    assert hit.pages == bm.page_table("a")
    before = bm.stats()
    assert not bm.allocate_prompt("b", tokens + [7] * (3 * B + 1), bm.lookup(tokens + [7] * (3 * B + 1)))
    assert bm.stats().pages_free == before.pages_free and bm.stats().requests == 1
    assert bm.allocate_prompt("b", tokens + [7], hit)
    assert [bm.refcount(p) for p in bm.page_table("b")] == [2, 2, 2, 1]
    assert not bm.grow("b", 8 * B)
    assert len(bm.page_table("b")) == 4
    assert bm.grow("b", 6 * B)
    assert bm.stats().pages_free == 0


def test_allocation_reclaims_least_recently_used_first_images_included() -> None:
    """Only when the free list is empty, allocation reclaims least recently used
    first: a freed request's chain from its tail, the image at a boundary just
    before the PAGE it hangs off (the entry stays: the hit stays, without the image),
    while a chain used since waits."""
    bm = _manager(num_pages=8, num_slots=2)
    tokens = list(range(3 * B + 1))
    _run(bm, "a", tokens)
    assert bm.attach_image("a", 2 * B, _private_image(bm, 2 * B))
    a_pages = bm.page_table("a")
    other = list(range(100, 100 + B + 1))
    _run(bm, "b", other)
    bm.free("a")
    bm.free("b")  # b's chain is the most recently used
    s = bm.stats()
    assert (s.pages_cached, s.image_pages_idle, s.pages_free) == (4, 2, 2)  # + the unpublished last PAGEs
    assert bm.allocate_pages(3) is not None  # the free PAGEs, then a's third PAGE
    assert not bm.is_cached(a_pages[2]) and bm.stats().evictions == 1
    hit = bm.lookup(tokens)
    assert hit.hit_tokens == 2 * B and hit.restore_image is not None
    assert bm.allocate_pages(1) is not None  # then the image at 2B: two PAGEs, one left free
    s = bm.stats()
    assert (s.images, s.image_evictions, s.evictions, s.pages_free) == (0, 1, 1, 1)
    hit = bm.lookup(tokens)
    assert (hit.hit_tokens, hit.restore_image) == (2 * B, None)
    assert bm.allocate_pages(2) is not None  # then a's second PAGE
    assert not bm.is_cached(a_pages[1]) and bm.is_cached(a_pages[0])
    assert bm.lookup(tokens).hit_tokens == B and bm.lookup(other).hit_tokens == B
    bm.check_invariants()


def test_an_evicted_page_takes_its_image() -> None:
    """An image attached to a hash entry whose PAGE was released before it is
    evicted with that PAGE: without its entry no lookup could reach it."""
    bm = _manager(num_pages=8, num_slots=2)
    tokens = list(range(2 * B + 1))
    _run(bm, "a", tokens)
    host = bm.page_table("a")[1]
    bm.free("a")
    # "b" computes the same PAGEs cold (as a prompt-logprobs request does): the
    # entries stay a's, and b's checkpoint at 2B attaches to a's idle PAGE.
    assert bm.allocate_prompt("b", tokens, bm.miss(tokens))
    bm.publish("b", tokens, len(tokens))
    assert bm.attach_image("b", 2 * B, _private_image(bm, 2 * B))
    assert bm.refcount(host) == 0 and bm.lookup(tokens).restore_image is not None
    assert bm.evict(1) == 3  # the host, released first (tail first), and the image's two PAGEs
    s = bm.stats()
    assert not bm.is_cached(host) and (s.images, s.image_pages_idle, s.image_evictions, s.evictions) == (0, 0, 0, 1)
    assert bm.lookup(tokens).hit_tokens == B
    bm.check_invariants()


def test_an_image_held_for_a_restore_is_never_reclaimed() -> None:
    """Between the admission that restores an image and ``restored`` (the first
    forward), no allocation or eviction reclaims the image or the hit's PAGEs; after
    it the image is idle again, and under pressure is reclaimed before the request
    waits."""
    bm = _manager(num_pages=8, num_slots=3)
    tokens = list(range(2 * B + 1))
    _run(bm, "a", tokens)
    image = _private_image(bm, 2 * B)
    assert bm.attach_image("a", 2 * B, image)
    bm.free("a")
    hit = bm.lookup(tokens)
    assert hit.restore_image == image
    assert bm.allocate_prompt("b", tokens, hit)
    assert bm.evict(100) == 0  # b holds the PAGEs, the image is held for its restore
    assert bm.allocate_pages(3) is not None and bm.allocate_pages(1) is None
    assert bm.lookup(tokens).restore_image == image
    bm.check_invariants()
    bm.restored("b")
    assert bm.stats().image_pages_idle == 2
    assert bm.allocate_pages(2) is not None  # the image, now idle, is what remains
    assert bm.stats().images == 0
    bm.check_invariants()


def test_an_image_that_does_not_fit_beside_the_prompt_is_let_go() -> None:
    """When a hit's image and the prompt's PAGEs do not both fit, ``allocate_prompt``
    refuses the hit with the image; the same hit ``without_image`` resumes from 0 in
    a reset slot and fits (an image is never what keeps a request out)."""
    bm = _manager(num_pages=5, num_slots=2)
    tokens = list(range(2 * B + 1))
    _run(bm, "a", tokens)
    assert bm.attach_image("a", 2 * B, _private_image(bm, 2 * B))
    bm.free("a")
    longer = tokens[: 2 * B] + list(range(100, 100 + 3 * B))  # 5 PAGEs, 2 of them hit
    hit = bm.lookup(longer)
    assert hit.restore_image is not None and not bm.has_room(len(longer), hit)
    assert not bm.allocate_prompt("b", longer, hit)
    plain = bm.without_image(hit)
    assert (plain.hit_tokens, plain.forward_start, plain.restore_image) == (2 * B, 0, None)
    assert bm.allocate_prompt("b", longer, plain)
    assert bm.stats().images == 0  # reclaimed for b's fresh PAGEs
    bm.check_invariants()
    with pytest.raises(BlockManagerError, match="replay"):
        _manager(StateTransfer.REPLAY).without_image(hit)


def test_allocate_pages_keeps_the_hit_it_is_asked_to_keep() -> None:
    """``allocate_pages(keep=hit)`` reclaims neither the hit's PAGEs nor its image,
    so the hit can still be allocated; with nothing else to reclaim it answers None."""
    bm = _manager(num_pages=6, num_slots=2)
    tokens = list(range(2 * B + 1))
    _run(bm, "a", tokens)
    assert bm.attach_image("a", 2 * B, _private_image(bm, 2 * B))
    bm.free("a")
    hit = bm.lookup(tokens)
    assert bm.allocate_pages(3, keep=hit) is None  # only the 2 free PAGEs: the rest is the hit
    pages = bm.allocate_pages(2, keep=hit)
    assert pages is not None
    assert bm.allocate_pages(1, keep=hit) is None
    bm.free_pages(pages)
    assert bm.allocate_prompt("b", tokens, hit)
    bm.check_invariants()


def test_a_stale_hit_is_refused() -> None:
    """A hit whose PAGEs were evicted since lookup() is refused, not silently used."""
    bm = _manager(num_pages=4, num_slots=2)
    tokens = list(range(2 * B + 1))
    _run(bm, "a", tokens)
    bm.free("a")
    hit = bm.lookup(tokens)
    assert bm.evict(10) == 2
    with pytest.raises(BlockManagerError, match="evicted since lookup"):
        bm.allocate_prompt("b", tokens, hit)


def test_counters_count_lookups_hits_and_pages() -> None:
    """stats() counts lookups, hits, looked-up and hit tokens, and partitions the PAGEs
    into used, cached and free."""
    bm = _manager(num_pages=10)
    tokens = list(range(2 * B + 1))
    _run(bm, "a", tokens)
    _run(bm, "b", tokens)
    s = bm.stats()
    assert (s.lookups, s.hits, s.lookup_tokens, s.hit_tokens) == (2, 1, 2 * len(tokens), 2 * B)
    assert s.hit_rate == 2 * B / (2 * len(tokens))
    assert (s.pages_used, s.pages_cached, s.pages_free, s.requests, s.slots_used) == (4, 0, 6, 2, 2)
    bm.free("a")
    bm.free("b")
    s = bm.stats()
    assert (s.pages_used, s.pages_cached, s.pages_free, s.slots_used) == (0, 2, 8, 0)


@settings(max_examples=60, deadline=None)
@given(cached=st.integers(0, 4), asked=st.integers(1, 6 * B))
def test_cached_prefix_tokens_is_a_lookup_that_counts_nothing(cached: int, asked: int) -> None:
    """Placement's question equals lookup()'s hit_tokens for every prompt, and leaves
    the counters as they were (only an admission's lookup counts)."""
    bm = _manager(num_pages=12)
    tokens = list(range(6 * B))
    if cached:
        _run(bm, "a", tokens[: cached * B + 1])
        bm.free("a")
    before = bm.stats()
    got = bm.cached_prefix_tokens(tokens[:asked])
    assert bm.stats() == before
    assert got == bm.lookup(tokens[:asked]).hit_tokens


@settings(max_examples=30, deadline=None)
@given(asked=st.integers(1, 6 * B), caching=st.booleans())
def test_miss_is_what_a_lookup_finds_with_nothing_cached(asked: int, caching: bool) -> None:
    """``miss`` equals ``lookup`` on a manager that caches nothing yet, with prefix
    caching on or off, and counts no lookup."""
    bm = BlockManager(
        CacheConfig(
            num_pages=12, num_slots=2, block_size=B, state_transfer=StateTransfer.REPLAY, enable_prefix_caching=caching
        )
    )
    tokens = list(range(asked))
    before = bm.stats()
    got = bm.miss(tokens)
    assert bm.stats() == before
    assert got == bm.lookup(tokens)


def test_disabled_prefix_caching_never_hits() -> None:
    """With prefix caching off nothing is published or hit."""
    bm = BlockManager(
        CacheConfig(
            num_pages=8, num_slots=2, block_size=B, state_transfer=StateTransfer.REPLAY, enable_prefix_caching=False
        )
    )
    tokens = list(range(2 * B + 1))
    _run(bm, "a", tokens)
    assert bm.lookup(tokens).hit_tokens == 0 and not bm.is_cached(bm.page_table("a")[0])


def test_contract_breaches_are_refused() -> None:
    """Double admission, unknown requests, double frees, foreign PAGEs and bad options
    are refused with errors that say which."""
    bm = _manager()
    _run(bm, "a", list(range(B + 1)))
    with pytest.raises(BlockManagerError, match="already holds"):
        bm.allocate_prompt("a", [1], bm.lookup([1]))
    with pytest.raises(BlockManagerError, match="holds no PAGEs"):
        bm.free("zz")
    with pytest.raises(BlockManagerError, match="not handed out by allocate_pages"):
        bm.free_pages([bm.page_table("a")[0]])
    pages = bm.allocate_pages(1)
    assert pages is not None
    bm.free_pages(pages)
    with pytest.raises(BlockManagerError, match="not handed out"):
        bm.free_pages(pages)
    with pytest.raises(BlockManagerError, match="empty prompt"):
        bm.lookup([])
    with pytest.raises(BlockManagerError, match=r"state_transfer: 'swap' \(allowed: 'copy', 'replay'\)"):
        StateTransfer("swap")
    with pytest.raises(BlockManagerError, match="boundary: 3"):
        bm.wants_image("a", 3)


@pytest.mark.parametrize("state_transfer", list(StateTransfer))
def test_extended_hit_registers_fetched_pages_and_a_failed_allocation_changes_nothing(
    state_transfer: StateTransfer,
) -> None:
    """An offload-extended hit covers the local PAGEs and the fetched ones; its
    allocation puts the fetched PAGEs (and, under copy, the fetched image) in the
    prefix index, so the next lookup hits them locally; when the pools cannot hold
    the prompt the allocation answers False with the counters and index untouched."""
    bm = _manager(state_transfer, num_pages=16)
    tokens = list(range(5 * B + 1))
    _run(bm, "a", tokens[: 2 * B])
    bm.free("a")
    hit = bm.lookup(tokens)
    assert len(hit.pages) == 2
    image = None
    if state_transfer is StateTransfer.COPY:
        pages = bm.allocate_pages(2)
        assert pages is not None
        image = StateImage(layout_id="L", pages=tuple(pages), image_bytes=100, num_tokens=4 * B)
    extended = bm.extend_hit(hit, 2, image)
    assert extended.hit_tokens == 4 * B and extended.num_hit_pages == 4
    expected_start = bm.replay_start(4 * B) if state_transfer is StateTransfer.REPLAY else 4 * B
    assert extended.forward_start == expected_start

    before = bm.stats()
    hog = bm.allocate_pages(bm.stats().pages_free)
    assert hog is not None
    assert not bm.allocate_prompt("b", tokens, extended)
    assert bm.stats().fetched_pages == before.fetched_pages == 0
    bm.free_pages(hog)

    assert bm.allocate_prompt("b", tokens, extended)
    stats = bm.stats()
    assert stats.fetched_pages == 2 and stats.fetched_images == (1 if image else 0)
    bm.free("b")
    again = bm.lookup(tokens)
    assert again.num_hit_pages == 4 and again.fetched_pages == 0 and len(again.pages) == 4
    if image is not None:
        assert again.restore_image == image


def test_extended_hit_refusals() -> None:
    """A fetched PAGE whose hash is cached locally, an image outside the fetched
    PAGEs, and an image under replay are refused."""
    bm = _manager(StateTransfer.COPY)
    tokens = list(range(4 * B + 1))
    hit = bm.lookup(tokens)
    pages = bm.allocate_pages(2)
    assert pages is not None
    with pytest.raises(BlockManagerError, match="image"):
        bm.extend_hit(hit, 2, StateImage(layout_id="L", pages=tuple(pages), image_bytes=1, num_tokens=3 * B))
    with pytest.raises(BlockManagerError, match="replay"):
        _manager(StateTransfer.REPLAY).extend_hit(
            hit, 1, StateImage(layout_id="L", pages=tuple(pages), image_bytes=1, num_tokens=B)
        )
    extended = bm.extend_hit(hit, 2, None)
    _run(bm, "x", tokens[:B])
    with pytest.raises(BlockManagerError, match="cached here"):
        bm.allocate_prompt("y", tokens, extended)


@settings(max_examples=40, deadline=None)
@given(held=st.integers(0, 16), slots_taken=st.integers(0, 4), length=st.integers(1, 12 * B))
def test_has_room_answers_what_allocate_prompt_will(held: int, slots_taken: int, length: int) -> None:
    """For any fill of the pools (PAGEs handed out, slots taken, a cached prefix),
    ``has_room`` is exactly ``allocate_prompt``'s answer, so a caller can ask before
    doing work for an admission that cannot happen."""
    bm = _manager(StateTransfer.REPLAY, num_pages=16, num_slots=4)
    prefix = list(range(2 * B))
    _run(bm, "cached", prefix)
    bm.free("cached")
    if held:
        bm.allocate_pages(min(held, bm.stats().pages_free + bm.stats().pages_cached))
    for i in range(slots_taken):
        hit = bm.lookup([1000 + i])
        if not bm.allocate_prompt(f"s{i}", [1000 + i], hit):
            break
    tokens = prefix + list(range(5000, 5000 + length))
    hit = bm.lookup(tokens)
    assert bm.has_room(len(tokens), hit) == bm.allocate_prompt("new", tokens, hit)


def test_shrink_hands_back_lookahead_pages_and_never_a_published_one() -> None:
    """A speculative verify grows PAGEs for rows it may reject; shrinking to the kept
    tokens frees the trailing PAGEs past them, keeps the table's head, never drops a
    published PAGE (its hash entry would lose its owner) and leaves the invariants."""
    bm = _manager(StateTransfer.REPLAY)
    tokens = list(range(2 * B + 1))
    _run(bm, "r", tokens)
    assert bm.grow("r", 4 * B)
    table = bm.page_table("r")
    used = bm.stats().pages_used
    bm.shrink("r", 2 * B + 2)
    assert bm.page_table("r") == table[:3]
    assert bm.stats().pages_used == used - 1
    bm.shrink("r", 1)
    assert bm.page_table("r") == table[:2]  # the two published PAGEs stay
    bm.check_invariants()
    bm.free("r")
    bm.check_invariants()
