"""The Triton backend of the paged kernels (NVIDIA GPUs; CPUs under TRITON_INTERPRET=1).

Owns the host side of the Triton kernels: binding a plane's views and strides to a
launch (the attention and scorer kernels split flat row addresses in registers and read
the pool in place, never a gathered copy, so a call prepares no per-key tensors and
nothing is left to reuse across the layers of a step), launch grids and the key splits
that fill the GPU, and the logits memory budget that bounds how many query rows one
scorer launch covers. The routed experts' grouped GEMMs are
model/kernels/triton/moe.py's (bank, alignment and launches). The compression path's
launches (pair pooling and tail stores, quantised row stores) are in their own block,
the mHC site steps are model/kernels/triton/mhc.py's fused launches, a projection's
epilogue (RMSNorm, RoPE, rounding) is model/kernels/triton/epilogue.py's, and the MoE
steps around the routed experts (router, shared SwiGLU, output) are route.py's; an
Engram table's rows are gathered on the device from the host table and added to the
streams through their gate in one launch (engram.py).
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import triton

from dsv41.model.config import V41Config
from dsv41.model.engram import EngramTable
from dsv41.model.epilogue import Epilogue
from dsv41.model.formats import FP8_BLOCK
from dsv41.model.kernels.interface import SCALE_GROUPS, ExpertBank, PairAddresses, PlaneView, check_row_write
from dsv41.model.kernels.triton.attention import (
    DEFAULT_ATTENTION_TILING,
    LOG2E,
    AttentionTiling,
    MlaTiling,
    fixed_key_split,
    merge_splits_kernel,
    mla_attention_kernel,
    plan_key_split,
    sparse_attention_kernel,
)
from dsv41.model.kernels.triton.compress import pool_pairs_kernel, store_tails_kernel
from dsv41.model.kernels.triton.decode import INTERPRETED
from dsv41.model.kernels.triton.engram import engram_gated_add, engram_rows
from dsv41.model.kernels.triton.epilogue import fused_epilogue
from dsv41.model.kernels.triton.fp32_gemm import split_fp32_matmul
from dsv41.model.kernels.triton.fp8_rows import round_fp8_rows
from dsv41.model.kernels.triton.gemm import decode_fp8_weight, fixed_tile_matmul
from dsv41.model.kernels.triton.index_scorer import ScorerTiling, index_score_kernel, plan_entry_span
from dsv41.model.kernels.triton.mhc import fused_collapse_norm, fused_expand, fused_hc_mix
from dsv41.model.kernels.triton.moe import TritonExpertBank, build_expert_bank, grouped_expert_slots
from dsv41.model.kernels.triton.reduce import row_sum
from dsv41.model.kernels.triton.route import fused_moe_output, fused_route, fused_shared_expert
from dsv41.model.kernels.triton.store import FORMAT_CODES, VALUES_PER_PROGRAM, store_rows
from dsv41.model.linalg import GpuKernels, batch_invariant_enabled, register_gpu_kernels
from dsv41.model.mhc import HcMix, HcSite
from dsv41.model.moe import ExpertWeights, Routing

DEFAULT_LOGITS_BUDGET_BYTES = 2048 << 20

logger = logging.getLogger(__name__)
register_gpu_kernels(
    GpuKernels(
        matmul=fixed_tile_matmul,
        fp32_matmul=split_fp32_matmul,
        row_sum=row_sum,
        decode_fp8=decode_fp8_weight,
        round_fp8=round_fp8_rows,
    )
)
# Under the interpreter dot operands stay fp32. The products are exact either way
# (every operand is bf16-exact); only the attention's probabilities, rounded to bf16
# for the GPU's dot, are not rounded there.
if INTERPRETED:
    logger.info("triton kernels: interpreter mode, fp32 dot operands, tl.exp in the pair softmax and the mHC mix")


def plane_launch_args(plane: PlaneView) -> tuple[Any, ...]:
    """A plane as the attention and scorer kernels take it: values, scales (the values
    again for bf16, never read), and the unit and row element strides of both."""
    scales = plane.scales if plane.scales is not None else plane.values
    return (plane.values, scales, plane.values.stride(0), plane.values.stride(1), scales.stride(0), scales.stride(1))


def plane_constants(plane: PlaneView) -> tuple[int, int, int]:
    """(rows per unit, FORMAT_CODES entry, channels per scale) of a plane."""
    return plane.values.shape[1], FORMAT_CODES[plane.fmt], SCALE_GROUPS.get(plane.fmt, 1)


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs_per_wave(configured: int | None, device: torch.device, per_sm: int) -> int:
    """Programs one launch runs at once: as configured, else ``per_sm`` per SM of the
    GPU; on the CPU interpreter one (its programs run one after another)."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return 1
    return per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def default_attention_tiling(heads: int, head_dim: int, groups: tuple[int, ...]) -> MlaTiling:
    """DEFAULT_ATTENTION_TILING fitted to a model's heads, head dim and planes' scale groups."""
    return DEFAULT_ATTENTION_TILING.fitted(heads, head_dim, groups)


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch with every argument bound."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constants: dict[str, Any]

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constants)


@dataclass(frozen=True)
class PreparedLaunch:
    """Kernel launches with every argument bound, run in order: ``run()`` is the
    kernels alone, no host-side work (what a benchmark times, what a CUDA graph of a
    step would capture)."""

    launches: tuple[KernelLaunch, ...]
    out: torch.Tensor

    def run(self) -> torch.Tensor:
        for launch in self.launches:
            launch()
        return self.out


class TritonKernels:
    name = "triton"
    # Engram rows are gathered by the forward's device from the host tables mapped for
    # it (kernels/triton/engram.py), so a forward, and a captured graph, does no host
    # lookup.
    engram_on_device = True

    def __init__(
        self,
        logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
        attention_tiling: AttentionTiling | MlaTiling | None = None,
        scorer_tiling: ScorerTiling = ScorerTiling(),
    ) -> None:
        if logits_budget_bytes <= 0:
            raise ValueError(f"logits_budget_bytes: {logits_budget_bytes} (allowed: > 0)")
        self.logits_budget_bytes = logits_budget_bytes
        # None: DEFAULT_ATTENTION_TILING, fitted to each launch's heads, head dim and planes.
        self.attention_tiling = attention_tiling
        self.scorer_tiling = scorer_tiling

    def attend(
        self,
        q: torch.Tensor,
        chunk_kv: torch.Tensor,
        chunk_rows: torch.Tensor,
        ring_rows: torch.Tensor,
        window_valid: torch.Tensor,
        ring: PlaneView,
        entry_rows: torch.Tensor | None,
        main: PlaneView | None,
        sink: torch.Tensor,
        softmax_scale: float,
    ) -> torch.Tensor:
        return self.prepare_attention(
            q, chunk_kv, chunk_rows, ring_rows, window_valid, ring, entry_rows, main, sink, softmax_scale
        ).run()

    def prepare_attention(
        self,
        q: torch.Tensor,
        chunk_kv: torch.Tensor,
        chunk_rows: torch.Tensor,
        ring_rows: torch.Tensor,
        window_valid: torch.Tensor,
        ring: PlaneView,
        entry_rows: torch.Tensor | None,
        main: PlaneView | None,
        sink: torch.Tensor,
        softmax_scale: float,
    ) -> PreparedLaunch:
        rows, heads, dim = q.shape
        window = chunk_rows.shape[1]
        out = torch.empty_like(q)
        if main is None or entry_rows is None:
            # No main keys: the ring stands in for the main plane, whose loop runs 0 times.
            main, entry_rows, topk = ring, ring_rows, 0
        else:
            topk = entry_rows.shape[1]
        if rows == 0:
            return PreparedLaunch((), out)
        ring_rows_per_unit, ring_fmt, ring_group = plane_constants(ring)
        main_rows_per_unit, main_fmt, main_group = plane_constants(main)
        tiling = self.attention_tiling or default_attention_tiling(heads, dim, (ring_group, main_group))
        head_groups = triton.cdiv(heads, tiling.block_h)
        if isinstance(tiling, MlaTiling):
            qk_chunk, _ = tiling.spans(dim, (ring_group, main_group))
            kernel, programs_per_split = mla_attention_kernel, head_groups * tiling.dim_split
            cut = dict(QK_CHUNK=qk_chunk, Q_RELOAD=tiling.q_reload, DIM_SPLIT=tiling.dim_split)
        else:
            kernel, programs_per_split, cut = sparse_attention_kernel, head_groups, {}
        wave = _programs_per_wave(tiling.programs_per_wave, q.device, per_sm=1)
        if batch_invariant_enabled():
            split = fixed_key_split(window, topk, tiling.block_n)
        else:
            split = plan_key_split(rows, programs_per_split, window, topk, tiling.block_n, wave)
        q, chunk_kv = _last_dim_dense(q), _last_dim_dense(chunk_kv)
        if split.splits > 1:
            partial_acc = torch.empty(rows, split.splits, heads, dim, dtype=torch.float32, device=q.device)
            partial_stats = torch.empty(rows, split.splits, 2, heads, dtype=torch.float32, device=q.device)
        else:
            partial_acc = partial_stats = out  # never written: the programs write ``out``
        launches = [
            KernelLaunch(
                kernel=kernel,
                grid=(rows * programs_per_split, split.splits),
                args=(
                    q,
                    sink,
                    out,
                    partial_acc,
                    partial_stats,
                    chunk_kv,
                    chunk_rows.contiguous(),
                    ring_rows.contiguous(),
                    window_valid.contiguous(),
                    entry_rows.contiguous(),
                    *plane_launch_args(ring),
                    *plane_launch_args(main),
                    heads,
                    head_groups,
                    window,
                    topk,
                    split.keys_per_split,
                    split.window_splits,
                    softmax_scale * LOG2E.value,
                    q.stride(0),
                    q.stride(1),
                    out.stride(0),
                    out.stride(1),
                    chunk_kv.stride(0),
                ),
                constants=dict(
                    HEAD_DIM=dim,
                    BLOCK_H=tiling.block_h,
                    BLOCK_N=tiling.block_n,
                    **cut,
                    RING_ROWS=ring_rows_per_unit,
                    RING_FMT=ring_fmt,
                    RING_GROUP=ring_group,
                    MAIN_ROWS=main_rows_per_unit,
                    MAIN_FMT=main_fmt,
                    MAIN_GROUP=main_group,
                    SPLIT=split.splits > 1,
                    DOT_BF16=q.dtype == torch.bfloat16 and not INTERPRETED,
                    num_warps=tiling.num_warps,
                    num_stages=tiling.num_stages,
                ),
            )
        ]
        if split.splits > 1:
            merge_groups = triton.cdiv(heads, tiling.merge_block_h)
            launches.append(
                KernelLaunch(
                    kernel=merge_splits_kernel,
                    grid=(rows * merge_groups,),
                    args=(partial_acc, partial_stats, sink, out, heads, merge_groups, split.splits, out.stride(0),
                          out.stride(1)),
                    constants=dict(HEAD_DIM=dim, BLOCK_H=tiling.merge_block_h, num_warps=8),
                )
            )
        return PreparedLaunch(tuple(launches), out)

    def score(
        self,
        q: torch.Tensor,
        head_weights: torch.Tensor,
        tile_rows: torch.Tensor,
        row_segments: torch.Tensor,
        index: PlaneView,
    ) -> torch.Tensor:
        return self.prepare_score(q, head_weights, tile_rows, row_segments, index).run()

    def prepare_score(
        self,
        q: torch.Tensor,
        head_weights: torch.Tensor,
        tile_rows: torch.Tensor,
        row_segments: torch.Tensor,
        index: PlaneView,
    ) -> PreparedLaunch:
        rows, heads, dim = q.shape
        entries = tile_rows.shape[1]
        out = torch.empty(rows, entries, dtype=torch.float32, device=q.device)
        if rows == 0 or entries == 0:
            return PreparedLaunch((), out)
        q, head_weights, tile_rows = _last_dim_dense(q), _last_dim_dense(head_weights), _last_dim_dense(tile_rows)
        segments = row_segments.contiguous()
        tiling = self.scorer_tiling
        wave = _programs_per_wave(tiling.programs_per_wave, q.device, per_sm=3)
        rows_per_unit, fmt, group = plane_constants(index)
        # Each launch writes at most logits_budget_bytes of scores.
        rows_per_launch = max(1, self.logits_budget_bytes // (4 * entries))
        launches = []
        for start in range(0, rows, rows_per_launch):
            count = min(rows_per_launch, rows - start)
            entries_per_span = plan_entry_span(count, entries, tiling.block_c, wave)
            spans = triton.cdiv(entries, entries_per_span)
            launches.append(
                KernelLaunch(
                    kernel=index_score_kernel,
                    grid=(count * spans,),
                    args=(
                        q,
                        head_weights,
                        out[start : start + count],
                        tile_rows,
                        segments,
                        *plane_launch_args(index),
                        start,
                        entries,
                        heads,
                        spans,
                        entries_per_span,
                        q.stride(0),
                        q.stride(1),
                        head_weights.stride(0),
                        tile_rows.stride(0),
                        out.stride(0),
                    ),
                    constants=dict(
                        ROWS=rows_per_unit,
                        INDEX_DIM=dim,
                        BLOCK_HI=max(16, triton.next_power_of_2(heads)),
                        BLOCK_C=tiling.block_c,
                        FMT=fmt,
                        GROUP=group,
                        DOT_BF16=not INTERPRETED,
                        num_warps=tiling.num_warps,
                        num_stages=tiling.num_stages,
                    ),
                )
            )
        return PreparedLaunch(tuple(launches), out)

    def expert_bank(self, experts: Mapping[int, ExpertWeights], weight_format: str) -> TritonExpertBank:
        return build_expert_bank(experts, weight_format)

    def routed_expert_slots(self, x: torch.Tensor, routing: Routing, bank: ExpertBank, limit: float) -> torch.Tensor:
        if not isinstance(bank, TritonExpertBank):
            raise TypeError(f"bank: {type(bank).__name__} (allowed: a TritonExpertBank from TritonKernels.expert_bank)")
        return grouped_expert_slots(x, routing, bank, limit, bf16_dot=x.dtype == torch.bfloat16 and not INTERPRETED)

    # -- the MoE steps around the routed experts (route.py) -------------------------------

    def route(self, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float) -> Routing:
        return fused_route(x, gate, bias, top_k, scaling)

    def shared_expert(self, x: torch.Tensor, w: ExpertWeights, limit: float) -> torch.Tensor:
        return fused_shared_expert(x, w, limit)

    def moe_output(self, slots: torch.Tensor, shared: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return fused_moe_output(slots, shared, dtype)

    # -- Engram rows and gated add (engram.py) --------------------------------------------

    def engram_rows(self, table: EngramTable, row_ids: torch.Tensor) -> torch.Tensor:
        return engram_rows(table, row_ids)

    def engram_gated_add(
        self, streams: torch.Tensor, projected: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return engram_gated_add(streams, projected, q_weight, k_weight, eps)

    # -- the mHC site steps (mhc.py) ----------------------------------------------------

    def hc_mix(self, streams: torch.Tensor, site: HcSite, config: V41Config) -> HcMix:
        return fused_hc_mix(streams, site, config)

    def hc_collapse_norm(
        self, streams: torch.Tensor, pre: torch.Tensor, norm: torch.Tensor, eps: float, out_dtype: torch.dtype
    ) -> torch.Tensor:
        return fused_collapse_norm(streams, pre, norm, eps, out_dtype)

    def hc_expand(self, streams: torch.Tensor, y: torch.Tensor, mix: HcMix) -> torch.Tensor:
        return fused_expand(streams, y, mix)

    # -- a projection's epilogue (epilogue.py) ------------------------------------------

    def epilogue(self, x: torch.Tensor, spec: Epilogue, positions: torch.Tensor | None = None) -> torch.Tensor:
        return fused_epilogue(x, spec, positions)

    # -- ratio-2 compression and the quantised stores (compress.py, store.py) ----------

    def pool_ratio2(
        self, v: torch.Tensor, g: torch.Tensor, pairs: PairAddresses, tails: torch.Tensor
    ) -> torch.Tensor:
        groups, dim = pairs.second_rows.numel(), v.shape[1]
        if tails.dtype != torch.float32 or tails.shape[1:] != (2, dim) or tails.stride(2) != 1:
            raise ValueError(
                f"tails: {tails.dtype} {tuple(tails.shape)} strides {tails.stride()} "
                f"(allowed: float32 [slots, 2, {dim}] with contiguous channels)"
            )
        v, g = v.float().contiguous(), g.float().contiguous()
        out = torch.empty(groups, dim, dtype=torch.float32, device=v.device)
        block_d = triton.next_power_of_2(dim)
        rows_per_program = max(1, VALUES_PER_PROGRAM // block_d)
        if groups:
            pool_pairs_kernel[(triton.cdiv(groups, rows_per_program),)](
                v,
                g,
                out,
                tails,
                pairs.first_rows.contiguous(),
                pairs.first_tail_slots.contiguous(),
                pairs.second_rows.contiguous(),
                groups,
                v.stride(0),
                g.stride(0),
                out.stride(0),
                tails.stride(0),
                tails.stride(1),
                DIM=dim,
                BLOCK_D=block_d,
                BLOCK_G=rows_per_program,
                # libdevice is compiled-only; the interpreter's tl.exp is numpy's.
                LIBDEVICE_EXP=not INTERPRETED,
                enable_fp_fusion=False,
            )
        pending = pairs.tail_write_rows.numel()
        if pending:
            store_tails_kernel[(triton.cdiv(pending, rows_per_program),)](
                v,
                g,
                tails,
                pairs.tail_write_rows.contiguous(),
                pairs.tail_write_slots.contiguous(),
                pending,
                v.stride(0),
                g.stride(0),
                tails.stride(0),
                tails.stride(1),
                DIM=dim,
                BLOCK_D=block_d,
                BLOCK_N=rows_per_program,
            )
        return out

    def write_rows(
        self, plane: PlaneView, flat_rows: torch.Tensor, values: torch.Tensor, round_to: str | None = None
    ) -> None:
        check_row_write(plane, flat_rows, values, round_to)
        count, width = values.shape
        if count == 0:
            return
        grid = round_to or plane.fmt
        # bf16 rows kept as they are move in groups of 32 channels, like FP8's.
        block = SCALE_GROUPS.get(grid, FP8_BLOCK)
        # A bf16 plane takes bit patterns, rounded in the kernel.
        stored = plane.values.view(torch.int16) if plane.fmt == "bf16" else plane.values
        scales = plane.scales if plane.scales is not None else stored
        if stored.stride(2) != 1 or scales.stride(2) != 1:
            raise ValueError(f"plane: a {plane.fmt} plane whose rows are not contiguous (strides {stored.stride()})")
        store_rows(
            values.contiguous(), flat_rows.contiguous(), stored, scales, block, FORMAT_CODES[plane.fmt], FORMAT_CODES[grid]
        )
