"""deploy/memory_probe.py in this process: each layer's reading sees what was allocated
between two readings (objects by type, tracemalloc's sites, the C heap) and a replica's
``memory_report`` is refused unless the application asked for the probe; AppArgs checks
``memory_probe`` and ``heap_trim_idle_s``."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from dsv41.deploy.app_args import AppArgs
from dsv41.deploy.memory_probe import MemoryProbe, ProbeOff, ProbeOptions, read_probe

KEPT = 2_000


class _Kept:
    """An object a 'request' leaves behind."""


def test_objects_kept_between_readings_are_named_by_type() -> None:
    """Objects created and kept between two readings are the growth the second reports,
    by their type and count; pymalloc's and glibc's totals are consistent."""
    probe = MemoryProbe(ProbeOptions(top=50))
    first = probe.read()
    assert "objects_grown" not in first
    kept = [_Kept() for _ in range(KEPT)]
    second = probe.read()
    name = f"{_Kept.__module__}.{_Kept.__qualname__}"
    assert dict(second["objects_grown"]).get(name) == KEPT
    pymalloc, malloc = second["pymalloc"], second["malloc"]
    assert 0 < pymalloc["allocated_block_bytes"] <= pymalloc["arena_bytes"]
    assert malloc["in_use"] + malloc["free"] == malloc["arena"] and malloc["arenas"] >= 1
    del kept
    third = probe.read(trim=True)
    assert name not in dict(third["objects_grown"])
    assert third["trim"]["rss_bytes"] <= third["rss_bytes"] + (1 << 20)


def test_tracemalloc_sites_name_the_line_that_kept_memory() -> None:
    """With tracing, the site that kept memory between two readings tops the growth,
    its traceback naming this file; once released, no site here grows and the traced
    bytes fall back."""
    probe = MemoryProbe(ProbeOptions(trace_frames=4))
    try:
        probe.read()
        kept = [bytearray(1024) for _ in range(KEPT)]
        grown = probe.read()["tracemalloc"]
        top = grown["sites"][0]
        assert top["size_diff"] >= KEPT * 1024 and top["count_diff"] >= KEPT
        assert any(Path(__file__).name in frame for frame in top["traceback"])
        del kept
        released = probe.read()["tracemalloc"]
        assert released["traced_bytes"] < grown["traced_bytes"] - KEPT * 1024 // 2
        assert not any(Path(__file__).name in frame for site in released["sites"] for frame in site["traceback"])
    finally:
        tracemalloc.stop()


def test_a_replica_without_the_probe_refuses_memory_report() -> None:
    """``memory_report`` is a diagnostic the application must ask for."""
    with pytest.raises(ProbeOff, match="memory_probe"):
        read_probe(None, trim=False)


@pytest.mark.parametrize(
    "args, error",
    [
        ({"memory_probe": {"trace_frames": -1}}, "memory_probe.trace_frames: -1"),
        ({"memory_probe": {"top": 0}}, "memory_probe.top: 0"),
        ({"memory_probe": {"frames": 3}}, r"memory_probe: unknown \['frames'\]"),
        ({"memory_probe": 3}, "memory_probe: 3"),
        ({"heap_trim_idle_s": 0}, "heap_trim_idle_s: 0"),
        ({"heap_trim_idle_s": "5"}, "heap_trim_idle_s: '5'"),
    ],
)
def test_memory_arguments_are_checked(args: dict[str, Any], error: str) -> None:
    """The probe's options and the trim's idle time are refused when wrong, naming the
    field and what is allowed."""
    with pytest.raises(ValueError, match=error):
        AppArgs(**args)


def test_memory_arguments_reach_the_ingress() -> None:
    """The ingress gets the probe's options and the idle time the LLM servers get; by
    default the probe is off and the heap trimmed after 5 s idle."""
    assert AppArgs().ingress_options().memory_probe is None
    assert AppArgs().ingress_options().heap_trim_idle_s == 5.0
    options = AppArgs(memory_probe={"trace_frames": 2}, heap_trim_idle_s=None).ingress_options()
    assert options.memory_probe == ProbeOptions(trace_frames=2) and options.heap_trim_idle_s is None
