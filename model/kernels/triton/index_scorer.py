"""The paged index scorer: one Triton kernel for every query row shape.

Owns the kernel that scores each query row against its request's tile of index-plane
rows, read in place and decoded in registers (FP8 E4M3 + E8M0, or MXFP4): score =
sum_h w_h ReLU(q_h . k). A prefill row, a decode row and a drafted row are the same
shape to it; each row finds its tile through its segment. Entries the tile does not
hold (NO_ROW) score -inf. Selection (visibility, candidates, top-k) stays outside.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import triton
import triton.language as tl

from model.kernels.triton.decode import load_decoded


@triton.jit
def index_score_kernel(
    q_ptr,
    weight_ptr,
    out_ptr,
    values_ptr,
    scales_ptr,
    offset_ptr,
    scale_offset_ptr,
    segment_ptr,
    row_start,
    num_entries,
    num_heads,
    stride_q_row,
    stride_q_head,
    stride_w_row,
    stride_out_row,
    INDEX_DIM: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FMT: tl.constexpr,
    BF16_DOT: tl.constexpr,
):
    local_row = tl.program_id(0)
    row = row_start + local_row
    segment = tl.load(segment_ptr + row).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < num_entries
    offset = tl.load(offset_ptr + segment * num_entries + cols, mask=col_mask, other=-1)
    scale_offset = tl.load(scale_offset_ptr + segment * num_entries + cols, mask=col_mask, other=0)
    present = col_mask & (offset >= 0)
    dims = tl.arange(0, INDEX_DIM)
    keys = load_decoded(values_ptr, scales_ptr, offset, scale_offset, dims, present, FMT)
    heads = tl.arange(0, BLOCK_HI)
    head_mask = heads < num_heads
    q = tl.load(
        q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :],
        mask=head_mask[:, None],
        other=0.0,
    )
    weights = tl.load(weight_ptr + row * stride_w_row + heads, mask=head_mask, other=0.0)
    # Index queries and keys sit on the MXFP4 / FP8 grids, which bf16 holds exactly: a
    # bf16 dot's products are exact and only the fp32 summation order differs.
    if BF16_DOT:
        dots = tl.dot(keys.to(tl.bfloat16), tl.trans(q.to(tl.bfloat16)))
    else:
        dots = tl.dot(keys, tl.trans(q), input_precision="ieee")
    scores = tl.sum(tl.maximum(dots, 0.0) * weights[None, :], 1)
    scores = tl.where(present, scores, float("-inf"))
    tl.store(out_ptr + local_row * stride_out_row + cols, scores, mask=col_mask)
