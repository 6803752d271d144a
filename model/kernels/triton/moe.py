"""Grouped GEMMs of the routed experts: ragged launches over every expert a rank holds.

Owns the Triton side of ``PagedKernels.routed_expert_slots``: the expert bank (per projection
a table of pointers to each held expert's weight, read in place: the params' own
tensors for plain weights, or MXFP4 packs, E2M1 pairs along the input dim with an E8M0
scale per 32), the alignment of a step's (token, slot) pairs into per-expert blocks of
rows (on the device, no host sync: the grid is sized by an upper bound and unused
blocks return at once; two launches: each span of pairs counted per expert, then
every pair placed and every block labelled), and two kernels, each one launch for all experts: w1/w3 with
the clamped SwiGLU and the routing weight, then w2. The function is model/moe.py's
``routed_expert_slots``: fp32 accumulation, the matmul outputs and the SwiGLU rounded to
the activations' dtype where that function rounds them, each (token, slot) pair's
contribution in its own row (the caller adds a row's slots in slot order). In the
batch-invariant mode the blocks have a fixed row count and the tiles a fixed shape,
whatever the step's number of pairs.

MXFP4 banks come two ways: packed here once from experts the loader decoded from an
FP4 checkpoint (model/loader.py post_load holds them in the compute dtype, exactly;
``build_expert_bank`` checks the packs are exact), or straight from the checkpoint's
own bytes (``build_packed_expert_bank``, read in place). Either way the kernels read
4.25 bits a weight: each weight tile's packed bytes and its scales are loaded once,
and bf16 activations meet them in ``tl.dot_scaled`` (E2M1 decoded to bf16 in registers,
times the power-of-two scale: exact, bit for bit formats.dequantize_fp4_weight's
values; ``ExpertTiling.mxfp4_dot`` "bits" decodes them with a few bit operations
instead, as fast at decode sizes on an H200 and slower at prefill, BENCHMARKS.md); fp32
activations meet the same tile decoded to fp32 in an IEEE fp32 dot.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import triton
import triton.language as tl

from dsv41.model.formats import MXFP4_BLOCK, dequantize_mxfp4, quantize_mxfp4
from dsv41.model.kernels.interface import EXPERT_WEIGHT_FORMATS
from dsv41.model.kernels.triton.decode import (
    INTERPRETED,
    e2m1_to_f32,
    e8m0_to_bf16,
    e8m0_to_f32,
    mxfp4_pairs_to_bf16,
)
from dsv41.model.linalg import batch_invariant_enabled
from dsv41.model.moe import ExpertWeights, Routing
from dsv41.model.stored_weights import Fp4Weight

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}
PROJECTIONS = ("w1", "w3", "w2")
# Rows of one block are (token, slot) pairs of a single expert; a block is at least
# tl.dot's 16 rows, and at most 64 so that a prefill's experts still span many blocks.
MIN_BLOCK_M = 16
MAX_BLOCK_M = 64
# The most rows a tiling may ask a block for (ExpertTiling.block_m): a 128-row block
# is one tile of two warpgroups' wgmma.
MAX_TILING_BLOCK_M = 128
# Blocks of pairs whose down programs run side by side over each column tile of w2
# (expert_down_kernel), for blocks of a prefill's height. With every block of a column
# tile side by side, each block's h rows are read again for every column tile: at a
# 4,096-token prefill 132 MB of h, more than L2, 20 times a layer. That order ran the
# down launch at 283 TFLOP/s against 490 for gate/up (2.05 ms a layer, H100,
# 2026-12-07, BENCHMARKS.md); this one is not yet timed on a card. Decode-height blocks
# keep every block of a column tile side by side (EVERY_BLOCK), the order the decode
# steps were measured with: their h is small, their w2 tiles are what is read.
DOWN_BLOCK_GROUP = 8
# A group wider than a step's blocks (one group: every block of a column tile side by
# side); a step of more blocks would run in groups of this many, with the same values.
EVERY_BLOCK = 1 << 16


@dataclass(frozen=True)
class ExpertPointers:
    """One projection of every held expert, in bank order: ``values`` [E] int64
    addresses of each expert's [out, in] weight (plain: the compute dtype; mxfp4: uint8
    E2M1 pairs [out, in / 2]), ``scales`` [E] int64 addresses of its E8M0 bytes
    [out, in / 32] (plain: the values again, never read); row strides in elements."""

    values: torch.Tensor
    scales: torch.Tensor
    row_stride: int
    scale_row_stride: int

    def __post_init__(self) -> None:
        for name in ("values", "scales"):
            table = getattr(self, name)
            if table.dtype != torch.int64 or table.dim() != 1 or table.numel() != self.values.numel():
                raise ValueError(
                    f"ExpertPointers.{name}: {table.dtype} {list(table.shape)} (allowed: int64 [E], E = len(values))"
                )
        if self.row_stride <= 0 or self.scale_row_stride < 0:
            raise ValueError(
                f"ExpertPointers.row_stride / scale_row_stride: {self.row_stride} / {self.scale_row_stride} "
                "(allowed: > 0 / >= 0)"
            )


@dataclass(frozen=True)
class TritonExpertBank:
    """The routed experts of one layer on one rank as the grouped GEMMs read them.
    ``held_ids`` [E] (sorted global ids, on the weights' device) maps routing ids to
    bank positions; ``storage`` keeps alive every tensor the pointer tables address."""

    expert_ids: tuple[int, ...]
    held_ids: torch.Tensor
    weight_format: str
    dtype: torch.dtype
    hidden: int
    intermediate: int
    w1: ExpertPointers
    w3: ExpertPointers
    w2: ExpertPointers
    storage: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if self.weight_format not in EXPERT_WEIGHT_FORMATS:
            raise ValueError(
                f"TritonExpertBank.weight_format: {self.weight_format!r} (allowed: {', '.join(EXPERT_WEIGHT_FORMATS)})"
            )
        if self.dtype not in TL_DTYPES:
            raise ValueError(f"TritonExpertBank.dtype: {self.dtype} (allowed: {', '.join(map(str, TL_DTYPES))})")
        if list(self.expert_ids) != sorted(set(self.expert_ids)) or not self.expert_ids:
            raise ValueError(
                f"TritonExpertBank.expert_ids: {self.expert_ids} (allowed: at least one id, distinct, ascending)"
            )


def _check_experts(experts: Mapping[int, ExpertWeights]) -> tuple[torch.dtype, int, int]:
    """The shared dtype, hidden and intermediate sizes of the held experts; raises
    naming the first expert and projection that differs or is not contiguous (the
    kernels take one row stride per projection for every expert)."""
    if not experts:
        raise ValueError("experts: none held (allowed: at least one expert)")
    first = next(iter(experts.values()))
    dtype, device = first.w1.dtype, first.w1.device
    if dtype not in TL_DTYPES:
        raise ValueError(f"experts: {dtype} weights (allowed: {', '.join(map(str, TL_DTYPES))})")
    inter, hidden = first.w1.shape
    expected = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    for expert_id, w in experts.items():
        for name in PROJECTIONS:
            t = getattr(w, name)
            if tuple(t.shape) != expected[name] or t.dtype != dtype or t.device != device or not t.is_contiguous():
                raise ValueError(
                    f"expert {expert_id} {name}: {t.dtype} {list(t.shape)} on {t.device}, strides {t.stride()} "
                    f"(allowed: {dtype} {list(expected[name])} on {device}, contiguous, like expert "
                    f"{next(iter(experts))})"
                )
    return dtype, hidden, inter


def _check_packed_experts(experts: Mapping[int, ExpertWeights]) -> tuple[int, int]:
    """The shared hidden and intermediate sizes of experts held as FP4 weights
    (``Fp4Weight``, the checkpoint's form); raises naming the first expert and
    projection that is not one, or whose values or scales differ in shape or device
    from the first expert's, or are not contiguous."""
    if not experts:
        raise ValueError("experts: none held (allowed: at least one expert)")
    first_id = next(iter(experts))
    first = experts[first_id]
    for expert_id, w in experts.items():
        for name in PROJECTIONS:
            if not isinstance(getattr(w, name), Fp4Weight):
                raise ValueError(
                    f"expert {expert_id} {name}: {type(getattr(w, name)).__name__} (allowed: an Fp4Weight, the "
                    "checkpoint's packed form)"
                )
    device = first.w1.values.device
    inter, hidden = first.w1.values.shape[0], first.w1.values.shape[1] * 2
    expected = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    for expert_id, w in experts.items():
        for name in PROJECTIONS:
            p = getattr(w, name)
            out_dim, in_dim = expected[name]
            for part, t, shape in (
                ("values", p.values, (out_dim, in_dim // 2)),
                ("scale", p.scale, (out_dim, in_dim // MXFP4_BLOCK)),
            ):
                if tuple(t.shape) != shape or t.device != device or not t.is_contiguous():
                    raise ValueError(
                        f"expert {expert_id} {name} {part}: {list(t.shape)} on {t.device}, strides {t.stride()} "
                        f"(allowed: {list(shape)} on {device}, contiguous, like expert {first_id})"
                    )
    return hidden, inter


def _address_table(name: str, expert_ids: tuple[int, ...], tensors: list[torch.Tensor]) -> torch.Tensor:
    """[E] int64 addresses, each checked to be 16-byte aligned (the kernels tell the
    compiler so, for vectorised loads)."""
    addresses = [t.data_ptr() for t in tensors]
    for expert_id, address in zip(expert_ids, addresses):
        if address % 16:
            raise ValueError(
                f"expert {expert_id} {name}: address {address:#x} is not 16-byte aligned (allowed: aligned "
                "tensors; one memory-mapped from a checkpoint file can be unaligned: copy it)"
            )
    return torch.tensor(addresses, dtype=torch.int64, device=tensors[0].device)


def _pointers(
    name: str, expert_ids: tuple[int, ...], tensors: list[torch.Tensor], scales: list[torch.Tensor] | None
) -> ExpertPointers:
    values = _address_table(name, expert_ids, tensors)
    if scales is None:
        return ExpertPointers(values=values, scales=values, row_stride=tensors[0].stride(0), scale_row_stride=0)
    return ExpertPointers(
        values=values,
        scales=_address_table(f"{name} scales", expert_ids, scales),
        row_stride=tensors[0].stride(0),
        scale_row_stride=scales[0].stride(0),
    )


def _pack_mxfp4(expert_id: int, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 pack of a weight that holds MXFP4 values exactly (what the loader
    decoded from an FP4 checkpoint); anything else is refused, never rounded."""
    packed, scales = quantize_mxfp4(weight)
    if not torch.equal(dequantize_mxfp4(packed, scales), weight.float()):
        raise ValueError(
            f"expert {expert_id} {name}: weights are not on the MXFP4 grid (weight_format 'mxfp4' reads experts "
            "that were loaded from FP4; use 'plain' for others)"
        )
    return packed, scales


def _check_scale_bytes(name: str, expert_ids: tuple[int, ...], scales: list[torch.Tensor]) -> None:
    """Refuses E8M0 bytes 0 (2^-127) and 255 (NaN): the scaled dot builds its bf16
    scale as byte << 7, which is e8m0_decode's value for bytes 1..254 alone (0 would
    become a zero scale). formats.pow2_scale never writes either byte. One host sync
    per projection."""
    outside = torch.stack([((s == 0) | (s == 255)).any() for s in scales]).tolist()
    for expert_id, bad in zip(expert_ids, outside):
        if bad:
            raise ValueError(
                f"expert {expert_id} {name} scale: holds E8M0 byte 0 or 255 (allowed: 1..254, the scales "
                "formats.quantize_fp4_weight writes)"
            )


def _bank(
    expert_ids: tuple[int, ...],
    weight_format: str,
    dtype: torch.dtype,
    hidden: int,
    inter: int,
    tables: dict[str, ExpertPointers],
    storage: list[torch.Tensor],
) -> TritonExpertBank:
    return TritonExpertBank(
        expert_ids=expert_ids,
        held_ids=torch.tensor(expert_ids, dtype=torch.int64, device=tables["w1"].values.device),
        weight_format=weight_format,
        dtype=dtype,
        hidden=hidden,
        intermediate=inter,
        w1=tables["w1"],
        w3=tables["w3"],
        w2=tables["w2"],
        storage=tuple(storage),
    )


def build_packed_expert_bank(experts: Mapping[int, ExpertWeights], dtype: torch.dtype) -> TritonExpertBank:
    """The "mxfp4" bank of ``experts`` (by global id, each projection an ``Fp4Weight``)
    in the checkpoint's own bytes, read in place (no decoding, no copy: each tensor must
    be contiguous and 16-byte aligned); ``dtype`` is the compute dtype of the
    activations the bank will meet."""
    if dtype not in TL_DTYPES:
        raise ValueError(f"dtype: {dtype} (allowed: {', '.join(map(str, TL_DTYPES))})")
    hidden, inter = _check_packed_experts(experts)
    expert_ids = tuple(sorted(experts))
    tables: dict[str, ExpertPointers] = {}
    storage: list[torch.Tensor] = []
    for name in PROJECTIONS:
        projections = [getattr(experts[e], name) for e in expert_ids]
        values = [p.values for p in projections]
        scales = [p.scale.view(torch.uint8) for p in projections]
        _check_scale_bytes(name, expert_ids, scales)
        tables[name] = _pointers(name, expert_ids, values, scales)
        storage.extend(values + scales)
    return _bank(expert_ids, "mxfp4", dtype, hidden, inter, tables, storage)


def build_expert_bank(experts: Mapping[int, ExpertWeights], weight_format: str) -> TritonExpertBank:
    """The bank of ``experts`` (by global id). Experts held as the checkpoint stores them
    (``Fp4Weight``: weight_storage "stored") are read in place under ``mxfp4``; under
    ``plain`` they are decoded once, into the compute dtype. Decoded experts: ``plain``
    points at the weights as held; ``mxfp4`` at packs made here once (E2M1 + E8M0 per
    32 input values, a quarter of the bf16 bytes plus 1/64), after checking they are
    exact."""
    if weight_format not in EXPERT_WEIGHT_FORMATS:
        raise ValueError(f"weight_format: {weight_format!r} (allowed: {', '.join(EXPERT_WEIGHT_FORMATS)})")
    first = next(iter(experts.values()), None)
    if first is not None and isinstance(first.w1, Fp4Weight):
        if weight_format == "mxfp4":
            return build_packed_expert_bank(experts, first.w1.dtype)
        experts = {
            e: ExpertWeights(**{name: getattr(w, name).decoded() for name in PROJECTIONS}) for e, w in experts.items()
        }
    dtype, hidden, inter = _check_experts(experts)
    expert_ids = tuple(sorted(experts))
    if weight_format == "mxfp4":
        packed = {
            e: ExpertWeights(
                **{name: Fp4Weight(*_pack_mxfp4(e, name, getattr(experts[e], name)), dtype) for name in PROJECTIONS}
            )
            for e in expert_ids
        }
        return build_packed_expert_bank(packed, dtype)
    tables: dict[str, ExpertPointers] = {}
    storage: list[torch.Tensor] = []
    for name in PROJECTIONS:
        weights = [getattr(experts[e], name) for e in expert_ids]
        tables[name] = _pointers(name, expert_ids, weights, None)
        storage.extend(weights)
    return _bank(expert_ids, weight_format, dtype, hidden, inter, tables, storage)


@dataclass(frozen=True)
class PairBlocks:
    """A step's (token, slot) pairs grouped by held expert into blocks of ``block_m``
    rows: ``slot_pairs`` [num_blocks * block_m] the flat pair id (token * top_k + slot)
    in each row, -1 for padding; ``block_experts`` [num_blocks] each block's bank
    position, -1 for blocks past the last expert's."""

    block_m: int
    slot_pairs: torch.Tensor
    block_experts: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.block_experts.numel()


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per block: the expected pairs per held expert, rounded up to a power of two
    within [MIN_BLOCK_M, MAX_BLOCK_M] (decode: 16; a prefill: 64)."""
    per_expert = -(-num_pairs // num_experts)
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(per_expert)))


# Pairs one alignment program ranks; on a GPU at most how many one-hot entries (pairs
# x held experts) a step of its loop holds, in registers (under the interpreter, whose
# cost is per operation, a step takes the whole span); blocks one program labels.
ALIGN_SPAN = 1024
ALIGN_ONE_HOT = 8192
ALIGN_BLOCKS = 16


@triton.jit
def _held_one_hot(expert_ptr, held, experts, first, num_pairs, ROWS: tl.constexpr):
    """Pairs first .. first + ROWS: their ids and [ROWS, E_P] int32, 1 where the pair's
    expert is held expert e (bank positions ``experts``; no 1 in a row whose expert is
    not held or that is past the last pair)."""
    pair = first + tl.arange(0, ROWS)
    live = pair < num_pairs
    routed = tl.load(expert_ptr + pair, mask=live, other=0)
    hot = (routed[:, None] == held[None, :]) & live[:, None] & (experts >= 0)[None, :]
    return pair, hot.to(tl.int32)


@triton.jit
def count_pairs_kernel(
    expert_ptr,
    held_ptr,
    counts_ptr,
    num_pairs,
    num_held,
    E_P: tl.constexpr,
    SPAN: tl.constexpr,
    ROWS: tl.constexpr,
):
    """counts[c, e]: pairs of span c (SPAN pairs) routed to held expert e."""
    span = tl.program_id(0)
    e = tl.arange(0, E_P)
    experts = tl.where(e < num_held, e, -1)
    held = tl.load(held_ptr + e, mask=e < num_held, other=0)
    counts = tl.zeros((E_P,), dtype=tl.int32)
    for first in range(span * SPAN, tl.minimum(span * SPAN + SPAN, num_pairs), ROWS):
        _, hot = _held_one_hot(expert_ptr, held, experts, first, num_pairs, ROWS)
        counts += tl.sum(hot, axis=0)
    tl.store(counts_ptr + span * E_P + e, counts)


@triton.jit
def place_pairs_kernel(
    expert_ptr,
    held_ptr,
    counts_ptr,
    slot_pair_ptr,
    block_expert_ptr,
    num_pairs,
    num_held,
    num_spans,
    num_blocks,
    E_P: tl.constexpr,
    SPAN: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Program c writes the rows of span c's held pairs (an expert's pairs in pair
    order, from its first block on) and labels blocks c * BLOCKS .. + BLOCKS: each
    block's expert (-1 past the last expert's) and -1 in its rows that hold no pair.
    Every row of slot_pairs is written once, by one of the two."""
    program = tl.program_id(0)
    e = tl.arange(0, E_P)
    real = e < num_held
    experts = tl.where(real, e, -1)
    held = tl.load(held_ptr + e, mask=real, other=0)
    totals = tl.zeros((E_P,), dtype=tl.int32)
    before = tl.zeros((E_P,), dtype=tl.int32)
    for span in range(0, num_spans):
        counts = tl.load(counts_ptr + span * E_P + e)
        totals += counts
        before += tl.where(span < program, counts, 0)
    blocks = (totals + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    block_start = block_end - blocks
    # Row of the next pair of each expert in this span.
    next_row = block_start * BLOCK_M + before
    for first in range(program * SPAN, tl.minimum(program * SPAN + SPAN, num_pairs), ROWS):
        pair, hot = _held_one_hot(expert_ptr, held, experts, first, num_pairs, ROWS)
        # The pairs of the same expert ahead of each pair in this step, plus those before it.
        ahead = tl.cumsum(hot, axis=0) - hot
        row = tl.sum(hot * (next_row[None, :] + ahead), axis=1)
        tl.store(slot_pair_ptr + row, pair.to(tl.int32), mask=tl.sum(hot, axis=1) > 0)
        next_row += tl.sum(hot, axis=0)
    block = program * BLOCKS + tl.arange(0, BLOCKS)
    # searchsorted(block_end, block, right=True): the experts whose blocks end by it.
    expert = tl.sum(((block_end[None, :] <= block[:, None]) & real[None, :]).to(tl.int32), axis=1)
    owned = expert < num_held
    tl.store(block_expert_ptr + block, tl.where(owned, expert, -1), mask=block < num_blocks)
    mine = (e[None, :] == expert[:, None]).to(tl.int32)
    filled = tl.sum(mine * totals[None, :], axis=1) - (block - tl.sum(mine * block_start[None, :], axis=1)) * BLOCK_M
    filled = tl.where(owned, filled, 0)
    r = tl.arange(0, BLOCK_M)
    empty = (r[None, :] >= filled[:, None]) & (block < num_blocks)[:, None]
    padding = tl.full((BLOCKS, BLOCK_M), -1, tl.int32)
    tl.store(slot_pair_ptr + block[:, None] * BLOCK_M + r[None, :], padding, mask=empty)


def align_pairs(
    expert_ids: torch.Tensor, held_ids: torch.Tensor, block_m: int, step_rows: int | None = None
) -> PairBlocks:
    """Sorts the pairs of ``expert_ids`` [T, k] (global ids) by held expert, each
    expert's in pair order, and pads each expert's run to whole blocks; pairs routed to
    experts not held (another EP rank's) get no row. Two launches, no host sync: the
    number of blocks is the bound ceil((P + min(E, P) * (block_m - 1)) / block_m) over
    P pairs and E held experts (each expert wastes at most block_m - 1 rows), and
    the blocks past the last expert's are marked -1. Integer arithmetic only.
    ``step_rows``: pairs per one-hot step, a power of two (default: the device's)."""
    flat = expert_ids.reshape(-1).to(held_ids.dtype).contiguous()
    num_pairs, num_held = flat.numel(), held_ids.numel()
    device = flat.device
    num_blocks = triton.cdiv(num_pairs + min(num_held, num_pairs) * (block_m - 1), block_m)
    slot_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if num_blocks:
        e_p = triton.next_power_of_2(num_held)
        rows = step_rows or (min(ALIGN_SPAN, max(16, ALIGN_ONE_HOT // e_p)) if device.type == "cuda" else ALIGN_SPAN)
        spans = triton.cdiv(num_pairs, ALIGN_SPAN)
        counts = torch.empty(spans, e_p, dtype=torch.int32, device=device)
        held = held_ids.contiguous()
        count_pairs_kernel[(spans,)](flat, held, counts, num_pairs, num_held, E_P=e_p, SPAN=ALIGN_SPAN, ROWS=rows)
        place_pairs_kernel[(max(spans, triton.cdiv(num_blocks, ALIGN_BLOCKS)),)](
            flat,
            held,
            counts,
            slot_pairs,
            block_experts,
            num_pairs,
            num_held,
            spans,
            num_blocks,
            E_P=e_p,
            SPAN=ALIGN_SPAN,
            ROWS=rows,
            BLOCK_M=block_m,
            BLOCKS=ALIGN_BLOCKS,
        )
    return PairBlocks(block_m=block_m, slot_pairs=slot_pairs, block_experts=block_experts)


MXFP4_DOTS = ("scaled", "decoded", "bits")


@dataclass(frozen=True)
class ExpertTiling:
    """How the grouped GEMMs cut one block of rows' work: ``block_n`` output columns per
    program, ``block_k`` input values per step of its loop (for MXFP4 a whole number of
    32-value scale groups), and the launch's warps and pipeline stages. The sum over
    the input dim runs in ``block_k`` steps in index order, so a row's value depends on
    the tiling and its own inputs alone. ``mxfp4_dot``: how MXFP4 tiles meet bf16
    activations, "scaled" (tl.dot_scaled, which decodes them itself), "decoded" (the
    fp32 decode below, rounded to bf16 exactly, then a bf16 tl.dot) or "bits" (each
    byte's pair decoded straight to bf16 by bit moves and two exact multiplies,
    decode.mxfp4_pairs_to_bf16, then a bf16 tl.dot; compiled NVIDIA kernels only). All
    three give the same values; fp32 activations always meet the fp32 decode.
    ``max_registers``: a cap on each thread's registers (ptxas' maxrregcount; None: the
    compiler's choice), which sets how many programs share an SM; it changes no value.
    ``block_m``: rows per block of pairs (None: ``block_rows``' choice from the step's
    pairs); a row's value does not depend on it, only how many rows share a weight tile."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    mxfp4_dot: str = "scaled"
    max_registers: int | None = None
    block_m: int | None = None

    def __post_init__(self) -> None:
        if self.block_m is not None and (
            not MIN_BLOCK_M <= self.block_m <= MAX_TILING_BLOCK_M or self.block_m & (self.block_m - 1)
        ):
            raise ValueError(
                f"ExpertTiling.block_m: {self.block_m} (allowed: None or a power of two in "
                f"{MIN_BLOCK_M}..{MAX_TILING_BLOCK_M})"
            )
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 32 or value & (value - 1):
                raise ValueError(
                    f"ExpertTiling.{name}: {value} (allowed: a power of two >= 32, whole MXFP4 groups and a dot's "
                    "minimum)"
                )
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"ExpertTiling.num_warps: {self.num_warps} (allowed: 1, 2, 4, 8, 16)")
        if self.num_stages < 1:
            raise ValueError(f"ExpertTiling.num_stages: {self.num_stages} (allowed: >= 1)")
        if self.max_registers is not None and not (24 <= self.max_registers <= 255 and self.max_registers % 8 == 0):
            raise ValueError(
                f"ExpertTiling.max_registers: {self.max_registers} (allowed: None or a multiple of 8 in 24..255)"
            )
        if self.mxfp4_dot not in MXFP4_DOTS:
            raise ValueError(
                f"ExpertTiling.mxfp4_dot: {self.mxfp4_dot!r} (allowed: {', '.join(map(repr, MXFP4_DOTS))})"
            )


PLAIN_DECODE_TILING = ExpertTiling()
# 64-row bf16 prefill blocks take 256 weight rows on two warpgroups: 1.50x the decode
# tiling at 4,096 tokens on 64 experts, the fastest of the plain sweep there (H100,
# 2026-12-07, BENCHMARKS.md); 128-row blocks were no faster.
PLAIN_PREFILL_TILING = ExpertTiling(block_n=256, block_k=64, num_warps=8, num_stages=3)
# Chosen from sm_90 builds (triton 3.6.0, the H200's, compiled on the CPU dev box,
# 2026-12-02; among the fastest of the card's sweep, BENCHMARKS.md): decode blocks (16
# or 32 rows) read 64 bytes of each of a program's 64 weight rows a step, 4 stages
# deep, in 161 (16 rows) or 188 (32 rows) registers without spills, so three or two
# programs share an SM; 64-row prefill blocks take 128 weight rows on two warpgroups
# (218 registers uncapped, so one program an SM; capped at 128, two: 21% faster at
# 4,096 tokens on 64 experts on the H100, 2026-12-06, BENCHMARKS.md; the same cap made
# the decode tiling 3-5% slower).
MXFP4_DECODE_TILING = ExpertTiling(block_n=64, block_k=128, num_warps=4, num_stages=4)
MXFP4_PREFILL_TILING = ExpertTiling(block_n=128, block_k=128, num_warps=8, num_stages=3, max_registers=128)


def expert_tiling(weight_format: str, block_m: int) -> ExpertTiling:
    """The default tiling of a bank's format for blocks of ``block_m`` rows. The
    batch-invariant mode always runs MIN_BLOCK_M rows, so its tiles, and the order of
    its sums, never change with the step's pairs."""
    if weight_format == "mxfp4":
        return MXFP4_PREFILL_TILING if block_m >= MAX_BLOCK_M else MXFP4_DECODE_TILING
    return PLAIN_PREFILL_TILING if block_m >= MAX_BLOCK_M else PLAIN_DECODE_TILING


@triton.jit
def weight_dot(
    acc,
    act,
    values,
    scales,
    rows,
    row_mask,
    k0,
    in_dim,
    row_stride,
    scale_row_stride,
    MXFP4: tl.constexpr,
    MXFP4_DOT: tl.constexpr,
    DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc + act [M, BLOCK_K] @ w[rows, k0 : k0 + BLOCK_K]^T in fp32, w one expert's [out,
    in] weight: as stored (plain), or MXFP4, whose tile's packed bytes [rows, BLOCK_K / 2]
    and scale bytes [rows, BLOCK_K / 32] are each loaded once. MXFP4_DOT (ExpertTiling's
    mxfp4_dot; "decoded" for fp32 activations): "scaled" has tl.dot_scaled decode them
    to bf16, "bits" decodes each byte's pair to bf16 here, "decoded" to float32 (E2M1
    code pairs, the even element in the low nibble, times the E8M0 scale of their 32
    input values)."""
    if MXFP4:
        pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        packed = tl.load(
            values + rows[:, None] * row_stride + pairs[None, :],
            mask=row_mask[:, None] & (pairs < in_dim // 2)[None, :],
            other=0,
        )
        scale = tl.load(
            scales + rows[:, None] * scale_row_stride + groups[None, :],
            mask=row_mask[:, None] & (groups < in_dim // 32)[None, :],
            other=127,
        )
        if MXFP4_DOT == "scaled":
            # fast_math skips the NaN select for scale byte 255; banks hold bytes 1..254.
            acc = tl.dot_scaled(act, None, "bf16", tl.trans(packed), scale, "e2m1", acc=acc, fast_math=True)
        elif MXFP4_DOT == "bits":
            # A byte's scale is its group's: 16 bytes (32 values) a group.
            group_scale = tl.broadcast_to(e8m0_to_bf16(scale)[:, :, None], (rows.shape[0], BLOCK_K // 32, 16))
            tile = mxfp4_pairs_to_bf16(packed, tl.reshape(group_scale, (rows.shape[0], BLOCK_K // 2)))
            acc += tl.dot(act.to(DOT), tl.trans(tile.to(DOT)), input_precision=DOT_PRECISION)
        else:
            codes = tl.interleave(packed & 0xF, packed >> 4)
            grouped = tl.reshape(e2m1_to_f32(codes), (rows.shape[0], BLOCK_K // 32, 32))
            tile = tl.reshape(grouped * e8m0_to_f32(scale)[:, :, None], (rows.shape[0], BLOCK_K))
            acc += tl.dot(act.to(DOT), tl.trans(tile.to(DOT)), input_precision=DOT_PRECISION)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(
            values + rows[:, None] * row_stride + ks[None, :],
            mask=row_mask[:, None] & (ks < in_dim)[None, :],
            other=0.0,
        )
        acc += tl.dot(act.to(DOT), tl.trans(tile.to(DOT)), input_precision=DOT_PRECISION)
    return acc


@triton.jit
def round_to_activation(x, ACT: tl.constexpr):
    """fp32 values rounded to the activations' dtype (nearest, ties to even), kept in
    fp32. bf16 is rounded by integer bit arithmetic: Triton's interpreter truncates on
    a float32 -> bfloat16 cast (seen with triton 3.9.0), a GPU rounds to nearest."""
    if ACT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = x.to(ACT).to(tl.float32)
    return out


@triton.jit
def expert_gate_up_kernel(
    x_ptr,
    h_ptr,
    weight_ptr,
    slot_pair_ptr,
    block_expert_ptr,
    w1_values,
    w1_scales,
    w3_values,
    w3_scales,
    hidden,
    inter,
    top_k,
    limit,
    w_row_stride,
    w_scale_row_stride,
    stride_x,
    stride_h,
    ACT: tl.constexpr,
    W_ELEM: tl.constexpr,
    MXFP4: tl.constexpr,
    MXFP4_DOT: tl.constexpr,
    DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """h = silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit) * routing weight, for
    one block of one expert's pairs and BLOCK_N intermediate columns."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slot_pair_ptr + slots)
    present = pair >= 0
    token = tl.where(present, pair // top_k, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    # Banks hold 16-byte aligned addresses; saying so lets the compiler vectorise loads.
    w1 = tl.multiple_of(tl.load(w1_values + expert).to(tl.pointer_type(W_ELEM)), 16)
    w3 = tl.multiple_of(tl.load(w3_values + expert).to(tl.pointer_type(W_ELEM)), 16)
    s1 = tl.multiple_of(tl.load(w1_scales + expert).to(tl.pointer_type(tl.uint8)), 16)
    s3 = tl.multiple_of(tl.load(w3_scales + expert).to(tl.pointer_type(tl.uint8)), 16)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + token[:, None] * stride_x + ks[None, :], mask=present[:, None] & (ks < hidden)[None, :], other=0.0
        )
        gate = weight_dot(
            gate, x, w1, s1, cols, col_mask, k0, hidden, w_row_stride, w_scale_row_stride,
            MXFP4, MXFP4_DOT, DOT, DOT_PRECISION, BLOCK_K,
        )  # fmt: skip
        up = weight_dot(
            up, x, w3, s3, cols, col_mask, k0, hidden, w_row_stride, w_scale_row_stride,
            MXFP4, MXFP4_DOT, DOT, DOT_PRECISION, BLOCK_K,
        )  # fmt: skip
    # The reference's projections come out in the activations' dtype.
    gate = tl.minimum(round_to_activation(gate, ACT), limit)
    up = tl.minimum(tl.maximum(round_to_activation(up, ACT), -limit), limit)
    routing_weight = tl.load(weight_ptr + pair, mask=present, other=0.0)
    h = round_to_activation(gate * tl.sigmoid(gate) * up * routing_weight[:, None], ACT)
    tl.store(
        h_ptr + slots.to(tl.int64)[:, None] * stride_h + cols[None, :],
        h.to(ACT),
        mask=present[:, None] & col_mask[None, :],
    )


@triton.jit
def expert_down_kernel(
    h_ptr,
    out_ptr,
    slot_pair_ptr,
    block_expert_ptr,
    w2_values,
    w2_scales,
    hidden,
    inter,
    w_row_stride,
    w_scale_row_stride,
    stride_h,
    stride_out,
    num_blocks,
    ACT: tl.constexpr,
    W_ELEM: tl.constexpr,
    MXFP4: tl.constexpr,
    MXFP4_DOT: tl.constexpr,
    DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
):
    """w2 h for one block of one expert's pairs and BLOCK_N hidden columns, rounded to
    the activations' dtype and written to each pair's own row (token * top_k + slot) in
    the output's dtype (the activations' or fp32, which holds them exactly). The
    programs of BLOCK_GROUP consecutive blocks take each column tile in turn, the
    group's blocks side by side: they share the tile of w2 while the group's h rows
    stay in L2 for every column tile."""
    pid = tl.program_id(0)
    column_tiles = tl.cdiv(hidden, BLOCK_N)
    per_group = BLOCK_GROUP * column_tiles
    first = (pid // per_group) * BLOCK_GROUP
    group_blocks = tl.minimum(num_blocks - first, BLOCK_GROUP)
    in_group = pid % per_group
    block = first + in_group % group_blocks
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slot_pair_ptr + slots)
    present = pair >= 0
    cols = (in_group // group_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    w2 = tl.multiple_of(tl.load(w2_values + expert).to(tl.pointer_type(W_ELEM)), 16)
    s2 = tl.multiple_of(tl.load(w2_scales + expert).to(tl.pointer_type(tl.uint8)), 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(
            h_ptr + slots.to(tl.int64)[:, None] * stride_h + ks[None, :],
            mask=present[:, None] & (ks < inter)[None, :],
            other=0.0,
        )
        acc = weight_dot(
            acc, h, w2, s2, cols, col_mask, k0, inter, w_row_stride, w_scale_row_stride,
            MXFP4, MXFP4_DOT, DOT, DOT_PRECISION, BLOCK_K,
        )  # fmt: skip
    tl.store(
        out_ptr + tl.where(present, pair, 0).to(tl.int64)[:, None] * stride_out + cols[None, :],
        round_to_activation(acc, ACT).to(out_ptr.dtype.element_ty),
        mask=present[:, None] & col_mask[None, :],
    )


def _launch_constants(bank: TritonExpertBank, act: torch.dtype, block_m: int, tiling: ExpertTiling, bf16_dot: bool):
    mxfp4 = bank.weight_format == "mxfp4"
    mxfp4_dot = tiling.mxfp4_dot if act == torch.bfloat16 else "decoded"
    if mxfp4 and mxfp4_dot == "bits" and (INTERPRETED or torch.version.hip is not None):
        raise ValueError(
            "ExpertTiling.mxfp4_dot: 'bits' runs PTX, which "
            + ("the interpreter cannot" if INTERPRETED else "a ROCm build has not")
            + " (allowed here: 'scaled', 'decoded')"
        )
    return dict(
        ACT=TL_DTYPES[act],
        W_ELEM=tl.uint8 if mxfp4 else TL_DTYPES[bank.dtype],
        MXFP4=mxfp4,
        # The scaled dot runs interpreted too: it decodes the same bytes to the same values.
        MXFP4_DOT=mxfp4_dot,
        # TF32 is Triton's default precision of every dot; it changes nothing for bf16.
        DOT=tl.bfloat16 if bf16_dot else tl.float32,
        DOT_PRECISION="tf32" if bf16_dot else "ieee",
        BLOCK_M=block_m,
        BLOCK_N=tiling.block_n,
        BLOCK_K=tiling.block_k,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
        maxnreg=tiling.max_registers,
    )


def expert_down(
    h: torch.Tensor,
    out: torch.Tensor,
    blocks: PairBlocks,
    bank: TritonExpertBank,
    tiling: ExpertTiling,
    *,
    bf16_dot: bool,
    block_group: int | None = None,
) -> None:
    """The w2 launch: ``out`` [P, hidden] (pair rows, the activations' dtype or fp32)
    gets w2 times each block row of ``h`` [num_blocks * block_m, inter] whose pair is
    present, rounded to the activations' dtype. ``block_group``: the blocks whose
    programs run side by side over each column tile (at least the number of blocks:
    every block of a column tile; None: DOWN_BLOCK_GROUP for blocks of MAX_BLOCK_M rows
    or more, else EVERY_BLOCK); it orders the programs and changes no value."""
    if block_group is None:
        block_group = DOWN_BLOCK_GROUP if blocks.block_m >= MAX_BLOCK_M else EVERY_BLOCK
    if block_group < 1:
        raise ValueError(f"block_group: {block_group} (allowed: >= 1, or None)")
    expert_down_kernel[(blocks.num_blocks * triton.cdiv(bank.hidden, tiling.block_n),)](
        h,
        out,
        blocks.slot_pairs,
        blocks.block_experts,
        bank.w2.values,
        bank.w2.scales,
        bank.hidden,
        bank.intermediate,
        bank.w2.row_stride,
        bank.w2.scale_row_stride,
        h.stride(0),
        out.stride(0),
        blocks.num_blocks,
        BLOCK_GROUP=block_group,
        **_launch_constants(bank, h.dtype, blocks.block_m, tiling, bf16_dot),
    )


def holds_every_expert(bank: TritonExpertBank, routing: Routing) -> bool:
    """Whether every routed pair's expert is one ``bank`` holds: the bank holds all of
    the router's ``num_experts`` ids (its ids are distinct and ascending)."""
    return len(bank.expert_ids) == routing.num_experts and bank.expert_ids[-1] == routing.num_experts - 1


def grouped_expert_slots(
    x: torch.Tensor,
    routing: Routing,
    bank: TritonExpertBank,
    limit: float,
    *,
    bf16_dot: bool,
    tiling: ExpertTiling | None = None,
) -> torch.Tensor:
    """model/moe.routed_expert_slots over ``bank``'s experts: [T, k, hidden] fp32. Two launches
    for every held expert at once. ``bf16_dot``: bf16 tensor-core dots (bf16
    activations on a GPU; bf16 holds every operand exactly: bf16 activations, bf16 or
    E2M1 x power-of-two weights), else fp32 operands with IEEE products (no TF32), as
    torch's fp32 matmul computes. ``tiling``: the format's default unless given (the
    benchmark's sweep); a tiling's ``block_m`` sets the rows per block outside the
    batch-invariant mode, which runs MIN_BLOCK_M rows and refuses any other."""
    if x.dtype != bank.dtype:
        raise ValueError(f"x: {x.dtype} (allowed: the experts' compute dtype {bank.dtype})")
    if x.shape[1] != bank.hidden:
        raise ValueError(f"x: hidden {x.shape[1]} (allowed: the experts' hidden size {bank.hidden})")
    rows, top_k = routing.expert_ids.shape
    if rows != x.shape[0]:
        raise ValueError(f"routing: {rows} rows for x's {x.shape[0]}")
    if rows == 0:
        return torch.zeros(0, top_k, bank.hidden, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    num_pairs = rows * top_k
    if batch_invariant_enabled():
        if tiling is not None and tiling.block_m not in (None, MIN_BLOCK_M):
            raise ValueError(
                f"ExpertTiling.block_m: {tiling.block_m} in the batch-invariant mode (allowed: None or {MIN_BLOCK_M}, "
                "whatever the step's pairs)"
            )
        block_m = MIN_BLOCK_M
    elif tiling is not None and tiling.block_m is not None:
        block_m = tiling.block_m
    else:
        block_m = block_rows(num_pairs, len(bank.expert_ids))
    tiling = expert_tiling(bank.weight_format, block_m) if tiling is None else tiling
    blocks = align_pairs(routing.expert_ids, bank.held_ids, block_m)
    h = torch.empty(blocks.num_blocks * blocks.block_m, bank.intermediate, dtype=x.dtype, device=x.device)
    # fp32, as the slots are returned: the kernel widens its rounded values itself
    # instead of a copy of every pair row after it. The down kernel writes the rows of
    # the held experts' pairs; only where the router has experts this bank does not hold
    # (EP) must the other rows start at zero (a prefill's zeroing took 1.2 ms of an
    # H100's device time, BENCHMARKS.md).
    if holds_every_expert(bank, routing):
        pair_out = torch.empty(num_pairs, bank.hidden, dtype=torch.float32, device=x.device)
    else:
        pair_out = torch.zeros(num_pairs, bank.hidden, dtype=torch.float32, device=x.device)
    weights = routing.weights.reshape(-1).float().contiguous()
    expert_gate_up_kernel[(blocks.num_blocks, triton.cdiv(bank.intermediate, tiling.block_n))](
        x,
        h,
        weights,
        blocks.slot_pairs,
        blocks.block_experts,
        bank.w1.values,
        bank.w1.scales,
        bank.w3.values,
        bank.w3.scales,
        bank.hidden,
        bank.intermediate,
        top_k,
        float(limit),
        bank.w1.row_stride,
        bank.w1.scale_row_stride,
        x.stride(0),
        h.stride(0),
        **_launch_constants(bank, x.dtype, blocks.block_m, tiling, bf16_dot),
    )
    expert_down(h, pair_out, blocks, bank, tiling, bf16_dot=bf16_dot)
    return pair_out.view(rows, top_k, bank.hidden)
