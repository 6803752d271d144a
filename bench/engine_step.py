"""Benchmark of the engine's host work per decode step as the outputs grow.

``--requests`` requests decode together on one rank for ``--tokens`` output tokens
each; the engine (scheduler, block manager, prefix hashing, stop checks and
detokenization, delta outputs) is the real one, over the embedded model's config and
tokenizer. What the rank does is split in two: its host input work is real — the
step's batch through the step wire (``pack_step`` -> bytes -> ``unpack_step``, what a
Ray rank receives) and the step's PAGE addresses (the batch's deltas applied to the
rank's PersistentBatch, the step's page tables gathered from its block table and
``build_step_addresses``, what the runner does before its forward) — while the forward
itself is replaced by a fixed cycle of ordinary text tokens, so a step costs no model
time and the run reaches 8k tokens in a minute. Columns, per step at 64 requests
around each output length: the engine's own CPU time (``Engine.step`` less the
rank's), the wire's, the addresses', as medians over the ``--window`` steps ending
there (CPU time of the one thread that runs it all, torch held to one thread, so
other processes on the machine move the figures less); and the PAGE ids the step's
segments carry (a mean over those steps: the PAGEs added) against the PAGE ids of the
step's tables (what segments carrying whole tables would hold).

The property this measures (issue 16): the host's work per step does not grow with
how many tokens the requests have already generated.

Usage: python3 -m bench.engine_step [--requests 64] [--tokens 8192] [--window 32]
       [--out bench/results/engine_step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import torch

from dsv41.actors.step_wire import pack_step, unpack_step
from dsv41.cache.addressing import PoolShape, SegmentSpec, build_step_addresses
from dsv41.cluster.batch import ScheduledBatch
from dsv41.cluster.engine import Engine
from dsv41.cluster.options import RankLayout, engine_options
from dsv41.cluster.persistent_batch import PersistentBatch
from dsv41.cluster.runner import SampledToken, StepResult
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.source import ModelSource
from dsv41.model.tiny import embedded_model_dir

REPO = Path(__file__).resolve().parents[1]
CHECKPOINTS = (16, 128, 1024, 2048, 4096, 8192)
TEXT = " the runtime keeps every request's pages and state in pools shared by all of them,"


class HostOnlyRank:
    """One rank's host input work for real, its forward replaced by ``cycle``'s tokens."""

    def __init__(self, shape: PoolShape, num_slots: int, cycle: Sequence[int]) -> None:
        self.shape = shape
        self.cycle = tuple(cycle)
        self.requests = PersistentBatch(num_slots)
        self.wire_s = 0.0
        self.address_s = 0.0
        self.pages_sent = 0  # PAGE ids the segments carried, all steps
        self.pages_held = 0  # PAGE ids of the last step's tables
        self.counting_s = 0.0  # the bench's own counting, left out of every column

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[StepResult]:
        (batch,) = batches
        start = time.thread_time()
        received, _ = unpack_step(pack_step(batch, []))
        wired = time.thread_time()
        self.requests.update(received)
        specs = [SegmentSpec(s.slot, s.start, s.length, s.write_from, s.window_start) for s in received.segments]
        build_step_addresses(specs, self.requests.page_tables(received.segments, self.shape.block_size), self.shape)
        addressed = time.thread_time()
        self.wire_s += wired - start
        self.address_s += addressed - wired
        self.pages_sent += sum(len(s.new_pages) for s in received.segments)
        self.pages_held = sum(s.kept_pages + len(s.new_pages) for s in received.segments)
        self.counting_s += time.thread_time() - addressed
        sampled = {s.request_id: SampledToken(self.cycle[s.end % len(self.cycle)], None) for s in received.segments if s.sample}
        return [StepResult(step_id=batch.step_id, sampled=sampled)]

    def restart(self) -> None:
        raise RuntimeError("a host-only rank has nothing to restart")


def run(requests: int, tokens: int, window: int) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    source = ModelSource.parse(str(embedded_model_dir()))
    config, tokenizer = source.config(), source.tokenizer()
    prompt_len = 32
    options = engine_options(
        {
            "max_num_seqs": requests,
            "max_num_batched_tokens": requests * prompt_len,
            "max_model_len": prompt_len + tokens + 1,
            "cache_memory_bytes": 1 << 40,
            "num_pages": requests * (-(-(prompt_len + tokens + 1) // 128) + 1),
        }
    )
    cycle = tokenizer.encode(TEXT).ids
    layout = RankLayout.build(config, options)
    shape = PoolShape.of(layout.geometry, config.sliding_window)
    rank = HostOnlyRank(shape, layout.num_slots, cycle)
    engine = Engine(config, tokenizer, options, 1, rank)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        engine.add_request(f"r{i}", [cycle[(i + j) % len(cycle)] for j in range(prompt_len)], params)
    samples: list[tuple[float, float, float, int]] = []
    generated = 0
    rows = []
    while engine.has_unfinished_requests():
        wire_before, address_before, sent_before = rank.wire_s, rank.address_s, rank.pages_sent
        counting_before = rank.counting_s
        start = time.thread_time()
        outputs = engine.step()
        total = time.thread_time() - start - (rank.counting_s - counting_before)
        wire, address = rank.wire_s - wire_before, rank.address_s - address_before
        sent = rank.pages_sent - sent_before
        if not outputs:
            continue
        generated = max(o.num_output_tokens for o in outputs)
        if len(outputs) != requests:
            continue  # the prefill step and the last one
        samples.append((total - wire - address, wire, address, sent))
        if generated in CHECKPOINTS:
            last = samples[-window:]
            rows.append(
                {
                    "output_tokens": generated,
                    "requests": requests,
                    "engine_ms": statistics.median(s[0] for s in last) * 1e3,
                    "wire_ms": statistics.median(s[1] for s in last) * 1e3,
                    "address_ms": statistics.median(s[2] for s in last) * 1e3,
                    "pages_sent": statistics.mean(s[3] for s in last),
                    "pages_held": rank.pages_held,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "engine_step.json"))
    args = parser.parse_args()
    rows = run(args.requests, args.tokens, args.window)
    print(
        "| output tokens | engine CPU ms/step | step wire CPU ms/step | PAGE addresses CPU ms/step "
        "| PAGE ids sent/step | PAGE ids in the tables |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['output_tokens']} | {r['engine_ms']:.2f} | {r['wire_ms']:.2f} | {r['address_ms']:.2f} "
            f"| {r['pages_sent']:.2f} | {r['pages_held']} |"
        )
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores".strip(),
        "command": "python3 -m bench.engine_step " + " ".join(sys.argv[1:]),
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
