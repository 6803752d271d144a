"""How far the stored-format engine's logits are from the dequantised reference.

Issue 18's acceptance: the quantised reference slice, run with its weights in the
checkpoint's stored bytes (FP8 dense kinds + block scales, FP4 routed experts packed)
and the kernels that read them, must give logits within a measured bound of the dense
reference over the same weights decoded to bf16, and greedy tokens that agree with
that reference wherever its margin exceeds the bound.

For each of ``--prompts`` random prompts the engine (stored weights, the chosen
kernels, cudagraph mode and batch-invariance) generates ``--new-tokens`` greedy
tokens; then over prompt + generated tokens the engine's paged logits of every
position (Engine.prompt_logits) and model/reference.py's dense forward over the
decoded weights are compared: the largest |difference|, and at every generated
position whether the engine's token is the reference's argmax and, where not, the
reference's margin (top-1 minus top-2 logit). A disagreement is a near-tie when that
margin is under twice the measured bound: then the difference can flip it.

Prints a table and writes JSON. On the GPU machine, from the repo root:
    python3 -m bench.stored_parity --dense fp8 --experts fp4 [--cudagraph-mode full]
On a CPU (small slice, torch backend):
    python3 -m bench.stored_parity --small --dense fp8 --experts fp4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.slice_engine import add_slice_options, build_slice_engine, environment, prepare_device, random_prompts
from bench.ceilings import ceilings
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.params import ModelParams
from dsv41.model.reference import ReferenceModel
from dsv41.model.reference_slice import REFERENCE_SLICE, SMALL_SLICE, SliceModel, load_slice


def _margins(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_slice_options(parser)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=None, help="default 512 (small: 64)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default="bench/results/stored_parity.json")
    args = parser.parse_args()
    if args.dense == "bf16" and args.experts == "bf16":
        parser.error("--dense/--experts: nothing is quantised (allowed: fp8 dense and/or fp4 experts)")
    args.weight_storage = "stored"
    device = prepare_device(args)
    prompt_len = args.prompt_len or (64 if args.small else 512)
    engine = build_slice_engine(
        args, max_num_seqs=args.prompts, max_num_batched_tokens=max(prompt_len + args.new_tokens, 256),
        tokens_per_request=prompt_len + args.new_tokens + 1,
        graph_batch_sizes=(args.prompts,),
    )
    prompts = random_prompts(args.prompts, prompt_len, engine.config.vocab_size, seed=1)
    began = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True))
    print(f"generated {args.prompts} x {args.new_tokens} tokens in {time.perf_counter() - began:.1f} s", flush=True)

    spec = SMALL_SLICE if args.small else REFERENCE_SLICE
    model = SliceModel.build(spec, V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True), expert_format=args.experts)
    decoded = load_slice(
        model, seed=args.seed, dtype=torch.bfloat16, device=device, weight_storage="decoded", dense_format=args.dense
    )
    reference = ReferenceModel(ModelParams.from_checkpoint(decoded), batch_invariant=engine.options.batch_invariant)

    rows = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        generated = list(out.token_ids)
        sequence = list(prompt) + generated[:-1]
        paged = engine.prompt_logits(sequence).logits.float()
        want = reference.forward(sequence).logits.float().cpu()
        diff = (paged - want).abs()
        # Row prompt_len - 1 + j predicts generated token j.
        at = want[prompt_len - 1 :]
        argmax = at.argmax(-1)
        margins = _margins(at)
        chosen = torch.tensor(generated)
        disagree = (argmax != chosen).nonzero().flatten().tolist()
        rows.append({
            "prompt": i,
            "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()),
            "reference_logit_std": float(want.std()),
            "generated_max_abs_diff": float(diff[prompt_len - 1 :].max()),
            "min_margin": float(margins.min()),
            "disagreements": [
                {"token": j, "engine": generated[j], "reference": int(argmax[j]), "reference_margin": float(margins[j]),
                 "engine_token_gap": float(at[j].max() - at[j, generated[j]])}
                for j in disagree
            ],
        })
        print(f"prompt {i}: max |diff| {rows[-1]['max_abs_diff']:.4g}, {len(disagree)} of {len(generated)} "
              f"greedy tokens differ from the reference's argmax", flush=True)
    bound = max(r["max_abs_diff"] for r in rows)
    for r in rows:
        for d in r["disagreements"]:
            d["near_tie"] = d["reference_margin"] < 2 * bound
    total = sum(len(o.token_ids) for o in outputs)
    differing = sum(len(r["disagreements"]) for r in rows)
    unexplained = sum(not d["near_tie"] for r in rows for d in r["disagreements"])
    result = {
        **environment(args, engine, ceilings(device)),
        "prompt_len": prompt_len,
        "new_tokens": args.new_tokens,
        "bound_max_abs_diff": bound,
        "greedy_tokens": total,
        "greedy_tokens_differing": differing,
        "differing_beyond_twice_the_bound": unexplained,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print()
    print("| prompt | max abs diff | mean abs diff | ref logit std | greedy differing | their ref margins |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        margins = ", ".join(f"{d['reference_margin']:.3g}" for d in r["disagreements"]) or "-"
        print(f"| {r['prompt']} | {r['max_abs_diff']:.4g} | {r['mean_abs_diff']:.3g} | {r['reference_logit_std']:.3g} "
              f"| {len(r['disagreements'])} | {margins} |")
    print(f"bound (max |diff|) {bound:.4g}; {differing} of {total} greedy tokens differ, "
          f"{unexplained} with a reference margin of at least twice the bound")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
