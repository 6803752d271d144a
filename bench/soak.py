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
memory an allocator keeps for reuse rises once and stays level. ``--warmup-round``
runs one round of the soak's own load before the baseline (the RSS before it is kept
as ``cold``): the baseline then holds what the first burst leaves in the allocators,
and whatever a round leaks shows as growth above it. The replicas collect
their garbage and trim their C heap once idle (AppArgs' ``heap_trim_idle_s``, 5 s:
deploy/heap.py), well within ``--settle``, and so does Serve's HTTP proxy, started as
``dsv41 serve`` starts it (deploy/proxy_heap.py); ``--no-heap-trim`` runs all three
without it, ``--no-proxy-heap-trim`` only the proxy.

What the memory is (``--memory-probe``): the application is built with AppArgs'
``memory_probe`` and, at baseline and after each round's idle RSS sample, each of the
LLM server and ingress replicas reads its own process (``deploy.memory_probe``: live
objects by type and the types that grew, pymalloc's arenas, glibc's ``mallinfo2``:
arena bytes in use and free, mmapped bytes, arenas); ``--trace-frames N`` adds
tracemalloc (started at baseline, N frames an allocation) and the allocation sites
that grew since the previous reading (it slows the replicas: a diagnostic run);
``--malloc-trim`` then calls ``malloc_trim(0)`` in each and reads the RSS it gave
back. Serve's ProxyActor is Ray's: it is read from outside, a debugger (gdb) attached
for a moment calling glibc's ``malloc_info`` (and with ``--malloc-trim``
``malloc_trim(0)``) in it.

Prints the latency summary (TTFT and TPOT p50 / p99), the RSS table and the probe's
table; writes JSON (default bench/results/soak.json).
Usage: python3 -m bench.soak [--model DIR] [--num-requests 3000] [--rounds 2] [--concurrency 1000] [--warmup-round]
       [--no-heap-trim | --no-proxy-heap-trim] [--memory-probe [--trace-frames N] [--malloc-trim]]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import ray
from ray import serve

from dsv41.deploy.app import build_app, run_app
from dsv41.deploy.bench import HttpTarget, run_http
from dsv41.deploy.bench_workload import Workload
from dsv41.deploy.cli import default_model_dir
from dsv41.deploy.heap import DEFAULT_HEAP_TRIM_IDLE_S, DEFAULT_PYTHON_ALLOCATOR, PYTHON_ALLOCATORS, parse_malloc_info
from dsv41.deploy.proxy_heap import controller_options
from dsv41.deploy.procfs import descendants, process_title, rss_bytes

# The deployments whose replicas read their own memory (--memory-probe).
PROBED_DEPLOYMENTS = ("OpenAIIngress", "LLMServer")
PROXY_TITLE = "ray::ProxyActor"
# A debugger attached to the idle proxy answers well within this.
GDB_TIMEOUT_S = 120

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


def probe_replicas(app_name: str, *, trim: bool) -> dict[str, dict]:
    """Each probed deployment's reading of its replica (one replica each here)."""
    return {
        name: serve.get_deployment_handle(name, app_name).memory_report.remote(trim=trim).result(timeout_s=GDB_TIMEOUT_S)
        for name in PROBED_DEPLOYMENTS
    }


def _gdb_calls(pid: int, calls: list[str]) -> None:
    """Runs ``calls`` (gdb expressions) in process ``pid``, stopped meanwhile."""
    command = ["gdb", "-p", str(pid), "-batch", "-nx"]
    for call in calls:
        command += ["-ex", call]
    subprocess.run(command, check=True, capture_output=True, timeout=GDB_TIMEOUT_S)


def _foreign_malloc_info(pid: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "malloc_info.xml"
        _gdb_calls(pid, [f'set $f = (void *) fopen("{path}", "w")', "call (int) malloc_info(0, $f)", "call (int) fclose($f)"])
        return asdict(parse_malloc_info(path.read_text()))


def read_foreign(pid: int, *, trim: bool) -> dict:
    """A process that is not ours (Serve's proxy) read from outside: its RSS and glibc's
    totals; with ``trim``, then ``malloc_trim(0)`` called in it and the same after."""
    reading = {"pid": pid, "rss_bytes": rss_bytes(pid), "malloc": _foreign_malloc_info(pid)}
    if trim:
        _gdb_calls(pid, ["call (int) malloc_trim(0)"])
        reading["trim"] = {"rss_bytes": rss_bytes(pid), "malloc": _foreign_malloc_info(pid)}
    return reading


def read_memory(app_name: str, processes: dict[int, tuple[str, float]], *, trim: bool) -> dict[str, dict]:
    """The replicas' readings of themselves and the proxy's from outside."""
    readings = probe_replicas(app_name, trim=trim)
    for pid, (name, _) in processes.items():
        if name.startswith(PROXY_TITLE):
            try:
                readings["ProxyActor"] = read_foreign(pid, trim=trim)
            except subprocess.CalledProcessError as exc:
                # Where gdb cannot call into the proxy (ptrace refused, or a gdb that will not
                # call fopen without its debug information), its RSS is all there is to read.
                unread = exc.stderr.decode(errors="replace").strip().splitlines()[-1:]
                readings["ProxyActor"] = {"pid": pid, "rss_bytes": rss_bytes(pid), "unread": unread}
    return readings


def _mib(value: float | None) -> str:
    return "" if value is None else f"{value / 2**20:.0f}"


def probe_table(points: list[tuple[str, dict[str, dict]]]) -> list[str]:
    """One row per process and reading: RSS (and after a full collection), the garbage
    that collection found, gc-tracked objects, pymalloc's arenas, glibc's arena bytes
    (in use / free), its mmapped bytes and arenas, RSS after trim."""
    lines = [
        "| process | reading | RSS MiB (after gc) | garbage collected | gc objects | pymalloc arenas MiB (blocks used) | malloc arena MiB (in use / free) "
        "| mmapped MiB | arenas | RSS after trim MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for point, readings in points:
        for name, r in readings.items():
            if "malloc" not in r:
                lines.append(f"| {name} | {point} | {_mib(r['rss_bytes'])} | not read through gdb: {' '.join(r['unread'])} |" + " |" * 6)
                continue
            pymalloc, malloc = r.get("pymalloc"), r["malloc"]
            pm = "" if pymalloc is None else f"{_mib(pymalloc['arena_bytes'])} ({_mib(pymalloc['allocated_block_bytes'])})"
            trimmed = r.get("trim", {}).get("rss_bytes")
            before = r.get("rss_bytes_before_collect")
            rss = _mib(r["rss_bytes"]) if before is None else f"{_mib(before)} ({_mib(r['rss_bytes'])})"
            lines.append(
                f"| {name} | {point} | {rss} | {r.get('gc_collected', '')} | {r.get('gc_objects', '')} | {pm} "
                f"| {_mib(malloc['arena'])} ({_mib(malloc['in_use'])} / {_mib(malloc['free'])}) "
                f"| {_mib(malloc['mmapped'])} | {malloc['arenas']} | {_mib(trimmed)} |"
            )
    return lines


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


def soak_round(args: argparse.Namespace, seed: int) -> Workload:
    """One round's closed loop: ``--num-requests`` streams, ``--concurrency`` at once."""
    return Workload(
        "completions",
        args.num_requests,
        args.output_len,
        input_len=args.input_len,
        vocab_size=512,
        seed=seed,
        max_concurrency=args.concurrency,
    )


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
    parser.add_argument(
        "--warmup-round",
        action="store_true",
        help="one round of the soak's own load before the baseline (the RSS before it recorded as cold)",
    )
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--out", default="bench/results/soak.json")
    parser.add_argument(
        "--no-heap-trim",
        action="store_true",
        help="build the app with heap_trim_idle_s null: the replicas keep their freed C heap (the behaviour before it)",
    )
    parser.add_argument(
        "--no-proxy-heap-trim",
        action="store_true",
        help="start Serve without the proxy's idle heap trim (deploy/proxy_heap.py), the replicas' kept",
    )
    parser.add_argument(
        "--python-allocator",
        default=DEFAULT_PYTHON_ALLOCATOR,
        choices=PYTHON_ALLOCATORS,
        help="the Python allocator of the replicas and Serve's proxy (AppArgs' python_allocator; deploy/heap.py)",
    )
    parser.add_argument(
        "--memory-probe",
        action="store_true",
        help="build the app with memory_probe; at baseline and after each round read each replica's objects, pymalloc "
        "and glibc, and Serve's proxy's glibc through gdb",
    )
    parser.add_argument(
        "--trace-frames",
        type=int,
        default=0,
        help="with --memory-probe: tracemalloc from baseline on, this many frames an allocation; the sites that grew between readings",
    )
    parser.add_argument(
        "--malloc-trim",
        action="store_true",
        help="with --memory-probe: malloc_trim(0) after each reading, in the replicas and Serve's proxy; the RSS it gives back",
    )
    args = parser.parse_args()
    if (args.trace_frames or args.malloc_trim) and not args.memory_probe:
        parser.error("--trace-frames and --malloc-trim need --memory-probe")
    if args.memory_probe and shutil.which("gdb") is None:
        parser.error("--memory-probe reads Serve's proxy through gdb, which is not on PATH")
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
    if args.no_heap_trim:
        app_args["heap_trim_idle_s"] = None
    app_args["python_allocator"] = args.python_allocator
    if args.memory_probe:
        app_args["memory_probe"] = {"trace_frames": args.trace_frames}
    # The workers import dsv41 from where this driver does (a worktree's .roof, say),
    # the checkout last; made absolute, as the workers run elsewhere.
    paths = [*os.environ.get("PYTHONPATH", "").split(os.pathsep), str(Path(__file__).resolve().parents[1])]
    python_path = os.pathsep.join(str(Path(p).absolute()) for p in paths if p)
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": python_path}})
    reports, afters = [], []
    probes: list[tuple[str, dict[str, dict]]] = []
    try:
        proxy_trim_idle_s = None if args.no_heap_trim or args.no_proxy_heap_trim else DEFAULT_HEAP_TRIM_IDLE_S
        serve.start(
            http_options={"host": "127.0.0.1", "port": args.port},
            controller_options=controller_options(proxy_trim_idle_s, args.python_allocator),
        )
        run_app(build_app(app_args), name="soak", route_prefix="/", timeout_s=600)
        target = HttpTarget(f"http://127.0.0.1:{args.port}/v1", "tiny")
        warmup = Workload("completions", 64, args.output_len, input_len=args.input_len, vocab_size=512, seed=1, max_concurrency=64)
        run_http(target, warmup)
        time.sleep(args.settle)
        cold = None
        if args.warmup_round:
            cold = sample()
            print("warm-up round:", flush=True)
            run_http(target, soak_round(args, seed=9), progress=lambda line: print(line, flush=True))
            time.sleep(args.settle)
        baseline = sample()
        if args.memory_probe:
            probes.append(("baseline", read_memory("soak", baseline, trim=args.malloc_trim)))
        sampler = Sampler(args.sample_every)
        sampler.start()
        for round_index in range(args.rounds):
            workload = soak_round(args, seed=10 + round_index)
            reports.append(run_http(target, workload, progress=lambda line: print(line, flush=True)))
            time.sleep(args.settle)
            afters.append(sample())
            if args.memory_probe:
                probes.append((f"after round {round_index + 1}", read_memory("soak", afters[-1], trim=args.malloc_trim)))
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
                "cold_mib": None if cold is None or pid not in cold else cold[pid][1],
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
    cold_column = "cold MiB | " if cold is not None else ""
    print(f"| process | {cold_column}baseline MiB | peak MiB | {rounds} |")
    print("| --- |" + " ---: |" * (2 + len(afters) + (cold is not None)))
    for row in rows:
        cells = " | ".join("gone" if v is None else f"{v:.0f} ({v - row['baseline_mib']:+.0f})" for v in row["after_round_mib"])
        cold_cell = "" if cold is None else ("- | " if row["cold_mib"] is None else f"{row['cold_mib']:.0f} | ")
        print(f"| {row['process']} | {cold_cell}{row['baseline_mib']:.0f} | {row['peak_mib']:.0f} | {cells} |")
    if probes:
        print("\n".join(probe_table(probes)))
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
        "memory_probe": [{"point": point, "readings": readings} for point, readings in probes],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
