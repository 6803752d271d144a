"""The mHC site steps (model/mhc.py) as fused Triton kernels, one launch each.

Owns four kernels and their launches: the site mix's projection of the flattened
streams and their sum of squares, read in the streams' own dtype and summed in fp32
over fixed column splits (``hc_mix_projection_kernel``: no fp32 copy of the streams is
made, and a decode step's few rows still spread over the SMs), the rest of the mix
(the splits summed first to last, the RMS scale, the pre and post sigmoids, the
Sinkhorn of the comb logits: ``hc_mix_kernel``), the collapse of the streams with the
previous site's pre followed by the RMSNorm (``collapse_norm_kernel``: a site's
sublayer input, the final hidden), and the expansion of a sublayer output back into
the streams (``expand_kernel``). Unfused, a site is about 160 torch ops, each a launch
on a GPU (the Sinkhorn's normalisations alone 117); fused it is these four.

model/mhc.py defines the arithmetic; the kernels follow its operation order in float32:
every product, quotient and sum of hc terms rounds where torch's ops do (hc terms added
first to last, as ``ordered_sum`` and a GPU's batch-invariant ``small_sum`` add them,
and as torch's CPU sum does up to hc = 4, not at 5 or 8; IEEE division, ``div_rn``,
since a GPU's plain '/' is approximate; no multiply-add fusion), so under the
interpreter they are the CPU torch path bit for bit where no exp and no long reduction
enters, at the configs' hc of 3 and 4 (tests/model/test_kernels_mhc.py). They differ
in the last bits through exp (numpy's in the interpreter; torch's CPU exp is its own),
the softmax's sum of hc terms (first to last here; torch's softmax sums in its
kernel's order) and the long row reductions (the projection and the mean of squares
over hc * hidden: each split's columns folded a tile at a time, then the splits first
to last; the mean of squares over hidden: BLOCK columns folded at a time, then one
tree). Compiled, exp and rsqrt are
libdevice's expf and rsqrtf, the functions torch's CUDA ops call; equality with the
torch path on a GPU is not measured.
A program reads and writes its own token rows only, and its shape is fixed by the
device, never by the call: a row's result does not depend on how many rows share the
launch (the batch-invariant mode's requirement).
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv41.model.config import V41Config
from dsv41.model.kernels.triton.dots import INTERPRETED_DOT_ELEMENTS, ieee_dot, split3
from dsv41.model.kernels.triton.store import f32_to_bf16_bits
from dsv41.model.mhc import HcMix, HcSite

# Columns a row reduction folds per step.
BLOCK = 1024
# Hidden channels one expand program writes for every stream.
EXPAND_BLOCK = 256
# Token rows per program under the interpreter (rows_per_program): its cost is per
# operation of a program, not per row, so a prefill's rows go in as few programs as
# the arrays stay small for. At 256 (was 16) the tiny model's 111-row prefill step on
# interpreted Triton took 31 s instead of 56 s (2-core CPU, 2026-12-07).
INTERPRETED_ROWS = 256
# Token rows per hc_mix program on a GPU: with one, its [1, hc, hc] Sinkhorn tiles cost
# more than the row's 80 KB of streams; two rows a program took a 4,096-token mix from
# 1.05 to 0.59 ms and a 128-token one from 95 to 58 us, same bits (four, eight and
# sixteen rows no faster; H100, 2026-12-07, BENCHMARKS.md).
HC_MIX_GPU_ROWS = 2
# The mix projection's program on a GPU: token rows (a tl.dot's M, at least 16), the
# columns of one tl.dot (its K), and the columns of one split (a multiple of the
# tile). The splits, not the rows, fill the SMs at decode widths; each split's partial
# sums go to memory and hc_mix_kernel adds them first to last, so a row's bits are
# fixed by these constants, never by the call. Swept on an H100 (2026-12-07, the Flash
# widths, bf16 streams, both launches of the mix): 64 / 64 / 1024 took 24 us at 1, 32
# and 128 rows and 117 us at 4,096 rows, where the fp32 copy and cuBLAS fp32 GEMM
# alone took 14 / 26 / 40 / 450 us; 16 rows a program 268 us at 4,096 rows.
MIX_PROJECTION_GPU_ROWS = 64
MIX_PROJECTION_GPU_TILE = 64
MIX_PROJECTION_GPU_SPLIT = 1024


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        # expf, the function torch's CUDA exp calls (tl.exp is ex2.approx there).
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def mean_as_torch(total, count: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``total / count`` as torch's mean rounds it: on a GPU the sum times the float32
    reciprocal of the count (torch's CUDA mean, and its division by a Python number,
    multiply by 1/count), on the CPU one IEEE division."""
    if LIBDEVICE:
        return total * tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.full([], count, tl.float32))
    else:
        return tl.math.div_rn(total, count)


@triton.jit
def rsqrt_as_torch(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        # rsqrtf, the function torch's CUDA rsqrt calls.
        return libdevice.rsqrt(x)
    else:
        # torch's CPU rsqrt: one over the correctly rounded square root.
        return tl.math.div_rn(1.0, tl.sqrt_rn(x))


@triton.jit
def sigmoid_as_torch(x, LIBDEVICE: tl.constexpr):
    """1 / (1 + exp(-x)), rounded step by step as torch's sigmoid."""
    return tl.math.div_rn(1.0, 1.0 + _exp(-x, LIBDEVICE))


@triton.jit
def store_rounded(ptr, x, mask, OUT_BF16: tl.constexpr):
    """Stores fp32 ``x``, or its bf16 rounding (nearest even) as int16 bit patterns:
    the interpreter's own fp32 -> bf16 conversion truncates."""
    if OUT_BF16:
        tl.store(ptr, f32_to_bf16_bits(x).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _ordered_sum(m, AXIS: tl.constexpr, R: tl.constexpr, HC: tl.constexpr, P: tl.constexpr, LOG2P: tl.constexpr):
    """The sum over ``AXIS`` (1 or 2) of [R, P, P] tiles' first HC entries, first to
    last (``small_sum``), kept as a size-1 dim. The entries are taken apart by halving
    the last dim (a reshape and a split: exact copies, and no reduction, which the
    interpreter runs as a function call of its own)."""
    if AXIS == 1:
        m = tl.permute(m, (0, 2, 1))
    parts = (m,)
    for level in tl.static_range(LOG2P):
        halved = ()
        for q in tl.static_range(2**level):
            lo, hi = tl.split(tl.permute(tl.reshape(parts[q], (R, P, 2, (P >> level) // 2)), (0, 1, 3, 2)))
            halved = halved + (lo, hi)
        parts = halved
    total = parts[0]
    for j in tl.static_range(1, HC):
        total = total + parts[j]
    if AXIS == 1:
        total = tl.reshape(total, (R, 1, P))
    return total


@triton.jit
def hc_mix_projection_kernel(
    streams_ptr,
    fn_ptr,
    m_ptr,
    sq_ptr,
    tokens,
    stride_row,
    COLS: tl.constexpr,
    N: tl.constexpr,
    N_P: tl.constexpr,
    SPLIT: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BF16_DOTS: tl.constexpr,
):
    """BLOCK_T token rows, the SPLIT columns of split ``program_id(1)`` of the flattened
    streams [COLS] in their dtype: that split's part of ``m`` = flat @ fn.T [N] and of
    sum(flat ** 2), in fp32 (fn [N, COLS] fp32), stored at [split, row].

    BF16_DOTS (bf16 streams, compiled): each fn tile is split exactly into three bf16
    parts (fp32 has 24 significant bits, bf16 8, and a part's exponent range is fp32's),
    so the products with the bf16 streams are exact and three bf16 tensor-core dots sum
    them in fp32, each part in its own accumulator. Otherwise one fp32 dot
    (dots.ieee_dot), as the interpreter runs bf16 too: its dot multiplies bf16 operands
    as their bit patterns."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    live = t < tokens
    n = tl.arange(0, N_P)
    acc_m = tl.zeros((BLOCK_T, N_P), dtype=tl.float32)
    acc_mid = tl.zeros((BLOCK_T, N_P), dtype=tl.float32)
    acc_lo = tl.zeros((BLOCK_T, N_P), dtype=tl.float32)
    acc_sq = tl.zeros((BLOCK_T, TILE), dtype=tl.float32)
    for c0 in range(0, SPLIT, TILE):
        cols = split * SPLIT + c0 + tl.arange(0, TILE)
        in_row = cols < COLS
        x = tl.load(
            streams_ptr + t[:, None] * stride_row + cols[None, :], mask=live[:, None] & in_row[None, :], other=0.0
        )
        w = tl.load(fn_ptr + n[None, :] * COLS + cols[:, None], mask=in_row[:, None] & (n < N)[None, :], other=0.0)
        if BF16_DOTS:
            hi, mid, lo = split3(w)
            acc_m = tl.dot(x, hi, acc_m)
            acc_mid = tl.dot(x, mid, acc_mid)
            acc_lo = tl.dot(x, lo, acc_lo)
            x = x.to(tl.float32)
        else:
            x = x.to(tl.float32)
            acc_m = ieee_dot(x, w, acc_m)
        acc_sq += x * x
    if BF16_DOTS:
        acc_m = (acc_m + acc_mid) + acc_lo
    at = split * tokens + t
    tl.store(m_ptr + at[:, None] * N_P + n[None, :], acc_m, mask=live[:, None])
    tl.store(sq_ptr + at, tl.sum(acc_sq, axis=1), mask=live)


@triton.jit
def _splits_summed(ptr, offsets, mask, split_stride, SPLITS: tl.constexpr):
    """sum over s of ptr[s * split_stride + offsets], s first to last."""
    total = tl.load(ptr + offsets, mask=mask, other=0.0)
    for s in range(1, SPLITS):
        total = total + tl.load(ptr + s * split_stride + offsets, mask=mask, other=0.0)
    return total


@triton.jit
def hc_mix_kernel(
    m_ptr,
    sq_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    tokens,
    hc_eps,
    norm_eps,
    COLS: tl.constexpr,
    N_P: tl.constexpr,
    SPLITS: tl.constexpr,
    HC: tl.constexpr,
    HC_P: tl.constexpr,
    LOG2_HC_P: tl.constexpr,
    ITERS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """BLOCK_T token rows: the projection's split sums (``m`` [SPLITS, tokens, N_P], the
    sums of squares ``sq`` [SPLITS, tokens]: hc_mix_projection_kernel's) -> pre [HC],
    post [HC], comb [HC, HC] (model/mhc.hc_mix after its projection)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < tokens
    m_split = tokens * N_P
    total = _splits_summed(sq_ptr, t, live, tokens, SPLITS)
    inv_rms = rsqrt_as_torch(mean_as_torch(total, COLS, LIBDEVICE) + norm_eps, LIBDEVICE)[:, None]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    k = tl.arange(0, HC_P)[None, :]
    kmask = live[:, None] & (k < HC)
    m_rows = t[:, None] * N_P
    pre_logits = tl.load(base_ptr + k, mask=k < HC, other=0.0) + (
        _splits_summed(m_ptr, m_rows + k, kmask, m_split, SPLITS) * inv_rms
    ) * s0
    post_logits = tl.load(base_ptr + HC + k, mask=k < HC, other=0.0) + (
        _splits_summed(m_ptr, m_rows + HC + k, kmask, m_split, SPLITS) * inv_rms
    ) * s1
    tl.store(pre_ptr + t[:, None] * HC + k, sigmoid_as_torch(pre_logits, LIBDEVICE) + hc_eps, mask=kmask)
    tl.store(post_ptr + t[:, None] * HC + k, 2.0 * sigmoid_as_torch(post_logits, LIBDEVICE), mask=kmask)

    t3 = t[:, None, None]
    rows = tl.arange(0, HC_P)[None, :, None]
    cols = tl.arange(0, HC_P)[None, None, :]
    entry = (rows < HC) & (cols < HC)
    valid = (t3 < tokens) & entry
    offsets = 2 * HC + rows * HC + cols
    logits = tl.load(base_ptr + offsets, mask=entry, other=0.0) + (
        _splits_summed(m_ptr, t3 * N_P + offsets, valid, m_split, SPLITS) * inv_rms[:, :, None]
    ) * s2
    # The softmax over each row's HC columns, + eps. Padding entries hold 0 from here
    # on and padding rows sum to 1, so nothing divides by zero.
    real_row = tl.arange(0, HC_P)[None, :] < HC
    top = tl.where(real_row, tl.max(tl.where(entry, logits, float("-inf")), axis=2), 0.0)
    shifted = tl.where(entry, _exp(logits - top[:, :, None], LIBDEVICE), 0.0)
    total = tl.where(real_row[:, :, None], _ordered_sum(shifted, 2, BLOCK_T, HC, HC_P, LOG2_HC_P), 1.0)
    comb = tl.where(entry, tl.math.div_rn(shifted, total) + hc_eps, 0.0)
    comb = tl.math.div_rn(comb, _ordered_sum(comb, 1, BLOCK_T, HC, HC_P, LOG2_HC_P) + hc_eps)
    for _iteration in range(ITERS - 1):
        comb = tl.math.div_rn(comb, _ordered_sum(comb, 2, BLOCK_T, HC, HC_P, LOG2_HC_P) + hc_eps)
        comb = tl.math.div_rn(comb, _ordered_sum(comb, 1, BLOCK_T, HC, HC_P, LOG2_HC_P) + hc_eps)
    tl.store(comb_ptr + t3 * (HC * HC) + rows * HC + cols, comb, mask=valid)


@triton.jit
def _collapsed(streams_rows, pre_rows, live, offsets, mask, stride_stream, HC: tl.constexpr):
    """sum_i pre[i] * streams[i] over the BLOCK channels ``offsets`` of each row, first
    to last."""
    pre = tl.load(pre_rows, mask=live, other=0.0)[:, None]
    x = pre * tl.load(streams_rows + offsets, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(1, HC):
        stream = tl.load(streams_rows + i * stride_stream + offsets, mask=mask, other=0.0).to(tl.float32)
        x = x + tl.load(pre_rows + i, mask=live, other=0.0)[:, None] * stream
    return x


@triton.jit
def collapse_norm_kernel(
    streams_ptr,
    pre_ptr,
    norm_ptr,
    out_ptr,
    tokens,
    stride_row,
    stride_stream,
    stride_pre,
    stride_out,
    eps,
    HIDDEN: tl.constexpr,
    HC: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OUT_BF16: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """BLOCK_T token rows: rms_norm(collapse(streams, pre), norm) in the output's dtype
    (model/mhc.site_input, final_hidden). The collapse is computed twice, once for
    the mean of squares and once for the output, so no fp32 row is stored."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < tokens
    streams_rows = streams_ptr + t[:, None] * stride_row
    pre_rows = pre_ptr + t * stride_pre
    acc = tl.zeros((BLOCK_T, BLOCK), dtype=tl.float32)
    for c0 in range(0, HIDDEN, BLOCK):
        offsets = c0 + tl.arange(0, BLOCK)[None, :]
        x = _collapsed(streams_rows, pre_rows, live, offsets, live[:, None] & (offsets < HIDDEN), stride_stream, HC)
        acc += x * x
    inv_rms = rsqrt_as_torch(mean_as_torch(tl.sum(acc, axis=1), HIDDEN, LIBDEVICE) + eps, LIBDEVICE)[:, None]
    for c0 in range(0, HIDDEN, BLOCK):
        offsets = c0 + tl.arange(0, BLOCK)[None, :]
        mask = live[:, None] & (offsets < HIDDEN)
        x = _collapsed(streams_rows, pre_rows, live, offsets, mask, stride_stream, HC)
        y = (x * inv_rms) * tl.load(norm_ptr + offsets, mask=offsets < HIDDEN, other=0.0).to(tl.float32)
        store_rounded(out_ptr + t[:, None] * stride_out + offsets, y, mask, OUT_BF16)


@triton.jit
def expand_kernel(
    streams_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    tokens,
    stride_row,
    stride_stream,
    stride_y,
    HIDDEN: tl.constexpr,
    HC: tl.constexpr,
    HC_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """BLOCK_T token rows, BLOCK_H channels: streams'[o] = post[o] * y + sum_i comb[i, o]
    * streams[i], the sum first to last, in the streams' dtype (model/mhc.expand)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t3 = t[:, None, None]
    channels = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, None, :]
    outs = tl.arange(0, HC_P)[None, :, None]
    live = t3 < tokens
    cmask = live & (channels < HIDDEN)
    omask = live & (outs < HC)
    streams_rows = streams_ptr + t3 * stride_row
    comb_rows = comb_ptr + t3 * (HC * HC)
    y = tl.load(y_ptr + t3 * stride_y + channels, mask=cmask, other=0.0).to(tl.float32)
    out = tl.load(post_ptr + t3 * HC + outs, mask=omask, other=0.0) * y
    mixed = tl.load(comb_rows + outs, mask=omask, other=0.0) * tl.load(
        streams_rows + channels, mask=cmask, other=0.0
    ).to(tl.float32)
    for i in tl.static_range(1, HC):
        stream = tl.load(streams_rows + i * stride_stream + channels, mask=cmask, other=0.0).to(tl.float32)
        mixed = mixed + tl.load(comb_rows + i * HC + outs, mask=omask, other=0.0) * stream
    out = out + mixed
    store_rounded(out_ptr + t3 * stride_row + outs * stride_stream + channels, out, omask & cmask, OUT_BF16)


def uses_libdevice(device: torch.device) -> bool:
    # libdevice is compiled-only: the interpreter cannot call it.
    return device.type == "cuda"


def rows_per_program(device: torch.device, gpu_rows: int = 1) -> int:
    """Token rows one program takes: ``gpu_rows`` on a GPU (one: a decode step's few
    rows still spread over the SMs); INTERPRETED_ROWS under the interpreter, whose cost
    is per operation of a program. A row's result is the same either way (no operation
    mixes rows), and never depends on the call's row count."""
    return gpu_rows if device.type == "cuda" else INTERPRETED_ROWS


OUT_DTYPES = (torch.float32, torch.bfloat16)


def out_rows(out: torch.Tensor) -> torch.Tensor:
    """What a kernel stores into: fp32 rows, or bf16 rows as int16 bit patterns."""
    if out.dtype not in OUT_DTYPES:
        raise ValueError(f"out dtype: {out.dtype} (allowed: {', '.join(map(str, OUT_DTYPES))})")
    return out.view(torch.int16) if out.dtype == torch.bfloat16 else out


def mix_projection_tiling(device: torch.device, cols: int, n_p: int) -> tuple[int, int, int]:
    """(rows, tile, split) of hc_mix_projection_kernel's programs on ``device`` for
    ``cols`` = hc * hidden columns and ``n_p`` padded outputs: the MIX_PROJECTION_GPU_*
    constants on a GPU; under the interpreter INTERPRETED_ROWS rows and one split, in
    the widest tiles whose product block (dots.ieee_dot's [rows, tile, n_p]) the
    interpreter holds (its cost is per operation, and the CPU configs' hc * hidden is a
    few hundred)."""
    if device.type == "cuda":
        return MIX_PROJECTION_GPU_ROWS, MIX_PROJECTION_GPU_TILE, MIX_PROJECTION_GPU_SPLIT
    tile = min(triton.next_power_of_2(cols), INTERPRETED_DOT_ELEMENTS // (INTERPRETED_ROWS * n_p))
    return INTERPRETED_ROWS, tile, triton.cdiv(cols, tile) * tile


def fused_hc_mix(streams: torch.Tensor, site: HcSite, config: V41Config, block_t: int | None = None) -> HcMix:
    """model/mhc.hc_mix in two launches: the projection and sum of squares over column
    splits (``mix_projection_tiling``), then the rest. ``block_t``: rows per
    hc_mix_kernel program (default ``rows_per_program`` with HC_MIX_GPU_ROWS)."""
    tokens, hc, hidden = streams.shape
    cols, n = hc * hidden, (2 + hc) * hc
    n_p = max(16, triton.next_power_of_2(n))
    rows, tile, split = mix_projection_tiling(streams.device, cols, n_p)
    splits = triton.cdiv(cols, split)
    streams = streams.contiguous()
    m = torch.empty(splits, tokens, n_p, dtype=torch.float32, device=streams.device)
    sq = torch.empty(splits, tokens, dtype=torch.float32, device=streams.device)
    pre = torch.empty(tokens, hc, dtype=torch.float32, device=streams.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, hc, hc, dtype=torch.float32, device=streams.device)
    block_t = block_t or rows_per_program(streams.device, HC_MIX_GPU_ROWS)
    if tokens:
        hc_mix_projection_kernel[(triton.cdiv(tokens, rows), splits)](
            streams,
            site.fn.float().contiguous(),
            m,
            sq,
            tokens,
            streams.stride(0),
            COLS=cols,
            N=n,
            N_P=n_p,
            SPLIT=split,
            TILE=tile,
            BLOCK_T=rows,
            BF16_DOTS=streams.dtype == torch.bfloat16 and streams.device.type == "cuda",
            enable_fp_fusion=False,
        )
        hc_mix_kernel[(triton.cdiv(tokens, block_t),)](
            m,
            sq,
            site.base.float().contiguous(),
            site.scale.float().contiguous(),
            pre,
            post,
            comb,
            tokens,
            config.hc_eps,
            config.rms_norm_eps,
            COLS=cols,
            N_P=n_p,
            SPLITS=splits,
            HC=hc,
            HC_P=triton.next_power_of_2(hc),
            LOG2_HC_P=(triton.next_power_of_2(hc) - 1).bit_length(),
            ITERS=config.hc_sinkhorn_iters,
            BLOCK_T=block_t,
            LIBDEVICE=uses_libdevice(streams.device),
            enable_fp_fusion=False,
        )
    return HcMix(pre=pre, post=post, comb=comb)


def fused_collapse_norm(
    streams: torch.Tensor,
    pre: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    block_t: int | None = None,
) -> torch.Tensor:
    """rms_norm(collapse(streams, pre), norm, eps, out_dtype) in one launch."""
    tokens, hc, hidden = streams.shape
    streams, pre, norm = streams.contiguous(), pre.float().contiguous(), norm.contiguous()
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=streams.device)
    block_t = block_t or rows_per_program(streams.device)
    if tokens:
        collapse_norm_kernel[(triton.cdiv(tokens, block_t),)](
            streams,
            pre,
            norm,
            out_rows(out),
            tokens,
            streams.stride(0),
            streams.stride(1),
            pre.stride(0),
            out.stride(0),
            eps,
            HIDDEN=hidden,
            HC=hc,
            BLOCK=min(BLOCK, triton.next_power_of_2(hidden)),
            BLOCK_T=block_t,
            OUT_BF16=out_dtype == torch.bfloat16,
            LIBDEVICE=uses_libdevice(streams.device),
            enable_fp_fusion=False,
        )
    return out


def fused_expand(streams: torch.Tensor, y: torch.Tensor, mix: HcMix, block_t: int | None = None) -> torch.Tensor:
    """model/mhc.expand in one launch."""
    tokens, hc, hidden = streams.shape
    streams, y = streams.contiguous(), y.contiguous()
    out = torch.empty_like(streams)
    block_t = block_t or rows_per_program(streams.device)
    if tokens:
        block_h = min(EXPAND_BLOCK, triton.next_power_of_2(hidden))
        expand_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(hidden, block_h))](
            streams,
            y,
            mix.post.contiguous(),
            mix.comb.contiguous(),
            out_rows(out),
            tokens,
            streams.stride(0),
            streams.stride(1),
            y.stride(0),
            HIDDEN=hidden,
            HC=hc,
            HC_P=triton.next_power_of_2(hc),
            BLOCK_H=block_h,
            BLOCK_T=block_t,
            OUT_BF16=out.dtype == torch.bfloat16,
            enable_fp_fusion=False,
        )
    return out
