"""Benchmark of the cache layer's bookkeeping: PAGE allocation and prefix lookup.

Drives a BlockManager the way the scheduler does, for ``--num-requests`` requests whose
prompts (``--prompt-len`` tokens) share one of ``--num-prefixes`` prefixes of
``--shared-len`` tokens and end in a unique suffix. Requests run in waves of
``--num-slots`` (the STATE slots): lookup, allocate_prompt, publish, ``--decode-tokens``
grow steps, free. The pool holds ``--num-pages`` PAGEs, fewer than the workload's
distinct PAGEs, so eviction is exercised. A final pass looks every prompt up again on
the warm cache (pure lookup throughput, hashing included), and one hashes the prompts
alone. Prints a table and writes JSON (``--out``).

Usage: python3 -m bench.cache_ops [--out bench/results/cache_ops.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path


from dsv41.cache.block_manager import BlockManager, CacheConfig, StateTransfer, prefix_hashes


class Timer:
    """Accumulated wall time and call count of one operation."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def add(self, start_ns: int) -> None:
        self.ns += time.perf_counter_ns() - start_ns
        self.calls += 1


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    vocab = 129_280
    prefixes = [[rng.randrange(vocab) for _ in range(args.shared_len)] for _ in range(args.num_prefixes)]
    suffix_len = args.prompt_len - args.shared_len
    return [
        prefixes[rng.randrange(args.num_prefixes)] + [rng.randrange(vocab) for _ in range(suffix_len)]
        for _ in range(args.num_requests)
    ]


def run(args: argparse.Namespace) -> dict[str, object]:
    print(f"generating {args.num_requests} prompts of {args.prompt_len} tokens ...", file=sys.stderr)
    prompts = make_prompts(args)
    # Ten million prompt token ints would otherwise be rescanned by every full GC
    # pass, timing the collector instead of the cache.
    gc.collect()
    gc.freeze()
    bm = BlockManager(
        CacheConfig(
            num_pages=args.num_pages,
            num_slots=args.num_slots,
            block_size=args.block_size,
            state_transfer=StateTransfer(args.state_transfer),
        )
    )
    timers = {name: Timer() for name in ("lookup", "allocate_prompt", "publish", "grow", "free")}
    refused = 0
    start_all = time.perf_counter()
    for wave_start in range(0, len(prompts), args.num_slots):
        wave = range(wave_start, min(wave_start + args.num_slots, len(prompts)))
        running: list[tuple[str, list[int]]] = []
        for i in wave:
            tokens = list(prompts[i])
            t = time.perf_counter_ns()
            hit = bm.lookup(tokens)
            timers["lookup"].add(t)
            t = time.perf_counter_ns()
            admitted = bm.allocate_prompt(f"r{i}", tokens, hit)
            timers["allocate_prompt"].add(t)
            if not admitted:
                refused += 1
                continue
            t = time.perf_counter_ns()
            bm.publish(f"r{i}", tokens, len(tokens))
            timers["publish"].add(t)
            running.append((f"r{i}", tokens))
        for step in range(args.decode_tokens):
            for request_id, tokens in running:
                t = time.perf_counter_ns()
                grown = bm.grow(request_id, len(tokens) + 1)
                timers["grow"].add(t)
                if not grown:
                    raise SystemExit(f"{request_id}: the pool cannot hold a wave; raise --num-pages")
                tokens.append(step)
        for request_id, _ in running:
            t = time.perf_counter_ns()
            bm.free(request_id)
            timers["free"].add(t)
        done = wave.stop
        if done % 1000 < args.num_slots or done == len(prompts):
            print(f"  {done}/{len(prompts)} requests, {time.perf_counter() - start_all:.1f}s", file=sys.stderr)
    churn_stats = bm.stats()

    print("warm lookup pass ...", file=sys.stderr)
    warm = Timer()
    warm_hit_tokens = 0
    for tokens in prompts:
        t = time.perf_counter_ns()
        warm_hit_tokens += bm.lookup(tokens).hit_tokens
        warm.add(t)
    print("hashing pass ...", file=sys.stderr)
    hashing = Timer()
    for tokens in prompts:
        t = time.perf_counter_ns()
        prefix_hashes(tokens, args.block_size)
        hashing.add(t)

    rows = []
    for name, timer in [*timers.items(), ("lookup (warm cache)", warm), ("prefix_hashes alone", hashing)]:
        seconds = timer.ns / 1e9
        rows.append(
            {
                "operation": name,
                "calls": timer.calls,
                "total_s": round(seconds, 4),
                "us_per_call": round(timer.ns / 1e3 / max(timer.calls, 1), 2),
                "calls_per_s": round(timer.calls / seconds) if seconds else None,
            }
        )
    return {
        "benchmark": "cache_ops",
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "label": args.machine,
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": rows,
        "refused_admissions": refused,
        "stats_after_run": asdict(churn_stats) | {"hit_rate": round(churn_stats.hit_rate, 4)},
        "warm_lookup_hit_rate": round(warm_hit_tokens / (len(prompts) * args.prompt_len), 4),
        "wall_s": round(time.perf_counter() - start_all, 2),
    }


def format_table(report: dict[str, object]) -> str:
    lines = [
        f"{'operation':<22} {'calls':>10} {'total s':>9} {'us/call':>9} {'calls/s':>11}",
    ]
    for row in report["results"]:  # type: ignore[union-attr]
        lines.append(
            f"{row['operation']:<22} {row['calls']:>10,} {row['total_s']:>9.3f} {row['us_per_call']:>9.2f} "
            f"{row['calls_per_s'] or 0:>11,}"
        )
    stats = report["stats_after_run"]
    lines.append(
        f"hit rate {stats['hit_rate']:.3f} (warm pass {report['warm_lookup_hit_rate']:.3f}), "  # type: ignore[index]
        f"evictions {stats['evictions']:,}, refused admissions {report['refused_admissions']}"  # type: ignore[index]
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--shared-len", type=int, default=512, help="tokens of the shared prefix")
    parser.add_argument("--num-prefixes", type=int, default=100)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--num-pages", type=int, default=16_384)
    parser.add_argument("--num-slots", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--state-transfer", choices=[s.value for s in StateTransfer], default="replay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--machine", default="2-core CPU dev box, no GPU")
    parser.add_argument("--out", type=Path, default=Path("bench/results/cache_ops.json"))
    args = parser.parse_args()
    if not 0 <= args.shared_len <= args.prompt_len:
        parser.error(f"--shared-len: {args.shared_len} (allowed: 0..--prompt-len {args.prompt_len})")
    report = run(args)
    print(format_table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
