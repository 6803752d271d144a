"""Benchmark of a step's request outputs between a group's scheduler actor and its client.

An actor stands in for the SchedulerActor: it holds ``--requests`` decoding requests
whose outputs are already ``length`` tokens long, and each call adds one token to
each (four characters of text per token, no logprobs) and returns the step's outputs,
either whole (``RequestOutput``s carrying each request's output so far, the wire before
``actors.output_wire``) or as the output wire's frame (the actor's ``OutputSender``
deltas, rebuilt by the client's ``OutputReceiver`` into the same outputs). Columns: the
pickled bytes of the last step's outputs (``length`` + 5 warm-up + ``--steps`` tokens
in), and the median and p90 of the whole call (Ray's call, the actor's building of the
outputs, their serialisation, transfer and deserialisation, and for the frame the
receiver's rebuilding) over ``--steps`` calls.

Usage: python3 -m bench.output_wire [--requests 64] [--steps 100] [--out bench/results/output_wire.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import ray

from dsv41.actors.output_wire import OutputReceiver, OutputSender
from dsv41.cluster.request import RequestOutput

LENGTHS = (16, 256, 2048, 8192)
WIRES = ("whole", "frame")
CHARS_PER_TOKEN = 4


class DecodingOutputs:
    """``requests`` requests ``length`` tokens into their outputs, one token per step."""

    def __init__(self, requests: int, length: int) -> None:
        self.tokens = [list(range(length)) for _ in range(requests)]
        self.texts = ["abcd" * length for _ in range(requests)]
        self.sender = OutputSender()

    def _outputs(self) -> list[RequestOutput]:
        return [
            RequestOutput(request_id=f"r{i}", token_ids=tuple(tokens), finished=False, finish_reason=None, text=text)
            for i, (tokens, text) in enumerate(zip(self.tokens, self.texts))
        ]

    def step(self) -> list[RequestOutput]:
        for i, tokens in enumerate(self.tokens):
            tokens.append(len(tokens) % 50_000)
            self.texts[i] += "a" * CHARS_PER_TOKEN
        return self._outputs()

    def whole(self) -> list[RequestOutput]:
        return self.step()

    def frame(self) -> tuple:
        return self.sender.frame(self.step())

    def first_frame(self) -> tuple:
        """The sender's frame of the outputs so far, each whole: a fresh receiver's first."""
        return self.sender.frame(self._outputs())


def measure(requests: int, length: int, wire: str, steps: int) -> dict[str, float]:
    actor = ray.remote(DecodingOutputs).options(num_cpus=0).remote(requests, length)
    receiver = OutputReceiver()
    if wire == "frame":
        receiver.outputs(ray.get(actor.first_frame.remote()))
    call = getattr(actor, wire)
    payload_bytes = 0
    times = []
    for _ in range(steps + 5):
        start = time.perf_counter()
        reply = ray.get(call.remote())
        outputs = receiver.outputs(reply) if wire == "frame" else reply
        times.append((time.perf_counter() - start) * 1e3)
        payload_bytes = len(pickle.dumps(reply))
        assert len(outputs) == requests and len(outputs[0].token_ids) > length
    ray.kill(actor)
    times = sorted(times[5:])
    return {
        "requests": requests,
        "length": length,
        "wire": wire,
        "bytes": payload_bytes,
        "median_ms": statistics.median(times),
        "p90_ms": times[int(0.9 * (len(times) - 1))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "output_wire.json"))
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        rows = [measure(args.requests, length, wire, args.steps) for length in LENGTHS for wire in WIRES]
    finally:
        ray.shutdown()
    print("| output tokens at the start | wire | bytes per step | ms per step, median (p90) |")
    print("|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['length']} | {r['wire']} | {r['bytes']:,} | {r['median_ms']:.2f} ({r['p90_ms']:.2f}) |")
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores".strip(),
        "ray": ray.__version__,
        "requests": args.requests,
        "steps": args.steps,
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
