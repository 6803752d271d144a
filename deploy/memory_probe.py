"""What a process's memory is, read from inside it: Python's objects, Python's
small-object allocator and the C allocator, each layer with what it holds in use and
what it keeps free (a diagnostic).

Owns :class:`ProbeOptions` (AppArgs' ``memory_probe``), :class:`MemoryProbe` (one
process's readings between points of a run: live objects by type and the types that
grew, tracemalloc's allocation sites diffed against the previous reading, pymalloc's
arenas, glibc's totals (deploy/heap.py) and what ``malloc_trim(0)`` gives back) and
:func:`read_probe`, a deployment's ``memory_report``. bench/soak.py reads it between
rounds in each replica (deploy/app.py, deploy/llm_server.py: only when the application
is built with ``memory_probe``; through a deployment handle, no HTTP route) to tell
memory kept per request (objects grow round after round) from memory an allocator
keeps (objects level, its free bytes grown).

Needs glibc >= 2.33 (deploy/heap.py): a replica built with ``memory_probe`` elsewhere
fails to start, naming what is missing.

Must not import: ``ray``, ``torch``, ``model``, ``cache``, ``cluster``, ``actors``; from
``deploy`` only ``deploy.heap`` and ``deploy.procfs``.
"""

from __future__ import annotations

import collections
import gc
import os
import re
import sys
import tempfile
import tracemalloc
from dataclasses import asdict, dataclass
from typing import Any

from dsv41.deploy.heap import glibc, malloc_stats, trim_heap
from dsv41.deploy.procfs import rss_bytes

# The allocation sites and object types a reading reports, largest change first.
DEFAULT_TOP = 15


_DEBUG_STAT = re.compile(r"^(#? ?[\w ]+?)\s*=\s*([\d,]+)\s*$")


def pymalloc_stats() -> dict[str, int] | None:
    """pymalloc's arenas and blocks (``sys._debugmallocstats``'s totals): arenas held,
    bytes in allocated and in available blocks, unused pools' bytes. It writes to the C
    stderr, so fd 2 is pointed at a file for the call (another thread's write to stderr
    meanwhile lands there too). None when pymalloc is not Python's allocator now
    (tracemalloc hooks it, or ``PYTHONMALLOC=malloc``): CPython then prints no totals."""
    sys.stderr.flush()
    with tempfile.TemporaryFile("w+") as capture:
        saved = os.dup(2)
        try:
            os.dup2(capture.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        text = capture.read()
    totals: dict[str, int] = {}
    for line in text.splitlines():
        match = _DEBUG_STAT.match(line.strip())
        if match:
            totals[match.group(1).lstrip("# ").strip()] = int(match.group(2).replace(",", ""))
    if "arenas allocated current" not in totals:
        return None
    unused = re.search(r"^(\d+) unused pools \* (\d+) bytes", text, re.M)
    arena = re.search(r"^(\d+) arenas \* (\d+) bytes/arena", text, re.M)
    return {
        "arenas": totals["arenas allocated current"],
        "arena_bytes": 0 if arena is None else int(arena.group(1)) * int(arena.group(2)),
        "allocated_block_bytes": totals["bytes in allocated blocks"],
        "available_block_bytes": totals["bytes in available blocks"],
        "unused_pool_bytes": 0 if unused is None else int(unused.group(1)) * int(unused.group(2)),
    }


def object_counts() -> collections.Counter[str]:
    """Live objects the collector tracks, by type (``module.qualname``): not those
    ``gc.freeze()`` moved out of its reach (Ray's workers freeze what they imported),
    nor the untracked (strings, numbers, dicts of atoms)."""
    return collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


class ProbeOff(RuntimeError):
    """``memory_report`` on a replica built without ``memory_probe``."""


@dataclass(frozen=True)
class ProbeOptions:
    """What a :class:`MemoryProbe` reads (AppArgs' ``memory_probe``): with
    ``trace_frames`` > 0, tracemalloc from the first reading on, that many frames kept
    per allocation (it slows every allocation: a diagnostic run's); ``top`` allocation
    sites and object types per reading, largest first."""

    trace_frames: int = 0
    top: int = DEFAULT_TOP

    def __post_init__(self) -> None:
        if isinstance(self.trace_frames, bool) or not isinstance(self.trace_frames, int) or self.trace_frames < 0:
            raise ValueError(f"memory_probe.trace_frames: {self.trace_frames!r} (allowed: an integer >= 0, 0 for no tracing)")
        if isinstance(self.top, bool) or not isinstance(self.top, int) or self.top < 1:
            raise ValueError(f"memory_probe.top: {self.top!r} (allowed: an integer >= 1)")


class MemoryProbe:
    """One process's readings (see the module docstring). The first :meth:`read` is the
    baseline (and starts tracemalloc when ``options.trace_frames`` > 0); each later one
    reports what changed since the previous."""

    def __init__(self, options: ProbeOptions) -> None:
        self.options = options
        self._libc = glibc()
        self._counts: collections.Counter[str] | None = None
        self._snapshot: tracemalloc.Snapshot | None = None

    def read(self, *, trim: bool = False) -> dict[str, Any]:
        """RSS before and after a full collection (and the unreachable objects it found:
        garbage cycles still waiting for the collector); live objects by type (and the
        types that grew since the last reading); pymalloc's arenas; glibc's allocator;
        tracemalloc's bytes (live, and the peak since the last reading) and the sites
        that grew. With ``trim``, then ``malloc_trim(0)`` and the RSS and glibc stats
        after it."""
        rss_before_collect = rss_bytes(os.getpid())
        collected = gc.collect()
        counts = object_counts()
        reading: dict[str, Any] = {
            "pid": os.getpid(),
            "rss_bytes_before_collect": rss_before_collect,
            "gc_collected": collected,
            "rss_bytes": rss_bytes(os.getpid()),
            "gc_objects": sum(counts.values()),
            "gc_frozen": gc.get_freeze_count(),
            "pymalloc": pymalloc_stats(),
            "malloc": asdict(malloc_stats(self._libc)),
            "objects_by_type": counts.most_common(self.options.top),
        }
        if self._counts is not None:
            grown = counts.copy()
            grown.subtract(self._counts)
            reading["objects_grown"] = [(name, n) for name, n in grown.most_common(self.options.top) if n > 0]
        self._counts = counts
        if self.options.trace_frames:
            reading["tracemalloc"] = self._trace()
        if trim:
            released = trim_heap(self._libc)
            reading["trim"] = {"released": released, "rss_bytes": rss_bytes(os.getpid()), "malloc": asdict(malloc_stats(self._libc))}
        return reading

    def _trace(self) -> dict[str, Any]:
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.options.trace_frames)
        # Not the probe's own allocations (its counts and snapshots) nor tracemalloc's.
        own = [tracemalloc.Filter(False, __file__, all_frames=True), tracemalloc.Filter(False, tracemalloc.__file__)]
        snapshot = tracemalloc.take_snapshot().filter_traces(own)
        traced, peak = tracemalloc.get_traced_memory()
        # The peak since the previous reading: what the round held at its height.
        tracemalloc.reset_peak()
        found: dict[str, Any] = {"traced_bytes": traced, "peak_bytes": peak, "own_bytes": tracemalloc.get_tracemalloc_memory()}
        if self._snapshot is not None:
            found["sites"] = [
                {
                    "size_diff": stat.size_diff,
                    "count_diff": stat.count_diff,
                    "size": stat.size,
                    "count": stat.count,
                    "traceback": [str(frame) for frame in stat.traceback],
                }
                for stat in snapshot.compare_to(self._snapshot, "traceback")[: self.options.top]
                if stat.size_diff > 0
            ]
        self._snapshot = snapshot
        return found


def probe_for(options: ProbeOptions | None) -> MemoryProbe | None:
    """A deployment's probe: None when the application was built without one."""
    return None if options is None else MemoryProbe(options)


def read_probe(probe: MemoryProbe | None, *, trim: bool) -> dict[str, Any]:
    """A deployment's reading of its process; refused when the application was built
    without ``memory_probe``."""
    if probe is None:
        raise ProbeOff("memory_report: the application was built without memory_probe (AppArgs.memory_probe)")
    return probe.read(trim=trim)
