"""Paged kernel benchmarks on a GPU at V4.1-Flash dims, against ceilings measured in the
same run: decode sparse attention (64 heads x 512, window 128 + top-512 entries) and the
paged index scorer (32 heads x 128, FP8 and FP4 planes), batch 1..256, context 4k..128k,
on real pool planes (the V4.1-Flash geometry at block 128), read in place; and the routed
experts' grouped GEMMs (hidden 5120, moe_intermediate 2304, top-6 of 64 or 256 held
experts, bf16 and MXFP4-packed weights, 1..256 decode tokens and a 4096-token prefill);
and the compression path's kernels (a ratio-2 owner's pair pooling with its STATE tails,
its main and index row stores, and the step's window-ring stores: head_dim 512, index
128, 1..256 decode rows and a 4096-row prefill), as time and bytes/s against the copy
bandwidth.

Prints tables and writes JSON. Usage (on the GPU machine, from the repo root):
    python3 -m bench.kernels --out kernels.json
The attention/scorer table compares each kernel with the rows of a baseline JSON (by
default bench/results/kernels.json as it was before this run: the first Triton
baseline), and a tiling sweep at 32k context times other AttentionTiling / ScorerTiling
choices than the defaults, and the all-heads kernel's MlaTiling cuts, each attention
variant checked against the torch backend's output (GPU only; --no-sweep skips it).
The attention part alone at 32k (rows and the attention sweep at batch 8/32/128, both
pool formats; no scorer sweep, MoE, GEMM or compression):
    python3 -m bench.kernels --attention-only --contexts 32768 --batches 8 32 128 --out attention.json
(most of its time is compiling the sweep's variants, each split and unsplit on both
formats; --attention-variants names the ones to time).
The MoE section alone, with its tiling sweeps of the MXFP4 and bf16 kernels (--no-sweep
skips them and the down launch's program orders; --moe-sweep-formats plain sweeps the
bf16 kernels alone; --moe-down-groups names the orders):
    python3 -m bench.kernels --moe-only --out moe.json
The down launch's program orders alone (each output checked for the first order's bits):
    python3 -m bench.kernels --moe-down-only --out moe_down.json
The dense projections alone (each FP8-stored shape of a Flash layer at 1..4096 rows:
the fixed-tile GEMM over the FP8 bytes, over their bf16 decode, and cuBLAS bf16,
against copy bandwidth and the bf16 and FP8 matmul rates measured in the run):
    python3 -m bench.kernels --gemm-only --out gemm.json
A smoke run on a CPU (small batches and contexts, the Triton kernels in their
interpreter, no MoE section: its Flash-size expert weights are GBs):
    TRITON_INTERPRET=1 python3 -m bench.kernels --small --out /tmp/kernels-small.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton.testing
from triton.runtime.errors import OutOfResources

from bench.ceilings import ceilings
from dsv41.cache.addressing import PoolShape, SegmentSpec, build_step_addresses
from dsv41.cache.plane_io import PlaneIO
from dsv41.cache.pools import PoolSize, V41Pools
from dsv41.cluster.pool_layout import pool_geometry
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.device import move_tensors
from dsv41.model import formats
from dsv41.model.formats import round_fp8, round_mxfp4
from dsv41.model.kernels.torch_backend import TorchKernels
from dsv41.model.kernels.triton import TritonKernels
from dsv41.model.kernels.triton.attention import DEFAULT_ATTENTION_TILING, AttentionTiling, MlaTiling
from dsv41.model.kernels.triton.gemm import decode_fp8_weight, fixed_tile_matmul
from dsv41.model.kernels.triton.index_scorer import ScorerTiling
from dsv41.model.kernels.triton.moe import (
    EVERY_BLOCK,
    ExpertTiling,
    PairBlocks,
    TritonExpertBank,
    align_pairs,
    block_rows,
    expert_down,
    expert_tiling,
    grouped_expert_slots,
)
from dsv41.model.linalg import fp8_activations, linear
from dsv41.model.moe import ExpertWeights, Routing, route, routed_expert_slots
from dsv41.model.stored_weights import Fp8Weight
from dsv41.model.weights import TensorKind, checkpoint_tensors

FLASH = FLASH_CONFIG_DIR
BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (4096, 32768, 131072)
MAX_POOL_BYTES = 48 << 30
MOE_EXPERTS = (64, 256)
MOE_TOKENS = (1, 8, 32, 128, 256, 4096)
MOE_CHECK_TOKENS = 32
# The MXFP4 tiling sweep: (held experts, tokens) and the tilings it times; the decode
# shapes run 16-row blocks, the prefill 64-row blocks.
MOE_SWEEP_SHAPES = ((64, 32), (256, 128), (64, 4096))
MOE_SWEEP = (
    ExpertTiling(block_n=64, block_k=128, num_warps=4, num_stages=4),
    ExpertTiling(block_n=128, block_k=128, num_warps=8, num_stages=3),
    ExpertTiling(block_n=128, block_k=128, num_warps=8, num_stages=3, max_registers=128),
    ExpertTiling(block_n=64, block_k=128, num_warps=4, num_stages=3),
    ExpertTiling(block_n=64, block_k=256, num_warps=4, num_stages=3),
    ExpertTiling(block_n=32, block_k=256, num_warps=4, num_stages=4),
    ExpertTiling(block_n=128, block_k=64, num_warps=8, num_stages=4),
    ExpertTiling(block_n=64, block_k=128, num_warps=4, num_stages=4, mxfp4_dot="decoded"),
    ExpertTiling(block_n=64, block_k=128, num_warps=4, num_stages=4, mxfp4_dot="bits"),
    ExpertTiling(block_n=64, block_k=128, num_warps=4, num_stages=3, mxfp4_dot="bits"),
    ExpertTiling(block_n=64, block_k=256, num_warps=4, num_stages=3, mxfp4_dot="bits"),
    ExpertTiling(block_n=128, block_k=128, num_warps=8, num_stages=3, mxfp4_dot="bits"),
    ExpertTiling(block_n=128, block_k=64, num_warps=4, num_stages=4, mxfp4_dot="bits"),
    ExpertTiling(block_n=32, block_k=256, num_warps=4, num_stages=4, mxfp4_dot="bits"),
)
# The bf16 ("plain") tiling sweep, on the same shapes: the default, then wider column
# tiles on one or two warpgroups, deeper pipelines and wider input steps, then 128-row
# blocks (for the prefill's compute-bound shape; the three that sm_90 builds at the
# Flash dims without register spills, triton 3.9, 2026-12-07).
PLAIN_MOE_SWEEP = (
    ExpertTiling(),
    ExpertTiling(block_n=128, block_k=64, num_warps=4, num_stages=3),
    ExpertTiling(block_n=128, block_k=64, num_warps=8, num_stages=3),
    ExpertTiling(block_n=128, block_k=64, num_warps=8, num_stages=4),
    ExpertTiling(block_n=256, block_k=64, num_warps=8, num_stages=3),
    ExpertTiling(block_n=64, block_k=64, num_warps=4, num_stages=4),
    ExpertTiling(block_n=64, block_k=128, num_warps=4, num_stages=3),
    ExpertTiling(block_n=128, block_k=128, num_warps=8, num_stages=3),
    ExpertTiling(block_n=64, block_k=64, num_warps=8, num_stages=4, block_m=128),
    ExpertTiling(block_n=128, block_k=64, num_warps=8, num_stages=3, block_m=128),
    ExpertTiling(block_n=128, block_k=64, num_warps=8, num_stages=4, block_m=128),
)
MOE_SWEEPS = {"mxfp4": MOE_SWEEP, "plain": PLAIN_MOE_SWEEP}
# The down launch's program orders (expert_down's block_group), on 64 held experts at two
# decode widths and a prefill: 0 stands for every block of a column tile side by side
# (moe.EVERY_BLOCK: decode heights' order, and a prefill's before moe.DOWN_BLOCK_GROUP).
MOE_DOWN_GROUPS = (0, 1, 4, 8, 16)
MOE_DOWN_SHAPES = ((64, 32), (64, 128), (64, 4096))
COMPRESSION_PREFILL_ROWS = 4096
# The dense projections' rows: decode batches and one 4096-token prefill.
GEMM_ROWS = (1, 8, 32, 128, 256, 1024, 4096)
# --small: what a CPU runs in minutes with the kernels interpreted.
SMALL_BATCHES = (1, 2)
SMALL_CONTEXTS = (4096,)
SMALL_COMPRESSION_PREFILL_ROWS = 128
# The tiling sweep: shapes, and the variants of the defaults it times.
SWEEP_CONTEXT = 32768
SWEEP_BATCHES = (8, 32, 128)
ATTENTION_SWEEP = {
    "default": DEFAULT_ATTENTION_TILING,
    # The 16-head cut (the engine's until 2026-12-06) and its variants.
    "16 heads": AttentionTiling(),
    "16 heads block_n=16": AttentionTiling(block_n=16),
    "16 heads block_n=32": AttentionTiling(block_n=32),
    "16 heads num_stages=2": AttentionTiling(num_stages=2),
    "16 heads no key split": AttentionTiling(programs_per_wave=1),
    # The all-heads kernel (MlaTiling): its default and cuts that compiled for sm_90
    # without spills (triton 3.9 on the CPU dev box, 2026-12-02), among them FlashMLA's
    # one program per row (the whole [64, 512] accumulator), which holds only with q
    # re-read from L2 for every tile (q_reload): with one stage and 32-key tiles, the default.
    "mla": MlaTiling(),
    "mla block_n=16 qk_chunk=128": MlaTiling(block_n=16, qk_chunk=128),
    "mla qk_chunk=128 dim_split=4": MlaTiling(qk_chunk=128, dim_split=4),
    "mla q_reload num_stages=1": MlaTiling(q_reload=True, num_stages=1),
    "mla row/program q_reload block_n=16": MlaTiling(block_n=16, q_reload=True, dim_split=1),
    "mla no key split": MlaTiling(programs_per_wave=1),
    # One warpgroup a program, half the latent each: its [64, keys] logits need no
    # replication, and with q re-read and one stage it builds without spills at 231-252
    # registers (16-key tiles; triton 3.6.0 and 3.9.0, 2026-12-08; 32-key tiles spill
    # 16-44 bytes in some builds), so two programs share an SM and one's loads can
    # overlap the other's dots (the default runs one a SM).
    "mla 4 warps dim_split=2 q_reload num_stages=1 block_n=16": MlaTiling(
        block_n=16, q_reload=True, dim_split=2, num_warps=4, num_stages=1
    ),
    "mla 4 warps dim_split=2 q_reload num_stages=1": MlaTiling(q_reload=True, dim_split=2, num_warps=4, num_stages=1),
}
# A sweep variant's output against the torch backend's counts as correct within the
# tests' bf16 tolerance (tests/model/test_kernels_triton.py: bf16 dots, bf16 probabilities).
SWEEP_REL_TOL = 2e-2
SCORER_SWEEP = {
    "default": ScorerTiling(),
    "block_c=64": ScorerTiling(block_c=64),
    "block_c=256 warps=8": ScorerTiling(block_c=256, num_warps=8),
    "num_stages=2": ScorerTiling(num_stages=2),
    "num_stages=4": ScorerTiling(num_stages=4),
}


def median_ms(fn) -> float:
    """Median milliseconds of ``fn``: do_bench's CUDA-event timing on a GPU, else the
    wall clock over a few calls (the --small smoke run on a CPU)."""
    if torch.cuda.is_available():
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def fill_random(pools: V41Pools) -> None:
    """Random finite data in every plane (never zeros: they hide indexing bugs)."""
    geometry = pools.geometry
    for owner in geometry.full_owners:
        main = pools.main_kv(owner)
        if main.dtype == torch.bfloat16:
            main.normal_()
        else:
            main.random_(0, 256)
            pools.main_kv_scales(owner).random_(0x30, 0x40)
        pools.index_values(owner).random_(0, 0x7F)
        pools.index_scales(owner).random_(120, 134)
    for layer in geometry.ring_layers:
        ring = pools.swa_ring(layer)
        if ring.dtype == torch.bfloat16:
            ring.normal_()
        else:
            ring.random_(0, 0x7F)
            pools.swa_scales(layer).random_(120, 134)


def attention_case(config: V41Config, store: PlaneIO, batch: int, context: int, pages_per_req: int):
    dev = store.pools.device
    g = torch.Generator(device=dev).manual_seed(batch * 7 + context)
    heads, dim, window, topk = config.num_attention_heads, config.head_dim, config.sliding_window, config.index_topk
    owner = config.topology.decoder_start  # the ratio-1 owner the decoder reads
    per_page = store.geometry.rows_per_page(owner)
    q = torch.randn(batch, heads, dim, device=dev, dtype=torch.bfloat16, generator=g)
    chunk_kv = torch.randn(batch, dim, device=dev, dtype=torch.bfloat16, generator=g)
    ring_rows_per_slot = store.geometry.ring_rows
    position = context - 1
    key_pos = position - window + 1 + torch.arange(window, device=dev)
    chunk_rows = torch.where(key_pos == position, torch.arange(batch, device=dev)[:, None], -1)
    slots = torch.arange(batch, device=dev)[:, None]
    ring_rows = torch.where(chunk_rows < 0, slots * ring_rows_per_slot + key_pos % ring_rows_per_slot, -1)
    valid = torch.ones(batch, window, dtype=torch.bool, device=dev)
    entries = torch.randint(0, context // 1, (batch, topk), device=dev, generator=g)
    pages = torch.arange(batch, device=dev)[:, None] * pages_per_req + entries // per_page
    entry_rows = pages * per_page + entries % per_page
    sink = torch.randn(heads, device=dev, generator=g)
    return (q, chunk_kv, chunk_rows, ring_rows, valid, store.window_plane(0), entry_rows, store.main_plane(owner), sink, dim**-0.5)


def scorer_case(config: V41Config, store: PlaneIO, batch: int, context: int, pages_per_req: int):
    dev = store.pools.device
    g = torch.Generator(device=dev).manual_seed(batch * 11 + context)
    owner = config.topology.full_owners[0]  # a ratio-2 owner
    per_page = store.geometry.rows_per_page(owner)
    width = context // store.geometry.ratio_of(owner)
    j = torch.arange(width, device=dev)
    tile = (torch.arange(batch, device=dev)[:, None] * pages_per_req + j // per_page) * per_page + j % per_page
    q = round_mxfp4(torch.randn(batch, config.index_n_heads, config.index_head_dim, device=dev, generator=g))
    w = torch.randn(batch, config.index_n_heads, device=dev, generator=g)
    return (q, w, tile, torch.arange(batch, device=dev), store.index_plane(owner))


def attention_bytes(config: V41Config, kv: str, batch: int) -> float:
    """Bytes a decode attention launch must move: each row's W - 1 ring rows, its own
    step's key row and its K main rows once (the head groups that share a row read it
    through L2), q read and out written (bf16), and its addresses: 8-byte flat rows
    (chunk, ring) and a 1-byte valid flag per window key, an 8-byte flat row per main
    entry. Split partials, an overhead, are not counted."""
    heads, dim, window, topk = config.num_attention_heads, config.head_dim, config.sliding_window, config.index_topk
    main_row = dim * 2 if kv == "bf16" else dim / 2 + dim / 16  # bf16, or NVFP4 + E4M3 scales
    ring_row = dim * 2 if kv == "bf16" else dim + dim / 32  # bf16, or FP8 + E8M0 scales
    per_row = (window - 1) * ring_row + dim * 2 + topk * main_row + 2 * heads * dim * 2 + window * 17 + topk * 8
    return batch * per_row


def scorer_bytes(config: V41Config, index: str, batch: int, width: int) -> float:
    """Bytes a scorer launch must move: every tile entry's key (values and scales), its
    8-byte flat row and its 4-byte score."""
    entry = (config.index_head_dim if index == "fp8" else config.index_head_dim / 2) + config.index_head_dim / 32
    return batch * width * (entry + 8 + 4)


def tiling_sweep(
    config: V41Config,
    ceil: dict,
    kv: str,
    index: str,
    batch: int,
    att: tuple,
    sc: tuple,
    scorer: bool = True,
    variants: list[str] | None = None,
) -> list[dict]:
    """Kernel ms and fraction of the copy bandwidth of each ATTENTION_SWEEP variant (the
    named ``variants``, or all) and, with ``scorer``, each SCORER_SWEEP one on one shape
    (the data to choose the defaults from), each attention variant's relative error
    against the torch backend's output with it."""
    rows = []
    reference = TorchKernels().attend(*att).float()
    attention = {name: ATTENTION_SWEEP[name] for name in variants or ATTENTION_SWEEP}
    for kernel, tilings in (("attention", attention), ("scorer", SCORER_SWEEP if scorer else {})):
        for name, tiling in tilings.items():
            if kernel == "attention":
                launch = TritonKernels(attention_tiling=tiling).prepare_attention(*att)
                moved = attention_bytes(config, kv, batch)
            else:
                launch = TritonKernels(scorer_tiling=tiling).prepare_score(*sc)
                moved = scorer_bytes(config, index, batch, sc[2].shape[1])
            row = {
                "formats": f"{kv}/{index}",
                "batch": batch,
                "context": SWEEP_CONTEXT,
                "kernel": kernel,
                "variant": name,
                "tiling": repr(tiling),
                "programs": math.prod(launch.launches[0].grid),
            }
            try:
                if kernel == "attention":
                    got = launch.run().float()
                    row["rel_err"] = float((got - reference).norm() / reference.norm())
                    row["correct"] = row["rel_err"] < SWEEP_REL_TOL
                ms = median_ms(launch.run)
            except OutOfResources as error:
                # A variant this GPU cannot run is a result of the sweep, not its end.
                rows.append({**row, "kernel_ms": None, "bw_frac": None, "error": str(error)})
                print(f"sweep {kv}/{index} B={batch:<4d} {kernel:9s} {name:42s} {error}", flush=True)
                continue
            rows.append({**row, "kernel_ms": ms, "bw_frac": moved / (ms * 1e-3) / ceil["copy_bytes_per_s"]})
            check = ""
            if kernel == "attention":
                check = f" rel err {row['rel_err']:.1e}{'' if row['correct'] else ' WRONG'}"
            print(
                f"sweep {kv}/{index} B={batch:<4d} {kernel:9s} {name:42s} {ms:8.4f} ms "
                f"({rows[-1]['bw_frac']:.0%} bw, {row['programs']} programs){check}",
                flush=True,
            )
    return rows


def load_baseline(path: Path) -> tuple[str, dict[tuple[str, int, int], dict]]:
    """The rows of an earlier run of this script by (formats, batch, context), and its date."""
    if not path.is_file():
        return "none", {}
    earlier = json.loads(path.read_text())
    return earlier.get("date", "?"), {(r["formats"], r["batch"], r["context"]): r for r in earlier.get("rows", [])}


def moe_experts(config: V41Config, num_experts: int, fmt: str) -> dict[int, ExpertWeights]:
    """Random bf16 experts at Flash dims; for "mxfp4", on the MXFP4 grid (what the
    loader decodes from an FP4 checkpoint), so the bank packs them exactly."""
    g = torch.Generator(device="cuda").manual_seed(num_experts)
    hidden, inter = config.hidden_size, config.moe_intermediate_size

    def weight(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(rows, cols, device="cuda", generator=g) * cols**-0.5
        return (round_mxfp4(w) if fmt == "mxfp4" else w).to(torch.bfloat16)

    return {
        e: ExpertWeights(w1=weight(inter, hidden), w2=weight(hidden, inter), w3=weight(inter, hidden))
        for e in range(num_experts)
    }


def expert_bytes_per_weight(fmt: str) -> float:
    """Bytes a bank of ``fmt`` holds per expert weight value: bf16, or an E2M1 nibble plus
    one E8M0 byte per 32."""
    return 2 if fmt == "plain" else 0.5 + 1 / 32


def moe_bytes(config: V41Config, fmt: str, tokens: int, experts_hit: int) -> float:
    """Bytes a grouped-GEMM step must move: the weights of the distinct experts it routes
    to (expert_bytes_per_weight), x, the intermediate h (written and read), the per-pair
    outputs (written and read) and the fp32 sums."""
    hidden, inter, top_k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    expert_bytes = 3 * hidden * inter * expert_bytes_per_weight(fmt)
    pairs = tokens * top_k
    return experts_hit * expert_bytes + tokens * hidden * 2 + pairs * (inter + hidden) * 2 * 2 + pairs * hidden * 4


def mxfp4_decode_check(bank, w2: torch.Tensor) -> dict:
    """Whether the w2 launch reads the first held expert's packs as exactly its decoded
    bf16 weight ``w2`` [hidden, inter] (the bank's build checked that the packs hold
    it: dequantize_fp4_weight of them is ``w2``): h is the identity (one pair row per
    intermediate index, all in that expert's blocks of 16), so each output row is one
    decoded column of w2 (a sum of one product by 1.0 and zeros)."""
    inter, hidden = bank.intermediate, bank.hidden
    h = torch.eye(inter, device="cuda", dtype=torch.bfloat16)
    blocks = PairBlocks(
        block_m=16,
        slot_pairs=torch.arange(inter, device="cuda", dtype=torch.int32),
        block_experts=torch.zeros(inter // 16, device="cuda", dtype=torch.int32),
    )
    out = torch.zeros(inter, hidden, device="cuda", dtype=torch.bfloat16)
    expert_down(h, out, blocks, bank, expert_tiling("mxfp4", blocks.block_m), bf16_dot=True)
    want = w2.T
    return {"check": "w2 decode exact", "equal": bool(torch.equal(out, want)), "mismatches": int((out != want).sum())}


def _bank_and_router(
    config: V41Config, num_experts: int, fmt: str
) -> tuple[TritonExpertBank, Callable[[int], tuple[torch.Tensor, Routing]]]:
    """A Triton bank of ``num_experts`` random experts in ``fmt`` (moe_experts; the
    unpacked weights freed once banked) and a function of a token count giving random
    bf16 rows and their routing by a random router over those experts."""
    experts = moe_experts(config, num_experts, fmt)
    bank = TritonKernels().expert_bank(experts, fmt)
    del experts
    hidden = config.hidden_size
    gate = torch.randn(num_experts, hidden, device="cuda") * hidden**-0.5
    bias = torch.zeros(num_experts, device="cuda")

    def router(tokens: int) -> tuple[torch.Tensor, Routing]:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        return x, route(x, gate, bias, config.num_experts_per_tok, config.routed_scaling_factor)

    return bank, router


def moe_sweep(config: V41Config, ceil: dict, formats: tuple[str, ...]) -> list[dict]:
    """Kernel ms and fraction of the copy bandwidth of each MOE_SWEEPS tiling of the
    grouped expert kernels of each of ``formats`` on the MOE_SWEEP_SHAPES (the data to
    choose the defaults from)."""
    return [row for fmt in formats for row in _format_moe_sweep(config, ceil, fmt)]


def _format_moe_sweep(config: V41Config, ceil: dict, fmt: str) -> list[dict]:
    hidden, top_k = config.hidden_size, config.num_experts_per_tok
    rows = []
    for num_experts in sorted({e for e, _ in MOE_SWEEP_SHAPES}):
        bank, router = _bank_and_router(config, num_experts, fmt)
        for held, tokens in MOE_SWEEP_SHAPES:
            if held != num_experts:
                continue
            x, routing = router(tokens)
            hit = routing.expert_ids.unique().numel()
            moved = moe_bytes(config, fmt, tokens, hit)
            flops = 2 * tokens * top_k * 3 * hidden * config.moe_intermediate_size
            for tiling in MOE_SWEEPS[fmt]:
                row = {"format": fmt, "experts": num_experts, "tokens": tokens, "tiling": str(tiling)}
                try:
                    ms = median_ms(
                        lambda: grouped_expert_slots(
                            x, routing, bank, config.swiglu_limit, bf16_dot=True, tiling=tiling
                        )
                    )
                except OutOfResources as error:
                    rows.append({**row, "ms": None, "bw_frac": None, "error": str(error)})
                    print(f"moe sweep {fmt} E={num_experts} T={tokens} {tiling} {error}", flush=True)
                    continue
                rows.append(
                    {**row, "ms": ms, "bw_frac": moved / (ms * 1e-3) / ceil["copy_bytes_per_s"],
                     "flop_per_s": flops / (ms * 1e-3)}
                )
                print(
                    f"moe sweep {fmt} E={num_experts:<3d} T={tokens:<5d} {tiling} {ms:8.3f} ms "
                    f"({rows[-1]['bw_frac']:.0%} bw, {rows[-1]['flop_per_s'] / 1e12:.1f} TFLOP/s)",
                    flush=True,
                )
        del bank
        torch.cuda.empty_cache()
    return rows


def moe_down_order(config: V41Config, ceil: dict, groups: tuple[int, ...]) -> list[dict]:
    """The down launch alone under each program order of ``groups`` (MOE_DOWN_GROUPS),
    both expert formats, MOE_DOWN_SHAPES: ms, TFLOP/s and the fraction of the copy
    bandwidth of its bytes (w2 of the experts hit, h read once, the fp32 pair rows
    written), and whether its output has the first order's bits (the order must change
    no value)."""
    hidden, inter, top_k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    held = max(e for e, _ in MOE_DOWN_SHAPES)
    rows = []
    for fmt in ("plain", "mxfp4"):
        bank, router = _bank_and_router(config, held, fmt)
        for _, tokens in MOE_DOWN_SHAPES:
            _, routing = router(tokens)
            hit = routing.expert_ids.unique().numel()
            block_m = block_rows(tokens * top_k, held)
            blocks = align_pairs(routing.expert_ids, bank.held_ids, block_m)
            h = torch.randn(blocks.num_blocks * block_m, inter, device="cuda").to(torch.bfloat16)
            out = torch.empty(tokens * top_k, hidden, device="cuda")
            tiling = expert_tiling(fmt, block_m)
            moved = hit * hidden * inter * expert_bytes_per_weight(fmt) + h.numel() * 2 + out.numel() * 4
            flops = 2 * tokens * top_k * hidden * inter
            first = None
            for group in groups:

                def down(group: int = group or EVERY_BLOCK) -> None:
                    expert_down(h, out, blocks, bank, tiling, bf16_dot=True, block_group=group)

                down()
                first = out.clone() if first is None else first
                ms = median_ms(down)
                rows.append(
                    {
                        "format": fmt, "experts": held, "tokens": tokens, "blocks": blocks.num_blocks,
                        "block_group": group or "every block", "ms": ms, "flop_per_s": flops / (ms * 1e-3),
                        "bw_frac": moved / (ms * 1e-3) / ceil["copy_bytes_per_s"], "same_bits": bool(torch.equal(out, first)),
                    }
                )
                r = rows[-1]
                print(
                    f"moe down {fmt} T={tokens:<5d} blocks={blocks.num_blocks:<4d} group={r['block_group']!s:<11} "
                    f"{ms:8.3f} ms ({r['flop_per_s'] / 1e12:.0f} TFLOP/s, {r['bw_frac']:.0%} bw)"
                    + ("" if r["same_bits"] else " OTHER BITS"),
                    flush=True,
                )
        del bank
        torch.cuda.empty_cache()
    return rows


def moe_benchmark(config: V41Config, ceil: dict) -> tuple[list[dict], list[dict]]:
    """Rows (time, TFLOP/s and bytes/s against the ceilings, bytes as moe_bytes counts
    them) and correctness checks of the grouped expert GEMMs, one rank holding every
    expert: the kernels against the torch backend (relative error) and, for MXFP4, the
    decode's exactness (mxfp4_decode_check)."""
    triton_k, torch_k = TritonKernels(), TorchKernels()
    hidden, inter, top_k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    rows, checks = [], []
    for fmt in ("plain", "mxfp4"):
        for num_experts in MOE_EXPERTS:
            experts = moe_experts(config, num_experts, fmt)
            bank = triton_k.expert_bank(experts, fmt)
            torch_bank = torch_k.expert_bank(experts, fmt)
            if fmt == "mxfp4":
                decode = mxfp4_decode_check(bank, experts[bank.expert_ids[0]].w2)
                checks.append({"format": fmt, "experts": num_experts, **decode})
                print(f"check moe {checks[-1]}", flush=True)
            gate = torch.randn(num_experts, hidden, device="cuda") * hidden**-0.5
            bias = torch.zeros(num_experts, device="cuda")
            for tokens in MOE_TOKENS:
                x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
                routing = route(x, gate, bias, top_k, config.routed_scaling_factor)
                args = (x, routing, bank, config.swiglu_limit)
                if tokens == MOE_CHECK_TOKENS:
                    want = torch_k.routed_expert_slots(x, routing, torch_bank, config.swiglu_limit)
                    got = triton_k.routed_expert_slots(*args)
                    rel_err = float((got - want).norm() / want.norm())
                    checks.append({"format": fmt, "experts": num_experts, "tokens": tokens, "rel_err": rel_err})
                    print(f"check moe {checks[-1]}", flush=True)
                ms = median_ms(lambda: triton_k.routed_expert_slots(*args))
                torch_ms = median_ms(lambda: routed_expert_slots(x, routing, experts, config.swiglu_limit))
                pairs = tokens * top_k
                hit = routing.expert_ids.unique().numel()
                moved = moe_bytes(config, fmt, tokens, hit)
                flops = 2 * pairs * 3 * hidden * inter
                row = {
                    "format": fmt,
                    "experts": num_experts,
                    "tokens": tokens,
                    "experts_hit": hit,
                    "ms": ms,
                    "torch_loop_ms": torch_ms,
                    "flop_per_s": flops / (ms * 1e-3),
                    "flop_frac": flops / (ms * 1e-3) / ceil["bf16_flop_per_s"],
                    "bytes_per_s": moved / (ms * 1e-3),
                    "bw_frac": moved / (ms * 1e-3) / ceil["copy_bytes_per_s"],
                }
                rows.append(row)
                print(
                    f"moe {fmt:5s} E={num_experts:<3d} T={tokens:<5d} hit {hit:<3d} {ms:8.3f} ms (torch loop "
                    f"{torch_ms:8.3f} ms) {row['flop_per_s'] / 1e12:6.1f} TFLOP/s ({row['flop_frac']:.0%}) "
                    f"{row['bytes_per_s'] / 1e12:5.2f} TB/s ({row['bw_frac']:.0%} bw)",
                    flush=True,
                )
            del experts, bank, torch_bank
            torch.cuda.empty_cache()
    return rows, checks


def fp8_activation_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """``linear(x, weight)`` as an engine in the FP8-activation mode runs it."""
    with fp8_activations(True):
        return linear(x, weight)


def graph_ms(fn) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph (do_bench_cudagraph)."""
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def fp8_matmul_rate() -> float:
    """FLOP/s of one large FP8 E4M3 product with per-tensor scales through torch's
    scaled matmul (cuBLAS), on random data: the ceiling an FP8-activation GEMM aims at."""
    n = 8192
    a = (torch.randn(n, n, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    b = (torch.randn(n, n, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = median_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n**3 / (ms * 1e-3)


def gemm_shapes(config: V41Config) -> list[tuple[str, int, int]]:
    """The distinct [out, in] shapes of one layer's FP8-stored projections, each named
    by its first tensor."""
    seen: dict[tuple[int, int], str] = {}
    for name, spec in checkpoint_tensors(config).items():
        if spec.kind is TensorKind.FP8_WEIGHT and name.startswith("layers.0.") and len(spec.shape) == 2:
            seen.setdefault(tuple(spec.shape), name.removeprefix("layers.0."))
    return [(name, n, k) for (n, k), name in seen.items()]


def gemm_benchmark(config: V41Config, ceil: dict) -> list[dict]:
    """Each FP8 projection shape at each row count, timed as CUDA-graph replays (how a
    decode step runs them; launch overhead left out): the fixed-tile GEMM over the FP8
    weight (its tiles decoded in registers) with the split plan outside the
    batch-invariant mode (the GPU default) and with the row-invariant one, the
    row-invariant GEMM over its bf16 decode, cuBLAS over the bf16 decode, and
    ``linear`` in the FP8-activation mode (EngineOptions.fp8_activations: the rows
    rounded to FP8, then the engine's GEMM for that many rows); as time, % copy
    bandwidth (at each weight's own bytes) and % of the bf16 and FP8 matmul rates. The
    FP8 products are checked against the decoded weight's; the FP8-activation product's
    largest difference from the fake-quantised rows' product with the decoded weight
    (fp32), relative to that product's largest value, is reported."""
    fp8_rate = fp8_matmul_rate()
    print(f"fp8 matmul (cuBLAS scaled): {fp8_rate / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for name, n, k in gemm_shapes(config):
        values, scale = formats.quantize_fp8_weight(torch.randn(n, k, device="cuda") / math.sqrt(k))
        stored = Fp8Weight(values, scale, torch.bfloat16)
        decoded = stored.decoded()
        for m in GEMM_ROWS:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for invariant in (True, False):
                got = fixed_tile_matmul(a, stored, row_invariant=invariant)
                if not torch.equal(got, fixed_tile_matmul(a, decoded, row_invariant=invariant)):
                    raise AssertionError(f"{name} [{n}, {k}] x {m} rows: the FP8 product differs from its decode's")
            times = {
                "fp8_ms": graph_ms(lambda: fixed_tile_matmul(a, stored, row_invariant=False)),
                "fp8_invariant_ms": graph_ms(lambda: fixed_tile_matmul(a, stored)),
                "bf16_invariant_ms": graph_ms(lambda: fixed_tile_matmul(a, decoded)),
                "cublas_bf16_ms": graph_ms(lambda: a @ decoded.t()),
                "decode_cublas_ms": graph_ms(lambda: a @ decode_fp8_weight(stored).t()),
                "fp8_activations_ms": graph_ms(lambda: fp8_activation_linear(a, stored)),
            }
            exact = round_fp8(a).float() @ decoded.float().t()
            fp8_activations_error = float((fp8_activation_linear(a, stored).float() - exact).abs().max() / exact.abs().max())
            flops = 2 * m * n * k
            io = 2 * m * (n + k)
            copy = ceil["copy_bytes_per_s"]
            row = {"tensor": name, "n": n, "k": k, "rows": m, **times}
            row["fp8_bw_frac"] = (stored.nbytes + io) / (times["fp8_ms"] * 1e-3) / copy
            row["fp8_invariant_bw_frac"] = (stored.nbytes + io) / (times["fp8_invariant_ms"] * 1e-3) / copy
            row["cublas_bw_frac"] = (decoded.nbytes + io) / (times["cublas_bf16_ms"] * 1e-3) / copy
            row["fp8_bf16_rate_frac"] = flops / (times["fp8_ms"] * 1e-3) / ceil["bf16_flop_per_s"]
            row["fp8_fp8_rate_frac"] = flops / (times["fp8_ms"] * 1e-3) / fp8_rate
            row["cublas_bf16_rate_frac"] = flops / (times["cublas_bf16_ms"] * 1e-3) / ceil["bf16_flop_per_s"]
            row["decode_cublas_fp8_rate_frac"] = flops / (times["decode_cublas_ms"] * 1e-3) / fp8_rate
            row["fp8_activations_fp8_rate_frac"] = flops / (times["fp8_activations_ms"] * 1e-3) / fp8_rate
            row["fp8_activations_bw_frac"] = (stored.nbytes + io) / (times["fp8_activations_ms"] * 1e-3) / copy
            row["fp8_activations_max_rel_diff"] = fp8_activations_error
            rows.append(row)
            print(
                f"{name:30s} [{n:5d}, {k:5d}] x {m:4d}: fp8 {times['fp8_ms']:.4f} ms ({row['fp8_bw_frac']:.0%} bw, "
                f"{row['fp8_fp8_rate_frac']:.0%} fp8 rate), invariant {times['fp8_invariant_ms']:.4f} ms, "
                f"bf16 invariant {times['bf16_invariant_ms']:.4f} ms, cuBLAS {times['cublas_bf16_ms']:.4f} ms, "
                f"decode + cuBLAS {times['decode_cublas_ms']:.4f} ms, fp8 activations {times['fp8_activations_ms']:.4f} "
                f"ms ({row['fp8_activations_fp8_rate_frac']:.0%} fp8 rate, max rel diff {fp8_activations_error:.2g})",
                flush=True,
            )
    for row in rows:
        row["fp8_matmul_flop_per_s"] = fp8_rate
    return rows


def compression_case(config: V41Config, kv: str, index: str, kind: str, rows: int, device: str) -> dict:
    """One step of the first ratio-2 owner's compression path on random pools (the Flash
    geometry at block 128): ``rows`` decode requests of one token each (alternately
    completing a pair with the slot's pending tail and leaving a new tail), or one
    prefill of ``rows`` tokens from position 0 (rows / 2 pairs, no tail). Inputs are the
    kernels' own: v, g fp32; the entries' KV before NVFP4 rounding (fp32; it stands in for
    rope(norm(pooled)), torch arithmetic between the kernels); the index keys on the
    MXFP4 grid and the window KV on the FP8 grid (bf16)."""
    geometry = pool_geometry(config, block_size=128, kv_cache_dtype=kv, index_cache_dtype=index)
    if kind == "decode":
        segments = [SegmentSpec(slot=b, start=3 - b % 2, length=1) for b in range(rows)]
        page_tables = torch.arange(rows).unsqueeze(1)  # request b's one PAGE is PAGE b
        size = PoolSize(num_pages=rows, num_slots=rows)
    else:
        pages = -(-rows // geometry.block_size)
        segments = [SegmentSpec(slot=0, start=0, length=rows)]
        page_tables = torch.arange(pages).unsqueeze(0)
        size = PoolSize(num_pages=pages, num_slots=1)
    shape = PoolShape(geometry.block_size, config.sliding_window, geometry.ring_rows, ratios=(2,))
    addresses = move_tensors(build_step_addresses(segments, page_tables, shape), device)
    plan, window = addresses.compression[2], addresses.window
    pools = V41Pools(geometry, size, device=device)
    fill_random(pools)
    g = torch.Generator(device=device).manual_seed(rows)
    dim, index_dim, groups = config.head_dim, config.index_head_dim, plan.dst.numel()
    return {
        "pools": pools,
        "owner": next(o for o in geometry.full_owners if geometry.ratio_of(o) == 2),
        "plan": plan,
        "window": window,
        "v": torch.randn(rows, dim, device=device, generator=g),
        "g": torch.randn(rows, dim, device=device, generator=g) * 2,
        "kv": torch.randn(groups, dim, device=device, generator=g),
        "keys": round_mxfp4(torch.randn(groups, index_dim, device=device, generator=g)).to(torch.bfloat16),
        "window_kv": round_fp8(torch.randn(rows, dim, device=device, generator=g)).to(torch.bfloat16),
    }


def compression_ops(case: dict, pools: V41Pools, kernels) -> dict:
    """The path's four launches on ``pools`` (the case's, or a copy), by name."""
    store, owner, plan = PlaneIO(pools), case["owner"], case["plan"]
    return {
        "pool": lambda: kernels.pool_ratio2(case["v"], case["g"], plan, store.tail_plane(owner)),
        "main": lambda: kernels.write_rows(store.main_plane(owner), plan.dst, case["kv"], round_to="nvfp4"),
        "index": lambda: kernels.write_rows(store.index_plane(owner), plan.dst, case["keys"]),
        "window": lambda: kernels.write_rows(
            store.window_plane(owner), case["window"].write_dst, case["window_kv"][case["window"].write_rows]
        ),
    }


def compression_bytes(config: V41Config, case: dict) -> dict:
    """Bytes each launch moves: its fp32 / bf16 sources read, its stored rows written
    (values and scales), and 8 bytes per address read. Pooling reads four fp32 rows a
    pair (v and g of both tokens) and writes one; a tail store copies v and g."""
    geometry, plan = case["pools"].geometry, case["plan"]
    dim, index_dim = config.head_dim, config.index_head_dim
    groups, tails, rows = plan.dst.numel(), plan.tail_write_rows.numel(), case["v"].shape[0]
    main_row = dim * 2 if geometry.kv_cache_dtype == "bf16" else dim // 2 + dim // 16
    index_row = (index_dim if geometry.index_cache_dtype == "fp8" else index_dim // 2) + index_dim // 32
    ring_row = dim * 2 if geometry.swa_dtype == "bf16" else dim + dim // 32
    return {
        "pool": groups * (5 * dim * 4 + 3 * 8) + tails * (4 * dim * 4 + 2 * 8),
        "main": groups * (dim * 4 + main_row + 8),
        "index": groups * (index_dim * 2 + index_row + 8),
        "window": case["window"].write_dst.numel() * (dim * 2 + ring_row + 8),
    }


def compression_check(case: dict) -> dict:
    """The Triton launches against the torch backend on a CPU copy of the pools (where
    model/formats.py defines the bytes): every stored byte, tails included, and the
    pooled rows' largest difference."""
    geometry, size = case["pools"].geometry, case["pools"].size
    reference = V41Pools(geometry, size, device="cpu")
    reference.buffer.copy_(case["pools"].buffer.cpu())
    cpu_case = move_tensors({k: v for k, v in case.items() if k != "pools"}, "cpu")
    want = {name: op() for name, op in compression_ops(cpu_case, reference, TorchKernels()).items()}
    got = {name: op() for name, op in compression_ops(case, case["pools"], TritonKernels()).items()}
    return {
        "stored_bytes_equal": bool(torch.equal(case["pools"].buffer.cpu(), reference.buffer)),
        "pooled_max_abs_diff": float((got["pool"].cpu() - want["pool"]).abs().max()) if want["pool"].numel() else 0.0,
    }


def compression_benchmark(config: V41Config, ceil: dict, device: str, small: bool) -> tuple[list[dict], list[dict]]:
    """Rows (per launch and for the whole path: ms and the fraction of the copy
    bandwidth its bytes would take; the torch backend's time for the path) and checks."""
    triton_k, torch_k = TritonKernels(), TorchKernels()
    cases = [("decode", b) for b in (SMALL_BATCHES if small else BATCHES)]
    cases.append(("prefill", SMALL_COMPRESSION_PREFILL_ROWS if small else COMPRESSION_PREFILL_ROWS))
    rows, checks = [], []
    for kv, index in (("bf16", "fp8"), ("fp4", "fp4")):
        for kind, count in cases:
            case = compression_case(config, kv, index, kind, count, device)
            if (kind, count) == cases[1]:
                checks.append({"formats": f"{kv}/{index}", "case": f"{kind} {count}", **compression_check(case)})
                print(f"check compression {checks[-1]}", flush=True)
            ops = compression_ops(case, case["pools"], triton_k)
            moved = compression_bytes(config, case)
            row = {"formats": f"{kv}/{index}", "case": kind, "rows": count, "groups": case["plan"].dst.numel()}
            for name, op in ops.items():
                row[f"{name}_ms"] = median_ms(op)
                row[f"{name}_bw_frac"] = moved[name] / (row[f"{name}_ms"] * 1e-3) / ceil["copy_bytes_per_s"]
            row["path_ms"] = median_ms(lambda: [op() for op in ops.values()])
            row["path_bytes"] = sum(moved.values())
            row["path_bytes_per_s"] = row["path_bytes"] / (row["path_ms"] * 1e-3)
            row["path_bw_frac"] = row["path_bytes_per_s"] / ceil["copy_bytes_per_s"]
            torch_ops = compression_ops(case, case["pools"], torch_k)
            row["torch_path_ms"] = median_ms(lambda: [op() for op in torch_ops.values()])
            rows.append(row)
            print(
                f"compression {row['formats']:9s} {kind:7s} R={count:<5d} path {row['path_ms']:8.3f} ms "
                f"({row['path_bw_frac']:.0%} bw; torch {row['torch_path_ms']:8.3f} ms) pool {row['pool_ms']:.3f} "
                f"main {row['main_ms']:.3f} index {row['index_ms']:.3f} window {row['window_ms']:.3f} ms",
                flush=True,
            )
            del case, ops, torch_ops
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows, checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/kernels.json")
    parser.add_argument(
        "--baseline",
        default="bench/results/kernels.json",
        help="an earlier run's JSON whose attention/scorer rows the table compares with (read before --out is written)",
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the attention/scorer and MoE tiling sweeps")
    parser.add_argument(
        "--moe-only", action="store_true", help="the MoE section alone (its sweep too, unless --no-sweep)"
    )
    parser.add_argument(
        "--moe-sweep-formats",
        nargs="+",
        choices=list(MOE_SWEEPS),
        default=list(MOE_SWEEPS),
        help="the expert formats whose MoE tilings the sweep times (default: both)",
    )
    parser.add_argument(
        "--moe-down-groups",
        type=int,
        nargs="+",
        default=list(MOE_DOWN_GROUPS),
        help="the down launch's program orders the MoE section times (expert_down's block_group; 0: every block "
        "of a column tile side by side)",
    )
    parser.add_argument(
        "--moe-down-only", action="store_true", help="the down launch's program orders alone (--moe-down-groups)"
    )
    parser.add_argument("--gemm-only", action="store_true", help="the dense FP8 projections' GEMM section alone")
    parser.add_argument(
        "--attention-only",
        action="store_true",
        help="the attention/scorer rows and the attention tiling sweep alone (no scorer sweep, MoE, GEMM or "
        "compression)",
    )
    parser.add_argument(
        "--attention-variants",
        nargs="+",
        choices=list(ATTENTION_SWEEP),
        help="the ATTENTION_SWEEP variants the sweep times (default: all; each is compiled twice, split and unsplit)",
    )
    parser.add_argument(
        "--contexts", type=int, nargs="+", help=f"contexts of the attention/scorer rows (default {CONTEXTS})"
    )
    parser.add_argument(
        "--batches", type=int, nargs="+", help=f"batches of the attention/scorer rows (default {BATCHES})"
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="a smoke run: small batches and contexts, no MoE section (runs on a CPU with TRITON_INTERPRET=1)",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not (args.small and os.environ.get("TRITON_INTERPRET") == "1"):
        parser.error("no CUDA device: on a CPU, run the --small smoke mode with TRITON_INTERPRET=1 set")
    if args.attention_only and (args.moe_only or args.gemm_only):
        parser.error("--attention-only excludes --moe-only and --gemm-only")
    if args.moe_down_only and (args.attention_only or args.moe_only or args.gemm_only or args.small):
        parser.error("--moe-down-only excludes --attention-only, --moe-only, --gemm-only and --small")
    if any(group < 0 for group in args.moe_down_groups):
        parser.error(f"--moe-down-groups: {args.moe_down_groups} (allowed: 0, every block, or a group of >= 1 blocks)")
    batches, contexts = (SMALL_BATCHES, SMALL_CONTEXTS) if args.small else (BATCHES, CONTEXTS)
    batches, contexts = tuple(args.batches or batches), tuple(args.contexts or contexts)
    config = V41Config.from_pretrained(FLASH, text_only=True)
    ceil = ceilings(device)
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    triton_k, torch_k = TritonKernels(), TorchKernels()
    # The baseline is a GPU run: a --small smoke run has nothing to compare with it.
    baseline_date, baseline = ("not read (--small)", {}) if args.small else load_baseline(Path(args.baseline))
    print(f"baseline: {args.baseline} ({baseline_date}, {len(baseline)} rows)", flush=True)
    rows = []
    checks = []
    sweep_rows: list[dict] = []
    only = args.moe_only or args.gemm_only or args.moe_down_only
    for kv, index in () if only else (("bf16", "fp8"), ("fp4", "fp4")):
        geometry = pool_geometry(config, block_size=128, kv_cache_dtype=kv, index_cache_dtype=index)
        for context in contexts:
            for batch in batches:
                pages_per_req = context // 128
                size = PoolSize(num_pages=batch * pages_per_req, num_slots=batch)
                if size.nbytes(geometry) > MAX_POOL_BYTES:
                    continue
                pools = V41Pools(geometry, size, device=device)
                fill_random(pools)
                store = PlaneIO(pools)
                att = attention_case(config, store, batch, context, pages_per_req)
                sc = scorer_case(config, store, batch, context, pages_per_req)
                if batch in (batches[min(1, len(batches) - 1)], batches[-1]) and context == contexts[0]:
                    # batches[1] runs split over keys on an H200, batches[-1] unsplit.
                    ref = torch_k.attend(*att).float()
                    got = triton_k.attend(*att).float()
                    want_s, got_s = torch_k.score(*sc), triton_k.score(*sc)
                    checks.append(
                        {
                            "formats": f"{kv}/{index}",
                            "batch": batch,
                            "attention_rel_err": float((got - ref).norm() / ref.norm()),
                            "scores_rel_err": float((got_s - want_s).norm() / want_s.norm()),
                        }
                    )
                    print(f"check {kv}/{index}: {checks[-1]}", flush=True)
                att_ms = median_ms(lambda: triton_k.attend(*att))
                launch = triton_k.prepare_attention(*att)
                att_kernel_ms = median_ms(launch.run)
                sc_ms = median_ms(lambda: triton_k.score(*sc))
                sc_kernel_ms = median_ms(triton_k.prepare_score(*sc).run)
                heads, dim, keys = config.num_attention_heads, config.head_dim, config.sliding_window + config.index_topk
                att_bytes = attention_bytes(config, kv, batch)
                att_flops = batch * 4 * heads * keys * dim
                sc_bytes = scorer_bytes(config, index, batch, sc[2].shape[1])
                copy = ceil["copy_bytes_per_s"]
                before = baseline.get((f"{kv}/{index}", batch, context), {})
                row = {
                    "formats": f"{kv}/{index}",
                    "batch": batch,
                    "context": context,
                    "attention_splits": launch.launches[0].grid[1],
                    "attention_ms": att_ms,
                    "attention_kernel_ms": att_kernel_ms,
                    "attention_kernel_bw_frac": att_bytes / (att_kernel_ms * 1e-3) / copy,
                    "attention_bw_frac": att_bytes / (att_ms * 1e-3) / copy,
                    "attention_flop_frac": att_flops / (att_ms * 1e-3) / ceil["bf16_flop_per_s"],
                    "scorer_ms": sc_ms,
                    "scorer_kernel_ms": sc_kernel_ms,
                    "scorer_bytes_per_s": sc_bytes / (sc_ms * 1e-3),
                    "scorer_bw_frac": sc_bytes / (sc_ms * 1e-3) / copy,
                    "scorer_kernel_bw_frac": sc_bytes / (sc_kernel_ms * 1e-3) / copy,
                    # The target: decode attention + index scoring of one layer.
                    "decode_kernel_bw_frac": (att_bytes + sc_bytes) / ((att_kernel_ms + sc_kernel_ms) * 1e-3) / copy,
                    "baseline_attention_kernel_ms": before.get("attention_kernel_ms"),
                    "baseline_scorer_ms": before.get("scorer_ms"),
                }
                rows.append(row)
                print(
                    f"{row['formats']:9s} B={batch:<4d} L={context:<7d} attn {att_ms:8.3f} ms, kernel "
                    f"{att_kernel_ms:8.3f} ms ({row['attention_kernel_bw_frac']:.0%} bw, {row['attention_splits']} "
                    f"splits) scorer {sc_ms:8.3f} ms, kernel {sc_kernel_ms:8.3f} ms ({row['scorer_kernel_bw_frac']:.0%} "
                    f"bw) both {row['decode_kernel_bw_frac']:.0%} bw",
                    flush=True,
                )
                if not (args.small or args.no_sweep) and context == SWEEP_CONTEXT and batch in SWEEP_BATCHES:
                    sweep_rows += tiling_sweep(
                        config, ceil, kv, index, batch, att, sc, scorer=not args.attention_only,
                        variants=args.attention_variants,
                    )
                del pools, store, att, sc
                if device == "cuda":
                    torch.cuda.empty_cache()
    no_moe = args.small or args.gemm_only or args.attention_only or args.moe_down_only
    moe_sweep_rows = [] if no_moe or args.no_sweep else moe_sweep(config, ceil, tuple(args.moe_sweep_formats))
    down_orders = args.moe_down_only or not (no_moe or args.no_sweep)
    moe_down_rows = moe_down_order(config, ceil, tuple(args.moe_down_groups)) if down_orders else []
    moe_rows, moe_checks = ([], []) if no_moe else moe_benchmark(config, ceil)
    gemm_rows = [] if args.small or args.moe_only or args.attention_only or args.moe_down_only else gemm_benchmark(config, ceil)
    compression_rows, compression_checks = (
        ([], []) if only or args.attention_only else compression_benchmark(config, ceil, device, args.small)
    )
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor()})",
        "small": args.small,
        "host": platform.platform(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "ceilings": ceil,
        "checks": checks,
        "baseline": {"path": args.baseline, "date": baseline_date},
        "rows": rows,
        "sweep_rows": sweep_rows,
        "moe_checks": moe_checks,
        "moe_sweep_rows": moe_sweep_rows,
        "moe_down_rows": moe_down_rows,
        "moe_rows": moe_rows,
        "gemm_rows": gemm_rows,
        "compression_checks": compression_checks,
        "compression_rows": compression_rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        "| formats | batch | context | attention ms (call) | attention ms (kernel) | key splits | kernel % bw "
        "| x baseline kernel | scorer ms (call) | scorer ms (kernel) | kernel % bw | x baseline call "
        "| attention + scorer kernels % bw |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def times(before: float | None, after: float) -> str:
        return f"{before / after:.1f}x" if before else "-"

    for r in rows:
        print(
            f"| {r['formats']} | {r['batch']} | {r['context']} | {r['attention_ms']:.3f} | "
            f"{r['attention_kernel_ms']:.3f} | {r['attention_splits']} | {100 * r['attention_kernel_bw_frac']:.0f}% | "
            f"{times(r['baseline_attention_kernel_ms'], r['attention_kernel_ms'])} | {r['scorer_ms']:.3f} | "
            f"{r['scorer_kernel_ms']:.3f} | {100 * r['scorer_kernel_bw_frac']:.0f}% | "
            f"{times(r['baseline_scorer_ms'], r['scorer_ms'])} | {100 * r['decode_kernel_bw_frac']:.0f}% |"
        )
    print("| formats | batch | kernel | tiling | programs | kernel ms | % copy bw | rel err vs torch |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for r in sweep_rows:
        timing = f"{r['kernel_ms']:.4f} | {100 * r['bw_frac']:.0f}%" if r["kernel_ms"] is not None else "out of resources | -"
        err = "-" if "rel_err" not in r else f"{r['rel_err']:.1e}" + ("" if r["correct"] else " WRONG")
        print(f"| {r['formats']} | {r['batch']} | {r['kernel']} | {r['variant']} | {r['programs']} | {timing} | {err} |")
    print("| held | tokens | MXFP4 tiling | ms | % copy bw | TFLOP/s |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in moe_sweep_rows:
        if r["ms"] is None:
            timing = "out of resources | - | -"
        else:
            timing = f"{r['ms']:.3f} | {100 * r['bw_frac']:.0f}% | {r['flop_per_s'] / 1e12:.1f}"
        print(f"| {r['experts']} | {r['tokens']} | {r['tiling']} | {timing} |")
    print("| experts format | held | tokens | blocks | down block group | ms | TFLOP/s | % copy bw | same bits |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|")
    for r in moe_down_rows:
        print(
            f"| {r['format']} | {r['experts']} | {r['tokens']} | {r['blocks']} | {r['block_group']} | {r['ms']:.3f} | "
            f"{r['flop_per_s'] / 1e12:.0f} | {100 * r['bw_frac']:.0f}% | {'yes' if r['same_bits'] else 'NO'} |"
        )
    print("| experts format | held | tokens | experts hit | ms | torch loop ms | TFLOP/s | % bf16 matmul | TB/s | % copy bw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in moe_rows:
        print(
            f"| {r['format']} | {r['experts']} | {r['tokens']} | {r['experts_hit']} | {r['ms']:.3f} | "
            f"{r['torch_loop_ms']:.3f} | {r['flop_per_s'] / 1e12:.1f} | {100 * r['flop_frac']:.0f}% | "
            f"{r['bytes_per_s'] / 1e12:.2f} | {100 * r['bw_frac']:.0f}% |"
        )
    print(
        "| projection | [out, in] | rows | FP8 ms | % copy bw | % fp8 rate | FP8 row-invariant ms | % copy bw "
        "| bf16 row-invariant ms | cuBLAS bf16 ms | cuBLAS % bw | cuBLAS % bf16 rate | decode + cuBLAS ms "
        "| its % fp8 rate | FP8 activations ms | its % fp8 rate | its % copy bw | its max rel diff |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in gemm_rows:
        print(
            f"| {r['tensor']} | [{r['n']}, {r['k']}] | {r['rows']} | {r['fp8_ms']:.4f} | {100 * r['fp8_bw_frac']:.0f}% | "
            f"{100 * r['fp8_fp8_rate_frac']:.0f}% | {r['fp8_invariant_ms']:.4f} | {100 * r['fp8_invariant_bw_frac']:.0f}% | "
            f"{r['bf16_invariant_ms']:.4f} | {r['cublas_bf16_ms']:.4f} | {100 * r['cublas_bw_frac']:.0f}% | "
            f"{100 * r['cublas_bf16_rate_frac']:.0f}% | {r['decode_cublas_ms']:.4f} | "
            f"{100 * r['decode_cublas_fp8_rate_frac']:.0f}% | {r['fp8_activations_ms']:.4f} | "
            f"{100 * r['fp8_activations_fp8_rate_frac']:.0f}% | {100 * r['fp8_activations_bw_frac']:.0f}% | "
            f"{r['fp8_activations_max_rel_diff']:.2g} |"
        )
    print(
        "| formats | step | rows | pairs | path ms | path TB/s | % copy bw | torch path ms "
        "| pool ms | main ms | index ms | window ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in compression_rows:
        print(
            f"| {r['formats']} | {r['case']} | {r['rows']} | {r['groups']} | {r['path_ms']:.3f} | "
            f"{r['path_bytes_per_s'] / 1e12:.3f} | {100 * r['path_bw_frac']:.1f}% | {r['torch_path_ms']:.3f} | "
            f"{r['pool_ms']:.3f} | {r['main_ms']:.3f} | {r['index_ms']:.3f} | {r['window_ms']:.3f} |"
        )

if __name__ == "__main__":
    main()
