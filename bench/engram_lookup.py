"""Engram rows of a step: the host lookup against the device's gather from the mapped table.

One Engram table of the reference slice's shape (model/reference_slice.REFERENCE_SLICE:
the layer-1 table, its rows the sum of its primes, 256 FP8 values and 8 E8M0 scales a
row), random bytes, host memory. For each step size (tokens, each reading
(max_ngram_size - 1) * n_heads rows), random row ids: the host lookup
(``EngramTable.lookup``: gather and dequantise on the CPU, what a step waited for
before its forward, and what the torch backend still does), and on a GPU the Triton
backend's gather (``kernels/triton/engram.py``, the table mapped for the device with
``EngramTable.map_for``; its rows checked equal to the host's), timed as
bench/kernels.py times kernels (``median_ms``: do_bench's CUDA events).
The host lookup's fp32 rows were also copied to the device before (their bytes shown);
the device's gather moves only the rows' FP8 bytes over the bus.

Prints a table and writes JSON. From the repository root (a GPU adds the device column):
    python3 -m bench.engram_lookup [--tokens 1,32,128,4096]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.kernels import median_ms
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.engram import EngramTable, engram_row_counts
from dsv41.model.formats import FP8_BLOCK
from dsv41.model.reference_slice import REFERENCE_SLICE, SliceModel


def host_ms(fn, reps: int) -> float:
    """Median wall milliseconds of ``fn`` over ``reps`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,32,128,4096", help="comma-separated step sizes (tokens)")
    parser.add_argument("--reps", type=int, default=20, help="timed host lookups per size (3 from 1,024 tokens up)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the host lookup")
    parser.add_argument("--out", default="bench/results/engram_lookup.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = SliceModel.build(REFERENCE_SLICE, V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True)).config
    layer = config.engram_layer_ids[0]
    rows = engram_row_counts([layer], config.engram_max_ngram_size, config.engram_n_heads, config.engram_vocab_size)[0]
    per_token = (config.engram_max_ngram_size - 1) * config.engram_n_heads
    head_dim = config.engram_head_dim
    generator = torch.Generator().manual_seed(0)
    # FP8 E4M3 bytes without the NaN codes (0x7f, 0xff), scales around 2^0.
    values = torch.randint(0, 0x7F, (rows, head_dim), dtype=torch.uint8, generator=generator)
    values |= torch.randint(0, 2, (rows, head_dim), dtype=torch.uint8, generator=generator) << 7
    scales = torch.randint(110, 140, (rows, -(-head_dim // FP8_BLOCK)), dtype=torch.uint8, generator=generator)
    table = EngramTable(values, scales)
    cuda = torch.cuda.is_available()
    if cuda:
        from dsv41.model.kernels.triton.engram import engram_rows

        table.map_for("cuda")
    print(f"Engram table: layer {layer}, {rows} rows x {head_dim} FP8 values, {per_token} rows a token", flush=True)
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        ids = torch.randint(0, rows, (tokens, per_token), generator=generator)
        reps = 3 if tokens >= 1024 else args.reps
        row = {
            "tokens": tokens,
            "rows_read": ids.numel(),
            "host_lookup_ms": host_ms(lambda: table.lookup(ids), reps),
            "fp32_rows_bytes": ids.numel() * head_dim * 4,
        }
        if cuda:
            device_ids = ids.cuda()
            if not torch.equal(engram_rows(table, device_ids).cpu(), table.lookup(ids)):
                raise RuntimeError(f"{tokens} tokens: the device's rows differ from the host lookup's")
            row["device_gather_ms"] = median_ms(lambda: engram_rows(table, device_ids))
        results.append(row)
        print(row, flush=True)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name() if cuda else None,
        "torch": torch.__version__,
        "threads": args.threads,
        "table_rows": rows,
        "head_dim": head_dim,
        "rows_per_token": per_token,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("\n| tokens | rows read | host lookup ms | fp32 rows MB (copied to the device) | device gather ms |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        device = f"{r['device_gather_ms']:.3f}" if "device_gather_ms" in r else "no GPU"
        print(
            f"| {r['tokens']} | {r['rows_read']} | {r['host_lookup_ms']:.3f} | {r['fp32_rows_bytes'] / 1e6:.2f} | "
            f"{device} |"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
