"""The host's own work per decode step, phase by phase.

The real engine path of a FULL-graph decode step (Engine, ModelRunner, DecodeGraphs:
on the CPU each bucket's static step runs eagerly, the very function a graph
captures) over the small slice (model/reference_slice.SMALL_SLICE, bf16, torch
kernels); with ``--reference``, over the reference slice as bench/decode_step.py
builds it (on a GPU: Triton kernels, each bucket's step a captured graph, so the
forward phase is the replay's launch and the sampling phase holds the wait for it).
For each batch size, that many random prompts are prefilled, a few decode steps warm
up, then ``--steps`` whole decode steps run with a timer around each host phase: the
scheduler, the Engram n-gram ids, the Engram table lookup (``engram_rows``: on the
host with the torch backend; with the Triton backend the device reads the rows inside
the graph, so a replayed step spends nothing here), the step's decode addresses (its
specs, page tables, bucket and ``build_decode_addresses``), staging them into the
step's buffer, the forward, sampling, the cursors (read and advanced) and the engine's
outputs. Phases nest (staging calls the address builder, a static step's forward the
lookup): each phase's time is its own, without the phases it calls; ``other`` is the
rest of the step. Every phase but the forward and sampling is host work a
device-resident step moves off the host or overlaps.

Prints a table (median ms per step over ``--repeats`` runs) and writes JSON. From the
repository root:
    python3 -m bench.decode_host [--batches 32,64] [--steps 20] [--repeats 5]
On the GPU machine:
    python3 -m bench.decode_host --reference --batches 1,32,128 --prompt-len 1024
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from bench.slice_engine import add_slice_options, build_slice_engine, random_prompts, start_decoding
from dsv41.cache.pools import PoolSize
from dsv41.cluster import cuda_graphs
from dsv41.cluster.cuda_graphs import DecodeBuckets, DecodeGraphs, StaticDecodeStep, page_buckets
from dsv41.cluster.engine import Engine, LocalRank
from dsv41.cluster.options import EngineOptions, RankLayout
from dsv41.cluster.persistent_batch import PersistentBatch
from dsv41.cluster.ranks import DPRank
from dsv41.cluster.runner import ModelRunner
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.cluster.scheduler import Scheduler
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.kernels import load_kernels
from dsv41.model.params import ModelParams
from dsv41.model.reference_slice import SMALL_SLICE, SliceModel, load_slice
from dsv41.model.runtime import PagedRuntime

# (phase, owner, attribute): each timed call of owner.attribute counts to its phase.
TIMED: tuple[tuple[str, Any, str], ...] = (
    ("scheduler", Scheduler, "schedule"),
    ("ngram_ids", ModelRunner, "_ngrams"),
    ("engram_lookup", PagedRuntime, "engram_rows"),
    ("addresses", ModelRunner, "_specs"),
    ("addresses", PersistentBatch, "page_tables"),
    ("addresses", DecodeGraphs, "width_for"),
    ("addresses", cuda_graphs, "build_decode_addresses"),
    ("staging", StaticDecodeStep, "load"),
    ("forward", DecodeGraphs, "_run_static"),
    ("sampling", ModelRunner, "_launch_sampling"),
    ("sampling", ModelRunner, "_drawn"),
    ("cursors", ModelRunner, "_committed_cursors"),
    ("cursors", ModelRunner, "_check_positions"),
    ("cursors", ModelRunner, "_advance_cursors"),
    ("outputs", Engine, "_apply"),
)
PHASES = tuple(dict.fromkeys(phase for phase, _, _ in TIMED)) + ("other",)
# The phases that do not depend on the forward's result.
HOST_PHASES = ("scheduler", "ngram_ids", "engram_lookup", "addresses", "staging", "cursors", "outputs")


class PhaseTimer:
    """Exclusive seconds per phase: a timed call's time, less that of the timed calls
    inside it."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {phase: 0.0 for phase in PHASES}
        self._stack: list[float] = []

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - began
                inner = self._stack.pop()
                self.spent[phase] += took - inner
                if self._stack:
                    self._stack[-1] += took

        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Every TIMED callable wrapped while inside; the originals put back after."""
        originals = [(owner, name, vars(owner)[name]) for _, owner, name in TIMED]
        for (phase, owner, name), (_, _, raw) in zip(TIMED, originals):
            wrapped = self.wrap(phase, getattr(owner, name))
            setattr(owner, name, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
        try:
            yield
        finally:
            for owner, name, raw in originals:
                setattr(owner, name, raw)


def build_engine(batches: tuple[int, ...], tokens_per_request: int, block_size: int, seed: int) -> Engine:
    """The small slice in a one-rank engine whose runner has decode graphs of every
    batch in ``batches`` (run eagerly on the CPU)."""
    model = SliceModel.build(SMALL_SLICE, V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True))
    checkpoint = load_slice(model, seed=seed, dtype=torch.bfloat16, device="cpu")
    params = ModelParams.from_checkpoint(checkpoint)
    biggest = max(batches)
    options = EngineOptions(
        dtype=torch.bfloat16,
        max_num_seqs=biggest,
        num_state_slots=biggest,
        max_num_batched_tokens=4096,
        long_prefill_token_threshold=0,
        block_size=block_size,
        enable_prefix_caching=False,
        kernel_backend="torch",
        device="cpu",
        max_model_len=tokens_per_request,
    )
    geometry = RankLayout.build(model.config, options).geometry
    num_pages = biggest * -(-tokens_per_request // block_size) + 1
    budget = PoolSize(num_pages=num_pages, num_slots=biggest).nbytes(geometry)
    options = dataclasses.replace(options, num_pages=num_pages, cache_memory_bytes=budget)
    layout = RankLayout.build(params.config, options)
    max_pages = -(-tokens_per_request // block_size)
    buckets = DecodeBuckets(batch_sizes=tuple(sorted(batches)), page_counts=page_buckets(max_pages))
    rank = DPRank(
        params,
        layout,
        0,
        None,
        kernels=load_kernels("torch"),
        batch_invariant=bool(options.batch_invariant),
        decode_graphs=buckets,
    )
    return Engine(params.config, checkpoint.tokenizer, options, 1, LocalRank(rank), None)


def output_tokens(batch: int, warmup: int, steps: int) -> int:
    """Output tokens a request may take so that none finishes before the timed steps
    end: the first ones decode one a step while the later prompts prefill."""
    return batch + warmup + steps + 4


def measure(engine: Engine, batch: int, prompt_len: int, warmup: int, steps: int, repeat: int) -> dict[str, float]:
    """One run: ms per decode step of each phase over ``steps`` steps
    of ``batch`` requests (prefilled and warmed up first, aborted after)."""
    params = SamplingParams(max_tokens=output_tokens(batch, warmup, steps), temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{repeat}-{i}" for i in range(batch)]
    prompts = random_prompts(batch, prompt_len, engine.config.vocab_size, seed=batch + 1000 * repeat)
    start_decoding(engine, dict(zip(ids, prompts)), params, warmup)
    timer = PhaseTimer()
    graphs = engine.runner.graphs
    assert graphs is not None
    replays = 0
    run = graphs.run

    def counted(*args: Any) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return run(*args)

    graphs.run = counted  # type: ignore[method-assign]
    with timer.installed():
        began = time.perf_counter()
        for _ in range(steps):
            outputs = engine.step()
            if len(outputs) != batch:
                raise RuntimeError(f"batch {batch}: a decode step gave {len(outputs)} outputs (expected {batch})")
        wall = time.perf_counter() - began
    del graphs.run
    if replays != steps:
        raise RuntimeError(f"batch {batch}: {replays} of {steps} steps ran the static decode step")
    for rid in ids:
        engine.abort(rid)
    engine.step()
    timer.spent["other"] = wall - sum(timer.spent[p] for p in PHASES if p != "other")
    row = {phase: 1e3 * spent / steps for phase, spent in timer.spent.items()}
    row["step"] = 1e3 * wall / steps
    row["host_independent_of_forward"] = sum(row[p] for p in HOST_PHASES)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="32,64", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per batch (the table shows medians)")
    parser.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before / after)")
    parser.add_argument("--out", default="bench/results/decode_host.json")
    parser.add_argument(
        "--reference", action="store_true",
        help="the reference slice through bench.slice_engine (its device, kernels and --cudagraph-mode, full here)",
    )
    add_slice_options(parser)
    parser.set_defaults(block_size=None, threads=None, cudagraph_mode="full")
    args = parser.parse_args()
    if args.cudagraph_mode != "full":
        parser.error(f"--cudagraph-mode {args.cudagraph_mode}: the phases are a FULL decode step's (allowed: full)")
    batches = tuple(int(b) for b in args.batches.split(","))
    tokens_per_request = args.prompt_len + output_tokens(max(batches), args.warmup, args.steps)
    if args.reference:
        args.block_size = args.block_size or 128
        if args.threads:
            torch.set_num_threads(args.threads)
        engine = build_slice_engine(
            args,
            max_num_seqs=max(batches),
            max_num_batched_tokens=16384,
            tokens_per_request=tokens_per_request,
            graph_batch_sizes=batches,
        )
    else:
        args.block_size = args.block_size or 32
        torch.set_num_threads(args.threads or 1)
        engine = build_engine(batches, tokens_per_request, args.block_size, seed=0)
    runs: dict[int, list[dict[str, float]]] = {}
    for repeat in range(args.repeats):
        for batch in batches:
            runs.setdefault(batch, []).append(measure(engine, batch, args.prompt_len, args.warmup, args.steps, repeat))
    columns = [*PHASES, "host_independent_of_forward", "step"]
    medians = {batch: {c: statistics.median(r[c] for r in rows) for c in columns} for batch, rows in runs.items()}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    result = {
        "label": args.label,
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.platform(),
        "cpus": torch.get_num_threads(),
        "torch": torch.__version__,
        "slice": "reference-slice" if args.reference else SMALL_SLICE.name,
        "device": torch.cuda.get_device_name() if engine.runner.pools.device.type == "cuda" else "cpu",
        "args": vars(args),
        "median_ms_per_step": medians,
        "runs_ms_per_step": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nms per decode step, median of {args.repeats} runs of {args.steps} steps ({args.label or 'this tree'})")
    print("| phase | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("| --- | " + " | ".join("---:" for _ in batches) + " |")
    for c in columns:
        print(f"| {c} | " + " | ".join(f"{medians[b][c]:.3f}" for b in batches) + " |")


if __name__ == "__main__":
    main()
