"""Sparse attention with a sink over paged rows: the Triton kernels and their tiling.

Owns the kernels that compute, for every query row of a step (prefill and decode rows
alike: a row is a row), the softmax attention over its own key rows: W window keys
(this step's KV or the slot's ring plane) followed by K selected entries of the main
plane, each read in place from the pool and decoded in registers (bf16 or FP8 rings,
bf16 or NVFP4 main rows). The layout is MLA's: a key row is the 512-wide latent that
is both key and value, so a program holds a group of heads and reads each key row once
for all of them, as a [heads x dim] x [dim x keys] dot and a [heads x keys] x [keys x
dim] dot. Flat row addresses are split in registers (decode.row_offsets).

When rows x head groups cannot fill the GPU (small decode batches), the key axis is
split: each program folds one span of keys (window or main, never both, so its loads
have one format) into an unnormalised partial (running max, running sum, weighted sum
of values), and a second kernel merges a row's partials with the sink. Otherwise one
program folds all W + K keys and writes the output itself. The zero-value sink key
starts the online softmax: running max = sink logit (finite, so no fully masked tile
makes exp(-inf + inf)), running sum = 1 (its own weight) when the program writes the
output, 0 when the merge adds it. A tile of main entries none of which is present (a
prefill row's selection holds fewer than K, padded with -1) is skipped: its logits
would all be -inf, so folding it would leave the max, the sum and the values as they
were.

Two kernels compute that function: sparse_attention_kernel (AttentionTiling: a group
of 16 heads a program, so a row's 64 heads read each key tile four times) and
mla_attention_kernel (MlaTiling: FlashMLA's layout as far as Triton allows, all of a
row's heads in one program, q . k summed over latent spans and the output latent split
over programs that share the softmax). Both write the same partials, so one merge
kernel serves them; TritonKernels runs the one its tiling names, DEFAULT_ATTENTION_TILING
unless told otherwise.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import triton
import triton.language as tl

from dsv41.model.kernels.triton.decode import load_row_span, load_rows

# Logits are kept in log2 units (exp2 is the hardware's exponential).
LOG2E = tl.constexpr(1.4426950408889634)


@dataclass(frozen=True)
class AttentionTiling:
    """How the attention kernels cut the work. ``block_h`` heads share each key tile of
    ``block_n`` rows. At 16 heads with 8 warps a program holds its [16, 512] fp32
    accumulator, its query block and a decoded key tile without spilling (compiled for
    sm_90 by triton 3.9 on the CPU dev box, 2026-11-30: 218-247 registers at Flash
    dims and 32-key tiles, bf16 and FP8/NVFP4 planes; all 64 heads in one program
    spilled at 8 and 16 warps), so one program runs per SM. 64-key tiles: in the H200
    sweep of bench/kernels.py (2026-11-30) they beat 32 at every batch measured (B=128,
    32k: 0.263 vs 0.328 ms bf16/fp8, 0.404 vs 0.551 ms fp4/fp4) and 16 at B >= 32. ``programs_per_wave`` is how many run at once
    (None: the GPU's SM count; on the CPU interpreter, where programs run one after
    another, 1, which never splits). The key axis is split only while the extra
    programs still fit in that wave."""

    block_h: int = 16
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    merge_block_h: int = 16
    programs_per_wave: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_h", "block_n", "merge_block_h"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"AttentionTiling.{name}: {value} (allowed: a power of two >= 16, a dot's minimum)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"AttentionTiling.num_warps: {self.num_warps} (allowed: 1, 2, 4, 8, 16)")
        if self.num_stages < 1:
            raise ValueError(f"AttentionTiling.num_stages: {self.num_stages} (allowed: >= 1)")
        if self.programs_per_wave is not None and self.programs_per_wave < 1:
            raise ValueError(f"AttentionTiling.programs_per_wave: {self.programs_per_wave} (allowed: >= 1 or None)")


@dataclass(frozen=True)
class KeySplit:
    """How a launch splits each row's W window + K main keys: ``keys_per_split`` keys
    per program, ``window_splits`` programs over the window then ``main_splits`` over
    the main entries; ``splits == 1`` means one program takes all keys of a row."""

    keys_per_split: int
    window_splits: int
    main_splits: int

    @property
    def splits(self) -> int:
        return self.window_splits + self.main_splits


def plan_key_split(rows: int, head_groups: int, window: int, topk: int, block_n: int, programs_per_wave: int) -> KeySplit:
    """As many splits (whole tiles of ``block_n`` keys each, as even as whole tiles
    allow) as one wave of programs holds: rows x head groups x splits <=
    programs_per_wave. A split costs a partial [heads, dim] fp32 write and read, and
    past one wave more programs only queue, so rows x head groups that already fill
    the wave get no split."""
    wanted = programs_per_wave // max(rows * head_groups, 1)
    window_tiles, main_tiles = triton.cdiv(window, block_n), triton.cdiv(topk, block_n)
    if wanted <= 1 or window_tiles + main_tiles <= 1:
        return KeySplit(keys_per_split=max(window, topk, 1), window_splits=1, main_splits=0)
    tiles = triton.cdiv(window_tiles + main_tiles, wanted)
    while triton.cdiv(window_tiles, tiles) + triton.cdiv(main_tiles, tiles) > wanted:
        tiles += 1
    keys_per_split = tiles * block_n
    return KeySplit(keys_per_split, triton.cdiv(window, keys_per_split), triton.cdiv(topk, keys_per_split))


def fixed_key_split(window: int, topk: int, block_n: int, tiles_per_split: int = 4) -> KeySplit:
    """The batch-invariant mode's split: ``tiles_per_split`` tiles of keys per program
    whatever the batch, so how a row's partial softmaxes are formed and merged depends
    on the row's key counts alone."""
    window_tiles, main_tiles = triton.cdiv(window, block_n), triton.cdiv(topk, block_n)
    if window_tiles + main_tiles <= tiles_per_split:
        return KeySplit(keys_per_split=max(window, topk, 1), window_splits=1, main_splits=0)
    keys_per_split = tiles_per_split * block_n
    return KeySplit(keys_per_split, triton.cdiv(window, keys_per_split), triton.cdiv(topk, keys_per_split))


@triton.jit
def _fold_tile(q, k, present, running_max, running_sum, acc, logit_scale, DOT_BF16: tl.constexpr):
    """One online-softmax step of a [BLOCK_H, D] query block over a key tile [BLOCK_N,
    D] (keys are values). Logits are in log2 units (logit_scale holds log2 e)."""
    if DOT_BF16:
        logits = tl.dot(q, tl.trans(k))
    else:
        logits = tl.dot(q, tl.trans(k), input_precision="ieee")
    return _fold_logits(logits, k, present, running_max, running_sum, acc, logit_scale, DOT_BF16)


@triton.jit
def _fold_logits(logits, v, present, running_max, running_sum, acc, logit_scale, DOT_BF16: tl.constexpr):
    """The online-softmax step of a tile's raw logits [BLOCK_H, BLOCK_N] (q . k, not yet
    scaled) over its values ``v`` [BLOCK_N, channels] (the key rows, or a span of their
    channels): the running max and sum, and acc [BLOCK_H, channels] rescaled and added to."""
    logits = tl.where(present[None, :], logits * logit_scale, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(logits, 1))
    correction = tl.exp2(running_max - new_max)
    p = tl.exp2(logits - new_max[:, None])
    running_sum = running_sum * correction + tl.sum(p, 1)
    if DOT_BF16:
        acc = acc * correction[:, None] + tl.dot(p.to(tl.bfloat16), v)
    else:
        acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
    return new_max, running_sum, acc


@triton.jit
def _window_keys(
    chunk_ptr,
    stride_chunk,
    chunk_row,
    from_chunk,
    ring_values,
    ring_scales,
    ring_row,
    from_ring,
    RING_ROWS: tl.constexpr,
    ring_values_stride_unit,
    ring_values_stride_row,
    ring_scales_stride_unit,
    ring_scales_stride_row,
    first,
    WIDTH: tl.constexpr,
    RING_FMT: tl.constexpr,
    RING_GROUP: tl.constexpr,
    dot_dtype: tl.constexpr,
):
    """Channels [first, first + WIDTH) of a tile of window keys: this step's row where
    ``from_chunk``, the ring row where ``from_ring``, zeros elsewhere."""
    dims = first + tl.arange(0, WIDTH)
    k_chunk = tl.load(
        chunk_ptr + tl.maximum(chunk_row, 0)[:, None] * stride_chunk + dims[None, :],
        mask=from_chunk[:, None],
        other=0.0,
    ).to(dot_dtype)
    k_ring = load_row_span(
        ring_values,
        ring_scales,
        ring_row,
        from_ring,
        RING_ROWS,
        ring_values_stride_unit,
        ring_values_stride_row,
        ring_scales_stride_unit,
        ring_scales_stride_row,
        first,
        WIDTH,
        RING_FMT,
        RING_GROUP,
        dot_dtype,
    )
    return tl.where(from_chunk[:, None], k_chunk, k_ring)


@triton.jit
def _key_spans(split, keys_per_split, window, window_splits, topk, SPLIT: tl.constexpr):
    """(window_lo, window_hi, main_lo, main_hi): the window and main keys a program
    folds. Split over keys, a program's span is window or main, never both (the first
    ``window_splits`` splits cut the window, the rest the main entries); unsplit, all."""
    if SPLIT:
        window_lo = tl.minimum(split * keys_per_split, window)
        window_hi = tl.where(split < window_splits, tl.minimum(window_lo + keys_per_split, window), window_lo)
        main_lo = tl.minimum(tl.maximum(split - window_splits, 0) * keys_per_split, topk)
        main_hi = tl.where(split >= window_splits, tl.minimum(main_lo + keys_per_split, topk), main_lo)
    else:
        window_lo = 0
        window_hi = window
        main_lo = 0
        main_hi = topk
    return window_lo, window_hi, main_lo, main_hi


@triton.jit
def _sink_start(sink_ptr, heads, head_mask, BLOCK_H: tl.constexpr, SPLIT: tl.constexpr):
    """The online softmax's start for ``heads``: running max = the sink logit (log2
    units), running sum = the sink's own weight when the program writes the output, 0
    when the merge adds it."""
    running_max = tl.load(sink_ptr + heads, mask=head_mask, other=0.0).to(tl.float32) * LOG2E
    if SPLIT:
        running_sum = tl.zeros([BLOCK_H], tl.float32)
    else:
        running_sum = tl.full([BLOCK_H], 1.0, tl.float32)
    return running_max, running_sum


@triton.jit
def sparse_attention_kernel(
    q_ptr,
    sink_ptr,
    out_ptr,
    partial_acc_ptr,
    partial_stats_ptr,
    chunk_ptr,
    chunk_rows_ptr,
    ring_rows_ptr,
    window_valid_ptr,
    entry_rows_ptr,
    ring_values,
    ring_scales,
    ring_values_stride_unit,
    ring_values_stride_row,
    ring_scales_stride_unit,
    ring_scales_stride_row,
    main_values,
    main_scales,
    main_values_stride_unit,
    main_values_stride_row,
    main_scales_stride_unit,
    main_scales_stride_row,
    num_heads,
    head_groups,
    window,
    topk,
    keys_per_split,
    window_splits,
    logit_scale,
    stride_q_row,
    stride_q_head,
    stride_out_row,
    stride_out_head,
    stride_chunk,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RING_ROWS: tl.constexpr,
    RING_FMT: tl.constexpr,
    RING_GROUP: tl.constexpr,
    MAIN_ROWS: tl.constexpr,
    MAIN_FMT: tl.constexpr,
    MAIN_GROUP: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    """Grid (rows x head groups, splits), head groups varying fastest: the programs
    that read the same key rows run side by side and share them through L2 (and no
    grid axis but the first, which has no 65535 limit, grows with the rows)."""
    row = (tl.program_id(0) // head_groups).to(tl.int64)
    heads = (tl.program_id(0) % head_groups) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    head_mask = heads < num_heads
    dims = tl.arange(0, HEAD_DIM)
    if DOT_BF16:
        dot_dtype = tl.bfloat16
    else:
        dot_dtype = tl.float32
    q = tl.load(
        q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :], mask=head_mask[:, None], other=0.0
    ).to(dot_dtype)
    running_max, running_sum = _sink_start(sink_ptr, heads, head_mask, BLOCK_H, SPLIT)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    window_lo, window_hi, main_lo, main_hi = _key_spans(split, keys_per_split, window, window_splits, topk, SPLIT)

    for start in range(window_lo, window_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        in_span = keys < window_hi
        chunk_row = tl.load(chunk_rows_ptr + row * window + keys, mask=in_span, other=-1)
        ring_row = tl.load(ring_rows_ptr + row * window + keys, mask=in_span, other=-1)
        valid = tl.load(window_valid_ptr + row * window + keys, mask=in_span, other=0) != 0
        # A valid key not in this step's rows is a ring row (row 0 if the address is
        # NO_ROW, as the torch backend's clamp reads it).
        from_chunk = valid & (chunk_row >= 0)
        from_ring = valid & (chunk_row < 0)
        k = _window_keys(
            chunk_ptr,
            stride_chunk,
            chunk_row,
            from_chunk,
            ring_values,
            ring_scales,
            ring_row,
            from_ring,
            RING_ROWS,
            ring_values_stride_unit,
            ring_values_stride_row,
            ring_scales_stride_unit,
            ring_scales_stride_row,
            0,
            HEAD_DIM,
            RING_FMT,
            RING_GROUP,
            dot_dtype,
        )
        running_max, running_sum, acc = _fold_tile(q, k, valid, running_max, running_sum, acc, logit_scale, DOT_BF16)

    for start in range(main_lo, main_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        entry = tl.load(entry_rows_ptr + row * topk + keys, mask=keys < main_hi, other=-1)
        present = entry >= 0
        # Selections are padded with absent entries; a tile of none adds nothing (its
        # logits are all -inf), so it is not folded.
        if tl.max(entry, 0) >= 0:
            k = load_rows(
                main_values,
                main_scales,
                entry,
                present,
                MAIN_ROWS,
                main_values_stride_unit,
                main_values_stride_row,
                main_scales_stride_unit,
                main_scales_stride_row,
                HEAD_DIM,
                MAIN_FMT,
                MAIN_GROUP,
                dot_dtype,
            )
            running_max, running_sum, acc = _fold_tile(
                q, k, present, running_max, running_sum, acc, logit_scale, DOT_BF16
            )

    if SPLIT:
        # Partials [rows, splits, heads, dim] and stats [rows, splits, 2, heads].
        num_splits = tl.num_programs(1)
        slot = row * num_splits + split
        tl.store(
            partial_acc_ptr + (slot * num_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
            acc,
            mask=head_mask[:, None],
        )
        tl.store(partial_stats_ptr + slot * 2 * num_heads + heads, running_max, mask=head_mask)
        tl.store(partial_stats_ptr + (slot * 2 + 1) * num_heads + heads, running_sum, mask=head_mask)
    else:
        tl.store(
            out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + dims[None, :],
            (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None],
        )


@triton.jit
def merge_splits_kernel(
    partial_acc_ptr,
    partial_stats_ptr,
    sink_ptr,
    out_ptr,
    num_heads,
    head_groups,
    num_splits,
    stride_out_row,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid (rows x head groups): one row's partials merged with the sink (weight
    2^(sink - max)), normalised, written in the output's dtype."""
    row = (tl.program_id(0) // head_groups).to(tl.int64)
    heads = (tl.program_id(0) % head_groups) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    dims = tl.arange(0, HEAD_DIM)
    running_max = tl.load(sink_ptr + heads, mask=head_mask, other=0.0).to(tl.float32) * LOG2E
    running_sum = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for split in range(num_splits):
        slot = row * num_splits + split
        part_max = tl.load(partial_stats_ptr + slot * 2 * num_heads + heads, mask=head_mask, other=0.0)
        part_sum = tl.load(partial_stats_ptr + (slot * 2 + 1) * num_heads + heads, mask=head_mask, other=0.0)
        part_acc = tl.load(
            partial_acc_ptr + (slot * num_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
            mask=head_mask[:, None],
            other=0.0,
        )
        new_max = tl.maximum(running_max, part_max)
        old_weight = tl.exp2(running_max - new_max)
        part_weight = tl.exp2(part_max - new_max)
        running_sum = running_sum * old_weight + part_sum * part_weight
        acc = acc * old_weight[:, None] + part_acc * part_weight[:, None]
        running_max = new_max
    tl.store(
        out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + dims[None, :],
        (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty),
        mask=head_mask[:, None],
    )


@dataclass(frozen=True)
class MlaTiling:
    """How the all-heads (FlashMLA-layout) attention kernel cuts the work: one program
    takes ``block_h`` heads (64, all of V4.1-Flash's, by default) so each key tile is
    read and decoded for all of a row's heads at once, and its dots are [64 x channels]
    x [channels x keys] (64 rows: whole warpgroup MMAs) instead of four programs' [16 x
    512] ones. ``block_n`` keys a tile. ``qk_chunk`` (None: the whole latent) is the
    channel span of each partial q . k dot; below the head dim each key tile is read
    (and decoded) span by span for the logits, then once more for the values (a second
    read, which L2 should serve).
    q's spans are loaded once and held (the compiler hoists them out of the key loop:
    registers, copied into shared memory for each tile's MMAs), or with ``q_reload``
    re-read from L2 for every tile (a volatile load), which frees those registers for a
    larger accumulator. ``dim_split`` splits the output latent over that many programs
    of a row: each folds the same logits (so they agree on the softmax statistics) and
    accumulates head dim / dim_split channels ([64, 256] fp32 at 2, the share of one of
    FlashMLA's two warpgroups); the programs of a row sit side by side in the grid, so
    L2 can serve their repeated reads of a tile and HBM see it about once. In the sm_90
    build the [64, keys] logits MMA is laid over both warpgroups of 8 warps by
    replication (warps [8, 1] over 64 rows), so each computes all of them: q . k work
    doubles, and doubles again at dim_split 2. Turning the dots around (logits^T = K . q^T,
    keys on M, q^T held in shared memory) ends the replication at 128-key tiles, but no
    such cut builds without spills (sm_90, triton 3.9.0 and 3.6.0, 2026-12-08, BENCHMARKS.md): the
    decoded tile passes through registers on its way to shared memory.
    ``programs_per_wave``, ``merge_block_h``, ``num_warps`` and ``num_stages`` are
    AttentionTiling's.

    Compiled for sm_90 on the CPU dev box (triton 3.9.0 and its ptxas; the H200 runs
    3.6.0) at Flash dims, split and unsplit launches, 2026-12-02: the default (32-key
    tiles, 64-channel q . k spans, two value spans, 8 warps, 2 stages) takes 232
    registers with bf16 planes and 242-254 with FP8 / NVFP4, no spills, 115 / 91 KB of
    shared memory. The whole [64, 512] accumulator in one program (dim_split 1) spills
    at 8 warps with q held (176-672 bytes, every qk_chunk and block_n tried) and at 16
    warps (128 registers a thread at most), and holds with q_reload: 16-key tiles, 2
    stages, 238-255 registers, 197-213 KB; 32-key tiles, 1 stage, 244-255 registers,
    32-131 KB. 4 warps spill at dim_split 2 and 4 with q held; with q_reload, one stage
    and 16-key tiles they build without spills (2026-12-08, 3.9.0 and 3.6.0, 231-252
    registers: two programs an SM; bench/kernels.py ATTENTION_SWEEP). q_reload with
    dim_split 2 needs more than an SM's 227 KB of shared memory at 2 stages (246 KB: the reloads are
    pipelined too), and 16-65 KB at 1. AttentionTiling at block_h 64 needs 263 KB (bf16) and
    spills. Which cut is fastest is for the sweep of bench/kernels.py (ATTENTION_SWEEP)
    to say; DEFAULT_ATTENTION_TILING is what it chose."""

    block_h: int = 64
    block_n: int = 32
    qk_chunk: int | None = 64
    q_reload: bool = False
    dim_split: int = 2
    num_warps: int = 8
    num_stages: int = 2
    merge_block_h: int = 16
    programs_per_wave: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_h", "block_n", "merge_block_h"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MlaTiling.{name}: {value} (allowed: a power of two >= 16, a dot's minimum)")
        if self.qk_chunk is not None and (self.qk_chunk < 16 or self.qk_chunk & (self.qk_chunk - 1)):
            raise ValueError(f"MlaTiling.qk_chunk: {self.qk_chunk} (allowed: None or a power of two >= 16)")
        if self.q_reload and self.qk_chunk is None:
            raise ValueError("MlaTiling.q_reload: True with qk_chunk None (allowed: True only with a qk_chunk)")
        if self.dim_split < 1 or self.dim_split & (self.dim_split - 1):
            raise ValueError(f"MlaTiling.dim_split: {self.dim_split} (allowed: a power of two >= 1)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MlaTiling.num_warps: {self.num_warps} (allowed: 1, 2, 4, 8, 16)")
        if self.num_stages < 1:
            raise ValueError(f"MlaTiling.num_stages: {self.num_stages} (allowed: >= 1)")
        if self.programs_per_wave is not None and self.programs_per_wave < 1:
            raise ValueError(f"MlaTiling.programs_per_wave: {self.programs_per_wave} (allowed: >= 1 or None)")

    def spans(self, head_dim: int, groups: tuple[int, ...]) -> tuple[int, int]:
        """(logits span, value span) channels at ``head_dim`` for planes of these
        channels-per-scale ``groups``: both must divide the head dim, be at least 16 (a
        dot's minimum) and hold whole scale groups."""
        qk_chunk = self.qk_chunk or head_dim
        value_dim = head_dim // self.dim_split
        if self.q_reload and qk_chunk == head_dim:
            raise ValueError(
                f"MlaTiling.q_reload: True with qk_chunk {qk_chunk} = the head dim (allowed: True only below it)"
            )
        for name, span in (("qk_chunk", qk_chunk), ("head_dim / dim_split", value_dim)):
            if not _span_fits(span, head_dim, groups):
                raise ValueError(
                    f"MlaTiling: {name} = {span} at head dim {head_dim} (allowed: >= 16, dividing the head "
                    f"dim, a multiple of the planes' scale groups {sorted(set(groups))})"
                )
        return qk_chunk, value_dim

    def fitted(self, heads: int, head_dim: int, groups: tuple[int, ...]) -> MlaTiling:
        """This cut for a model narrower than the one it was chosen at: ``block_h`` no
        wider than the heads (a power of two, at least 16), and, where ``qk_chunk``
        cannot cut ``head_dim`` into spans of whole scale groups below it, the whole
        latent in one q . k dot with q held (``qk_chunk`` None, no ``q_reload``). It
        depends on the model's dims and the planes' formats alone, never on a batch."""
        block_h = max(16, min(self.block_h, triton.next_power_of_2(heads)))
        qk_chunk, q_reload = self.qk_chunk, self.q_reload
        if qk_chunk is not None and (qk_chunk >= head_dim or not _span_fits(qk_chunk, head_dim, groups)):
            qk_chunk, q_reload = None, False
        return dataclasses.replace(self, block_h=block_h, qk_chunk=qk_chunk, q_reload=q_reload)


def _span_fits(span: int, head_dim: int, groups: tuple[int, ...]) -> bool:
    """A latent span a dot can take: at least 16 channels, dividing the head dim, whole
    scale groups of every plane."""
    return span >= 16 and head_dim % span == 0 and all(span % g == 0 for g in groups)


# The engine's cut (fitted to a smaller model's dims: MlaTiling.fitted): one program a row
# holding the whole [64, 512] accumulator, q re-read from L2 for each 32-key tile, one
# stage. On an H100 (2026-12-06, bench/kernels.py's sweep at 32k context and a 4,096-token
# prefill of the reference slice, BENCHMARKS.md) it was the fastest cut timed at batch 128
# on both pool formats (1.4x / 1.8x AttentionTiling() with bf16 / NVFP4 keys) and at batch
# 32 with NVFP4, within 8% of the fastest at batches 8 and 32 otherwise, and took the
# prefill step from 197 to 168 ms. One cut whatever the batch: a row's bits never depend
# on its neighbours.
DEFAULT_ATTENTION_TILING = MlaTiling(q_reload=True, dim_split=1, num_stages=1)


@triton.jit
def _logits(q, k, DOT_BF16: tl.constexpr):
    """q [BLOCK_H, C] . k [BLOCK_N, C] -> [BLOCK_H, BLOCK_N] fp32."""
    if DOT_BF16:
        return tl.dot(q, tl.trans(k))
    else:
        return tl.dot(q, tl.trans(k), input_precision="ieee")


@triton.jit
def _q_span(q_rows, first, WIDTH: tl.constexpr, head_mask, dot_dtype: tl.constexpr, RELOAD: tl.constexpr):
    """Channels [first, first + WIDTH) of the program's query rows. RELOAD: a volatile
    load, which the compiler neither hoists out of the key loop nor merges with the
    previous tile's, so q is re-read from L2 for every tile instead of being held."""
    offsets = q_rows + first + tl.arange(0, WIDTH)[None, :]
    if RELOAD:
        q = tl.load(offsets, mask=head_mask[:, None], other=0.0, volatile=True)
    else:
        q = tl.load(offsets, mask=head_mask[:, None], other=0.0)
    return q.to(dot_dtype)


@triton.jit
def mla_attention_kernel(
    q_ptr,
    sink_ptr,
    out_ptr,
    partial_acc_ptr,
    partial_stats_ptr,
    chunk_ptr,
    chunk_rows_ptr,
    ring_rows_ptr,
    window_valid_ptr,
    entry_rows_ptr,
    ring_values,
    ring_scales,
    ring_values_stride_unit,
    ring_values_stride_row,
    ring_scales_stride_unit,
    ring_scales_stride_row,
    main_values,
    main_scales,
    main_values_stride_unit,
    main_values_stride_row,
    main_scales_stride_unit,
    main_scales_stride_row,
    num_heads,
    head_groups,
    window,
    topk,
    keys_per_split,
    window_splits,
    logit_scale,
    stride_q_row,
    stride_q_head,
    stride_out_row,
    stride_out_head,
    stride_chunk,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QK_CHUNK: tl.constexpr,
    Q_RELOAD: tl.constexpr,
    DIM_SPLIT: tl.constexpr,
    RING_ROWS: tl.constexpr,
    RING_FMT: tl.constexpr,
    RING_GROUP: tl.constexpr,
    MAIN_ROWS: tl.constexpr,
    MAIN_FMT: tl.constexpr,
    MAIN_GROUP: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    """sparse_attention_kernel's function and outputs (the same partials for
    merge_splits_kernel) with MlaTiling's cut. Grid (rows x head groups x DIM_SPLIT
    value spans, key splits), value spans varying fastest, then head groups: the
    programs that read the same key rows run side by side."""
    VALUE_DIM: tl.constexpr = HEAD_DIM // DIM_SPLIT
    ONE_READ: tl.constexpr = QK_CHUNK == HEAD_DIM and DIM_SPLIT == 1
    part = tl.program_id(0) % DIM_SPLIT
    group = (tl.program_id(0) // DIM_SPLIT) % head_groups
    row = (tl.program_id(0) // (DIM_SPLIT * head_groups)).to(tl.int64)
    heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    head_mask = heads < num_heads
    value_first = part * VALUE_DIM
    value_dims = value_first + tl.arange(0, VALUE_DIM)
    if DOT_BF16:
        dot_dtype = tl.bfloat16
    else:
        dot_dtype = tl.float32
    q_rows = q_ptr + row * stride_q_row + heads[:, None] * stride_q_head
    if QK_CHUNK == HEAD_DIM:
        q = _q_span(q_rows, 0, HEAD_DIM, head_mask, dot_dtype, False)
    running_max, running_sum = _sink_start(sink_ptr, heads, head_mask, BLOCK_H, SPLIT)
    acc = tl.zeros([BLOCK_H, VALUE_DIM], tl.float32)
    window_lo, window_hi, main_lo, main_hi = _key_spans(split, keys_per_split, window, window_splits, topk, SPLIT)

    for start in range(window_lo, window_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        in_span = keys < window_hi
        chunk_row = tl.load(chunk_rows_ptr + row * window + keys, mask=in_span, other=-1)
        ring_row = tl.load(ring_rows_ptr + row * window + keys, mask=in_span, other=-1)
        valid = tl.load(window_valid_ptr + row * window + keys, mask=in_span, other=0) != 0
        # As in sparse_attention_kernel: a valid key not in this step's rows is a ring row.
        from_chunk = valid & (chunk_row >= 0)
        from_ring = valid & (chunk_row < 0)
        if QK_CHUNK == HEAD_DIM:
            k = _window_keys(chunk_ptr, stride_chunk, chunk_row, from_chunk, ring_values, ring_scales, ring_row,
                             from_ring, RING_ROWS, ring_values_stride_unit, ring_values_stride_row,
                             ring_scales_stride_unit, ring_scales_stride_row, 0, HEAD_DIM, RING_FMT, RING_GROUP,
                             dot_dtype)
            logits = _logits(q, k, DOT_BF16)
        else:
            logits = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
            for first in tl.static_range(0, HEAD_DIM, QK_CHUNK):
                q_span = _q_span(q_rows, first, QK_CHUNK, head_mask, dot_dtype, Q_RELOAD)
                k_span = _window_keys(chunk_ptr, stride_chunk, chunk_row, from_chunk, ring_values, ring_scales,
                                      ring_row, from_ring, RING_ROWS, ring_values_stride_unit,
                                      ring_values_stride_row, ring_scales_stride_unit, ring_scales_stride_row, first,
                                      QK_CHUNK, RING_FMT, RING_GROUP, dot_dtype)
                logits += _logits(q_span, k_span, DOT_BF16)
        if ONE_READ:
            v = k
        else:
            v = _window_keys(chunk_ptr, stride_chunk, chunk_row, from_chunk, ring_values, ring_scales, ring_row,
                             from_ring, RING_ROWS, ring_values_stride_unit, ring_values_stride_row,
                             ring_scales_stride_unit, ring_scales_stride_row, value_first, VALUE_DIM, RING_FMT,
                             RING_GROUP, dot_dtype)
        running_max, running_sum, acc = _fold_logits(logits, v, valid, running_max, running_sum, acc, logit_scale,
                                                     DOT_BF16)

    for start in range(main_lo, main_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        entry = tl.load(entry_rows_ptr + row * topk + keys, mask=keys < main_hi, other=-1)
        present = entry >= 0
        # Selections are padded with absent entries; a tile of none adds nothing (its
        # logits are all -inf), so it is not folded.
        if tl.max(entry, 0) >= 0:
            if QK_CHUNK == HEAD_DIM:
                k = load_row_span(main_values, main_scales, entry, present, MAIN_ROWS, main_values_stride_unit,
                                  main_values_stride_row, main_scales_stride_unit, main_scales_stride_row, 0, HEAD_DIM,
                                  MAIN_FMT, MAIN_GROUP, dot_dtype)
                logits = _logits(q, k, DOT_BF16)
            else:
                logits = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
                for first in tl.static_range(0, HEAD_DIM, QK_CHUNK):
                    q_span = _q_span(q_rows, first, QK_CHUNK, head_mask, dot_dtype, Q_RELOAD)
                    k_span = load_row_span(main_values, main_scales, entry, present, MAIN_ROWS,
                                           main_values_stride_unit, main_values_stride_row, main_scales_stride_unit,
                                           main_scales_stride_row, first, QK_CHUNK, MAIN_FMT, MAIN_GROUP, dot_dtype)
                    logits += _logits(q_span, k_span, DOT_BF16)
            if ONE_READ:
                v = k
            else:
                v = load_row_span(main_values, main_scales, entry, present, MAIN_ROWS, main_values_stride_unit,
                                  main_values_stride_row, main_scales_stride_unit, main_scales_stride_row, value_first,
                                  VALUE_DIM, MAIN_FMT, MAIN_GROUP, dot_dtype)
            running_max, running_sum, acc = _fold_logits(logits, v, present, running_max, running_sum, acc, logit_scale,
                                                         DOT_BF16)

    if SPLIT:
        # sparse_attention_kernel's partials; every value span writes its channels, the
        # first alone the (identical) statistics.
        num_splits = tl.num_programs(1)
        slot = row * num_splits + split
        tl.store(
            partial_acc_ptr + (slot * num_heads + heads[:, None]) * HEAD_DIM + value_dims[None, :],
            acc,
            mask=head_mask[:, None],
        )
        if part == 0:
            tl.store(partial_stats_ptr + slot * 2 * num_heads + heads, running_max, mask=head_mask)
            tl.store(partial_stats_ptr + (slot * 2 + 1) * num_heads + heads, running_sum, mask=head_mask)
    else:
        tl.store(
            out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + value_dims[None, :],
            (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None],
        )
