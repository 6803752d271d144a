"""Paged logits against the dense reference at V4.1-Flash attention widths, by prefill
chunking, and how far two correct summation orders drift apart at those widths.

Slices: ``flash-attention`` (the default; the reference slice's eight layer roles at
Flash's attention widths — 64 heads of 512 dims, q/o LoRA ranks, 8 output groups,
window 128, the Flash indexer — with a 4096-token vocabulary and 8 routed experts of
256 channels, so the dense reference runs on a CPU) and ``reference-slice`` (the GPU
issue's slice at full widths: 129,280-token vocabulary, 64 experts of 2304 channels).
``--experts`` replaces either's routed expert count.

Parity: one prompt is prefilled by the paged engine in ragged chunks and in one chunk,
in the batch-invariant mode (model/linalg.py; the reference in it too), for every dtype
and kernels backend asked for. Each run's logits against the reference's: bit for bit
or not, the largest difference, the rows off by more than 1e-3, the first row that
differs at all, and whether every selecting layer's top-k equals the reference's. With
the prompt at most ``index_topk`` entries long a selection is every visible entry, so
equal selections prove nothing there: ``choosing_rows`` counts, per selecting layer, the
rows that see more entries than ``index_topk``.

Sensitivity: the reference outside the mode (the BLAS's own GEMMs for the whole
sequence) against the reference in it: the same sums in two correct orders. Per layer,
the largest difference of the residual streams entering it, the window-KV elements
whose FP8 rounding came out differently and the rows whose routed experts differ; then
the logits'. This is how far a last-bit difference travels at these widths: where the
paged runtime and the reference run different kernels (Triton's, on a GPU), their
difference is of this kind.

Usage (CPU, the BENCHMARKS.md figures):
    python3 -m bench.chunked_parity --out bench/results/chunked_parity.json
GPU, the full reference slice at the validation's PAGE size (1100 tokens: from row 512
on the ratio-1 layers, from row 1024 the ratio-2 layers, choose among more entries than
index_topk; ``--tokens 509`` is the validation's "long" prompt):
    python3 -m bench.chunked_parity --device cuda --slice reference-slice --tokens 1100 \
        --block-size 128 --dtypes bfloat16,float32 --kernel-backends torch,triton \
        --out bench/results/chunked_parity_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import random
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]

import torch

import dsv41.model.moe as moe
from dsv41.cluster.engine import Engine
from dsv41.cluster.options import EngineOptions
from dsv41.model.config import FLASH_CONFIG_DIR, LayerMode, V41Config
from dsv41.model.indexer import visible_entries
from dsv41.model.kernels import register_gpu_linalg_kernels
from dsv41.model.params import ModelParams
from dsv41.model.reference import ReferenceModel, ReferenceOutput
from dsv41.model.reference_slice import REFERENCE_SLICE, SliceModel, SliceSpec, load_slice

SLICES = {
    "flash-attention": dataclasses.replace(
        REFERENCE_SLICE,
        name="flash-attention",
        engram_vocab_size=1009,
        n_routed_experts=8,
        widths=(("vocab_size", 4096), ("moe_intermediate_size", 256)),
    ),
    "reference-slice": REFERENCE_SLICE,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OFF = 1e-3


def build(spec: SliceSpec, dtype: torch.dtype, device: str) -> tuple[ModelParams, SliceModel]:
    model = SliceModel.build(spec, V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True))
    return ModelParams.from_checkpoint(load_slice(model, dtype=dtype, device=device)), model


@contextmanager
def recorded_routing() -> Iterator[list[torch.Tensor]]:
    """Each MoE call's routed expert ids [T, k], in call order (one per layer of a
    reference forward, which looks ``route`` up in model/moe at every call), while the
    block runs; the routing itself is unchanged."""
    calls: list[torch.Tensor] = []
    route = moe.route

    def recording(*args, **kwargs) -> moe.Routing:
        routing = route(*args, **kwargs)
        calls.append(routing.expert_ids.cpu())
        return routing

    moe.route = recording
    try:
        yield calls
    finally:
        moe.route = route


def sensitivity(params: ModelParams, prompt: list[int]) -> tuple[ReferenceOutput, dict]:
    """The reference in the mode (returned: the parity's oracle) and outside it, compared."""
    layers = tuple(range(params.config.num_hidden_layers))
    with recorded_routing() as routing_in:
        inside = ReferenceModel(params, batch_invariant=True).forward(prompt, capture_layers=layers)
    with recorded_routing() as routing_out:
        outside = ReferenceModel(params, batch_invariant=False).forward(prompt, capture_layers=layers)
    per_layer = []
    for layer in layers:
        streams = (inside.layer_inputs[layer] - outside.layer_inputs[layer]).abs().amax(dim=(1, 2))
        experts_in, experts_out = (torch.sort(r[layer], dim=1).values for r in (routing_in, routing_out))
        per_layer.append(
            {
                "layer": layer,
                "stream_max_abs_diff": float(streams.max()),
                "stream_rows_differing": int((streams > 0).sum()),
                "window_kv_elements_differing": int((inside.window_kv[layer] != outside.window_kv[layer]).sum()),
                "routing_rows_differing": int((experts_in != experts_out).any(dim=1).sum()),
            }
        )
    logits = (inside.logits - outside.logits).abs().max(dim=1).values.cpu()
    return inside, {
        "logits_max_abs_diff": float(logits.max()),
        "logit_rows_off": int((logits > OFF).sum()),
        "logit_std": float(inside.logits.std()),
        "layers": per_layer,
    }


def choosing_rows(config: V41Config, tokens: int) -> dict[int, int]:
    """Per selecting layer, the prompt rows that see more entries than index_topk."""
    positions = torch.arange(tokens)
    return {
        t.layer_id: int((visible_entries(positions, t.ratio) > config.index_topk).sum())
        for t in config.topology.layers
        if t.mode in (LayerMode.FULL, LayerMode.REINDEX)
    }


def compare(reference: ReferenceOutput, engine: Engine, prompt: list[int], chunks: tuple[int, ...]) -> dict:
    started = time.perf_counter()
    paged = engine.prompt_logits(prompt, chunk_sizes=chunks)
    want = reference.logits.cpu()
    per_row = (paged.logits - want).abs().max(dim=1).values
    differing = (per_row > 0).nonzero().flatten().tolist()
    return {
        "chunks": list(chunks),
        "exact": bool(torch.equal(paged.logits, want)),
        "max_abs_diff": float(per_row.max()),
        "rows_off": int((per_row > OFF).sum()),
        "first_row_differing": differing[0] if differing else None,
        "selections_equal": all(
            torch.equal(paged.selections[layer].cpu(), s.cpu()) for layer, s in reference.selections.items()
        ),
        "seconds": round(time.perf_counter() - started, 1),
    }


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slice", choices=sorted(SLICES), default="flash-attention")
    parser.add_argument("--experts", type=int, default=None, help="routed experts (default: the slice's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    parser.add_argument("--kernel-backends", default="torch", help="comma-separated: torch, triton")
    parser.add_argument("--tokens", type=int, default=268)
    parser.add_argument("--chunks", default="3,1,129,7,128", help="the ragged chunking (cycled)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--no-sensitivity", action="store_true", help="skip the reference-against-itself run")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "chunked_parity.json"))
    args = parser.parse_args()
    dtypes = [DTYPES[name] for name in args.dtypes.split(",")]
    backends = args.kernel_backends.split(",")
    ragged = tuple(int(c) for c in args.chunks.split(","))
    spec = SLICES[args.slice]
    if args.experts is not None:
        spec = dataclasses.replace(spec, n_routed_experts=args.experts)
    torch.set_num_threads(1)
    register_gpu_linalg_kernels(args.device)
    report: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "slice": spec.name,
        "experts": spec.n_routed_experts,
        "tokens": args.tokens,
        "block_size": args.block_size,
        "runs": [],
        "sensitivity": {},
    }

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1))

    for dtype in dtypes:
        dtype_name = str(dtype).removeprefix("torch.")
        params, model = build(spec, dtype, args.device)
        config = params.config
        report["choosing_rows"] = choosing_rows(config, args.tokens)
        rng = random.Random(0)
        prompt = [rng.randrange(3, config.vocab_size) for _ in range(args.tokens)]
        if args.no_sensitivity:
            reference = ReferenceModel(params, batch_invariant=True).forward(prompt)
        else:
            reference, report["sensitivity"][dtype_name] = sensitivity(params, prompt)
            print(dtype_name, "sensitivity", json.dumps(report["sensitivity"][dtype_name]), file=sys.stderr, flush=True)
        save()
        for backend in backends:
            options = EngineOptions(
                dtype=dtype, device=args.device, kernel_backend=backend, batch_invariant=True,
                block_size=args.block_size, state_transfer="copy", enable_prefix_caching=False, num_pages=16,
                max_num_seqs=2,
            )
            engine = Engine.from_params(params, model.tokenizer, options)
            for chunks in (ragged, (args.tokens,)):
                row = {"dtype": dtype_name, "kernel_backend": backend}
                try:
                    row.update(compare(reference, engine, prompt, chunks))
                except Exception as exc:  # a kernel that cannot run here (Triton fp32 at head_dim 512): recorded
                    row.update(chunks=list(chunks), error=f"{type(exc).__name__}: {exc}"[:500])
                report["runs"].append(row)
                print(row, file=sys.stderr, flush=True)
                save()
            del engine
        del params, reference
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"\n{spec.name}, {spec.n_routed_experts} experts, {args.tokens} tokens, {report['device']}")
    print(f"| dtype | kernels | chunks | bit-exact | max abs diff | rows off by > {OFF:g} | first row differing | selections equal |")
    print("|---|---|---|---|---:|---:|---:|---|")
    for r in report["runs"]:
        if "error" in r:
            print(f"| {r['dtype']} | {r['kernel_backend']} | {r['chunks']} | error: {r['error'][:80]} | | | | |")
            continue
        print(
            f"| {r['dtype']} | {r['kernel_backend']} | {r['chunks']} | {r['exact']} | {r['max_abs_diff']:.3g} "
            f"| {r['rows_off']} / {args.tokens} | {r['first_row_differing']} | {r['selections_equal']} |"
        )
    print(f"rows seeing more entries than index_topk, per selecting layer: {report['choosing_rows']}")
    for dtype_name, s in report["sensitivity"].items():
        print(f"\nsensitivity ({dtype_name}): reference outside the mode vs in it; logits max abs diff "
              f"{s['logits_max_abs_diff']:.3g} (logit std {s['logit_std']:.3g}), rows off {s['logit_rows_off']}")
        print("| layer | streams max abs diff | stream rows differing | window-KV elements differing | rows routed differently |")
        print("|---:|---:|---:|---:|---:|")
        for layer in s["layers"]:
            print(
                f"| {layer['layer']} | {layer['stream_max_abs_diff']:.3g} | {layer['stream_rows_differing']} "
                f"| {layer['window_kv_elements_differing']} | {layer['routing_rows_differing']} |"
            )
    save()
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
