"""Engine throughput on the CPU: output tokens/s at 1, 8 and 64 concurrent requests on
the tiny model, and the scheduler's own time per step with 256 running requests.

Prints a table and writes JSON (default bench/results/engine_cpu.json).
Usage: python3 -m bench.engine_cpu [--model DIR] [--out PATH] [--prompt-len 64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.deploy.cli import default_model_dir


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


def throughput(engine: Engine, concurrency: int, prompt_len: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = _prompts(concurrency, prompt_len, engine.config.vocab_size, concurrency)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"concurrency": concurrency, "output_tokens": tokens, "seconds": elapsed, "output_tok_per_s": tokens / elapsed}


def scheduler_overhead(engine: Engine, running: int, prompt_len: int, steps: int) -> dict:
    """Mean time of Scheduler.schedule + commit per step once ``running`` requests decode."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(_prompts(running, prompt_len, engine.config.vocab_size, 99)):
        engine.add_request(f"s{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    scheduler = engine.scheduler
    spent = {"schedule": 0.0, "commit": 0.0}
    original_schedule, original_commit = scheduler.schedule, scheduler.commit

    def timed_schedule():
        t = time.perf_counter()
        out = original_schedule()
        spent["schedule"] += time.perf_counter() - t
        return out

    def timed_commit(segment, request, *committed):
        t = time.perf_counter()
        original_commit(segment, request, *committed)
        spent["commit"] += time.perf_counter() - t

    scheduler.schedule, scheduler.commit = timed_schedule, timed_commit
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    scheduler.schedule, scheduler.commit = original_schedule, original_commit
    for rid in [r.request_id for r in scheduler.running]:
        engine.abort(rid)
    return {
        "running": running,
        "steps": steps,
        "scheduler_ms_per_step": 1e3 * (spent["schedule"] + spent["commit"]) / steps,
        "step_ms": 1e3 * total / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default="bench/results/engine_cpu.json")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else default_model_dir()
    engine = Engine.from_pretrained(
        model_dir, block_size=32, max_num_seqs=256, num_state_slots=256, max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    engine.generate(_prompts(2, 16, engine.config.vocab_size, 0), SamplingParams(max_tokens=2, temperature=0.0))
    rows = []
    for concurrency in (1, 8, 64):
        row = throughput(engine, concurrency, args.prompt_len, args.max_tokens)
        rows.append(row)
        print(f"{concurrency:>4} concurrent: {row['output_tok_per_s']:8.1f} output tok/s ({row['seconds']:.2f} s)", flush=True)
    speedup = rows[-1]["output_tok_per_s"] / rows[0]["output_tok_per_s"]
    sched = scheduler_overhead(engine, 256, args.prompt_len, steps=10)
    print()
    print("| concurrency | output tok/s | wall s |")
    print("|---:|---:|---:|")
    for row in rows:
        print(f"| {row['concurrency']} | {row['output_tok_per_s']:.1f} | {row['seconds']:.2f} |")
    print(f"\n64 vs 1 concurrent: {speedup:.1f}x")
    print(f"scheduler with 256 running: {sched['scheduler_ms_per_step']:.2f} ms/step of a {sched['step_ms']:.1f} ms step")
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "throughput": rows,
        "speedup_64_vs_1": speedup,
        "scheduler": sched,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
