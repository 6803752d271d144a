"""Sparse attention with a sink over paged rows, as one ragged Triton launch.

Owns the kernel that computes, for every query row of a step (prefill and decode rows
alike: a row is a row), the softmax attention over its own key rows: window keys from
this step's KV or the slot's ring plane, and selected compressed entries of the main
plane, each read in place from the pool by element offset and decoded in registers
(bf16 or FP8 rings, bf16 or NVFP4 main rows). The zero-value sink key starts the online
softmax: running max = sink logit, running sum = 1.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import triton
import triton.language as tl

from model.kernels.triton.decode import load_decoded

SOURCE_NONE, SOURCE_CHUNK, SOURCE_RING, SOURCE_MAIN = -1, 0, 1, 2


@triton.jit
def sparse_attention_kernel(
    q_ptr,
    out_ptr,
    sink_ptr,
    chunk_ptr,
    ring_values,
    ring_scales,
    main_values,
    main_scales,
    source_ptr,
    offset_ptr,
    scale_offset_ptr,
    num_keys,
    num_heads,
    softmax_scale,
    stride_q_row,
    stride_q_head,
    stride_out_row,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RING_FMT: tl.constexpr,
    MAIN_FMT: tl.constexpr,
    BF16_DOT: tl.constexpr,
):
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :],
        mask=head_mask[:, None],
        other=0.0,
    ).to(tl.float32)
    if BF16_DOT:
        q = q.to(tl.bfloat16)
    running_max = tl.load(sink_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    running_sum = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    base = row.to(tl.int64) * num_keys
    for start in range(0, num_keys, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < num_keys
        source = tl.load(source_ptr + base + keys, mask=key_mask, other=-1)
        offset = tl.load(offset_ptr + base + keys, mask=key_mask, other=0)
        scale_offset = tl.load(scale_offset_ptr + base + keys, mask=key_mask, other=0)
        k = load_decoded(chunk_ptr, chunk_ptr, offset, scale_offset, dims, source == 0, 0)
        k += load_decoded(ring_values, ring_scales, offset, scale_offset, dims, source == 1, RING_FMT)
        k += load_decoded(main_values, main_scales, offset, scale_offset, dims, source == 2, MAIN_FMT)
        if BF16_DOT:
            k = k.to(tl.bfloat16)
            logits = tl.dot(q, tl.trans(k)) * softmax_scale
        else:
            logits = tl.dot(q, tl.trans(k), input_precision="ieee") * softmax_scale
        logits = tl.where((source >= 0)[None, :], logits, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, 1))
        correction = tl.exp(running_max - new_max)
        p = tl.exp(logits - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(p, 1)
        if BF16_DOT:
            acc = acc * correction[:, None] + tl.dot(p.to(tl.bfloat16), k)
        else:
            acc = acc * correction[:, None] + tl.dot(p, k, input_precision="ieee")
        running_max = new_max
    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_mask[:, None],
    )
