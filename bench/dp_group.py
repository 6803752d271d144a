"""A DP engine group on Ray against the in-process engine: tokens, then throughput.

Starts a local Ray cluster, runs a staggered mixed workload (prompts of 3..300 tokens
arriving over several steps, so ranks prefill, decode and idle at different times,
chunked by the token budget) through an ``EngineGroup`` of ``--dp`` ranks with EP
and with TP-sharded experts, and checks every request's greedy tokens against the
in-process one-rank ``Engine``'s run of the same prompt alone; a request whose tokens
differ is reported with where it leaves and both runs' margin between the greedy token
and the runner-up there (a near tie flips when only the order of a sum changes, as
between one rank's expert sum and a DP group's). Then measures output
tokens/s and step time of each group at the given concurrencies (``ignore_eos``,
fixed output length). On GPUs each rank holds one GPU and the collectives run on NCCL,
or (``--gpus-per-rank`` below 1) ranks share GPUs and the collectives run on gloo.
Prints a table and writes JSON.

Usage: python3 -m bench.dp_group --dp 2 --device cuda [--model DIR or generated:SLICE] [--dtype bfloat16]
       [--concurrency 1,16,64,256] [--gpus-per-rank 0.5] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import ray
import torch

from dsv41.actors.engine_group import EngineGroup
from dsv41.actors.group import GroupOptions
from dsv41.cluster.engine import Engine
from dsv41.cluster.request import CumulativeOutputs, RequestOutput
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.source import ModelSource
from dsv41.model.tiny import make_tiny

# Two logprobs per token: the margin between the greedy token and the runner-up says
# whether a token that differs between two runs was a near tie.
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
ENGINE = dict(block_size=32, max_num_seqs=64, max_num_batched_tokens=256, state_transfer="copy")


def workload(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 300))] for _ in range(count)]


def staggered(group: EngineGroup, prompts: list[list[int]]) -> dict[str, RequestOutput]:
    """Adds a prompt every other step, steps until all finish; outputs by request id."""
    pending = list(enumerate(prompts))
    done: dict[str, RequestOutput] = {}
    whole = CumulativeOutputs()
    step = 0
    while pending or len(done) < len(prompts):
        if pending and step % 2 == 0:
            i, prompt = pending.pop(0)
            group.add_request(f"r{i}", prompt, GREEDY)
        for out in group.step():
            cumulative = whole.add(out)
            if out.finished:
                assert out.finish_reason == "length", f"{out.request_id}: {out.finish_reason}"
                done[out.request_id] = cumulative
        step += 1
    return done


def margin(logprobs: dict[int, float]) -> float:
    """The greedy token's logprob minus the runner-up's."""
    first, second = sorted(logprobs.values(), reverse=True)[:2]
    return first - second


def divergences(expected: dict[str, RequestOutput], got: dict[str, RequestOutput]) -> list[dict]:
    """Each request whose tokens leave the reference's: where, and both runs' margin
    there (a near tie flips on a change of summation order; a real fault does not
    need one)."""
    found = []
    for rid, want in expected.items():
        have = got[rid]
        for i, (a, b) in enumerate(zip(want.token_ids, have.token_ids)):
            if a != b:
                assert want.logprobs is not None and have.logprobs is not None
                found.append(
                    {
                        "request": rid,
                        "index": i,
                        "reference_margin": margin(want.logprobs[i]),
                        "group_margin": margin(have.logprobs[i]),
                    }
                )
                break
    return found


def throughput(group: EngineGroup, vocab: int, concurrency: int, output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prompts = workload(vocab, concurrency, seed=concurrency)
    for i, prompt in enumerate(prompts):
        group.add_request(f"t{concurrency}-{i}", prompt[:128], params)
    start = time.perf_counter()
    step_ms: list[float] = []
    generated = 0
    first_token: float | None = None
    while group.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = group.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        generated += sum(len(o.token_ids) for o in outs)
        if outs and first_token is None:
            first_token = time.perf_counter() - start
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "output_tokens": generated,
        "wall_s": wall,
        "output_tok_per_s": generated / wall,
        "step_ms_median": statistics.median(step_ms),
        "first_token_s": first_token,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (one GPU per rank, NCCL)")
    parser.add_argument("--kernel-backend", default=None, help="default: triton on cuda, torch on cpu")
    parser.add_argument(
        "--model",
        help="checkpoint directory or generated slice, e.g. generated:reference-slice (default: the tiny model, made now)",
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--gpus-per-rank",
        type=float,
        default=1.0,
        help="on cuda: 1 for a GPU per rank (NCCL); a fraction puts several ranks on one GPU, "
        "whose collectives then run on gloo through the host (NCCL refuses two ranks on one device)",
    )
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument(
        "--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
        help="the engines' batch-invariant mode (default: the engine's, on for the CPU, off on a GPU); with it, "
        "an EP group's logprobs must equal the in-process engine's bit for bit",
    )
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out", default="bench/results/dp_group.json")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    backend = args.kernel_backend or ("triton" if cuda else "torch")
    model = ModelSource.parse(args.model or make_tiny(Path(tempfile.mkdtemp()) / "tiny"))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    engine_options = dict(
        ENGINE,
        max_num_seqs=max(ENGINE["max_num_seqs"], *concurrencies),
        dtype=getattr(torch, args.dtype),
        device=args.device,
        kernel_backend=backend,
        batch_invariant=args.batch_invariant,
    )

    reference = Engine.from_pretrained(model, **engine_options)
    vocab = reference.config.vocab_size
    prompts = workload(vocab, args.requests, seed=0)
    expected = {f"r{i}": reference.generate([p], GREEDY)[0] for i, p in enumerate(prompts)}
    margins = [margin(entry) for out in expected.values() for entry in out.logprobs or ()]
    del reference
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()  # rank 0 shares this GPU
    print(
        f"in-process reference: {len(expected)} requests on {args.device} ({backend} kernels); greedy margin "
        f"median {statistics.median(margins):.2e}, p10 {sorted(margins)[len(margins) // 10]:.2e}",
        flush=True,
    )

    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
    env |= {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_", "NVSHMEM_"))}
    shared_gpus = cuda and args.gpus_per_rank < 1
    dist_backend = "nccl" if cuda and not shared_gpus else "gloo"
    ray.init(
        num_cpus=max(4, 2 * args.dp),
        num_gpus=math.ceil(args.dp * args.gpus_per_rank) if cuda else 0,
        runtime_env={"env_vars": env},
        include_dashboard=False,
    )
    group_options = GroupOptions(
        rank_num_cpus=1, rank_num_gpus=args.gpus_per_rank if cuda else 0, step_timeout_s=120, start_timeout_s=300
    )
    rows: list[dict] = []
    checks: list[dict] = []
    try:
        for expert_mode in ("ep", "tp"):
            started = time.perf_counter()
            with EngineGroup(
                model,
                dp=args.dp,
                expert_mode=expert_mode,
                backend=dist_backend,
                group_options=group_options,
                name=f"dp{args.dp}-{expert_mode}",
                **engine_options,
            ) as group:
                print(f"dp{args.dp} {expert_mode}: group up in {time.perf_counter() - started:.1f} s", flush=True)
                got = staggered(group, prompts)
                differ = divergences(expected, got)
                equal = len(expected) - len(differ)
                logprobs_equal = sum(got[rid].logprobs == out.logprobs for rid, out in expected.items() if rid in got)
                checks.append(
                    {
                        "expert_mode": expert_mode,
                        "requests": len(expected),
                        "tokens_equal": equal,
                        "logprobs_equal": logprobs_equal,
                        "divergences": differ,
                    }
                )
                print(
                    f"dp{args.dp} {expert_mode}: {equal}/{len(expected)} requests with the reference's tokens, "
                    f"{logprobs_equal} with its logprobs bit for bit",
                    flush=True,
                )
                for d in differ:
                    print(
                        f"  {d['request']} leaves at token {d['index']}: margin {d['reference_margin']:.2e} "
                        f"(reference), {d['group_margin']:.2e} (group)",
                        flush=True,
                    )
                for concurrency in concurrencies:
                    row = {"expert_mode": expert_mode, **throughput(group, vocab, concurrency, args.output_len)}
                    rows.append(row)
                    print(
                        f"dp{args.dp} {expert_mode} c={concurrency}: {row['output_tok_per_s']:.1f} tok/s, "
                        f"step {row['step_ms_median']:.1f} ms",
                        flush=True,
                    )
    finally:
        ray.shutdown()

    print(f"\n| experts | concurrency | output tok/s | step ms (median) | first token s |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['expert_mode']} | {r['concurrency']} | {r['output_tok_per_s']:.1f} | {r['step_ms_median']:.1f} "
            f"| {r['first_token_s']:.2f} |"
        )
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.platform(),
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "dp": args.dp,
        "gpus_per_rank": args.gpus_per_rank if cuda else 0,
        "collectives": dist_backend,
        "kernel_backend": backend,
        "model": str(model) if args.model else "tiny (model/tiny.py TINY, seed 0)",
        "engine": {**engine_options, "dtype": args.dtype},
        "reference_margin_median": statistics.median(margins),
        "reference_margin_p10": sorted(margins)[len(margins) // 10],
        "checks": checks,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    if any(c["tokens_equal"] != c["requests"] for c in checks):
        raise SystemExit("tokens differ from the in-process engine")


if __name__ == "__main__":
    main()
