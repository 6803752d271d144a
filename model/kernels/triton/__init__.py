"""The Triton backend of the paged kernels (NVIDIA GPUs; CPUs under TRITON_INTERPRET=1).

Owns the host side of the Triton kernels: turning flat row addresses into element
offsets of the planes' own strided views (so kernels read the pool in place, never a
gathered copy), launch grids, and the logits memory budget that bounds how many query
rows one scorer launch covers.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton

from model.kernels.interface import PlaneView
from model.kernels.triton.attention import SOURCE_CHUNK, SOURCE_MAIN, SOURCE_NONE, SOURCE_RING, sparse_attention_kernel
from model.kernels.triton.index_scorer import index_score_kernel

FORMAT_CODES = {"bf16": 0, "fp8": 1, "nvfp4": 2, "mxfp4": 3}
DEFAULT_LOGITS_BUDGET_BYTES = 2048 << 20
# Triton's CPU interpreter computes bf16 dots wrongly (garbage, seen with triton 3.9.0
# on 2026-11-30), so under TRITON_INTERPRET the kernels keep dot operands in fp32. The
# products are exact either way (every operand is bf16-exact); only the attention's
# probabilities, rounded to bf16 for the GPU's dot, are not rounded there.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

logger = logging.getLogger(__name__)
if INTERPRETED:
    logger.info("triton kernels: interpreter mode, fp32 dot operands")


def plane_offsets(plane: PlaneView, flat_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Element offsets of flat rows in the plane's values and scales views."""
    rows = plane.values.shape[1]
    unit, row = torch.div(flat_rows, rows, rounding_mode="floor"), flat_rows.remainder(rows)
    values = unit * plane.values.stride(0) + row * plane.values.stride(1)
    if plane.scales is None:
        return values, torch.zeros_like(values)
    return values, unit * plane.scales.stride(0) + row * plane.scales.stride(1)


def _scales_or_values(plane: PlaneView) -> torch.Tensor:
    return plane.scales if plane.scales is not None else plane.values


@dataclass(frozen=True)
class PreparedLaunch:
    """A kernel launch with its addresses already computed: ``run()`` is the kernel
    alone (what a step could reuse across layers that share addresses)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constants: dict[str, Any]
    out: torch.Tensor

    def run(self) -> torch.Tensor:
        self.kernel[self.grid](*self.args, **self.constants)
        return self.out


class TritonKernels:
    name = "triton"

    def __init__(self, logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES) -> None:
        if logits_budget_bytes <= 0:
            raise ValueError(f"logits_budget_bytes: {logits_budget_bytes} (allowed: > 0)")
        self.logits_budget_bytes = logits_budget_bytes

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
        q = q.contiguous()
        chunk_kv = chunk_kv.contiguous()
        ring_off, ring_scale_off = plane_offsets(ring, ring_rows.clamp_min(0))
        source = torch.where(chunk_rows >= 0, SOURCE_CHUNK, SOURCE_RING)
        source = torch.where(window_valid, source, SOURCE_NONE)
        offset = torch.where(chunk_rows >= 0, chunk_rows.clamp_min(0) * chunk_kv.stride(0), ring_off)
        scale_offset = torch.where(chunk_rows >= 0, 0, ring_scale_off)
        main_plane = main if main is not None else ring
        if entry_rows is not None and main is not None:
            main_off, main_scale_off = plane_offsets(main, entry_rows.clamp_min(0))
            source = torch.cat((source, torch.where(entry_rows >= 0, SOURCE_MAIN, SOURCE_NONE)), dim=1)
            offset = torch.cat((offset, main_off), dim=1)
            scale_offset = torch.cat((scale_offset, main_scale_off), dim=1)
        out = torch.empty_like(q)
        num_keys = source.shape[1]
        # 16 heads per program: a [16, head_dim] fp32 accumulator stays in registers at
        # head_dim 512; the row's keys are re-read by each head block, from L2.
        block_h = 16
        return PreparedLaunch(
            kernel=sparse_attention_kernel,
            grid=(rows, triton.cdiv(heads, block_h)),
            args=(
                q,
                out,
                sink.float().contiguous(),
                chunk_kv,
                ring.values,
                _scales_or_values(ring),
                main_plane.values,
                _scales_or_values(main_plane),
                source.to(torch.int32).contiguous(),
                offset.contiguous(),
                scale_offset.contiguous(),
                num_keys,
                heads,
                softmax_scale,
                q.stride(0),
                q.stride(1),
                out.stride(0),
                out.stride(1),
            ),
            constants=dict(
                HEAD_DIM=dim,
                BLOCK_H=block_h,
                BLOCK_N=32,
                RING_FMT=FORMAT_CODES[ring.fmt],
                MAIN_FMT=FORMAT_CODES[main_plane.fmt],
                BF16_DOT=q.dtype == torch.bfloat16 and not INTERPRETED,
                num_warps=8,
            ),
            out=out,
        )

    def score(
        self,
        q: torch.Tensor,
        head_weights: torch.Tensor,
        tile_rows: torch.Tensor,
        row_segments: torch.Tensor,
        index: PlaneView,
    ) -> torch.Tensor:
        rows, heads, dim = q.shape
        entries = tile_rows.shape[1]
        out = torch.empty(rows, entries, dtype=torch.float32, device=q.device)
        if rows == 0 or entries == 0:
            return out
        values_off, scales_off = plane_offsets(index, tile_rows.clamp_min(0))
        values_off = torch.where(tile_rows >= 0, values_off, -1).contiguous()
        q = q.float().contiguous()
        head_weights = head_weights.float().contiguous()
        segments = row_segments.contiguous()
        block_c = 128
        # Each launch writes at most logits_budget_bytes of scores.
        rows_per_launch = max(1, self.logits_budget_bytes // (4 * entries))
        for start in range(0, rows, rows_per_launch):
            count = min(rows_per_launch, rows - start)
            index_score_kernel[(count, triton.cdiv(entries, block_c))](
                q,
                head_weights,
                out[start : start + count],
                index.values,
                _scales_or_values(index),
                values_off,
                scales_off.contiguous(),
                segments,
                start,
                entries,
                heads,
                q.stride(0),
                q.stride(1),
                head_weights.stride(0),
                out.stride(0),
                INDEX_DIM=dim,
                BLOCK_HI=max(16, triton.next_power_of_2(heads)),
                BLOCK_C=block_c,
                FMT=FORMAT_CODES[index.fmt],
                BF16_DOT=not INTERPRETED,
            )
        return out
