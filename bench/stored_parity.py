"""How far the stored-format engine's logits are from the dequantised reference.

Issue 18's acceptance: the quantised reference slice, run with its weights in the
checkpoint's stored bytes (FP8 dense kinds + block scales, FP4 routed experts packed)
and the kernels that read them, must give logits within a measured bound of the dense
reference over the same weights decoded to bf16, and greedy tokens that agree with
that reference wherever its margin exceeds the bound.

With ``--fp8-activations`` the stored engine also quantises the inputs of its FP8-weight
projections to FP8 (EngineOptions.fp8_activations), and the same figures measure what
that costs: the FP8-activation mode's bound.

Random bf16 weights make the slice chaotic: any two sums of different order drift
apart over its layers. So the same comparison runs for a baseline, an engine over the
reference's own decoded weights with the same kernels (what the kernels' bf16
arithmetic alone costs), and the two engines are compared with each other (what
keeping the weights stored costs on top).

For each of ``--prompts`` random prompts the engine (stored weights, the chosen
kernels, cudagraph mode and batch-invariance) generates ``--new-tokens`` greedy
tokens; then over prompt + generated tokens the engine's paged logits of every
position (Engine.prompt_logits, in ``--chunk-size`` chunks) and model/reference.py's dense forward over the
decoded weights are compared: the largest |difference|, and at every generated
position whether the engine's token is the reference's argmax and, where not, the
reference's margin (top-1 minus top-2 logit). A disagreement is a near-tie when that
margin is under twice the measured bound: then the difference can flip it.

Prints a table and writes JSON. On the GPU machine, from the repo root:
    python3 -m bench.stored_parity --dense fp8 --experts fp4 [--cudagraph-mode full] [--fp8-activations]
On a CPU (small slice, torch backend):
    python3 -m bench.stored_parity --small --dense fp8 --experts fp4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.slice_engine import (
    add_slice_options,
    build_slice_engine,
    environment,
    generate_slice,
    prepare_device,
    random_prompts,
)
from bench.ceilings import ceilings
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.reference import ReferenceModel


def _margins(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_slice_options(parser)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=None, help="default 512 (small: 64)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--chunk-size", type=int, default=64,
        help="prompt logits are prefilled in chunks of this many tokens: under linalg.DECODED_GEMM_ROWS a "
        "projection reads the stored FP8 bytes itself (at or above it, it decodes them for cuBLAS)",
    )
    parser.add_argument("--out", default="bench/results/stored_parity.json")
    args = parser.parse_args()
    if args.dense == "bf16" and args.experts == "bf16":
        parser.error("--dense/--experts: nothing is quantised (allowed: fp8 dense and/or fp4 experts)")
    args.weight_storage = "stored"
    device = prepare_device(args)
    prompt_len = args.prompt_len or (64 if args.small else 512)
    sizes = dict(
        max_num_seqs=args.prompts, max_num_batched_tokens=max(prompt_len + args.new_tokens, 256),
        tokens_per_request=prompt_len + args.new_tokens + 1, graph_batch_sizes=(args.prompts,),
    )
    decoded = generate_slice(args, weight_storage="decoded")
    engines = {
        "stored": build_slice_engine(args, **sizes),
        "decoded": build_slice_engine(args, checkpoint=decoded, fp8_activations=False, **sizes),
    }
    engine = engines["stored"]
    reference = ReferenceModel(engines["decoded"].params, batch_invariant=engine.options.batch_invariant)
    prompts = random_prompts(args.prompts, prompt_len, engine.config.vocab_size, seed=1)
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    generated_by: dict[str, list[list[int]]] = {}
    for name, e in engines.items():
        began = time.perf_counter()
        generated_by[name] = [list(o.token_ids) for o in e.generate(prompts, greedy)]
        print(f"{name}: generated {args.prompts} x {args.new_tokens} tokens in {time.perf_counter() - began:.1f} s",
              flush=True)
    outputs = generated_by["stored"]

    rows = []
    for i, (prompt, generated) in enumerate(zip(prompts, outputs)):
        sequence = list(prompt) + generated[:-1]
        chunks = (args.chunk_size,)
        paged = engine.prompt_logits(sequence, chunk_sizes=chunks).logits.float()
        baseline = engines["decoded"].prompt_logits(sequence, chunk_sizes=chunks).logits.float()
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
            "decoded_engine_max_abs_diff": float((baseline - want).abs().max()),
            "decoded_engine_mean_abs_diff": float((baseline - want).abs().mean()),
            "stored_vs_decoded_engine_max_abs_diff": float((paged - baseline).abs().max()),
            "stored_vs_decoded_engine_mean_abs_diff": float((paged - baseline).abs().mean()),
            # Greedy decoding is chaotic on random weights: after the first token that
            # differs the two continuations share nothing, so where it falls is the figure.
            "first_token_differing_from_the_decoded_engine": next(
                (j for j, (a, b) in enumerate(zip(generated, generated_by["decoded"][i])) if a != b), None
            ),
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
    total = sum(len(g) for g in outputs)
    differing = sum(len(r["disagreements"]) for r in rows)
    unexplained = sum(not d["near_tie"] for r in rows for d in r["disagreements"])
    result = {
        **environment(args, engine, ceilings(device)),
        "prompt_len": prompt_len,
        "new_tokens": args.new_tokens,
        "chunk_size": args.chunk_size,
        "bound_max_abs_diff": bound,
        "greedy_tokens": total,
        "greedy_tokens_differing": differing,
        "differing_beyond_twice_the_bound": unexplained,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print()
    print("| prompt | stored vs ref: max / mean abs diff | decoded engine vs ref | stored vs decoded engine "
          "| ref logit std | greedy differing from ref | their ref margins | first token unlike the decoded engine's |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        margins = ", ".join(f"{d['reference_margin']:.3g}" for d in r["disagreements"]) or "-"
        print(f"| {r['prompt']} | {r['max_abs_diff']:.4g} / {r['mean_abs_diff']:.3g} "
              f"| {r['decoded_engine_max_abs_diff']:.4g} / {r['decoded_engine_mean_abs_diff']:.3g} "
              f"| {r['stored_vs_decoded_engine_max_abs_diff']:.4g} / {r['stored_vs_decoded_engine_mean_abs_diff']:.3g} "
              f"| {r['reference_logit_std']:.3g} | {len(r['disagreements'])} | {margins} "
              f"| {r['first_token_differing_from_the_decoded_engine']} |")
    print(f"bound (max |diff|) {bound:.4g}; {differing} of {total} greedy tokens differ, "
          f"{unexplained} with a reference margin of at least twice the bound")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
