"""Engram on the device: table rows gathered from the host table in place, and the
gated add of the projected rows to the streams.

Owns the Triton side of ``EngramKernels``. ``engram_rows``: each program reads the rows
of 16 looked-up row ids from the host table through the address ``EngramTable.map_for``
made readable (page-locked and mapped: a GPU reads it over the bus, no staging copy;
under the interpreter the host memory itself) and writes them dequantised to float32,
value for value ``EngramTable.lookup``'s: FP8 E4M3 bytes times their 32-value group's E8M0
scale (both exact in float32, so the product is too), or the float rows as they are.
Only the rows a step asks for cross the bus; a forward on the device (a decode graph
too) thus hashes, gathers and applies Engram with no host work and no host sync.
``engram_gated_add``: model/engram.gated_add in one launch (torch runs it as about a
dozen fp32 ops over the [T, hc, hidden] streams), the gate's three row reductions
(the key dot, both means of squares) folded BLOCK columns at a time, then one tree,
and every other step rounded where torch's ops round (the helpers of mhc.py): so it
differs from the torch path in the last bits through those reductions' order and exp
only (tests/model/test_kernels_engram.py). A program takes whole token rows, so a
row's result does not depend on the call.

The row ids are trusted: ``EngramHashing.row_ids`` lands every n-gram in its layer's
rows by construction (floor-mod of its prime, plus the offset), and the table's row
count is checked against the layer's primes when the runtime maps it; an id outside
the table would read outside it.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv41.model.engram import GATE_DOT_FLOOR, EngramTable
from dsv41.model.formats import FP8_BLOCK
from dsv41.model.kernels.triton.decode import INTERPRETED, e4m3_to_f32, e8m0_to_f32
from dsv41.model.kernels.triton.mhc import (
    BLOCK,
    mean_as_torch,
    out_rows,
    rows_per_program,
    rsqrt_as_torch,
    sigmoid_as_torch,
    store_rounded,
    uses_libdevice,
)

_ELEMENTS = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.uint8: tl.uint8}


@triton.jit
def engram_rows_kernel(
    values_address,
    scales_address,
    row_ids_ptr,
    out_ptr,
    num_ids,
    head_dim,
    value_row_stride,
    value_col_stride,
    scale_row_stride,
    scale_col_stride,
    ELEMENT: tl.constexpr,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    IDS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[i, :head_dim] = row ``row_ids[i]`` of the table, as float32, for IDS ids a
    program."""
    ids = tl.program_id(0) * IDS + tl.arange(0, IDS)
    live_ids = ids < num_ids
    row = tl.load(row_ids_ptr + ids, mask=live_ids, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    live = live_ids[:, None] & (cols < head_dim)[None, :]
    values = values_address.to(tl.pointer_type(ELEMENT))
    stored = tl.load(values + row[:, None] * value_row_stride + cols[None, :] * value_col_stride, mask=live, other=0)
    if FP8:
        scales = scales_address.to(tl.pointer_type(tl.uint8))
        groups = (cols // GROUP)[None, :] * scale_col_stride
        scale = tl.load(scales + row[:, None] * scale_row_stride + groups, mask=live, other=127)
        rows = e4m3_to_f32(stored) * e8m0_to_f32(scale)
    else:
        rows = stored.to(tl.float32)
    tl.store(out_ptr + ids.to(tl.int64)[:, None] * head_dim + cols[None, :], rows, mask=live)


# Row ids a program reads: 16 rows of 256 bytes (an FP8 Flash row) keep several
# kilobytes of host reads in flight per program.
IDS_PER_PROGRAM = 16


def engram_rows(table: EngramTable, row_ids: torch.Tensor) -> torch.Tensor:
    """``table.lookup(row_ids)`` on ``row_ids``' device: ``row_ids [..., k]`` int64 ->
    float32 ``[..., k * head_dim]``, the rows concatenated in the order given. A CUDA
    device reads a table ``map_for`` made readable there (refused otherwise); the
    interpreter reads the host memory."""
    if row_ids.dim() == 0 or row_ids.dtype != torch.int64:
        raise ValueError(f"row_ids: {row_ids.dtype} {tuple(row_ids.shape)} (allowed: torch.int64 [..., k])")
    device = row_ids.device
    if device.type == "cuda" and not table.device_readable:
        raise RuntimeError(
            "Engram table: not mapped for the device (allowed: a table EngramTable.map_for made readable there)"
        )
    if device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("engram_rows: row ids on the CPU outside the Triton interpreter (allowed: a CUDA device)")
    flat = row_ids.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), table.head_dim, dtype=torch.float32, device=device)
    if flat.numel():
        scales = table.scales
        engram_rows_kernel[(triton.cdiv(flat.numel(), IDS_PER_PROGRAM),)](
            table.values.data_ptr(),
            table.values.data_ptr() if scales is None else scales.data_ptr(),
            flat,
            out,
            flat.numel(),
            table.head_dim,
            *table.values.stride(),
            *((0, 0) if scales is None else scales.stride()),
            ELEMENT=_ELEMENTS[table.values.dtype],
            FP8=table.is_fp8,
            GROUP=FP8_BLOCK,
            IDS=IDS_PER_PROGRAM,
            BLOCK_D=triton.next_power_of_2(table.head_dim),
            num_warps=4,
        )
    return out.view(*row_ids.shape[:-1], row_ids.shape[-1] * table.head_dim)


# model/engram.gated_add's floor under the gate's square root, as a kernel constant.
GATE_FLOOR = tl.constexpr(GATE_DOT_FLOOR)


@triton.jit
def engram_gated_add_kernel(
    streams_ptr,
    projected_ptr,
    q_ptr,
    k_ptr,
    out_ptr,
    tokens,
    stride_row,
    stride_stream,
    stride_projected,
    eps,
    root_hidden,
    HIDDEN: tl.constexpr,
    HC: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OUT_BF16: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """BLOCK_T token rows, each stream s: the gate from sum(h * q[s] * k[s] * key_s),
    the RMS of h and of key_s, then out = h + gate * value (model/engram.gated_add)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < tokens
    projected_rows = projected_ptr + t[:, None] * stride_projected
    for s in tl.static_range(HC):
        streams_rows = streams_ptr + t[:, None] * stride_row + s * stride_stream
        dots = tl.zeros((BLOCK_T, BLOCK), dtype=tl.float32)
        h_squares = tl.zeros((BLOCK_T, BLOCK), dtype=tl.float32)
        key_squares = tl.zeros((BLOCK_T, BLOCK), dtype=tl.float32)
        for c0 in range(0, HIDDEN, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            in_row = cols < HIDDEN
            mask = live[:, None] & in_row[None, :]
            h = tl.load(streams_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            key = tl.load(projected_rows + s * HIDDEN + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + s * HIDDEN + cols, mask=in_row, other=0.0).to(tl.float32)[None, :]
            k = tl.load(k_ptr + s * HIDDEN + cols, mask=in_row, other=0.0).to(tl.float32)[None, :]
            dots += ((h * q) * k) * key
            h_squares += h * h
            key_squares += key * key
        dot = tl.sum(dots, axis=1)
        dot = dot * rsqrt_as_torch(mean_as_torch(tl.sum(h_squares, axis=1), HIDDEN, LIBDEVICE) + eps, LIBDEVICE)
        dot = dot * rsqrt_as_torch(mean_as_torch(tl.sum(key_squares, axis=1), HIDDEN, LIBDEVICE) + eps, LIBDEVICE)
        if LIBDEVICE:
            # torch's CUDA division by a Python number multiplies by its reciprocal.
            dot = dot * tl.math.div_rn(tl.full([], 1.0, tl.float32), root_hidden)
        else:
            dot = tl.math.div_rn(dot, root_hidden)
        magnitude = tl.sqrt_rn(tl.maximum(tl.abs(dot), GATE_FLOOR))
        gate = sigmoid_as_torch(tl.where(dot > 0, magnitude, tl.where(dot < 0, -magnitude, 0.0)), LIBDEVICE)[:, None]
        for c0 in range(0, HIDDEN, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = live[:, None] & (cols < HIDDEN)[None, :]
            h = tl.load(streams_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            value = tl.load(projected_rows + HC * HIDDEN + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            out = h + gate * value
            store_rounded(out_ptr + t[:, None] * stride_row + s * stride_stream + cols[None, :], out, mask, OUT_BF16)


def engram_gated_add(
    streams: torch.Tensor, projected: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """model/engram.gated_add in one launch: ``streams [T, hc, hidden]`` (fp32 or
    bf16), ``projected [T, (hc + 1) * hidden]``, ``q_weight``, ``k_weight [hc, hidden]``
    -> the streams' dtype."""
    tokens, hc, hidden = streams.shape
    streams, projected = streams.contiguous(), projected.contiguous()
    out = torch.empty_like(streams)
    block_t = rows_per_program(streams.device)
    if tokens:
        engram_gated_add_kernel[(triton.cdiv(tokens, block_t),)](
            streams,
            projected,
            q_weight.contiguous(),
            k_weight.contiguous(),
            out_rows(out),
            tokens,
            streams.stride(0),
            streams.stride(1),
            projected.stride(0),
            eps,
            math.sqrt(hidden),
            HIDDEN=hidden,
            HC=hc,
            BLOCK=min(BLOCK, triton.next_power_of_2(hidden)),
            BLOCK_T=block_t,
            OUT_BF16=streams.dtype == torch.bfloat16,
            LIBDEVICE=uses_libdevice(streams.device),
            enable_fp_fusion=False,
        )
    return out
