"""Serve's cost per streamed token: ``dsv41 bench`` of one workload on the engine in
process and through ``dsv41 serve`` of the same config, and where the CPU went.

Runs, one after the other (each holds the config's device alone): ``dsv41 bench
--in-process --config CONFIG`` with the torch threads Ray gives the config's LLM server
replica; then ``dsv41 serve --config CONFIG`` (its environment
this command's: ``RAY_SERVE_*`` variables set here reach its replicas), a warm-up
request, and ``dsv41 bench`` against its endpoint with the same workload, reading the
CPU time of every thread of Serve's HTTP proxy, the ingress replica, the LLM server
replica and its engine process where it has one (``backend: process``) (/proc) before
and after it. Prints both TPOTs and their ratio, and each process's CPU per output
token: for an LLM server replica with the engine on a thread (``backend: local``), its
engine thread's (the thread that used the most) apart from all its others', which share
the engine thread's GIL (their Python work in a step's host part delays the next step).
Writes JSON.

Usage: python3 -m bench.serve_tpot --config deploy/configs/reference-slice-h200.yaml
       [--input-len 1024] [--output-len 64] [--num-prompts 8] [--max-concurrency 1]
       [--out bench/results/serve_tpot.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from dsv41.deploy.engine_process import engine_processes
from dsv41.deploy.procfs import descendants, process_title

REPLICA_NAMES = ("ProxyActor", "OpenAIIngress", "LLMServer")
# The report's name for the LLM server's engine process (backend: process), where there is one.
ENGINE_PROCESS = "EngineProcess"


def _thread_cpu_ms(pid: int) -> dict[int, float]:
    """CPU time (user + system, ms) of each thread of ``pid`` now."""
    tick = os.sysconf("SC_CLK_TCK")
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        times[int(tid)] = (int(fields[11]) + int(fields[12])) * 1000 / tick
    return times


def _replicas(serve_pid: int) -> dict[str, int]:
    """The pid of each Serve process of ``dsv41 serve`` (pid ``serve_pid``) by name."""
    found = {}
    for pid in descendants(serve_pid):
        title = process_title(pid) or ""
        for name in REPLICA_NAMES:
            if title.startswith("ray::") and name in title:
                found[name] = pid
    missing = set(REPLICA_NAMES) - set(found)
    if missing:
        raise SystemExit(f"serve_tpot: no process of {sorted(missing)} under dsv41 serve (pid {serve_pid})")
    for pid in engine_processes(found["LLMServer"]):
        found[ENGINE_PROCESS] = pid
    return found


def _bench(args: list[str], out: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    command = [sys.executable, "-m", "dsv41.deploy.cli", "bench", *args, "--out", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
    return json.loads(out.read_text())


def _cpu_per_token(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], tokens: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, threads in after.items():
        spent = {tid: ms - before[name].get(tid, 0.0) for tid, ms in threads.items()}
        total = sum(spent.values())
        entry: dict[str, Any] = {"all_threads_ms_per_token": total / tokens}
        if name == "LLMServer" and ENGINE_PROCESS not in after:
            engine = max(spent.values())
            entry["engine_thread_ms_per_token"] = engine / tokens
            entry["other_threads_ms_per_token"] = (total - engine) / tokens
        report[name] = entry
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="Serve YAML with one dsv41 application")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-concurrency", type=int, default=1, help="requests in flight (issue 17's target: 1)")
    parser.add_argument("--port", type=int, default=None, help="HTTP port of dsv41 serve (default: the config's)")
    parser.add_argument("--out", default="bench/results/serve_tpot.json")
    args = parser.parse_args()

    from dsv41.deploy.app_args import SERVE_REPLICA_NUM_CPUS, AppArgs, read_serve_config

    serve_config, application = read_serve_config(args.config)
    app = AppArgs.from_dict(application.args or {})
    model = app.model if app.model is not None else str(app.model_dir())
    port = args.port if args.port is not None else serve_config.http_options.port
    workload = [
        "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.max_concurrency), "--temperature", "0", "--seed", "0",
    ]
    scratch = Path(tempfile.mkdtemp(prefix="serve_tpot-"))
    # Ray gives a replica OMP_NUM_THREADS = its num_cpus (at least 1) when the
    # environment sets none; the in-process engine runs with the same, or the two sides
    # differ in torch's host threads (with 16 on a 16-core host, the in-process step
    # was 1.3x slower on the H200, 2026-12-03).
    threads = os.environ.get("OMP_NUM_THREADS") or str(
        max(1, int(app.llm_server_actor_options().get("num_cpus", SERVE_REPLICA_NUM_CPUS)))
    )
    print(f"serve_tpot: in-process bench of {args.config} ({threads} torch threads) ...", file=sys.stderr, flush=True)
    in_process = _bench(
        ["--in-process", "--config", args.config, *workload],
        scratch / "in_process.json",
        env={**os.environ, "OMP_NUM_THREADS": threads},
    )

    serve_command = [sys.executable, "-m", "dsv41.deploy.cli", "serve", "--config", args.config, "--port", str(port)]
    log = (scratch / "serve.log").open("w")
    serve = subprocess.Popen(serve_command, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        # dsv41 serve gives up (and exits) by itself when its replicas do not start in time.
        assert serve.stdout is not None
        for line in serve.stdout:
            if line.startswith("serving "):
                break
        else:
            raise SystemExit(f"serve_tpot: dsv41 serve exited before serving (log: {log.name})")
        # Its later lines go on to the log: a pipe nobody reads would stop it once full.
        threading.Thread(target=lambda: log.writelines(serve.stdout), daemon=True).start()
        http = ["--base-url", f"http://127.0.0.1:{port}/v1", "--model", app.model_name, "--model-dir", model]
        _bench([*http, *workload[:4], "--num-prompts", "2", *workload[6:]], scratch / "warmup.json")
        pids = _replicas(serve.pid)
        before = {name: _thread_cpu_ms(pid) for name, pid in pids.items()}
        served = _bench([*http, *workload], scratch / "serve.json")
        after = {name: _thread_cpu_ms(pid) for name, pid in pids.items()}
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=120)

    tokens = sum(r["output_tokens"] for r in served["requests"] if r["success"])
    inproc_tpot, serve_tpot = in_process["summary"]["tpot"]["mean_ms"], served["summary"]["tpot"]["mean_ms"]
    report = {
        "config": args.config,
        "max_concurrency": args.max_concurrency,
        "in_process_omp_num_threads": int(threads),
        "in_process": in_process["summary"],
        "serve": served["summary"],
        "serve_over_in_process_mean_tpot": serve_tpot / inproc_tpot,
        "serve_output_tokens": tokens,
        "serve_cpu": _cpu_per_token(before, after, tokens),
    }
    print(f"mean TPOT ms: in-process {inproc_tpot:.2f}, through Serve {serve_tpot:.2f} ({serve_tpot / inproc_tpot:.3f}x)")
    print(
        f"median TPOT ms: in-process {in_process['summary']['tpot']['median_ms']:.2f}, "
        f"through Serve {served['summary']['tpot']['median_ms']:.2f}"
    )
    for name, entry in report["serve_cpu"].items():
        print(f"{name}: " + ", ".join(f"{key} {value:.3f}" for key, value in entry.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
