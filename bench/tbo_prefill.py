"""Prefill tok/s of a DP2 replica with and without prefill two-batch overlap (TBO).

The real engine path (Engine, ThreadedRanks: two DP-attention ranks as threads of
this process, gloo between them, EP experts; ModelRunner, paged runtime, torch
kernels) on a checkpoint (default: the shipped trained tiny model). Each timed step
prefills two distinct ``--prompt-len``-token prompts whole, one per rank (the batch
budget holds each whole, no per-request cap, prefix caching off), and samples their
first tokens; prefill tok/s is both prompts' tokens over that step's wall time. TBO on
and off alternate repeat by repeat, so drift on a shared machine hits both alike.

On a CPU this measures what the split costs, not what it hides: gloo among threads of
one process moves bytes in memory, so the collectives TBO overlaps are short, and the
two ranks' threads already occupy the cores that attention would overlap on. The
figure TBO is for (collectives over NVLink/RDMA hidden behind attention) needs two
GPUs.

Usage: python3 -m bench.tbo_prefill [--prompt-len 1024] [--repeats 5]
       [--model DIR] [--out bench/results/tbo_prefill_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from dsv41.cluster.engine import Engine
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.tiny import TRAINED_TINY_DIR

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prefill_step(engine: Engine, prompts: list[list[int]], tag: str) -> float:
    """Wall seconds of the one step that prefills ``prompts`` (one per rank)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, FIRST_TOKEN)
    start = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - start
    if len(outputs) != len(prompts) or not all(output.finished for output in outputs):
        raise RuntimeError(f"{tag}: the prompts did not prefill in one step")
    engine.step()  # tells the ranks the requests left (not timed)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(TRAINED_TINY_DIR), help="checkpoint directory")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="JSON report path")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = dict(
        max_num_batched_tokens=2 * args.prompt_len,
        long_prefill_token_threshold=0,
        enable_prefix_caching=False,
        max_num_seqs=4,
    )
    engines = {
        tbo: Engine.in_process(args.model, DPLayout(2, "ep"), enable_tbo_prefill=tbo, tbo_prefill_min_tokens=2, **options)
        for tbo in (False, True)
    }
    vocab = engines[False].config.vocab_size
    rng = random.Random(0)
    times: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(args.warmup + args.repeats):
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(2)]
        order = (False, True) if repeat % 2 == 0 else (True, False)
        for tbo in order:
            seconds = prefill_step(engines[tbo], prompts, f"r{repeat}-{int(tbo)}")
            if repeat >= args.warmup:
                times[tbo].append(seconds)
    for engine in engines.values():
        engine.executor.close()
    rows = []
    for tbo in (False, True):
        median = statistics.median(times[tbo])
        rows.append(
            {
                "tbo": tbo,
                "median_s": round(median, 4),
                "prefill_tok_per_s": round(2 * args.prompt_len / median, 1),
                "seconds": [round(t, 4) for t in times[tbo]],
            }
        )
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.platform(),
        "device": platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "prompt_len": args.prompt_len,
        "ranks": 2,
        "expert_mode": "ep",
        "backend": "gloo (threads of one process)",
        "batch_invariant": engines[False].options.batch_invariant,
        "decoder_swa_bounded_replay": engines[False].options.decoder_swa_bounded_replay,
        "results": rows,
    }
    print(f"DP2 prefill of 2 x {args.prompt_len} tokens ({args.repeats} repeats, median)")
    print("| TBO | median s | prefill tok/s |")
    print("|---|---:|---:|")
    for row in rows:
        print(f"| {'on' if row['tbo'] else 'off'} | {row['median_s']:.3f} | {row['prefill_tok_per_s']:.0f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
