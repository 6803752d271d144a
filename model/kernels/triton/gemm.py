"""A fixed-tile GEMM for the batch-invariant mode on NVIDIA GPUs.

Owns ``fixed_tile_matmul``: ``a @ b.T`` where every output tile is computed with one
tile shape and one walk over K (no autotuning, nothing chosen from the number of
rows), so an output row's value does not depend on how many rows share the call or
where the row sits in it. K is cut into a number of splits chosen from the weight's
shape and the GPU's size alone (``plan_k_splits``), each split's fp32 partial summed in
split order: a decode step's few rows read a weight with every SM, not with one program
per column tile walking all of K. A batch of items (each row's own product with its own
keys: attention, index scores) gets each item's ``a[i] @ b[i].T`` from that item's own
programs, K in one walk: the items fill the GPU, and an item's value does not depend on
how many share the call. cuBLAS instead picks its algorithm, and possibly a split of K,
from M (a batched GEMM's from the batch count too), which is why model/linalg.py routes
the projections and the per-row products here in that mode (an fp32 projection goes to
fp32_gemm.py's split GEMM instead). fp32 operands use IEEE products (no TF32), as
torch's fp32 matmul, through dots.ieee_dot: under Triton's interpreter (which runs bf16
operands as fp32 here too) each output's products are summed in K order, so a row's
bits do not depend on the call on a CPU either (numpy's BLAS would make them).

The weight may be an FP8 weight as the checkpoint stores it (model/stored_weights.py
``Fp8Weight``: E4M3 values, one E8M0 scale per 32x32 tile): each weight tile is read
as its bytes and its scales, decoded in registers (E4M3 to fp32 times the tile's power
of two, then the compute dtype: all exact) and multiplied as the decoded weight would
be, with the same tiles and splits, so the product equals the decoded weight's bit for
bit while the weight's bytes read are halved (bf16) or quartered (fp32). Also owns
``decode_fp8_weight``, the weight's exact decode in one pass: outside the
batch-invariant mode a prefill's projection (model/linalg.py ``DECODED_GEMM_ROWS``)
decodes into a transient copy and runs cuBLAS, whose bf16 rate the in-register decode
does not reach.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.model.kernels.triton.decode import INTERPRETED, e4m3_to_f32, e8m0_to_f32
from dsv41.model.kernels.triton.dots import ieee_dot
from dsv41.model.kernels.triton.moe import TL_DTYPES
from dsv41.model.stored_weights import FP8_TILE, Fp8Weight

# Elements one program of the split sum adds; rows whose partials one launch keeps.
SUM_BLOCK = 1024
SPLIT_ROWS = 1024
# One tile shape per operand dtype (fp32's smaller tiles keep IEEE dots in shared memory).
TILES = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
    torch.float32: dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2),
}


@triton.jit
def fixed_tile_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    M_TILES,
    stride_ab,
    stride_am,
    stride_ak,
    stride_bb,
    stride_bn,
    stride_bk,
    stride_cb,
    stride_cs,
    stride_cm,
    scale_ptr,
    stride_sn,
    stride_sk,
    OUT: tl.constexpr,
    IEEE: tl.constexpr,
    B_SCALED: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One output tile of one batch item (``program_id(0)``: item * M_TILES + row
    tile, on the grid axis without CUDA's 65,535 limit) summed over one split of K
    (split ``program_id(2)``: K_PER_SPLIT values from split * K_PER_SPLIT), in BLOCK_K
    steps, into ``c`` (the output when there is one split, else that split's fp32
    partial). ``B_SCALED``: b is E4M3 with one E8M0 byte per TILE x TILE block at
    ``scale_ptr`` (BLOCK_K a multiple of TILE, and every split starts on a block)."""
    item = (tl.program_id(0) // M_TILES).to(tl.int64)
    a_ptr += item * stride_ab
    b_ptr += item * stride_bb
    c_ptr += item * stride_cb
    rows = (tl.program_id(0) % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        a = tl.load(
            a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks.to(tl.int64)[None, :] * stride_ak,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + cols.to(tl.int64)[:, None] * stride_bn + ks.to(tl.int64)[None, :] * stride_bk,
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if B_SCALED:
            # Each column's scale for each of the step's TILE-wide K blocks, spread over
            # the block's columns.
            scale_rows = (cols // TILE).to(tl.int64) * stride_sn
            scale = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for g in tl.static_range(BLOCK_K // TILE):
                code = tl.load(
                    scale_ptr + scale_rows + (k0 // TILE + g) * stride_sk,
                    mask=col_mask & (cols * 0 + k0 + g * TILE < k_end),
                    other=127,
                )
                block = e8m0_to_f32(code)
                scale = tl.where((tl.arange(0, BLOCK_K) // TILE == g)[None, :], block[:, None], scale)
            b = (b.to(tl.float32) * scale).to(a.dtype)
        if IEEE:
            acc = ieee_dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
        else:
            acc += tl.dot(a, tl.trans(b))
    tl.store(
        c_ptr + split.to(tl.int64) * stride_cs + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :],
        acc.to(OUT),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def decode_fp8_weight_kernel(
    values_ptr, scale_ptr, out_ptr, rows, cols, stride_vr, stride_vc, stride_sr, stride_sc, stride_o,
    OUT: tl.constexpr, TILE: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One TILE-row band of BLOCK_C columns of an E4M3 weight decoded to ``OUT``: each
    value times its TILE x TILE tile's E8M0 scale, in fp32 (exact), then rounded."""
    r = tl.program_id(0) * TILE + tl.arange(0, TILE)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    byte = tl.load(values_ptr + r.to(tl.int64)[:, None] * stride_vr + c[None, :] * stride_vc, mask=mask, other=0)
    code = tl.load(scale_ptr + tl.program_id(0) * stride_sr + (c // TILE) * stride_sc, mask=c < cols, other=127)
    value = e4m3_to_f32(byte) * e8m0_to_f32(code)[None, :]
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :], value.to(OUT), mask=mask)


def decode_fp8_weight(weight: Fp8Weight) -> torch.Tensor:
    """The weight's exact decode in its compute dtype (``Fp8Weight.decoded``'s values)
    in one pass over its bytes: the transient operand of a prefill's cuBLAS GEMM."""
    values = weight.values.view(torch.uint8)
    rows, cols = values.shape
    out = torch.empty(rows, cols, dtype=weight.dtype, device=values.device)
    block_c = 4 * FP8_TILE
    if rows and cols:
        decode_fp8_weight_kernel[(triton.cdiv(rows, FP8_TILE), triton.cdiv(cols, block_c))](
            values, weight.scale, out, rows, cols, *values.stride(), *weight.scale.stride(), out.stride(0),
            OUT=TL_DTYPES[weight.dtype], TILE=FP8_TILE, BLOCK_C=block_c,
        )
    return out


@triton.jit
def sum_splits_kernel(partial_ptr, out_ptr, count, SPLITS: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr):
    """out = the splits' partials summed in split order (fp32), in ``OUT``."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < count
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLITS):
        acc += tl.load(partial_ptr + split * count + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, acc.to(OUT), mask=mask)


def plan_k_splits(n: int, k: int, dtype: torch.dtype, programs: int) -> int:
    """How many parts ``fixed_tile_matmul`` cuts K into for a weight [n, k]: enough
    that one row tile's programs (column tiles x splits) reach ``programs``, each part
    whole BLOCK_K steps. It follows from the weight's shape and the device alone,
    never from the rows: a decode step's few rows then still read the weight with the
    whole GPU, and a row's sum order is the same in a call of any size."""
    tiles = TILES[dtype]
    column_tiles = triton.cdiv(n, tiles["BLOCK_N"])
    steps = triton.cdiv(k, tiles["BLOCK_K"])
    wanted = min(steps, max(1, triton.cdiv(programs, column_tiles)))
    return triton.cdiv(steps, triton.cdiv(steps, wanted))


def _default_programs(device: torch.device) -> int:
    """Two programs per SM of a GPU; one under the CPU interpreter (its programs run
    one after another)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return 2 * torch.cuda.get_device_properties(index).multi_processor_count


def fixed_tile_matmul(
    a: torch.Tensor, b: torch.Tensor | Fp8Weight, *, programs: int | None = None, row_invariant: bool = True
) -> torch.Tensor:
    """``a @ b.T`` for a [M, K] and b [N, K] of one dtype (bf16 or fp32) -> [M, N] in
    that dtype, accumulated in fp32 over K in ``BLOCK_K`` steps, cut into the splits
    ``plan_k_splits`` gives for ``programs`` (None: the device's) and summed in split
    order; or each item's ``a[i] @ b[i].T`` for a [B, M, K] and b [B, N, K] -> [B, M,
    N], K in one walk. Any strides (a transposed view of the values is a ``b``). An
    ``Fp8Weight`` b (decoding to a's dtype) gives its decoded weight's product exactly.
    ``row_invariant=False`` (outside the batch-invariant mode) lets the row tiles share
    the programs: a prefill's many row tiles fill the GPU themselves, so K is cut only
    as far as the rest need (none at 4096 rows), and a row's sum order then depends on
    M."""
    scale_args: tuple[object, ...] = (a, 0, 0)
    scaled = isinstance(b, Fp8Weight)
    if scaled:
        if b.dtype != a.dtype:
            raise ValueError(f"a, b: {a.dtype}, an Fp8Weight decoding to {b.dtype} (allowed: one compute dtype)")
        scale_args = (b.scale, *b.scale.stride())
        b = b.values
    elif a.dtype != b.dtype:
        raise ValueError(f"a, b: {a.dtype}, {b.dtype} (allowed: both {' or both '.join(map(str, TILES))})")
    if a.dtype not in TILES:
        raise ValueError(f"a: {a.dtype} (allowed: {', '.join(map(str, TILES))})")
    if scaled and a.dim() != 2:
        raise ValueError(f"a: shape {tuple(a.shape)} with an Fp8Weight (allowed: [M, K], a projection's rows)")
    batched = a.dim() == 3
    if a.dim() not in (2, 3) or b.dim() != a.dim() or a.shape[-1] != b.shape[-1] or (batched and a.shape[0] != b.shape[0]):
        raise ValueError(
            f"a, b: shapes {tuple(a.shape)}, {tuple(b.shape)} (allowed: [M, K] and [N, K], or [B, M, K] and [B, N, K])"
        )
    tiles = TILES[a.dtype]
    ieee = a.dtype == torch.float32 or INTERPRETED
    if batched:
        items, m, k = a.shape
        n = b.shape[1]
        out = torch.empty(items, m, n, dtype=a.dtype, device=a.device)
        if items and m and n:
            m_tiles = triton.cdiv(m, tiles["BLOCK_M"])
            fixed_tile_matmul_kernel[(items * m_tiles, triton.cdiv(n, tiles["BLOCK_N"]), 1)](
                a, b, out, m, n, k, k, m_tiles, *a.stride(), *b.stride(), out.stride(0), 0, out.stride(1),
                *scale_args, OUT=TL_DTYPES[a.dtype], IEEE=ieee, B_SCALED=False, TILE=FP8_TILE, **tiles,
            )
        return out
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    programs = _default_programs(a.device) if programs is None else programs
    if not row_invariant:
        programs = max(1, programs // triton.cdiv(m, tiles["BLOCK_M"]))
    splits = plan_k_splits(n, k, a.dtype, programs)
    k_per_split = triton.cdiv(triton.cdiv(k, tiles["BLOCK_K"]), splits) * tiles["BLOCK_K"]
    # One item: the batch strides are never used.
    strides = (0, *a.stride(), 0, *b.stride(), 0)
    if splits == 1:
        m_tiles = triton.cdiv(m, tiles["BLOCK_M"])
        fixed_tile_matmul_kernel[(m_tiles, triton.cdiv(n, tiles["BLOCK_N"]), 1)](
            a, b, out, m, n, k, k_per_split, m_tiles, *strides, 0, out.stride(0),
            *scale_args, OUT=TL_DTYPES[a.dtype], IEEE=ieee, B_SCALED=scaled, TILE=FP8_TILE, **tiles,
        )
        return out
    # The partials of at most SPLIT_ROWS rows at a time: a row's sum does not depend on
    # which rows share its launch, and a long prefill's workspace stays bounded.
    chunk = min(m, SPLIT_ROWS)
    partials = torch.empty(splits, chunk, n, dtype=torch.float32, device=a.device)
    for start in range(0, m, chunk):
        rows = min(chunk, m - start)
        m_tiles = triton.cdiv(rows, tiles["BLOCK_M"])
        fixed_tile_matmul_kernel[(m_tiles, triton.cdiv(n, tiles["BLOCK_N"]), splits)](
            a[start:], b, partials, rows, n, k, k_per_split, m_tiles, *strides, rows * n, n,
            *scale_args, OUT=tl.float32, IEEE=ieee, B_SCALED=scaled, TILE=FP8_TILE, **tiles,
        )
        count = rows * n
        sum_splits_kernel[(triton.cdiv(count, SUM_BLOCK),)](
            partials, out[start:], count, SPLITS=splits, OUT=TL_DTYPES[a.dtype], BLOCK=SUM_BLOCK
        )
    return out
