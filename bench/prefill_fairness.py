"""Prefill fairness: the TTFT of a 3-token request that arrives behind a 16k-token prefill,
with ``long_prefill_token_threshold`` off (0) and at its default (half the step budget).

The in-process engine on the tiny model (CPU, fp32, one torch thread), warmed by a
1k-token prefill of another prompt: a decode request runs, then the long prompt is added and stepped once (its prefill is under way), then
the short request arrives. Recorded per setting: the short request's TTFT (arrival to
first token) and the steps it waited, the long request's whole prefill (its arrival to
its first token), and the longest gap between the decode request's tokens while the
long prefill ran.

Prints a table and writes JSON (default bench/results/prefill_fairness.json).
Usage: python3 -m bench.prefill_fairness [--model DIR] [--long 16384] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.deploy.cli import default_model_dir

GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0)


def run(model: Path, long_len: int, threshold: int | None) -> dict:
    engine = Engine.from_pretrained(
        model, block_size=128, max_model_len=long_len + 1024, long_prefill_token_threshold=threshold
    )
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(11, engine.config.vocab_size, (long_len,), generator=g).tolist()
    # Warm the kernels on another prompt (one that shares no PAGE with the long one).
    engine.generate([torch.randint(11, engine.config.vocab_size, (1024,), generator=g).tolist()], GREEDY_ONE)
    engine.add_request("decode", [11, 12, 13, 14], SamplingParams(max_tokens=long_len, temperature=0.0, ignore_eos=True))
    while not engine.step():
        pass
    long_start = time.perf_counter()
    engine.add_request("long", long_prompt, GREEDY_ONE)
    engine.step()
    short_start = time.perf_counter()
    engine.add_request("short", [11, 12, 13], GREEDY_ONE)
    short_ttft = long_ttft = None
    steps_waited = 0
    last_decode = time.perf_counter()
    decode_gap = 0.0
    while long_ttft is None or short_ttft is None:
        outputs = engine.step()
        now = time.perf_counter()
        if short_ttft is None:
            steps_waited += 1
        for output in outputs:
            if output.request_id == "decode":
                decode_gap, last_decode = max(decode_gap, now - last_decode), now
            elif output.request_id == "short" and short_ttft is None:
                short_ttft = now - short_start
            elif output.request_id == "long" and long_ttft is None:
                long_ttft = now - long_start
    engine.abort("decode")
    return {
        "long_prefill_token_threshold": engine.options.long_prefill_token_threshold,
        "max_num_batched_tokens": engine.options.max_num_batched_tokens,
        "long_prompt_tokens": long_len,
        "short_ttft_s": short_ttft,
        "short_steps_waited": steps_waited,
        "long_prefill_s": long_ttft,
        "decode_max_gap_s": decode_gap,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--long", type=int, default=16384, help="tokens of the long prompt")
    parser.add_argument("--out", default="bench/results/prefill_fairness.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = Path(args.model) if args.model else default_model_dir()
    rows = [run(model, args.long, threshold) for threshold in (0, None)]
    print("| long_prefill_token_threshold | short TTFT s | steps waited | long prefill s | decode max gap s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['long_prefill_token_threshold']} | {row['short_ttft_s']:.2f} | {row['short_steps_waited']} "
            f"| {row['long_prefill_s']:.1f} | {row['decode_max_gap_s']:.2f} |"
        )
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s)",
        "torch": torch.__version__,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
