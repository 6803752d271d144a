"""A row reduction with one order per row, for the batch-invariant mode on GPUs.

Owns ``row_sum``: the fp32 sum over the last dim, one program per row walking the row in
``BLOCK`` columns and reducing the block's partial sums as one fixed tree. torch's CUDA
reductions choose how many blocks share a row from the number of rows, so a row's sum
there depends on the call (model/linalg.py says where this is used instead).
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def row_sum_kernel(x_ptr, out_ptr, cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, cols, BLOCK):
        offsets = c0 + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row.to(tl.int64) * stride + offsets, mask=offsets < cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc, 0))


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """The fp32 sum over the last dim of ``x`` [..., C] -> [...]."""
    lead, cols = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, cols).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        row_sum_kernel[(rows.shape[0],)](rows, out, cols, rows.stride(0), BLOCK=BLOCK)
    return out.reshape(lead)
