"""Launches per decode step and the GPU-busy fraction, from a torch.profiler trace.

The real engine path on the reference slice (as bench/decode_step.py builds it): for
each batch size, that many random prompts are prefilled, a few decode steps warm up,
then ``--steps`` whole decode steps (scheduling, addresses, Engram lookup, forward,
sampling) are profiled. Per step: the launches the host issued (CUDA runtime / driver
calls that start device work: kernel launches, graph launches, copies and memsets),
the kernels the device ran, the step's wall time, and how much of it the device was
busy (the union of its kernels' and copies' intervals). With ``--cudagraph-mode full``
a decode step is one graph launch plus what surrounds it. ``--prefill-len N`` profiles
one warm N-token prefill (one engine step) instead: where a prefill's time goes.
``--gaps N`` also lists the N longest intervals in which the device sat idle between
two of its ops, each with when it began and the op whose launch ended it, and the idle
time summed by that op: where the host held the device up.

Prints a table and writes JSON. On the GPU machine, from the repo root:
    python3 -m bench.profile_step [--cudagraph-mode full] [--batches 1,32]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.decode_step import FULL_WORKLOAD, SMALL_WORKLOAD, Workload
from bench.slice_engine import (
    add_slice_options,
    build_slice_engine,
    environment,
    prepare_device,
    random_prompts,
    start_decoding,
)
from bench.ceilings import ceilings
from bench.prefill import prefill_once
from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams

# Host calls that start device work (CUDA runtime and driver names).
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaGraphLaunch",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaMemcpy",
)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def _issuing_op(event: object) -> str:
    """The innermost aten op above a launch call, or the call's own name."""
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith("aten::"):
            return parent.name
        parent = parent.cpu_parent
    return event.name  # type: ignore[attr-defined]


# Idle intervals shorter than this are a launch's own latency, not the host holding
# the device up.
MIN_GAP_US = 20.0
def idle_gaps(device_intervals: list[tuple[float, float]], launches: list[tuple[float, str]], most: int) -> dict:
    """The device's idle intervals of at least MIN_GAP_US between its ops (``device_intervals``:
    (start, end) us), each ended by the last launch (``launches``: (start us, issuing op))
    issued before the op that ended it: the ``most`` longest, and the idle time summed
    by that op (the ``most`` largest sums)."""
    gaps = []
    end = None
    for start, stop in sorted(device_intervals):
        if end is not None and start - end >= MIN_GAP_US:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    launch_times = sorted(launches)
    found = []
    for gap_start, gap_end in gaps:
        issued = [launch for launch in launch_times if launch[0] <= gap_end]
        _, op = issued[-1] if issued else (0.0, "(none)")
        found.append({"idle_us": gap_end - gap_start, "at_us": gap_start - device_intervals[0][0], "op": op})
    by_op: collections.Counter[str] = collections.Counter()
    for gap in found:
        by_op[gap["op"]] += gap["idle_us"]
    return {
        "gaps": len(found),
        "idle_us": sum(g["idle_us"] for g in found),
        "longest": sorted(found, key=lambda g: -g["idle_us"])[:most],
        "by_op": [{"op": op, "idle_us": us} for op, us in by_op.most_common(most)],
    }


def summarize(prof: profile, steps: int, wall_us: float, top_kernels: int, gaps: int = 0) -> dict[str, object]:
    """Per step of a trace of ``steps`` engine steps taking ``wall_us``: launches, device
    ops, device-busy time and fraction, and the ``top_kernels`` device ops by time and
    by count; with ``gaps``, the trace's idle_gaps (its ``gaps`` longest)."""
    events = prof.events()
    launch_events = [e for e in events if e.device_type == DeviceType.CPU and e.name in LAUNCH_CALLS]
    launches = len(launch_events)
    launch_ops: collections.Counter[str] = collections.Counter(_issuing_op(e) for e in launch_events)
    graph_launches = sum(1 for e in events if e.device_type == DeviceType.CPU and e.name == "cudaGraphLaunch")
    device_events = [e for e in events if e.device_type == DeviceType.CUDA]
    busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in device_events])
    kernel_us = [e.device_time for e in device_events]
    by_name: dict[str, list[float]] = {}
    for e in device_events:
        by_name.setdefault(e.name, []).append(e.device_time)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top_kernels]
    frequent = sorted(by_name.items(), key=lambda item: -len(item[1]))[:top_kernels]
    idle = {}
    if gaps:
        idle = {
            "idle_gaps": idle_gaps(
                [(e.time_range.start, e.time_range.end) for e in device_events],
                [(e.time_range.start, _issuing_op(e)) for e in launch_events],
                gaps,
            )
        }
    return {
        **idle,
        "steps": steps,
        "step_ms": wall_us / steps / 1e3,
        "launches_per_step": launches / steps,
        "graph_launches_per_step": graph_launches / steps,
        "device_ops_per_step": len(device_events) / steps,
        "device_busy_ms_per_step": busy_us / steps / 1e3,
        "gpu_busy_fraction": busy_us / wall_us,
        "median_device_op_us": statistics.median(kernel_us) if kernel_us else 0.0,
        # The device ops that take the most time: name, ops per step, ms per step.
        "top_device_ops": [
            {"name": name[:120], "per_step": len(times) / steps, "ms_per_step": sum(times) / steps / 1e3}
            for name, times in top
        ],
        # The host launches by the torch op that issued each (the graph's replay alone
        # is not under one): what is left to move into the graph or fuse.
        "launches_by_op": {op: n / steps for op, n in launch_ops.most_common()},
        # The device ops launched most often: where fusion removes the most launches.
        "frequent_device_ops": [
            {"name": name[:120], "per_step": len(times) / steps, "ms_per_step": sum(times) / steps / 1e3}
            for name, times in frequent
        ],
    }


def profile_case(
    engine: Engine, batch: int, workload: Workload, steps: int, top_kernels: int, gaps: int = 0
) -> dict[str, object]:
    """One batch size: prefill, warm-up, then ``steps`` profiled decode steps; the
    ``top_kernels`` device ops that take the most time (and ``gaps`` idle gaps)."""
    params = SamplingParams(max_tokens=workload.max_tokens(batch) + steps, temperature=0.0, ignore_eos=True)
    ids = [f"p{batch}-{i}" for i in range(batch)]
    prompts = random_prompts(batch, workload.prompt_len, engine.config.vocab_size, seed=batch)
    start_decoding(engine, dict(zip(ids, prompts)), params, workload.warmup_steps + 2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            outputs = engine.step()
            if len(outputs) != batch:
                raise RuntimeError(f"batch {batch}: a decode step produced {len(outputs)} tokens (expected {batch})")
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - began) * 1e6
    for rid in ids:
        engine.abort(rid)
    return {"batch": batch, **summarize(prof, steps, wall_us, top_kernels, gaps)}


def profile_prefill(engine: Engine, prompt_len: int, top_kernels: int, gaps: int = 0) -> dict[str, object]:
    """One warm prefill of a ``prompt_len``-token prompt, fed whole in one engine step
    (after an untimed one of another prompt), profiled: the step's kernels by time (and
    ``gaps`` idle gaps)."""
    vocab = engine.config.vocab_size
    warm, timed = random_prompts(2, prompt_len, vocab, seed=prompt_len)
    prefill_once(engine, "prefill-warm", warm)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        _, steps = prefill_once(engine, "prefill-timed", timed)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - began) * 1e6
    if steps != 1:
        raise RuntimeError(f"prefill: {steps} engine steps (expected one: the batch budget must hold the prompt)")
    return {"batch": f"prefill {prompt_len}", **summarize(prof, steps, wall_us, top_kernels, gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_slice_options(parser)
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 1024 (small: 128)")
    parser.add_argument("--steps", type=int, default=8, help="profiled decode steps per batch")
    parser.add_argument("--top", type=int, default=12, help="device ops listed by time, and by count, per step")
    parser.add_argument(
        "--prefill-len",
        type=int,
        default=None,
        help="profile one prefill of this many tokens (one engine step) instead of decode steps",
    )
    parser.add_argument(
        "--gaps", type=int, default=0,
        help="list this many of the device's longest idle gaps and the ops whose launches ended them (default 0)",
    )
    parser.add_argument("--out", default="bench/results/profile_step.json")
    args = parser.parse_args()
    device = prepare_device(args)
    if torch.device(device).type != "cuda":
        parser.error("--device: this bench profiles CUDA launches (allowed: a CUDA device)")
    workload = SMALL_WORKLOAD if args.small else FULL_WORKLOAD
    workload = dataclasses.replace(
        workload,
        batches=tuple(int(b) for b in args.batches.split(",")),
        prompt_len=args.prompt_len or workload.prompt_len,
    )
    if args.prefill_len is not None:
        engine = build_slice_engine(
            args,
            max_num_seqs=2,
            max_num_batched_tokens=args.prefill_len,
            tokens_per_request=args.prefill_len + 1,
            graph_batch_sizes=(1,),
        )
        rows = [profile_prefill(engine, args.prefill_len, args.top, args.gaps)]
    else:
        biggest = max(workload.batches)
        engine = build_slice_engine(
            args,
            max_num_seqs=biggest,
            max_num_batched_tokens=max(workload.max_num_batched_tokens, biggest),
            tokens_per_request=workload.prompt_len + workload.max_tokens(biggest) + args.steps,
            graph_batch_sizes=workload.batches,
        )
        rows = [profile_case(engine, batch, workload, args.steps, args.top, args.gaps) for batch in workload.batches]
    result = {**environment(args, engine, ceilings(device)), "workload": dataclasses.asdict(workload), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print()
    print("| batch | ms/step | launches/step | graph launches/step | device ops/step | device busy ms/step | GPU busy |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['step_ms']:.2f} | {r['launches_per_step']:.0f} | {r['graph_launches_per_step']:.0f} "
            f"| {r['device_ops_per_step']:.0f} | {r['device_busy_ms_per_step']:.2f} | {r['gpu_busy_fraction']:.0%} |"
        )
    for r in rows:
        print(f"\nbatch {r['batch']}: host launches per step by the op that issued them")
        print(", ".join(f"{op} {n:g}" for op, n in r["launches_by_op"].items()))
    for r in rows:
        for key, title in (("top_device_ops", "by time"), ("frequent_device_ops", "by count")):
            print(f"\nbatch {r['batch']}: device ops {title} per step")
            print("| ms/step | per step | op |")
            print("|---:|---:|---|")
            for op in r[key]:
                print(f"| {op['ms_per_step']:.3f} | {op['per_step']:.0f} | {op['name']} |")
    for r in rows:
        if "idle_gaps" not in r:
            continue
        idle = r["idle_gaps"]
        print(f"\nbatch {r['batch']}: {idle['gaps']} idle gaps of >= {MIN_GAP_US:g} us, {idle['idle_us'] / 1e3:.2f} ms in all")
        print("| idle us | at us (from the first device op) | ended by the launch of |")
        print("|---:|---:|---|")
        for gap in idle["longest"]:
            print(f"| {gap['idle_us']:.0f} | {gap['at_us']:.0f} | {gap['op']} |")
        print("| idle us, summed | ended by the launch of |")
        print("|---:|---|")
        for entry in idle["by_op"]:
            print(f"| {entry['idle_us']:.0f} | {entry['op']} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
