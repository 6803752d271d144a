"""Host time of a step plan (cache/addressing.build_step_addresses) for one prefill.

One segment of ``--tokens`` rows from position 0 at the V4.1-Flash pools' geometry
(block 128, the config's sliding window and ratios, as many ring rows as the window),
built the three ways the runner can: the window's [rows, window] sources expanded with
numpy on the host (a CPU engine), by torch on the CPU, and on a GPU where there is one
(what the runner asks for there; the time includes its launches and the one copy of
the per-row columns, synchronised); and, for scale, with a 1-key window (everything
else the plan holds).
Median of ``--repeats`` after one warm-up. Prints a table and writes JSON.

    python3 -m bench.step_plan [--tokens 4096] [--out bench/results/step_plan.json]
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

from dsv41.cache.addressing import PoolShape, SegmentSpec, build_step_addresses
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config

BLOCK_SIZE = 128


def _median_ms(build, device: str | None, repeats: int) -> float:
    build()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        build()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="bench/results/step_plan.json")
    args = parser.parse_args()
    config = V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True)
    ratios = tuple(sorted({r for r in config.compress_ratios if r}))
    segments = [SegmentSpec(slot=0, start=0, length=args.tokens)]
    page_tables = torch.arange(-(-args.tokens // BLOCK_SIZE) + 1, dtype=torch.int64)[None, :]
    cases = [("numpy on the host", config.sliding_window, None), ("torch on the CPU", config.sliding_window, "cpu")]
    if torch.cuda.is_available():
        cases.append(("on the GPU", config.sliding_window, "cuda"))
    cases.append(("numpy, 1-key window", 1, None))
    rows = []
    for name, window, device in cases:
        shape = PoolShape(block_size=BLOCK_SIZE, window=window, ring_rows=window, ratios=ratios)
        ms = _median_ms(lambda: build_step_addresses(segments, page_tables, shape, device=device), device, args.repeats)
        rows.append({"case": name, "window": window, "device": device, "ms": ms})
        print(f"{name:22s} window {window:4d}: {ms:7.2f} ms", flush=True)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.platform(),
        "processor": platform.processor(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "tokens": args.tokens,
        "ratios": ratios,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("\n| plan built | window | ms |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['window']} | {r['ms']:.2f} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
