"""Ratio-2 compression of token pairs with the STATE tails, as Triton kernels.

Owns two kernels: the pair pooling (per channel, sum over the pair of v * softmax(g),
model/compressor.pool_pairs) of every group a step completes, whose first token is a
row of this step or the pending tail of the group's STATE slot, read in place; and the
tail store, which leaves each request's trailing odd token (its fp32 v and g) in its
slot. They are two launches because a slot's tail can be read and replaced in one step
(a chunk that starts and ends on an odd position): the store must follow every read.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def pool_pairs_kernel(
    v_ptr,
    g_ptr,
    out_ptr,
    tails_ptr,
    first_rows_ptr,
    first_slots_ptr,
    second_rows_ptr,
    num_groups,
    stride_v,
    stride_g,
    stride_out,
    stride_tail_slot,
    stride_tail_part,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
):
    """BLOCK_G groups per program. A group whose second row is NO_ROW is padding: its
    output row is zero and it reads nothing. The softmax over two follows torch's order
    (max, exp of the differences, their sum, a division each) in float32; the launch
    disables multiply-add fusion so v * p + v * p rounds as torch's sum of products."""
    groups = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    in_range = groups < num_groups
    first = tl.load(first_rows_ptr + groups, mask=in_range, other=-1).to(tl.int64)
    slot = tl.load(first_slots_ptr + groups, mask=in_range, other=-1).to(tl.int64)
    second = tl.load(second_rows_ptr + groups, mask=in_range, other=-1).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    present = (second >= 0)[:, None] & (dims < DIM)[None, :]
    from_rows = present & (first >= 0)[:, None]
    from_tail = present & (first < 0)[:, None]
    row_off = first[:, None] * stride_v + dims[None, :]
    tail_off = slot[:, None] * stride_tail_slot + dims[None, :]
    v1 = tl.where(
        from_rows,
        tl.load(v_ptr + row_off, mask=from_rows, other=0.0),
        tl.load(tails_ptr + tail_off, mask=from_tail, other=0.0),
    )
    g1 = tl.where(
        from_rows,
        tl.load(g_ptr + first[:, None] * stride_g + dims[None, :], mask=from_rows, other=0.0),
        tl.load(tails_ptr + tail_off + stride_tail_part, mask=from_tail, other=0.0),
    )
    v2 = tl.load(v_ptr + second[:, None] * stride_v + dims[None, :], mask=present, other=0.0)
    g2 = tl.load(g_ptr + second[:, None] * stride_g + dims[None, :], mask=present, other=0.0)
    top = tl.maximum(g1, g2)
    if LIBDEVICE_EXP:
        # expf, the function torch's CUDA softmax calls (tl.exp is ex2.approx there).
        e1 = libdevice.exp(g1 - top)
        e2 = libdevice.exp(g2 - top)
    else:
        e1 = tl.exp(g1 - top)
        e2 = tl.exp(g2 - top)
    total = e1 + e2
    pooled = v1 * tl.math.div_rn(e1, total) + v2 * tl.math.div_rn(e2, total)
    pooled = tl.where(present, pooled, 0.0)
    out_mask = in_range[:, None] & (dims < DIM)[None, :]
    tl.store(out_ptr + groups[:, None] * stride_out + dims[None, :], pooled, mask=out_mask)


@triton.jit
def store_tails_kernel(
    v_ptr,
    g_ptr,
    tails_ptr,
    rows_ptr,
    slots_ptr,
    count,
    stride_v,
    stride_g,
    stride_tail_slot,
    stride_tail_part,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Copies row ``rows[n]``'s v and g into slot ``slots[n]``'s tail; NO_ROW slots are skipped."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + n, mask=n < count, other=-1).to(tl.int64)
    row = tl.load(rows_ptr + n, mask=n < count, other=0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    mask = (slot >= 0)[:, None] & (dims < DIM)[None, :]
    tail = tails_ptr + slot[:, None] * stride_tail_slot + dims[None, :]
    tl.store(tail, tl.load(v_ptr + row[:, None] * stride_v + dims[None, :], mask=mask), mask=mask)
    tl.store(tail + stride_tail_part, tl.load(g_ptr + row[:, None] * stride_g + dims[None, :], mask=mask), mask=mask)
