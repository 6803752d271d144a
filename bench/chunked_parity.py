"""Paged logits against the dense reference at Flash attention widths, by prefill chunking.

A slice with V4.1-Flash's attention widths (64 heads of 512 dims, q/o LoRA ranks, 8
output groups, window 128, the Flash indexer) but a 4096-token vocabulary and 8 routed
experts of 256 channels, so the dense reference runs on a CPU. One prompt is prefilled
by the paged engine in ragged chunks and in one chunk, and each run's logits are
compared with the reference's: the largest difference, the rows off by more than 1e-3
and the first of them, and whether every layer's top-k selections agree. ``--small-heads``
puts the attention heads at the small slice's 64 dims instead.

Why: the key rows are rounded to FP8 before they are stored. A chunk of another length
runs the projections as matmuls of another shape, whose last bits may differ; when a
value sits at an FP8 rounding boundary that difference becomes a whole FP8 step in one
stored element, and every later row that reads it differs. One chunk has the
reference's shapes.

Usage: python3 -m bench.chunked_parity [--tokens 96] [--out bench/results/chunked_parity.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import torch

from dsv41.cluster.engine import Engine

from dsv41.cluster.options import EngineOptions
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.params import ModelParams
from dsv41.model.reference import ReferenceModel
from dsv41.model.reference_slice import REFERENCE_SLICE, SMALL_SLICE, SliceModel, load_slice

CPU_WIDTHS = {"vocab_size": 4096, "moe_intermediate_size": 256}
SMALL_HEAD_FIELDS = ("head_dim", "qk_rope_head_dim")
BLOCK_SIZE = 32
OFF = 1e-3


def build(small_heads: bool) -> tuple[ModelParams, SliceModel]:
    widths = dict(CPU_WIDTHS)
    if small_heads:
        widths.update({name: dict(SMALL_SLICE.widths)[name] for name in SMALL_HEAD_FIELDS})
    spec = dataclasses.replace(
        REFERENCE_SLICE, name="flash-attention-cpu", engram_vocab_size=1009, n_routed_experts=8, widths=tuple(widths.items())
    )
    model = SliceModel.build(spec, V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True))
    return ModelParams.from_checkpoint(load_slice(model, dtype=torch.float32)), model


def compare(params: ModelParams, model: SliceModel, prompt: list[int], chunks: tuple[int, ...]) -> dict:
    reference = ReferenceModel(params).forward(prompt)
    options = EngineOptions(
        block_size=BLOCK_SIZE, state_transfer="copy", enable_prefix_caching=False, num_pages=16, max_num_seqs=2
    )
    paged = Engine.from_params(params, model.tokenizer, options).prompt_logits(prompt, chunk_sizes=chunks)
    per_row = (paged.logits - reference.logits).abs().max(dim=1).values
    off = (per_row > OFF).nonzero().flatten().tolist()
    return {
        "chunks": list(chunks),
        "max_abs_diff": float(per_row.max()),
        "rows_off": len(off),
        "first_row_off": off[0] if off else None,
        "selections_equal": all(torch.equal(paged.selections[layer], s) for layer, s in reference.selections.items()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "chunked_parity.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompt = [rng.randrange(3, CPU_WIDTHS["vocab_size"]) for _ in range(args.tokens)]
    ragged = (3, 1, 29, 7, 64)
    rows = []
    for small_heads in (False, True):
        params, model = build(small_heads)
        for chunks in (ragged, (args.tokens,)):
            row = {"head_dim": params.config.head_dim, **compare(params, model, prompt, chunks)}
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    print(f"| head_dim | chunks | max abs diff | rows off by > {OFF:g} | first row off | selections equal |")
    print("|---:|---|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['head_dim']} | {r['chunks']} | {r['max_abs_diff']:.2e} | {r['rows_off']} / {args.tokens} "
            f"| {r['first_row_off']} | {r['selections_equal']} |"
        )
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "tokens": args.tokens,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
