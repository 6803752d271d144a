"""Rows per program of the row-wise Triton kernels: time, and whether a row's bits change.

The mHC site steps (model/kernels/triton/mhc.py: the mix with its projection, the
collapse + RMSNorm, the expand) and three projection epilogues
(model/kernels/triton/epilogue.py: the window KV's norm + rope + FP8 rounding, the
query latent's norm, the query heads' rope) at the V4.1-Flash widths on random inputs,
each at ``--tokens`` rows with 1, 2, 4, 8 and 16 rows a program: median milliseconds of
the call (triton.testing.do_bench, so a small call's launch cost is in it) and whether
every output equals the one-row-a-program call's bit for bit. The data the kernels'
rows per program on a GPU are chosen from (mhc.HC_MIX_GPU_ROWS).

Prints a table and writes JSON. On the GPU machine, from the repo root:
    python3 -m bench.rows_per_program [--tokens 32,128,4096]
Under TRITON_INTERPRET=1 on the CPU it runs as a check of the bits alone (times 0).
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
import triton

from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.epilogue import Epilogue
from dsv41.model.kernels.triton.epilogue import fused_epilogue
from dsv41.model.kernels.triton.mhc import fused_collapse_norm, fused_expand, fused_hc_mix
from dsv41.model.mhc import HcMix, HcSite
from dsv41.model.rope import Rope

ROWS_PER_PROGRAM = (1, 2, 4, 8, 16)
EPS = 1e-6


def _outputs(result: HcMix | torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (result.pre, result.post, result.comb) if isinstance(result, HcMix) else (result,)


def kernel_calls(config: V41Config, tokens: int, device: str) -> dict[str, Callable[[int], HcMix | torch.Tensor]]:
    """Each kernel's call on random inputs of ``tokens`` rows, by its rows a program."""
    g = torch.Generator(device=device).manual_seed(tokens)
    hc, hidden = config.hc_mult, config.hidden_size

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=g) * scale

    site = HcSite(
        fn=randn((2 + hc) * hc, hc * hidden, scale=0.01),
        base=randn((2 + hc) * hc, scale=0.1),
        scale=torch.rand(3, device=device, generator=g),
    )
    # Layer 3's rope: a compressed layer's, with YaRN (as tests/model/test_kernels_epilogue.py).
    theta, yarn = config.layer_rope(3)
    rope = Rope.build(config.qk_rope_head_dim, theta, yarn)
    kv_norm = torch.rand(config.head_dim, device=device, generator=g) + 0.5
    latent_norm = torch.rand(config.q_lora_rank, device=device, generator=g) + 0.5
    hidden_norm = torch.rand(hidden, device=device, generator=g) + 0.5
    streams = randn(tokens, hc, hidden).to(torch.bfloat16)
    mix = fused_hc_mix(streams, site, config)
    y = randn(tokens, hidden).to(torch.bfloat16)
    kv = randn(tokens, config.head_dim).to(torch.bfloat16)
    latent = randn(tokens, config.q_lora_rank).to(torch.bfloat16)
    query = randn(tokens, config.num_attention_heads, config.head_dim).to(torch.bfloat16)
    positions = torch.arange(tokens, device=device)
    window_kv = Epilogue(torch.bfloat16, norm=kv_norm, eps=EPS, rope=rope, round_to="fp8")
    return {
        "hc_mix": lambda rows: fused_hc_mix(streams, site, config, block_t=rows),
        "collapse_norm": lambda rows: fused_collapse_norm(
            streams, mix.pre, hidden_norm, EPS, torch.bfloat16, block_t=rows
        ),
        "expand": lambda rows: fused_expand(streams, y, mix, block_t=rows),
        "epilogue window_kv": lambda rows: fused_epilogue(kv, window_kv, positions, block_r=rows),
        "epilogue q_latent": lambda rows: fused_epilogue(
            latent, Epilogue(torch.bfloat16, norm=latent_norm, eps=EPS), None, block_r=rows
        ),
        "epilogue query": lambda rows: fused_epilogue(
            query, Epilogue(torch.bfloat16, rope=rope), positions, block_r=rows
        ),
    }


def measure(config: V41Config, tokens: int, device: str) -> list[dict[str, object]]:
    """Every kernel call at every ROWS_PER_PROGRAM: ms (0 off a GPU) and bit equality
    with one row a program."""
    rows = []
    for name, call in kernel_calls(config, tokens, device).items():
        one_row = _outputs(call(1))
        for per_program in ROWS_PER_PROGRAM:
            got = _outputs(call(per_program))
            same = all(torch.equal(a, b) for a, b in zip(got, one_row))
            ms = (
                float(triton.testing.do_bench(lambda: call(per_program), rep=50, return_mode="median"))
                if device == "cuda"
                else 0.0
            )
            rows.append(
                {"kernel": name, "tokens": tokens, "rows_per_program": per_program, "ms": ms, "same_bits": same}
            )
            print(
                f"{name:20s} T={tokens:5d} rows/program {per_program:2d} {ms * 1e3:9.1f} us  same bits: {same}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="32,128,4096", help="comma-separated row counts")
    parser.add_argument("--out", default="bench/results/rows_per_program.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True)
    rows = [row for tokens in (int(t) for t in args.tokens.split(",")) for row in measure(config, tokens, device)]
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter: bits only)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print()
    print("| kernel | tokens | " + " | ".join(f"{n} rows us" for n in ROWS_PER_PROGRAM) + " |")
    print("|---|---:|" + "---:|" * len(ROWS_PER_PROGRAM))
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        for tokens in dict.fromkeys(r["tokens"] for r in rows):
            cells = [r for r in rows if r["kernel"] == kernel and r["tokens"] == tokens]
            shown = [f"{r['ms'] * 1e3:.1f}{'' if r['same_bits'] else ' (bits differ)'}" for r in cells]
            print(f"| {kernel} | {tokens} | " + " | ".join(shown) + " |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
