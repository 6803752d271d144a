"""Engram table rows gathered on the device from the host table in place.

Owns the Triton side of ``EngramKernels.engram_rows``: each program reads the rows of
16 looked-up row ids from the host table through the address ``EngramTable.map_for``
made readable (page-locked and mapped: a GPU reads it over the bus, no staging copy;
under the interpreter the host memory itself) and writes them dequantised to float32,
value for value ``EngramTable.lookup``'s: FP8 E4M3 bytes times their 32-value group's E8M0
scale (both exact in float32, so the product is too), or the float rows as they are.
Only the rows a step asks for cross the bus; a forward on the device (a decode graph
too) thus hashes, gathers and applies Engram with no host work and no host sync.

The row ids are trusted: ``EngramHashing.row_ids`` lands every n-gram in its layer's
rows by construction (floor-mod of its prime, plus the offset), and the table's row
count is checked against the layer's primes when the runtime maps it; an id outside
the table would read outside it.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.model.engram import EngramTable
from dsv41.model.formats import FP8_BLOCK
from dsv41.model.kernels.triton.decode import INTERPRETED, e4m3_to_f32, e8m0_to_f32

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
