"""The paged index scorer: one Triton kernel for every query row shape, and its tiling.

Owns the kernel that scores each query row against its request's tile of index-plane
rows, read in place and decoded in registers (FP8 E4M3 + E8M0, or MXFP4): score =
sum_h w_h ReLU(q_h . k). A prefill row, a decode row and a drafted row are the same
shape to it; each row finds its tile through its segment. Entries the tile does not
hold (NO_ROW) score -inf. Selection (visibility, candidates, top-k) stays outside.

A program holds one row's query heads (loaded once) and walks a span of that row's
tile in blocks of entries, each block one [entries x dim] x [dim x heads] dot, the
next blocks' loads in flight while it computes (software pipelining). Spans are sized
so one wave of programs covers the launch: long enough to read each query rarely,
short enough to keep every SM busy at small batches.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from dsv41.model.kernels.triton.decode import load_rows


@dataclass(frozen=True)
class ScorerTiling:
    """How the scorer cuts the work: ``block_c`` entries per dot. ``programs_per_wave``
    is how many programs run at once (None: three per SM of the GPU, what the registers
    of a [128, 128] key tile and a [32, 128] query at 4 warps allow: 168, compiled for
    sm_90 by triton 3.9 on the CPU dev box, 2026-11-30; on the CPU interpreter, where
    programs run one after another, 1: one span per row)."""

    block_c: int = 128
    num_warps: int = 4
    num_stages: int = 3
    programs_per_wave: int | None = None

    def __post_init__(self) -> None:
        if self.block_c < 16 or self.block_c & (self.block_c - 1):
            raise ValueError(f"ScorerTiling.block_c: {self.block_c} (allowed: a power of two >= 16, a dot's minimum)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"ScorerTiling.num_warps: {self.num_warps} (allowed: 1, 2, 4, 8, 16)")
        if self.num_stages < 1:
            raise ValueError(f"ScorerTiling.num_stages: {self.num_stages} (allowed: >= 1)")
        if self.programs_per_wave is not None and self.programs_per_wave < 1:
            raise ValueError(f"ScorerTiling.programs_per_wave: {self.programs_per_wave} (allowed: >= 1 or None)")


def plan_entry_span(rows: int, entries: int, block_c: int, programs_per_wave: int) -> int:
    """Entries per program, whole blocks of ``block_c``: every row cut into the same
    number of spans, as many as one wave of programs holds (rows x spans <=
    programs_per_wave, at least one span per row). Equal spans in one wave finish
    together, and the longest such spans read each row's query least often."""
    blocks = triton.cdiv(entries, block_c)
    spans_per_row = max(1, min(blocks, programs_per_wave // max(rows, 1)))
    return triton.cdiv(blocks, spans_per_row) * block_c


@triton.jit
def index_score_kernel(
    q_ptr,
    weight_ptr,
    out_ptr,
    tile_rows_ptr,
    segment_ptr,
    values_ptr,
    scales_ptr,
    values_stride_unit,
    values_stride_row,
    scales_stride_unit,
    scales_stride_row,
    row_start,
    num_entries,
    num_heads,
    spans,
    entries_per_span,
    stride_q_row,
    stride_q_head,
    stride_w_row,
    stride_tile,
    stride_out_row,
    ROWS: tl.constexpr,
    INDEX_DIM: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    """Grid (rows of this launch x spans), a row's spans side by side; ``out`` holds
    this launch's rows."""
    local_row = (tl.program_id(0) // spans).to(tl.int64)
    span = tl.program_id(0) % spans
    row = row_start + local_row
    segment = tl.load(segment_ptr + row).to(tl.int64)
    dims = tl.arange(0, INDEX_DIM)
    heads = tl.arange(0, BLOCK_HI)
    head_mask = heads < num_heads
    # Index queries and keys sit on the MXFP4 / FP8 grids, which bf16 holds exactly: a
    # bf16 dot's products are exact and only the fp32 summation order differs.
    if DOT_BF16:
        dot_dtype = tl.bfloat16
    else:
        dot_dtype = tl.float32
    q = tl.load(
        q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :], mask=head_mask[:, None], other=0.0
    ).to(dot_dtype)
    weights = tl.load(weight_ptr + row * stride_w_row + heads, mask=head_mask, other=0.0).to(tl.float32)
    first = span * entries_per_span
    last = tl.minimum(first + entries_per_span, num_entries)
    for start in range(first, last, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        in_span = cols < last
        flat = tl.load(tile_rows_ptr + segment * stride_tile + cols, mask=in_span, other=-1)
        present = flat >= 0
        keys = load_rows(
            values_ptr,
            scales_ptr,
            flat,
            present,
            ROWS,
            values_stride_unit,
            values_stride_row,
            scales_stride_unit,
            scales_stride_row,
            INDEX_DIM,
            FMT,
            GROUP,
            dot_dtype,
        )
        if DOT_BF16:
            dots = tl.dot(keys, tl.trans(q))
        else:
            dots = tl.dot(keys, tl.trans(q), input_precision="ieee")
        scores = tl.sum(tl.maximum(dots, 0.0) * weights[None, :], 1)
        tl.store(out_ptr + local_row * stride_out_row + cols, tl.where(present, scores, float("-inf")), mask=in_span)
