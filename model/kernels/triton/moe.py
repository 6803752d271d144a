"""Grouped GEMMs of the routed experts: ragged launches over every expert a rank holds.

Owns the Triton side of ``PagedKernels.routed_expert_slots``: the expert bank (per projection
a table of pointers to each held expert's weight, read in place: the params' own
tensors for plain weights, or MXFP4 packs, E2M1 pairs along the input dim with an E8M0
scale per 32, decoded in registers), the alignment of a step's (token, slot) pairs into
per-expert blocks of rows (on the device, no host sync: the grid is sized by an upper
bound and unused blocks return at once), and two kernels, each one launch for all
experts: w1/w3 with the clamped SwiGLU and the routing weight, then w2. The function is
model/moe.py's ``routed_expert_slots``: fp32 accumulation, the matmul outputs and the
SwiGLU rounded to the activations' dtype where that function rounds them, each (token,
slot) pair's contribution in its own row (the caller adds a row's slots in slot order).
In the batch-invariant mode the blocks have a fixed row count, whatever the step's
number of pairs.

The loader decodes an FP4 checkpoint's experts at load time (model/loader.py post_load:
the params hold them in the compute dtype, exactly); the "mxfp4" bank packs them back
once, checking the packs are exact, so the kernels read 4.25 bits a weight.
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
from dsv41.model.kernels.triton.decode import e2m1_to_f32, e8m0_to_f32
from dsv41.model.linalg import batch_invariant_enabled
from dsv41.model.moe import ExpertWeights, Routing

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}
PROJECTIONS = ("w1", "w3", "w2")
# Rows of one block are (token, slot) pairs of a single expert; a block is at least
# tl.dot's 16 rows, and at most 64 so that a prefill's experts still span many blocks.
MIN_BLOCK_M = 16
MAX_BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64


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


def build_expert_bank(experts: Mapping[int, ExpertWeights], weight_format: str) -> TritonExpertBank:
    """The bank of ``experts`` (by global id). ``plain`` points at the weights as held;
    ``mxfp4`` points at packs made here once (E2M1 + E8M0 per 32 input values, a
    quarter of the bf16 bytes plus 1/64), after checking they are exact."""
    if weight_format not in EXPERT_WEIGHT_FORMATS:
        raise ValueError(f"weight_format: {weight_format!r} (allowed: {', '.join(EXPERT_WEIGHT_FORMATS)})")
    dtype, hidden, inter = _check_experts(experts)
    expert_ids = tuple(sorted(experts))
    device = experts[expert_ids[0]].w1.device
    tables: dict[str, ExpertPointers] = {}
    storage: list[torch.Tensor] = []
    for name in PROJECTIONS:
        weights = [getattr(experts[e], name) for e in expert_ids]
        if weight_format == "plain":
            tables[name] = _pointers(name, expert_ids, weights, None)
            storage.extend(weights)
            continue
        out_dim, in_dim = weights[0].shape
        packed = torch.empty(len(weights), out_dim, in_dim // 2, dtype=torch.uint8, device=device)
        scales = torch.empty(len(weights), out_dim, in_dim // MXFP4_BLOCK, dtype=torch.uint8, device=device)
        for i, (expert_id, weight) in enumerate(zip(expert_ids, weights)):
            packed[i], scales[i] = _pack_mxfp4(expert_id, name, weight)
        tables[name] = _pointers(name, expert_ids, list(packed.unbind(0)), list(scales.unbind(0)))
        storage.extend((packed, scales))
    return TritonExpertBank(
        expert_ids=expert_ids,
        held_ids=torch.tensor(expert_ids, dtype=torch.int64, device=device),
        weight_format=weight_format,
        dtype=dtype,
        hidden=hidden,
        intermediate=inter,
        w1=tables["w1"],
        w3=tables["w3"],
        w2=tables["w2"],
        storage=tuple(storage),
    )


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


def align_pairs(expert_ids: torch.Tensor, held_ids: torch.Tensor, block_m: int) -> PairBlocks:
    """Sorts the pairs of ``expert_ids`` [T, k] (global ids) by held expert and pads
    each expert's run to whole blocks; pairs routed to experts not held (another EP
    rank's) get no row. Device ops only: the number of blocks is the bound
    ceil((P + min(E, P) * (block_m - 1)) / block_m) over P pairs and E held experts."""
    flat = expert_ids.reshape(-1).to(held_ids.dtype)
    num_pairs, num_held = flat.numel(), held_ids.numel()
    device = flat.device
    position = torch.searchsorted(held_ids, flat)
    local = torch.where(held_ids[position.clamp(max=num_held - 1)] == flat, position, num_held)
    # A scatter, not bincount: bincount sizes its output from the data (a host sync,
    # which a captured decode graph cannot hold).
    counts = torch.zeros(num_held + 1, dtype=local.dtype, device=device).scatter_add_(0, local, torch.ones_like(local))
    counts = counts[:num_held]
    blocks = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
    block_end = torch.cumsum(blocks, 0)
    pair_start = torch.cumsum(counts, 0) - counts
    num_blocks = triton.cdiv(num_pairs + min(num_held, num_pairs) * (block_m - 1), block_m)
    order = torch.argsort(local, stable=True)
    sorted_local = local[order]
    expert = sorted_local.clamp(max=num_held - 1)
    rank = torch.arange(num_pairs, device=device) - pair_start[expert]
    slot = (block_end[expert] - blocks[expert]) * block_m + rank
    # Pairs of experts not held all land in one extra row, cut off below.
    dump = num_blocks * block_m
    slot = torch.where(sorted_local < num_held, slot, dump)
    slot_pairs = torch.full((dump + 1,), -1, dtype=torch.int32, device=device)
    slot_pairs.scatter_(0, slot, order.to(torch.int32))
    block_experts = torch.searchsorted(block_end, torch.arange(num_blocks, device=device), right=True)
    block_experts = torch.where(block_experts < num_held, block_experts, -1).to(torch.int32)
    return PairBlocks(block_m=block_m, slot_pairs=slot_pairs[:dump], block_experts=block_experts)


@triton.jit
def load_weight_tile(values, scales, rows, cols, row_stride, scale_row_stride, mask, MXFP4: tl.constexpr):
    """rows x cols of one expert's [out, in] weight: as stored (plain), or decoded to
    float32 (E2M1 code pairs along ``in``, the even element in the low nibble, times
    the E8M0 scale of its 32 input values)."""
    if MXFP4:
        packed = tl.load(values + rows[:, None] * row_stride + (cols // 2)[None, :], mask=mask, other=0)
        code = (packed.to(tl.int32) >> ((cols % 2) * 4)[None, :]) & 0xF
        scale = tl.load(scales + rows[:, None] * scale_row_stride + (cols // 32)[None, :], mask=mask, other=127)
        tile = e2m1_to_f32(code) * e8m0_to_f32(scale)
    else:
        tile = tl.load(values + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)
    return tile


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
        k_mask = ks < hidden
        x = tl.load(x_ptr + token[:, None] * stride_x + ks[None, :], mask=present[:, None] & k_mask[None, :], other=0.0)
        x = x.to(DOT)
        w_mask = col_mask[:, None] & k_mask[None, :]
        w1_tile = load_weight_tile(w1, s1, cols, ks, w_row_stride, w_scale_row_stride, w_mask, MXFP4)
        w3_tile = load_weight_tile(w3, s3, cols, ks, w_row_stride, w_scale_row_stride, w_mask, MXFP4)
        gate += tl.dot(x, tl.trans(w1_tile.to(DOT)), input_precision=DOT_PRECISION)
        up += tl.dot(x, tl.trans(w3_tile.to(DOT)), input_precision=DOT_PRECISION)
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
    ACT: tl.constexpr,
    W_ELEM: tl.constexpr,
    MXFP4: tl.constexpr,
    DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """w2 h for one block of one expert's pairs and BLOCK_N hidden columns, written to
    each pair's own row (token * top_k + slot) in the activations' dtype."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slot_pair_ptr + slots)
    present = pair >= 0
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    w2 = tl.multiple_of(tl.load(w2_values + expert).to(tl.pointer_type(W_ELEM)), 16)
    s2 = tl.multiple_of(tl.load(w2_scales + expert).to(tl.pointer_type(tl.uint8)), 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < inter
        h = tl.load(
            h_ptr + slots.to(tl.int64)[:, None] * stride_h + ks[None, :],
            mask=present[:, None] & k_mask[None, :],
            other=0.0,
        )
        w_mask = col_mask[:, None] & k_mask[None, :]
        w2_tile = load_weight_tile(w2, s2, cols, ks, w_row_stride, w_scale_row_stride, w_mask, MXFP4)
        acc += tl.dot(h.to(DOT), tl.trans(w2_tile.to(DOT)), input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + tl.where(present, pair, 0).to(tl.int64)[:, None] * stride_out + cols[None, :],
        round_to_activation(acc, ACT).to(ACT),
        mask=present[:, None] & col_mask[None, :],
    )


def grouped_expert_slots(
    x: torch.Tensor, routing: Routing, bank: TritonExpertBank, limit: float, *, bf16_dot: bool
) -> torch.Tensor:
    """model/moe.routed_expert_slots over ``bank``'s experts: [T, k, hidden] fp32. Two launches
    for every held expert at once. ``bf16_dot``: bf16 tensor-core dots (bf16
    activations on a GPU; bf16 holds every operand exactly: bf16 activations, bf16 or
    E2M1 x power-of-two weights), else fp32 operands with IEEE products (no TF32), as
    torch's fp32 matmul computes."""
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
    block_m = MIN_BLOCK_M if batch_invariant_enabled() else block_rows(num_pairs, len(bank.expert_ids))
    blocks = align_pairs(routing.expert_ids, bank.held_ids, block_m)
    h = torch.empty(blocks.num_blocks * blocks.block_m, bank.intermediate, dtype=x.dtype, device=x.device)
    pair_out = torch.zeros(num_pairs, bank.hidden, dtype=x.dtype, device=x.device)
    weights = routing.weights.reshape(-1).float().contiguous()
    mxfp4 = bank.weight_format == "mxfp4"
    constants = dict(
        ACT=TL_DTYPES[x.dtype],
        W_ELEM=tl.uint8 if mxfp4 else TL_DTYPES[bank.dtype],
        MXFP4=mxfp4,
        # TF32 is Triton's default precision of every dot; it changes nothing for bf16.
        DOT=tl.bfloat16 if bf16_dot else tl.float32,
        DOT_PRECISION="tf32" if bf16_dot else "ieee",
        BLOCK_M=blocks.block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )
    expert_gate_up_kernel[(blocks.num_blocks, triton.cdiv(bank.intermediate, BLOCK_N))](
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
        **constants,
    )
    expert_down_kernel[(blocks.num_blocks, triton.cdiv(bank.hidden, BLOCK_N))](
        h,
        pair_out,
        blocks.slot_pairs,
        blocks.block_experts,
        bank.w2.values,
        bank.w2.scales,
        bank.hidden,
        bank.intermediate,
        bank.w2.row_stride,
        bank.w2.scale_row_stride,
        h.stride(0),
        pair_out.stride(0),
        **constants,
    )
    return pair_out.view(rows, top_k, bank.hidden).float()
