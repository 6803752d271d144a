"""Device memory after load against the memory plan (issue 18 item 3).

For each model source, the in-process engine's pieces are built on the device as
``Engine.from_pretrained`` builds them (``sized_options`` under ``--gpu-memory``, then
the load, then the rank), and the device's allocated bytes are read at each stage:
before the load, after the weights, after the engine (its PAGE/STATE pools and step
buffers). The plan's weight bytes and pool bytes (cluster/memory_plan.py) are set
beside them, with the difference as a fraction of the plan. ``torch.cuda.mem_get_info``
is read too: it counts the CUDA context and the caching allocator's reserve, which
the plan's reserve is meant to cover.

Prints a table and writes JSON. On the GPU machine, from the repo root:
    python3 -m bench.memory_check --gpu-memory 60e9
On a CPU it measures nothing (no device allocator) and refuses to run.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from dsv41.cluster.engine import Engine
from dsv41.cluster.memory_plan import plan_memory, sized_options
from dsv41.cluster.options import engine_options
from dsv41.cluster.ranks import DPLayout
from dsv41.model.source import ModelSource

DEFAULT_SOURCES = (
    ("generated:reference-slice,experts=fp4,dense=fp8", "stored"),
    ("generated:reference-slice,experts=bf16", "stored"),
)


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def check(source_text: str, weight_storage: str, gpu_memory: int) -> dict[str, object]:
    """One source's plan and the device's bytes at each stage of the engine's build."""
    source = ModelSource.parse(source_text)
    options = engine_options(
        {
            "device": "cuda",
            "dtype": torch.bfloat16,
            "kernel_backend": "triton",
            "weight_storage": weight_storage,
            "gpu_memory_bytes": gpu_memory,
            "enable_prefix_caching": False,
        }
    )
    plan = plan_memory(source, DPLayout(1), options)
    print(plan.render(), flush=True)
    sized = sized_options(source, DPLayout(1), options)
    gc.collect()
    torch.cuda.empty_cache()
    before = _allocated()
    params, tokenizer = source.load_params(dtype=sized.dtype, device="cuda", weight_storage=sized.weight_storage)
    gc.collect()
    after_weights = _allocated()
    engine = Engine.from_params(params, tokenizer, sized)
    gc.collect()
    after_engine = _allocated()
    free, total = torch.cuda.mem_get_info()
    weights = after_weights - before
    pools = after_engine - after_weights
    row = {
        "source": str(source),
        "weight_storage": weight_storage,
        "gpu_memory_bytes": gpu_memory,
        "plan_weight_bytes": plan.weights.device,
        "plan_pool_bytes": plan.pool_bytes,
        "plan_reserve_bytes": plan.reserve_bytes,
        "device_weight_bytes": weights,
        "device_engine_bytes": pools,
        "device_total_bytes": after_engine - before,
        "weights_diff": (weights - plan.weights.device) / plan.weights.device,
        "total_diff": (after_engine - before - plan.weights.device - plan.pool_bytes)
        / (plan.weights.device + plan.pool_bytes),
        "mem_get_info_used_bytes": total - free,
        "cache_tokens": plan.cache_tokens,
    }
    del engine, params
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-memory", type=float, default=60e9, help="gpu_memory_bytes the plan sizes the pools to")
    parser.add_argument(
        "--source", action="append", default=None,
        help="SOURCE:STORAGE (repeatable; default: the reference slice, FP8+FP4 stored and bf16)",
    )
    parser.add_argument("--out", default="bench/results/memory_check.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("memory_check measures a CUDA device's allocator: no CUDA device here")
    sources = [tuple(s.rsplit(":", 1)) for s in args.source] if args.source else list(DEFAULT_SOURCES)
    rows = [check(text, storage, int(args.gpu_memory)) for text, storage in sources]
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.platform(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print()
    print("| source | storage | plan weights GB | device weights GB | diff | plan pools GB | device engine GB | total diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['source']} | {r['weight_storage']} | {r['plan_weight_bytes'] / 1e9:.3f} | "
            f"{r['device_weight_bytes'] / 1e9:.3f} | {100 * r['weights_diff']:+.2f}% | {r['plan_pool_bytes'] / 1e9:.3f} | "
            f"{r['device_engine_bytes'] / 1e9:.3f} | {100 * r['total_diff']:+.2f}% |"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
