"""deploy/heap.py on this machine's glibc: its totals read two ways agree, a trim gives
freed pages back, and IdleHeapTrim trims once per idle spell, never while work is in
flight, returning what garbage cycles held as well as what was freed."""

from __future__ import annotations

import ctypes
import gc
import os
import random
import threading
import time

import pytest

from dsv41.deploy.heap import IdleHeapTrim, glibc, malloc_info_xml, malloc_stats, parse_malloc_info, trim_heap
from dsv41.deploy.procfs import rss_bytes

# Small, so a test waits for a few idle spells in well under a second each.
IDLE_S = 0.2
# Chunks of 4 KiB: below glibc's mmap threshold, so they live in the arena.
CHUNK = 4096
CHUNKS = 20_000


def _own_rss() -> int:
    rss = rss_bytes(os.getpid())
    assert rss is not None
    return rss


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _fragmented_free(libc: ctypes.CDLL) -> list[int]:
    """80 MiB malloc'd and written, then all but every 64th chunk freed: the live ones
    pin the heap's top, so glibc keeps the freed pages resident. Returns the pinned."""
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(CHUNK) for _ in range(CHUNKS)]
    for chunk in chunks:
        ctypes.memset(chunk, 1, CHUNK)
    kept = chunks[::64]
    for index, chunk in enumerate(chunks):
        if index % 64:
            libc.free(chunk)
    return kept


def _free_all(libc: ctypes.CDLL, chunks: list[int]) -> None:
    for chunk in chunks:
        libc.free(chunk)


def test_mallinfo2_and_malloc_info_agree() -> None:
    """The in-process totals (mallinfo2) and the XML a debugger would read from outside
    (malloc_info) name the same arena and mmapped bytes, and free bytes within what
    reading the XML itself allocates."""
    libc = glibc()
    kept = _fragmented_free(libc)
    try:
        inside = malloc_stats(libc)
        outside = parse_malloc_info(malloc_info_xml(libc))
    finally:
        _free_all(libc, kept)
    assert inside.arena == outside.arena and inside.mmapped == outside.mmapped
    assert inside.arenas == outside.arenas >= 1
    assert abs(inside.free - outside.free) < 256 << 10
    assert inside.free > (CHUNKS - len(kept)) * CHUNK * 0.9


def test_trim_returns_freed_pages_that_free_kept() -> None:
    """Freed chunks below a live one stay resident after free (glibc returns only the
    heap's top); malloc_trim(0) gives most of their pages back."""
    libc = glibc()
    trim_heap(libc)
    kept = _fragmented_free(libc)
    try:
        freed = (CHUNKS - len(kept)) * CHUNK
        before = _own_rss()
        assert trim_heap(libc)
        assert before - _own_rss() > freed * 0.6
    finally:
        _free_all(libc, kept)


def test_idle_trim_waits_for_idle_and_trims_once_per_spell() -> None:
    """No trim before anything was served, none while work is in flight (however long),
    one within idle_s (plus the scheduler's slack) after the last work ends, none again
    until more work has come and gone; concurrent work from several threads counts as
    one spell."""
    trimmer = IdleHeapTrim(IDLE_S, name="test-idle-trim")
    try:
        time.sleep(IDLE_S * 3)
        assert trimmer.trims == 0
        with trimmer.serving():
            time.sleep(IDLE_S * 4)
            assert trimmer.trims == 0
        ended = time.monotonic()
        assert _wait_for(lambda: trimmer.trims == 1)
        assert time.monotonic() - ended >= IDLE_S
        time.sleep(IDLE_S * 3)
        assert trimmer.trims == 1

        rng = random.Random(3)
        spans = [rng.uniform(0.05, IDLE_S * 2) for _ in range(6)]

        def work(span: float) -> None:
            with trimmer.serving():
                time.sleep(span)

        threads = [threading.Thread(target=work, args=(span,)) for span in spans]
        for thread in threads:
            thread.start()
        time.sleep(min(spans) / 2)
        assert trimmer.trims == 1
        for thread in threads:
            thread.join()
        assert _wait_for(lambda: trimmer.trims == 2)
        time.sleep(IDLE_S * 3)
        assert trimmer.trims == 2
    finally:
        trimmer.close()
    assert "test-idle-trim" not in [thread.name for thread in threading.enumerate()]


def test_idle_trim_gives_a_freed_peak_back() -> None:
    """A peak freed inside ``serving`` is resident until the trimmer's idle spell ends,
    then most of it is returned (what the trimmer counts as released)."""
    libc = glibc()
    trim_heap(libc)
    trimmer = IdleHeapTrim(IDLE_S)
    try:
        with trimmer.serving():
            kept = _fragmented_free(libc)
            peak = _own_rss()
        assert _wait_for(lambda: trimmer.trims == 1)
        freed = (CHUNKS - len(kept)) * CHUNK
        assert peak - _own_rss() > freed * 0.6 and trimmer.released_bytes > freed * 0.6
        _free_all(libc, kept)
    finally:
        trimmer.close()


class _Cycle:
    """An object in a reference cycle with itself, holding a malloc'd buffer."""

    def __init__(self) -> None:
        self.buffer = bytearray(CHUNK)
        self.me = self


def test_idle_trim_collects_garbage_cycles_before_trimming() -> None:
    """Buffers only garbage cycles hold (the collector off, as between its generation-2
    passes) are resident until the idle spell ends; then the trimmer collects them
    (counted in ``collected``) and their pages are returned by the same trim, the
    live buffers among them (pinning the heap) kept."""
    libc = glibc()
    enabled = gc.isenabled()
    gc.disable()
    trim_heap(libc)
    trimmer = IdleHeapTrim(IDLE_S)
    try:
        with trimmer.serving():
            cycles = [_Cycle() for _ in range(CHUNKS)]
            pinned = [bytearray(cycle.buffer) for cycle in cycles[::64]]
            garbage = (CHUNKS - len(pinned)) * CHUNK
            del cycles
            peak = _own_rss()
        assert _wait_for(lambda: trimmer.trims == 1)
        assert trimmer.collected >= CHUNKS
        assert peak - _own_rss() > garbage * 0.6 and trimmer.released_bytes > garbage * 0.6
        assert all(len(buffer) == CHUNK for buffer in pinned)
    finally:
        trimmer.close()
        if enabled:
            gc.enable()


@pytest.mark.parametrize("idle_s", [0, -1.0, True, "5", None])
def test_idle_s_must_be_positive_seconds(idle_s: object) -> None:
    """A trimmer's idle time is a positive number; anything else is refused by name."""
    with pytest.raises(ValueError, match="idle_s"):
        IdleHeapTrim(idle_s)  # type: ignore[arg-type]
