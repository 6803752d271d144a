"""Soak: 1,000 concurrent streams held against one CPU replica for minutes, and the
memory of every process of the application before, during and after.

Starts a local Ray (2 CPUs) and the application on the tiny model: one LLM server
replica (``backend: local``, one CPU, max_num_seqs 256) with queues deep enough to
hold every stream (``max_ongoing_requests`` 1,024: no 429 is expected; the 429 path is
the configured bound, tests/deploy/test_overload.py). ``deploy.bench`` then replays a
closed loop: ``--num-requests`` streaming completions of ``--input-len`` random token
ids and ``--output-len`` tokens each (``ignore_eos``), ``--concurrency`` in flight at
once, a new one sent as each finishes, in ``--rounds`` rounds. The RSS of every process
Ray started for the application (gcs_server, raylet, the Serve controller, the HTTP
proxy, the ingress and LLM server replicas, idle workers; not this client) is read from
/proc every ``--sample-every`` seconds: at baseline (after a warm-up, idle), during the
load, and after each round (``--settle`` seconds idle). A leak grows round after round;
memory an allocator keeps for reuse rises once and stays level.

Prints the latency summary (TTFT and TPOT p50 / p99) and the RSS table; writes JSON
(default bench/results/soak.json).
Usage: python3 -m bench.soak [--model DIR] [--num-requests 3000] [--rounds 2] [--concurrency 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import ray
from ray import serve

from dsv41.deploy.app import build_app, run_app
from dsv41.deploy.bench import HttpTarget, run_http
from dsv41.deploy.bench_workload import Workload
from dsv41.deploy.cli import default_model_dir
from dsv41.deploy.procfs import descendants, process_title, rss_bytes

def sample() -> dict[int, tuple[str, float]]:
    """pid -> (name, RSS MiB) of every process Ray started for this run (every process
    below this one: Ray's own and its workers)."""
    out = {}
    for pid in descendants(os.getpid()):
        title, rss = process_title(pid), rss_bytes(pid)
        if title is not None and rss is not None:
            out[pid] = (title, rss / 2**20)
    return out


class Sampler(threading.Thread):
    """Samples RSS every ``every_s`` seconds until stopped."""

    def __init__(self, every_s: float) -> None:
        super().__init__(daemon=True)
        self.every_s = every_s
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self._done.is_set():
            self.samples.append((time.monotonic() - start, sample()))
            self._done.wait(self.every_s)

    def stop(self) -> None:
        self._done.set()
        self.join()


def _latencies(report) -> dict[str, object]:
    s = report.summary
    return {
        "completed": s.completed,
        "failed": s.failed,
        "errors": s.errors,
        "duration_s": s.duration_s,
        "output_tok_per_s": s.output_throughput,
        "ttft_ms": {"p50": s.ttft.median_ms, "p99": s.ttft.p99_ms},
        "tpot_ms": {"p50": s.tpot.median_ms, "p99": s.tpot.p99_ms},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--num-requests", type=int, default=3000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of load, each followed by an idle sample")
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--settle", type=float, default=30.0, help="idle seconds before each after sample")
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--out", default="bench/results/soak.json")
    args = parser.parse_args()
    model = str(Path(args.model) if args.model else default_model_dir())
    app_args = {
        "model": model,
        "served_model_name": "tiny",
        "engine": {"block_size": 32, "max_num_seqs": 256, "max_model_len": 256, "cache_memory_bytes": 256 << 20},
        "ray_actor_options": {"num_cpus": 1},
        "max_ongoing_requests": 1024,
        "max_queued_requests": 1024,
        "ingress_max_ongoing_requests": 2048,
        "ingress_max_queued_requests": 2048,
    }
    checkout = str(Path(__file__).resolve().parents[1])
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": checkout}})
    reports, afters = [], []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        run_app(build_app(app_args), name="soak", route_prefix="/", timeout_s=600)
        target = HttpTarget(f"http://127.0.0.1:{args.port}/v1", "tiny")
        warmup = Workload("completions", 64, args.output_len, input_len=args.input_len, vocab_size=512, seed=1, max_concurrency=64)
        run_http(target, warmup)
        time.sleep(args.settle)
        baseline = sample()
        sampler = Sampler(args.sample_every)
        sampler.start()
        for round_index in range(args.rounds):
            workload = Workload(
                "completions",
                args.num_requests,
                args.output_len,
                input_len=args.input_len,
                vocab_size=512,
                seed=10 + round_index,
                max_concurrency=args.concurrency,
            )
            reports.append(run_http(target, workload, progress=lambda line: print(line, flush=True)))
            time.sleep(args.settle)
            afters.append(sample())
        sampler.stop()
    finally:
        serve.shutdown()
        ray.shutdown()

    # A process is named by its title at baseline (Ray retitles workers per call).
    rows = []
    for pid, (name, rss) in sorted(baseline.items(), key=lambda item: item[1][0]):
        during = [s[pid][1] for _, s in sampler.samples if pid in s]
        rows.append(
            {
                "process": f"{name} ({pid})",
                "baseline_mib": rss,
                "peak_mib": max(during, default=rss),
                "after_round_mib": [after[pid][1] if pid in after else None for after in afters],
            }
        )
    for index, report in enumerate(reports):
        print(f"round {index + 1}:")
        print(report.table())
    for index, report in enumerate(reports):
        s = report.summary
        print(
            f"round {index + 1}: TTFT p50 {s.ttft.median_ms:.0f} ms, p99 {s.ttft.p99_ms:.0f} ms; "
            f"TPOT p50 {s.tpot.median_ms:.0f} ms, p99 {s.tpot.p99_ms:.0f} ms; {s.failed} failed"
        )
    rounds = " | ".join(f"after round {i + 1} MiB" for i in range(len(afters)))
    print(f"| process | baseline MiB | peak MiB | {rounds} |")
    print("| --- | ---: | ---: |" + " ---: |" * len(afters))
    for row in rows:
        cells = " | ".join("gone" if v is None else f"{v:.0f} ({v - row['baseline_mib']:+.0f})" for v in row["after_round_mib"])
        print(f"| {row['process']} | {row['baseline_mib']:.0f} | {row['peak_mib']:.0f} | {cells} |")
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "args": vars(args),
        "app_args": app_args,
        "rounds": [_latencies(report) for report in reports],
        "rss": rows,
        "rss_samples": [
            {"t_s": t, "mib": {f"{name} ({pid})": rss for pid, (name, rss) in values.items()}} for t, values in sampler.samples
        ],
        "processes_started_during": sorted(
            {f"{values[pid][0]} ({pid})" for _, values in sampler.samples for pid in values if pid not in baseline}
        ),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
