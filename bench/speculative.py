"""DSpark speculation on the CPU or a GPU: acceptance length and decode tokens/s with and
without DSpark 5, at one request and at 16 concurrent requests.

Prompts are evenly spaced windows of the held-out standard-library modules (the trained
checkpoint's held-out split, model/training.Corpus), decoded greedily. Decode tokens/s
counts the output tokens generated from the first step at which every request holds
its first token (its prefill's) to the end, over that time; acceptance length is the
tokens a verify step emits per request, accepted drafts + 1. Both engines run in the
batch-invariant mode and emit the same tokens (checked). On a shared box the rates
move with the load: each configuration runs ``--repeats`` times, plain and DSpark
alternating, and the table takes each one's best rate (the JSON keeps every run); the
rate per CPU second of this process (torch runs on one thread) moves less with the
load than the wall-clock rate.

Prints a table and writes JSON (default bench/results/speculative.json).
Usage: python3 -m bench.speculative [--model DIR] [--out PATH] [--prompt-len 96] [--max-tokens 64] [--repeats 3]
       [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from dsv41.cluster.engine import Engine
from dsv41.cluster.request import CumulativeOutputs
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.loader import TOKENIZER_FILE
from dsv41.model.tiny import TRAINED_TINY_DIR
from dsv41.model.training import Corpus, token_stream
from tokenizers import Tokenizer

CONCURRENCIES = (1, 16)


def heldout_prompts(model: Path, count: int, length: int) -> list[list[int]]:
    stream = token_stream(Tokenizer.from_file(str(model / TOKENIZER_FILE)), Corpus.texts(Corpus.stdlib().heldout))
    stride = (stream.numel() - length) // count
    return [stream[i * stride : i * stride + length].tolist() for i in range(count)]


def decode_run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Runs ``prompts`` at once to completion; times the steps after every prefill."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    whole = CumulativeOutputs()
    tokens: dict[str, tuple[int, ...]] = {}
    decode_start = cpu_start = None
    first_tokens = 0
    while engine.has_unfinished_requests():
        if decode_start is None and all(r.num_output_tokens for r in engine.scheduler.running) and not engine.scheduler.waiting:
            decode_start = time.perf_counter()
            cpu_start = time.process_time()
            first_tokens = sum(r.num_output_tokens for r in engine.scheduler.running)
        for out in engine.step():
            total = whole.add(out)
            if out.finished:
                tokens[out.request_id] = total.token_ids
    elapsed = time.perf_counter() - decode_start
    cpu = time.process_time() - cpu_start
    decoded = sum(len(t) for t in tokens.values()) - first_tokens
    s = engine.scheduler
    return {
        "requests": len(prompts),
        "decode_tokens": decoded,
        "decode_seconds": elapsed,
        "decode_tok_per_s": decoded / elapsed,
        "decode_cpu_seconds": cpu,
        "decode_tok_per_cpu_s": decoded / cpu,
        "verify_steps": s.num_verifies,
        "drafts_accepted_per_verify": s.num_drafts_accepted / s.num_verifies if s.num_verifies else None,
        "acceptance_length": 1 + s.num_drafts_accepted / s.num_verifies if s.num_verifies else None,
        "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=TRAINED_TINY_DIR)
    ap.add_argument("--out", type=Path, default=Path("bench/results/speculative.json"))
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu (torch kernels) or cuda (Triton kernels)")
    args = ap.parse_args()
    # Batch-invariant on either device, so DSpark's tokens can be checked against plain decoding's.
    device_options = dict(device=args.device, batch_invariant=True)
    if args.device.startswith("cuda"):
        device_options["kernel_backend"] = "triton"
    torch.set_num_threads(1)
    rows = []
    for concurrency in CONCURRENCIES:
        prompts = heldout_prompts(args.model, concurrency, args.prompt_len)
        runs: dict[str, list[dict]] = {"plain": [], "dspark": []}
        for _ in range(args.repeats):
            for method in (None, "dspark"):
                engine = Engine.from_pretrained(
                    args.model,
                    block_size=32,
                    max_num_seqs=concurrency,
                    max_num_batched_tokens=512,
                    speculative_method=method,
                    **device_options,
                )
                run = decode_run(engine, prompts, args.max_tokens)
                runs[method or "plain"].append(run)
                print(f"concurrency {concurrency}, {method or 'plain'}: {run['decode_tok_per_s']:.1f} tok/s", flush=True)
        if any(run["tokens"] != runs["plain"][0]["tokens"] for run in runs["plain"] + runs["dspark"]):
            raise SystemExit(f"concurrency {concurrency}: DSpark's tokens differ from plain greedy decoding")
        plain = max(runs["plain"], key=lambda r: r["decode_tok_per_s"])
        spec = max(runs["dspark"], key=lambda r: r["decode_tok_per_s"])
        plain_cpu = max(r["decode_tok_per_cpu_s"] for r in runs["plain"])
        spec_cpu = max(r["decode_tok_per_cpu_s"] for r in runs["dspark"])
        rows.append(
            {
                "concurrency": concurrency,
                "plain_decode_tok_per_s": plain["decode_tok_per_s"],
                "dspark_decode_tok_per_s": spec["decode_tok_per_s"],
                "speedup": spec["decode_tok_per_s"] / plain["decode_tok_per_s"],
                "plain_decode_tok_per_cpu_s": plain_cpu,
                "dspark_decode_tok_per_cpu_s": spec_cpu,
                "cpu_speedup": spec_cpu / plain_cpu,
                "acceptance_length": spec["acceptance_length"],
                "drafts_accepted_per_verify": spec["drafts_accepted_per_verify"],
                "verify_steps": spec["verify_steps"],
                "decode_tokens": spec["decode_tokens"],
                "plain_runs_tok_per_s": [r["decode_tok_per_s"] for r in runs["plain"]],
                "dspark_runs_tok_per_s": [r["decode_tok_per_s"] for r in runs["dspark"]],
                "plain_runs_tok_per_cpu_s": [r["decode_tok_per_cpu_s"] for r in runs["plain"]],
                "dspark_runs_tok_per_cpu_s": [r["decode_tok_per_cpu_s"] for r in runs["dspark"]],
            }
        )
    print(
        "| concurrency | plain tok/s | DSpark 5 tok/s | speedup | plain tok/CPU-s | DSpark 5 tok/CPU-s | CPU speedup "
        "| acceptance length | accepted / 5 |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['plain_decode_tok_per_s']:.1f} | {r['dspark_decode_tok_per_s']:.1f} | "
            f"{r['speedup']:.2f}x | {r['plain_decode_tok_per_cpu_s']:.1f} | {r['dspark_decode_tok_per_cpu_s']:.1f} | "
            f"{r['cpu_speedup']:.2f}x | {r['acceptance_length']:.2f} | {r['drafts_accepted_per_verify']:.2f} |"
        )
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        },
        "model": str(args.model),
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
