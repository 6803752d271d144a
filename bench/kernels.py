"""Paged kernel benchmarks on a GPU at V4.1-Flash dims, against ceilings measured in the
same run: decode sparse attention (64 heads x 512, window 128 + top-512 entries) and the
paged index scorer (32 heads x 128, FP8 and FP4 planes), batch 1..256, context 4k..128k,
on real pool planes (the V4.1-Flash geometry at block 128), read in place.

Prints a table and writes JSON. Usage (on the GPU machine, from the repo root):
    PYTHONPATH=. python3 bench/kernels.py --out kernels.json
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton.testing

from cache.pools import PoolSize, V41Pools
from cache.plane_io import PlaneIO
from cluster.pool_layout import pool_geometry
from model.config import V41Config
from model.formats import round_mxfp4
from model.kernels.torch_backend import TorchKernels
from model.kernels.triton import TritonKernels

FLASH = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "flash"
BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (4096, 32768, 131072)
MAX_POOL_BYTES = 48 << 30


def median_ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def ceilings() -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate."""
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: a @ b)
    return {"copy_bytes_per_s": 2 * src.numel() * 4 / (copy_ms * 1e-3), "bf16_flop_per_s": 2 * 8192**3 / (mm_ms * 1e-3)}


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
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    dev = "cuda"
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
    g = torch.Generator(device="cuda").manual_seed(batch * 11 + context)
    owner = config.topology.full_owners[0]  # a ratio-2 owner
    per_page = store.geometry.rows_per_page(owner)
    width = context // store.geometry.ratio_of(owner)
    j = torch.arange(width, device="cuda")
    tile = (torch.arange(batch, device="cuda")[:, None] * pages_per_req + j // per_page) * per_page + j % per_page
    q = round_mxfp4(torch.randn(batch, config.index_n_heads, config.index_head_dim, device="cuda", generator=g))
    w = torch.randn(batch, config.index_n_heads, device="cuda", generator=g)
    return (q, w, tile, torch.arange(batch, device="cuda"), store.index_plane(owner))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/kernels.json")
    args = parser.parse_args()
    config = V41Config.from_pretrained(FLASH, text_only=True)
    ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    triton_k, torch_k = TritonKernels(), TorchKernels()
    rows = []
    checks = []
    for kv, index in (("bf16", "fp8"), ("fp4", "fp4")):
        geometry = pool_geometry(config, block_size=128, kv_cache_dtype=kv, index_cache_dtype=index)
        for context in CONTEXTS:
            for batch in BATCHES:
                pages_per_req = context // 128
                size = PoolSize(num_pages=batch * pages_per_req, num_slots=batch)
                if size.nbytes(geometry) > MAX_POOL_BYTES:
                    continue
                pools = V41Pools(geometry, size, device="cuda")
                fill_random(pools)
                store = PlaneIO(pools)
                att = attention_case(config, store, batch, context, pages_per_req)
                sc = scorer_case(config, store, batch, context, pages_per_req)
                if batch == 8 and context == 4096:
                    ref = torch_k.attend(*att).float()
                    got = triton_k.attend(*att).float()
                    want_s, got_s = torch_k.score(*sc), triton_k.score(*sc)
                    checks.append(
                        {
                            "formats": f"{kv}/{index}",
                            "attention_rel_err": float((got - ref).norm() / ref.norm()),
                            "scores_rel_err": float((got_s - want_s).norm() / want_s.norm()),
                        }
                    )
                    print(f"check {kv}/{index}: {checks[-1]}", flush=True)
                att_ms = median_ms(lambda: triton_k.attend(*att))
                launch = triton_k.prepare_attention(*att)
                att_kernel_ms = median_ms(launch.run)
                sc_ms = median_ms(lambda: triton_k.score(*sc))
                heads, dim, keys = config.num_attention_heads, config.head_dim, config.sliding_window + config.index_topk
                main_row = dim * 2 if kv == "bf16" else dim / 2 + dim / 16  # bf16, or NVFP4 + E4M3 scales
                ring_row = dim * 2 if kv == "bf16" else dim + dim / 32  # bf16, or FP8 + E8M0 scales
                window = config.sliding_window
                # Keys read once per row (one head block holds all 64 heads), q and out,
                # and each key's 20 bytes of addresses (source, offset, scale offset).
                att_bytes = batch * (
                    (window - 1) * ring_row + config.index_topk * main_row + 2 * heads * dim * 2 + keys * 20
                )
                att_flops = batch * 4 * heads * keys * dim
                width = sc[2].shape[1]
                entry_bytes = (config.index_head_dim if index == "fp8" else config.index_head_dim / 2) + config.index_head_dim / 32
                sc_bytes = batch * width * (entry_bytes + 16 + 4)
                row = {
                    "formats": f"{kv}/{index}",
                    "batch": batch,
                    "context": context,
                    "attention_ms": att_ms,
                    "attention_kernel_ms": att_kernel_ms,
                    "attention_kernel_bw_frac": att_bytes / (att_kernel_ms * 1e-3) / ceil["copy_bytes_per_s"],
                    "attention_bw_frac": att_bytes / (att_ms * 1e-3) / ceil["copy_bytes_per_s"],
                    "attention_flop_frac": att_flops / (att_ms * 1e-3) / ceil["bf16_flop_per_s"],
                    "scorer_ms": sc_ms,
                    "scorer_bytes_per_s": sc_bytes / (sc_ms * 1e-3),
                    "scorer_bw_frac": sc_bytes / (sc_ms * 1e-3) / ceil["copy_bytes_per_s"],
                }
                rows.append(row)
                print(
                    f"{row['formats']:9s} B={batch:<4d} L={context:<7d} attn {att_ms:8.3f} ms, kernel "
                    f"{att_kernel_ms:8.3f} ms ({row['attention_kernel_bw_frac']:.0%} bw) "
                    f"scorer {sc_ms:8.3f} ms ({row['scorer_bw_frac']:.0%} bw)",
                    flush=True,
                )
                del pools, store, att, sc
                torch.cuda.empty_cache()
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "host": platform.platform(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "ceilings": ceil,
        "checks": checks,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("| formats | batch | context | attention ms (call) | attention ms (kernel) | kernel % bw | scorer ms | scorer % bw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['formats']} | {r['batch']} | {r['context']} | {r['attention_ms']:.3f} | "
            f"{r['attention_kernel_ms']:.3f} | {100 * r['attention_kernel_bw_frac']:.0f}% | "
            f"{r['scorer_ms']:.3f} | {100 * r['scorer_bw_frac']:.0f}% |"
        )


if __name__ == "__main__":
    main()
