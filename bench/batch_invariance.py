"""Greedy tokens of one engine alone versus batched: how often a batch changes them.

Runs the same prompts through one in-process engine twice: each prompt alone, then all
of them at once (chunked by the token budget, decoding together), and counts the
requests whose greedy tokens agree. On an exact path (fp32, the torch reference
kernels) every request agrees; where the kernels' accumulation order depends on the
batch (bf16 GEMMs whose tiling follows the row count), a near-tie in a random-weight
model's logits can flip. The same count for a DP group (bench/dp_group.py) is then read
against this one. Prints the count and writes JSON.

Usage: python3 -m bench.batch_invariance --model generated:reference-slice --device cuda
       [--dtype bfloat16] [--kernel-backend triton] [--requests 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import torch

from bench.dp_group import ENGINE, GREEDY, workload
from dsv41.cluster.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--kernel-backend", default="torch")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument(
        "--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
        help="the engine's batch-invariant mode (default: the engine's, on for the CPU, off on a GPU)",
    )
    parser.add_argument("--out", default="bench/results/batch_invariance.json")
    args = parser.parse_args()
    options = dict(
        ENGINE,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        kernel_backend=args.kernel_backend,
        batch_invariant=args.batch_invariant,
    )
    engine = Engine.from_pretrained(args.model, **options)
    prompts = workload(engine.config.vocab_size, args.requests, seed=0)
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    together = [out.token_ids for out in engine.generate(prompts, GREEDY)]
    agree = sum(a == b for a, b in zip(alone, together))
    first_token_agree = sum(a[0] == b[0] for a, b in zip(alone, together))
    print(f"{args.model} {args.dtype} {args.kernel_backend} on {args.device}: {agree}/{len(prompts)} requests agree "
          f"alone vs batched ({first_token_agree}/{len(prompts)} first tokens)")
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "model": args.model,
        "engine": {**options, "dtype": args.dtype},
        "requests": len(prompts),
        "agree": agree,
        "first_token_agree": first_token_agree,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
