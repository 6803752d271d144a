"""This process's C heap (glibc's malloc): what it holds, and giving its free pages back
to the OS once the process is idle.

Owns :func:`glibc` (the allocator's calls, typed), the Python allocator a replica
starts with (:func:`python_allocator_env`), :class:`MallocStats` (its totals:
``mallinfo2`` in process, ``malloc_info``'s XML from outside, :func:`parse_malloc_info`),
:func:`trim_heap` (``malloc_trim(0)``) and :class:`IdleHeapTrim`, the replicas' behaviour
behind AppArgs' ``heap_trim_idle_s``.

Why a replica trims: glibc keeps the chunks a process frees for its next allocations
and returns pages to the OS only from the top of a heap. A serving process's peak
(1,000 concurrent streams: request bodies, SSE strings, Ray's and gRPC's buffers) is
freed when the load ends, yet stays resident: bench/soak.py measured 55-100 MiB per
replica held in glibc's free chunks after a round, level round after round, with the
live objects back where they were. ``malloc_trim(0)`` returns the free pages of every
arena (``madvise``); a replica calls it once it has had no request in flight for
``idle_s`` seconds after serving, so a busy replica never pays for it and an idle one
gives its peak back. (Two arenas instead of 16, ``MALLOC_ARENA_MAX=2``, and fixed trim
and mmap thresholds do not stand in for it: BENCHMARKS.md, soak.)
Before the trim it runs a full garbage collection (``gc.collect()``): reference cycles a
load left (up to 5,904 unreachable objects in the ingress after a soak round, holding
about 3 MiB: BENCHMARKS.md, soak) hold their buffers until the collector's next
generation-2 pass, which an idle process may not reach for long, and what they free
after a trim stays resident. What it cannot return is pymalloc's: Python's
small-object arenas go back only when every object in them is freed. Hence
:data:`PYTHON_ALLOCATORS`: a replica started with ``PYTHONMALLOC=malloc`` (AppArgs'
``python_allocator``) keeps Python's small objects in glibc's heap, where the trim
reaches them: bench/soak.py measured the RSS left above baseline after its rounds about
halved, and 8% fewer output tokens a second (BENCHMARKS.md, "soak"). The default stays
CPython's own, ``pymalloc``: an engine's host work is Python, and a decode step on a GPU
waits on it.

glibc >= 2.33 only (``mallinfo2``); elsewhere :func:`glibc` raises :class:`NoGlibcHeap`.

Must not import: ``ray``, ``torch``, ``model``, ``cache``, ``cluster``, ``actors``; from
``deploy`` only ``deploy.procfs``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import re
import tempfile
import threading
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dsv41.deploy.procfs import rss_bytes

logger = logging.getLogger(__name__)

# Seconds without a request in flight after which a replica trims its heap (AppArgs'
# default): long enough that a replica under steady load never trims, short next to
# the idle time it gives back.
DEFAULT_HEAP_TRIM_IDLE_S = 5.0
# The Python object allocators a replica's process may start with (CPython's
# PYTHONMALLOC): "malloc", glibc's heap for every object, or "pymalloc", CPython's own
# arenas for small ones (its default).
PYTHON_ALLOCATORS = ("malloc", "pymalloc")
DEFAULT_PYTHON_ALLOCATOR = "pymalloc"
PYTHON_ALLOCATOR_ENV = "PYTHONMALLOC"


def python_allocator_env(allocator: str) -> dict[str, str]:
    """The environment variable that starts a Python process with ``allocator``."""
    if allocator not in PYTHON_ALLOCATORS:
        raise ValueError(f"python_allocator: {allocator!r} (allowed: {', '.join(PYTHON_ALLOCATORS)})")
    return {PYTHON_ALLOCATOR_ENV: allocator}


class NoGlibcHeap(RuntimeError):
    """This process's C library is not glibc >= 2.33 (no ``mallinfo2`` / ``malloc_trim``)."""


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


@dataclass(frozen=True)
class MallocStats:
    """glibc's allocator over all its arenas, in bytes: ``arena`` taken from the system
    for its heaps (brk and arena mmaps), of which ``in_use`` is allocated and ``free``
    held in free chunks (resident or not: a trimmed page still counts); ``mmapped`` in
    chunks of their own mmap (returned on free); ``arenas`` how many arenas it made."""

    arena: int
    mmapped: int
    in_use: int
    free: int
    arenas: int


def glibc() -> ctypes.CDLL:
    """This process's glibc with the allocator's calls typed; NoGlibcHeap otherwise."""
    name = ctypes.util.find_library("c")
    if name is None:
        raise NoGlibcHeap("no C library found")
    libc = ctypes.CDLL(name, use_errno=True)
    for symbol in ("mallinfo2", "malloc_trim", "malloc_info"):
        if not hasattr(libc, symbol):
            raise NoGlibcHeap(f"{name} has no {symbol} (needs glibc >= 2.33)")
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return libc


def malloc_stats(libc: ctypes.CDLL) -> MallocStats:
    """``mallinfo2`` (bytes), with the arena count from ``malloc_info``."""
    info = libc.mallinfo2()
    return MallocStats(
        arena=info.arena,
        mmapped=info.hblkhd,
        in_use=info.uordblks,
        free=info.fordblks,
        arenas=parse_malloc_info(malloc_info_xml(libc)).arenas,
    )


def malloc_info_xml(libc: ctypes.CDLL) -> str:
    """glibc's ``malloc_info`` XML of this process: every arena's sizes and totals."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "malloc_info.xml"
        stream = libc.fopen(str(path).encode(), b"w")
        if not stream:
            raise OSError(ctypes.get_errno(), f"fopen {path}")
        try:
            if libc.malloc_info(0, stream) != 0:
                raise OSError(ctypes.get_errno(), "malloc_info")
        finally:
            libc.fclose(stream)
        return path.read_text()


def parse_malloc_info(xml: str) -> MallocStats:
    """The totals of glibc's ``malloc_info`` XML (what follows the last ``<heap>``): how a
    process's allocator is read from outside it (a debugger calling ``malloc_info``)."""
    totals = xml[xml.rindex("</heap>") :]

    def size(kind: str, name: str) -> int:
        match = re.search(rf'<{kind} type="{name}"(?: count="\d+")? size="(\d+)"/>', totals)
        if match is None:
            raise ValueError(f"malloc_info: no <{kind} type={name!r}> total")
        return int(match.group(1))

    arena = size("system", "current")
    free = size("total", "fast") + size("total", "rest")
    return MallocStats(
        arena=arena,
        mmapped=size("total", "mmap"),
        in_use=arena - free,
        free=free,
        arenas=len(re.findall(r'<heap nr="\d+">', xml)),
    )


def trim_heap(libc: ctypes.CDLL) -> bool:
    """``malloc_trim(0)``: every arena's free pages back to the OS; True if any went."""
    return bool(libc.malloc_trim(0))


class IdleHeapTrim:
    """Collects this process's garbage cycles and trims its heap (:func:`trim_heap`) once
    it has served something and then had nothing in flight for ``idle_s`` seconds; once
    per idle spell. The work it waits for is whatever runs inside :meth:`serving` (from
    any thread). Its own thread collects and trims, so that callers (an event loop)
    never wait for it; ``collected`` counts the unreachable objects its collections
    found, ``released_bytes`` the RSS collection and trim gave back together."""

    def __init__(self, idle_s: float, *, name: str = "dsv41-heap-trim") -> None:
        if isinstance(idle_s, bool) or not isinstance(idle_s, (int, float)) or not idle_s > 0:
            raise ValueError(f"idle_s: {idle_s!r} (allowed: a positive number of seconds)")
        self.idle_s = float(idle_s)
        self._libc = glibc()
        self._changed = threading.Condition()
        self._in_flight = 0
        # When the last work ended with none left; None: nothing served since the last trim.
        self._idle_since: float | None = None
        self._stopped = False
        self.trims = 0
        self.collected = 0
        self.released_bytes = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Holds off the trim while the body runs; its end may start the idle clock."""
        with self._changed:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle_since = time.monotonic()
                    self._changed.notify()

    @property
    def in_flight(self) -> int:
        """How many bodies of :meth:`serving` are running now."""
        with self._changed:
            return self._in_flight

    def close(self, timeout_s: float = 10.0) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._thread.join(timeout_s)

    def _wait_s(self) -> float | None:
        """Seconds until a trim is due (<= 0: now); None while one cannot be."""
        if self._in_flight or self._idle_since is None:
            return None
        return self._idle_since + self.idle_s - time.monotonic()

    def _run(self) -> None:
        while True:
            with self._changed:
                while (wait := self._wait_s()) is None or wait > 0:
                    if self._stopped:
                        return
                    self._changed.wait(wait)
                if self._stopped:
                    return
                self._idle_since = None
            before = _own_rss()
            # First, so that what the cycles held is among the free chunks the trim returns.
            # Their finalizers run on this thread, as they would on whichever thread's
            # allocation set off an automatic collection.
            collected = gc.collect()
            trim_heap(self._libc)
            released = max(0, before - _own_rss())
            self.trims += 1
            self.collected += collected
            self.released_bytes += released
            logger.debug(
                "idle for %.1f s: gc collected %d objects, malloc_trim returned %.1f MiB", self.idle_s, collected, released / 2**20
            )


def _own_rss() -> int:
    rss = rss_bytes(os.getpid())
    assert rss is not None, "a live process's own /proc entry"
    return rss


def serving(heap_trim: IdleHeapTrim | None) -> AbstractContextManager[None]:
    """``heap_trim.serving()``, or nothing when the replica does not trim."""
    return nullcontext() if heap_trim is None else heap_trim.serving()


def idle_heap_trim(idle_s: float | None, *, name: str) -> IdleHeapTrim | None:
    """A replica's trimmer: None when ``idle_s`` is None (switched off) or the process
    has no glibc heap to trim (said in the log: its allocator returns memory its own way)."""
    if idle_s is None:
        return None
    try:
        return IdleHeapTrim(idle_s, name=name)
    except NoGlibcHeap as exc:
        logger.warning("heap_trim_idle_s: %s; this replica does not trim its heap", exc)
        return None
