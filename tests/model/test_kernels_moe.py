"""The Triton backend's grouped expert GEMMs compute model/moe.routed_expert_slots: compiled
on a GPU when one is present, else under TRITON_INTERPRET=1 on the CPU (tests/conftest.py
sets it).

Experts are fresh random weights (never zeros), plain or on the MXFP4 grid (what the
loader decodes from an FP4 checkpoint, which the bank packs back into E2M1 + E8M0), or
the checkpoint's own packed bytes (build_packed_expert_bank); the kernels decode MXFP4
tiles in registers, exactly. fp32: IEEE dots, so the kernels differ from the
reference only by the order of fp32 sums (1e-5). bf16: the kernels round where the
reference rounds (both projections, the SwiGLU, each expert's output), so they differ
only where a sum in another order lands on the other side of a bf16 rounding boundary
(1e-2 of the output's norm; for MXFP4, one bf16 step at rare outputs).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cluster.distributed import DPExpertExchange, GroupSpec, open_process_group
from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.formats import dequantize_fp4_weight, dequantize_mxfp4, quantize_fp4_weight, round_mxfp4
from dsv41.model.kernels.interface import ExpertBank
from dsv41.model.linalg import batch_invariant
from dsv41.model.loader import ExpertShard
from dsv41.model.moe import ExpertWeights, Routing, combine_slots, moe_forward, routed_expert_slots
from dsv41.model.stored_weights import Fp4Weight
from dsv41.model.params import load_model_params

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from dsv41.model.kernels.triton import TritonKernels  # noqa: E402
from dsv41.model.kernels.triton.decode import e8m0_to_bf16, mxfp4_pairs_to_bf16  # noqa: E402
from dsv41.model.kernels.triton.moe import (  # noqa: E402
    ExpertTiling,
    PairBlocks,
    TritonExpertBank,
    align_pairs,
    build_expert_bank,
    build_packed_expert_bank,
    expert_down,
    expert_tiling,
    grouped_expert_slots,
    holds_every_expert,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LIMIT = 1.5  # small enough that the clamps of w1 x and w3 x bind on some values


def _experts(
    ids: range | list[int], hidden: int, inter: int, dtype: torch.dtype, fmt: str, seed: int
) -> dict[int, ExpertWeights]:
    g = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=g) * cols**-0.5 * 4
        return (round_mxfp4(w) if fmt == "mxfp4" else w).to(dtype).to(DEVICE)

    return {e: ExpertWeights(w1=weight(inter, hidden), w2=weight(hidden, inter), w3=weight(inter, hidden)) for e in ids}


def _routing(rows: int, top_k: int, routed_to: list[int], seed: int, num_experts: int | None = None) -> Routing:
    """Each row picks top_k distinct experts of ``routed_to``; slot 0 always picks the
    first of them, so that expert gets a pair from every row (more than the 16 rows of
    a decode-sized block once there are more than 16 rows). The router has
    ``num_experts`` (default: one past the largest id routed to)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(routed_to)
    picks = [
        torch.cat((pool[:1], pool[1:][torch.randperm(len(routed_to) - 1, generator=g)[: top_k - 1]]))
        for _ in range(rows)
    ]
    weights = torch.rand(rows, top_k, generator=g) + 0.1
    num_experts = max(routed_to) + 1 if num_experts is None else num_experts
    return Routing(weights=weights.to(DEVICE), expert_ids=torch.stack(picks).to(DEVICE), num_experts=num_experts)


def _assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert float((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("fmt", ["plain", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_routed_expert_slots(dtype: torch.dtype, fmt: str) -> None:
    """6 held experts, rows routed to 4 of them (2 get no pair; one gets more pairs
    than a block holds), hidden and intermediate sizes that are not multiples of the
    64-wide tiles: the kernels give routed_expert_slots' output, slot by slot."""
    hidden, inter, top_k, rows = 96, 96, 2, 17
    experts = _experts(range(6), hidden, inter, dtype, fmt, seed=1)
    routing = _routing(rows, top_k, [5, 0, 2, 3], seed=2)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    kernels = TritonKernels()
    bank = kernels.expert_bank(experts, fmt)
    assert isinstance(bank, TritonExpertBank) and bank.weight_format == fmt
    assert holds_every_expert(bank, routing)  # so no output row starts zeroed
    _assert_matches(
        kernels.routed_expert_slots(x, routing, bank, LIMIT), routed_expert_slots(x, routing, experts, LIMIT), dtype
    )


@pytest.mark.parametrize("fmt", ["plain", "mxfp4"])
def test_every_block_height_a_tiling_asks_for_gives_routed_expert_slots(fmt: str) -> None:
    """A tiling's block_m (16 to 128 rows of pairs a block, whatever the step's pair
    count would choose) changes only how many rows share a weight tile: with 40 rows
    routed to 3 of 5 experts (one expert's pairs fill more than two 16-row blocks and
    fewer than one 128-row block), each gives routed_expert_slots' output."""
    hidden, inter, top_k, rows = 64, 96, 2, 40
    experts = _experts(range(5), hidden, inter, torch.float32, fmt, seed=41)
    routing = _routing(rows, top_k, [4, 1, 2], seed=42)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(43)).to(DEVICE)
    bank = TritonKernels().expert_bank(experts, fmt)
    want = routed_expert_slots(x, routing, experts, LIMIT)
    for block_m in (16, 32, 64, 128):
        tiling = ExpertTiling(block_n=32, block_k=32, block_m=block_m)
        _assert_matches(grouped_expert_slots(x, routing, bank, LIMIT, bf16_dot=False, tiling=tiling), want, torch.float32)


def test_block_heights_outside_the_kernels_range_or_the_invariant_mode_are_refused() -> None:
    """block_m must be a power of two of 16..128 rows; the batch-invariant mode runs 16
    rows whatever the step, so a tiling asking it for another height fails naming the
    field, and computes nothing."""
    for bad in (8, 96, 256):
        with pytest.raises(ValueError, match=rf"ExpertTiling.block_m: {bad} \(allowed: None or a power of two"):
            ExpertTiling(block_m=bad)
    experts = _experts(range(2), 64, 64, torch.float32, "plain", seed=44)
    bank = TritonKernels().expert_bank(experts, "plain")
    routing = _routing(3, 1, [1, 0], seed=45)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(46)).to(DEVICE)
    with batch_invariant(True):
        with pytest.raises(ValueError, match=r"ExpertTiling.block_m: 64 in the batch-invariant mode"):
            grouped_expert_slots(x, routing, bank, LIMIT, bf16_dot=False, tiling=ExpertTiling(block_m=64))
        got = grouped_expert_slots(x, routing, bank, LIMIT, bf16_dot=False, tiling=ExpertTiling(block_m=16))
    _assert_matches(got, routed_expert_slots(x, routing, experts, LIMIT), torch.float32)


def _checkpoint_form(experts: dict[int, ExpertWeights]) -> dict[int, ExpertWeights]:
    """The experts as a stored load holds an FP4 checkpoint's: quantize_fp4_weight's
    pairs and E8M0 bytes as ``Fp4Weight`` (model/stored_weights.py)."""

    def packed(w: torch.Tensor) -> Fp4Weight:
        values, scale = quantize_fp4_weight(w.float())
        return Fp4Weight(values.view(torch.uint8), scale, w.dtype)

    return {e: ExpertWeights(w1=packed(w.w1), w2=packed(w.w2), w3=packed(w.w3)) for e, w in experts.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_checkpoints_bytes_give_the_decoded_banks_result_bit_for_bit(dtype: torch.dtype) -> None:
    """A bank over the checkpoint's own packed bytes (build_packed_expert_bank, read in
    place) and the bank packed from the decoded weights (build_expert_bank "mxfp4")
    hold the same bytes, so the kernels give the same output, bit for bit, at decode
    and prefill block sizes."""
    hidden, inter, top_k = 96, 96, 2
    experts = _experts(range(6), hidden, inter, dtype, "mxfp4", seed=21)
    stored = _checkpoint_form(experts)
    decoded_bank = build_expert_bank(experts, "mxfp4")
    stored_bank = build_packed_expert_bank(stored, dtype)
    assert stored_bank.storage[0].data_ptr() == stored[0].w1.values.data_ptr(), "read in place"
    for rows in (5, 40):
        routing = _routing(rows, top_k, [5, 0, 2, 3], seed=22)
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(23)).to(dtype).to(DEVICE)
        kernels = TritonKernels()
        want = kernels.routed_expert_slots(x, routing, decoded_bank, LIMIT)
        assert torch.equal(kernels.routed_expert_slots(x, routing, stored_bank, LIMIT), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_tiles_decode_to_dequantize_fp4_weight_exactly(dtype: torch.dtype) -> None:
    """The w2 launch over an identity h (one pair row per intermediate index, all in one
    expert's blocks) writes each decoded column of w2 once, times 1.0 plus zeros: its
    output is dequantize_fp4_weight of the checkpoint's bytes, in the compute dtype,
    bit for bit (bf16 activations through the scaled dot, and on a GPU the bit decode,
    fp32 through the fp32 decode), at the decode and prefill tilings."""
    hidden, inter = 64, 96
    experts = _experts([2, 7], hidden, inter, dtype, "mxfp4", seed=24)
    stored = _checkpoint_form(experts)
    bank = build_packed_expert_bank(stored, dtype)
    h = torch.eye(inter, dtype=dtype, device=DEVICE)
    blocks = PairBlocks(
        block_m=16,
        slot_pairs=torch.arange(inter, dtype=torch.int32, device=DEVICE),
        block_experts=torch.ones(inter // 16, dtype=torch.int32, device=DEVICE),
    )
    w2 = stored[7].w2
    want = dequantize_fp4_weight(w2.values, w2.scale.view(torch.uint8)).to(dtype).T
    on_gpu_bf16 = dtype == torch.bfloat16 and DEVICE == "cuda"
    bits = [ExpertTiling(block_n=64, block_k=64, mxfp4_dot="bits")] if on_gpu_bf16 else []
    for tiling in (expert_tiling("mxfp4", 16), expert_tiling("mxfp4", 64), *bits):
        out = torch.zeros(inter, hidden, dtype=dtype, device=DEVICE)
        expert_down(h, out, blocks, bank, tiling, bf16_dot=dtype == torch.bfloat16 and DEVICE == "cuda")
        assert torch.equal(out, want), tiling


def test_the_scaled_the_decoded_and_the_bit_mxfp4_dots_agree_bit_for_bit() -> None:
    """bf16 activations meet MXFP4 tiles in tl.dot_scaled by default; the "decoded"
    tiling option decodes them to fp32 here and runs a plain dot instead, and on a GPU
    "bits" decodes each byte straight to bf16. All see the same operand values in the
    same K steps: the outputs are equal, bit for bit."""
    hidden, inter, top_k, rows = 96, 64, 2, 17
    experts = _experts(range(4), hidden, inter, torch.bfloat16, "mxfp4", seed=25)
    bank = build_expert_bank(experts, "mxfp4")
    routing = _routing(rows, top_k, [3, 1, 0], seed=26)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(27)).to(torch.bfloat16).to(DEVICE)
    bf16_dot = DEVICE == "cuda"
    scaled = ExpertTiling(block_n=32, block_k=64)
    got = grouped_expert_slots(x, routing, bank, LIMIT, bf16_dot=bf16_dot, tiling=scaled)
    for mxfp4_dot in ("decoded", "bits") if DEVICE == "cuda" else ("decoded",):
        tiling = ExpertTiling(block_n=32, block_k=64, mxfp4_dot=mxfp4_dot)
        assert torch.equal(grouped_expert_slots(x, routing, bank, LIMIT, bf16_dot=bf16_dot, tiling=tiling), got)


@pytest.mark.parametrize("fmt", ["plain", "mxfp4"])
def test_the_down_launchs_program_order_changes_no_value(fmt: str) -> None:
    """expert_down's block_group only orders its programs: with 80 rows routed to 4 of 5
    experts in 16-row blocks (more used blocks than a group of 7, and a count neither 4
    nor 7 divides) over 3 column tiles, groups of 1, 4, 7, every block and the default
    give the same bits; a group below one block is refused."""
    hidden, inter, top_k, rows = 96, 64, 2, 80
    experts = _experts(range(5), hidden, inter, torch.float32, fmt, seed=51)
    bank = build_expert_bank(experts, fmt)
    routing = _routing(rows, top_k, [4, 0, 2, 3], seed=52)
    blocks = align_pairs(routing.expert_ids, bank.held_ids, 16)
    h = torch.randn(blocks.num_blocks * 16, inter, generator=torch.Generator().manual_seed(53)).to(DEVICE)
    tiling = ExpertTiling(block_n=32, block_k=32)
    outputs = []
    for group in (1, 4, 7, blocks.num_blocks, None):
        out = torch.zeros(rows * top_k, hidden, device=DEVICE)
        expert_down(h, out, blocks, bank, tiling, bf16_dot=False, block_group=group)
        outputs.append(out)
    assert int(blocks.block_experts.ge(0).sum()) > 7 and blocks.num_blocks % 4 and blocks.num_blocks % 7
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
    assert outputs[0].abs().sum(1).gt(0).sum() == rows * top_k
    with pytest.raises(ValueError, match="block_group: 0"):
        expert_down(h, outputs[0], blocks, bank, tiling, bf16_dot=False, block_group=0)


@triton.jit
def _decode_pairs_kernel(packed_ptr, scale_ptr, out_ptr, ROWS: tl.constexpr, PAIRS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    pairs = tl.arange(0, PAIRS)
    packed = tl.load(packed_ptr + rows[:, None] * PAIRS + pairs[None, :])
    scale = tl.load(scale_ptr + rows[:, None] * PAIRS + pairs[None, :])
    values = mxfp4_pairs_to_bf16(packed, e8m0_to_bf16(scale))
    tl.store(out_ptr + rows[:, None] * (2 * PAIRS) + tl.arange(0, 2 * PAIRS)[None, :], values)


@pytest.mark.skipif(DEVICE != "cuda", reason="the bit decode is PTX: the interpreter runs no inline asm")
def test_the_bit_decode_is_dequantize_mxfp4_for_every_byte_and_scale() -> None:
    """decode.mxfp4_pairs_to_bf16 over every byte (both nibbles: all 16 codes, signed
    zeros included) times every E8M0 scale byte but NaN's 255 (0, 2^-127, included;
    results that overflow are inf on both sides): formats.dequantize_mxfp4's values in
    bf16, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(255, 1)
    scales = torch.arange(255, dtype=torch.uint8)[:, None].expand(255, 256).contiguous()
    rows = 256
    packed = torch.zeros(rows, 256, dtype=torch.uint8)
    pair_scale = torch.full((rows, 256), 127, dtype=torch.uint8)
    packed[:255], pair_scale[:255] = codes, scales
    out = torch.empty(rows, 512, dtype=torch.bfloat16, device=DEVICE)
    _decode_pairs_kernel[(1,)](packed.to(DEVICE), pair_scale.to(DEVICE), out, ROWS=rows, PAIRS=256)
    want = dequantize_mxfp4(packed, pair_scale[:, ::16].contiguous()).to(torch.bfloat16)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU runs the bit decode")
def test_the_bit_decode_is_refused_where_no_ptx_runs() -> None:
    """Under the interpreter (or on ROCm) an MXFP4 tiling asking for "bits" with bf16
    activations fails at launch naming the field and what runs there, never falls back."""
    experts = _experts(range(2), 64, 64, torch.bfloat16, "mxfp4", seed=29)
    bank = build_expert_bank(experts, "mxfp4")
    routing = _routing(3, 1, [1, 0], seed=30)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(31)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"ExpertTiling.mxfp4_dot: 'bits' .*allowed here: 'scaled', 'decoded'"):
        grouped_expert_slots(x, routing, bank, LIMIT, bf16_dot=False, tiling=ExpertTiling(mxfp4_dot="bits"))


def test_the_packed_bank_refuses_mismatched_packs_and_scale_bytes_it_cannot_decode() -> None:
    """Packs whose shapes disagree across experts, a projection that is not held packed,
    and E8M0 bytes 0 or 255 (which the scaled dot cannot decode as
    formats.e8m0_decode does) are named, never read."""
    experts = _experts([0, 3], 64, 64, torch.float32, "mxfp4", seed=28)
    stored = _checkpoint_form(experts)
    w1 = stored[3].w1
    short = Fp4Weight(w1.values[:32].contiguous(), w1.scale[:32].contiguous(), w1.dtype)
    with pytest.raises(ValueError, match="expert 3 w1 values"):
        mismatched = ExpertWeights(w1=short, w2=stored[3].w2, w3=stored[3].w3)
        build_packed_expert_bank({**stored, 3: mismatched}, torch.float32)
    with pytest.raises(ValueError, match="expert 0 w2: Tensor"):
        build_packed_expert_bank({**stored, 0: ExpertWeights(stored[0].w1, experts[0].w2, stored[0].w3)}, torch.float32)
    zero = w1.scale.clone()
    zero[5, 1] = 0
    bad = ExpertWeights(w1=Fp4Weight(w1.values, zero, w1.dtype), w2=stored[3].w2, w3=stored[3].w3)
    with pytest.raises(ValueError, match="expert 3 w1 scale: holds E8M0 byte 0 or 255"):
        build_packed_expert_bank({**stored, 3: bad}, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        build_packed_expert_bank(stored, torch.float16)


def test_mxfp4_bf16_outputs_are_the_references_or_one_rounding_step_from_it() -> None:
    """Measured bound, bf16 MXFP4 experts over 200 rows: the kernels' operands are the
    reference's exactly (the decode is exact) and they round where it rounds, but they
    add each fp32 sum over K in BLOCK_K steps where torch's bf16 matmul blocks it
    otherwise, so a sum that lands next to a bf16 rounding boundary can round to the
    neighbouring value. Every output is therefore the reference's bf16 value or one
    step from it, and such steps are rare (1 of 38400 at this seed; asserted < 0.1%)."""
    hidden, inter, top_k, rows = 96, 96, 2, 200
    experts = _experts(range(6), hidden, inter, torch.bfloat16, "mxfp4", seed=1)
    routing = _routing(rows, top_k, [5, 0, 2, 3], seed=2)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    kernels = TritonKernels()
    got = kernels.routed_expert_slots(x, routing, kernels.expert_bank(experts, "mxfp4"), LIMIT)
    want = routed_expert_slots(x, routing, experts, LIMIT)
    steps = (got.bfloat16().view(torch.int16).int() - want.bfloat16().view(torch.int16).int()).abs()
    assert int(steps.max()) <= 1
    assert float((steps > 0).float().mean()) < 1e-3


def _ep_shards(experts: dict[int, ExpertWeights]) -> list[dict[int, ExpertWeights]]:
    ids = sorted(experts)
    half = len(ids) // 2
    return [{e: experts[e] for e in ids[:half]}, {e: experts[e] for e in ids[half:]}]


def _tp_shards(experts: dict[int, ExpertWeights]) -> list[dict[int, ExpertWeights]]:
    inter = next(iter(experts.values())).w1.shape[0]
    halves = (slice(0, inter // 2), slice(inter // 2, inter))
    return [
        {
            e: ExpertWeights(w1=w.w1[s].contiguous(), w2=w.w2[:, s].contiguous(), w3=w.w3[s].contiguous())
            for e, w in experts.items()
        }
        for s in halves
    ]


@pytest.mark.parametrize("fmt", ["plain", "mxfp4"])
@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_shards_give_partial_sums_that_add_up_to_every_expert(mode: str, fmt: str) -> None:
    """An EP shard (half of the experts; rows routed to the other half get nothing
    from it) and a TP shard (half of every expert's intermediate dim, whole MXFP4
    groups): each shard's kernel output is routed_expert_slots over that shard, and the
    two shards' combined slots add up to every expert's (fp32)."""
    hidden, inter, top_k, rows = 64, 128, 2, 9
    experts = _experts(range(8), hidden, inter, torch.float32, fmt, seed=4)
    routing = _routing(rows, top_k, [6, 1, 2, 4, 5, 7], seed=5)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    kernels = TritonKernels()
    total = torch.zeros(rows, hidden, device=DEVICE)
    for shard in (_ep_shards if mode == "ep" else _tp_shards)(experts):
        got = kernels.routed_expert_slots(x, routing, kernels.expert_bank(shard, fmt), LIMIT)
        _assert_matches(got, routed_expert_slots(x, routing, shard, LIMIT), torch.float32)
        total += combine_slots(got)
    _assert_matches(total, combine_slots(routed_expert_slots(x, routing, experts, LIMIT)), torch.float32)


def test_rows_without_held_experts_get_exact_zeros() -> None:
    """No rows: an empty [0, k, hidden] result. Slots whose expert is another rank's:
    exact zeros, next to slots that do reach the held experts."""
    experts = _experts([4, 5], 64, 64, torch.float32, "plain", seed=7)
    kernels = TritonKernels()
    bank = kernels.expert_bank(experts, "plain")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    routing = Routing(
        weights=torch.rand(3, 2, generator=torch.Generator().manual_seed(9)).to(DEVICE),
        expert_ids=torch.tensor([[0, 1], [4, 2], [3, 6]], device=DEVICE),
        num_experts=7,
    )
    assert not holds_every_expert(bank, routing)
    got = kernels.routed_expert_slots(x, routing, bank, LIMIT)
    assert torch.equal(got[[0, 2]], torch.zeros(2, 2, 64, device=DEVICE))
    assert torch.equal(got[1, 1], torch.zeros(64, device=DEVICE))
    _assert_matches(got, routed_expert_slots(x, routing, experts, LIMIT), torch.float32)
    assert got[1, 0].abs().sum() > 0
    empty = Routing(weights=routing.weights[:0], expert_ids=routing.expert_ids[:0], num_experts=7)
    assert kernels.routed_expert_slots(x[:0], empty, bank, LIMIT).shape == (0, 2, 64)


def _blocks_by_hand(expert_ids: torch.Tensor, held: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """What align_pairs must give, built one expert at a time: each held expert's pair
    ids in ascending order, padded with -1 to whole blocks of block_m rows, the experts
    in bank order; then -1 blocks up to align_pairs' bound on the block count."""
    flat = expert_ids.flatten().tolist()
    by_expert: dict[int, list[int]] = {}
    for pair, expert in enumerate(flat):
        by_expert.setdefault(expert, []).append(pair)
    rows: list[int] = []
    labels: list[int] = []
    for position, expert in enumerate(held):
        pairs = by_expert.get(expert, [])
        blocks = -(-len(pairs) // block_m)
        rows += pairs + [-1] * (blocks * block_m - len(pairs))
        labels += [position] * blocks
    bound = -(-(len(flat) + min(len(held), len(flat)) * (block_m - 1)) // block_m)
    return rows + [-1] * ((bound - len(labels)) * block_m), labels + [-1] * (bound - len(labels))


def _assert_aligned(expert_ids: torch.Tensor, held: list[int], block_m: int, step_rows: int | None = None) -> None:
    blocks = align_pairs(expert_ids.to(DEVICE), torch.tensor(held, device=DEVICE), block_m, step_rows)
    rows, labels = _blocks_by_hand(expert_ids, held, block_m)
    assert blocks.slot_pairs.dtype == blocks.block_experts.dtype == torch.int32
    assert blocks.slot_pairs.tolist() == rows
    assert blocks.block_experts.tolist() == labels


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 40),
    top_k=st.integers(1, 8),
    held=st.sets(st.integers(0, 40), min_size=1, max_size=20),
    spread=st.integers(1, 41),
    block_m=st.sampled_from([16, 32, 64]),
    seed=st.integers(0, 2**16),
)
def test_alignment_is_the_by_hand_grouping(
    rows: int, top_k: int, held: set[int], spread: int, block_m: int, seed: int
) -> None:
    """align_pairs (two Triton launches) gives exactly the by-hand grouping of random
    routings: ids drawn from the first ``spread`` experts (1: every pair on expert 0),
    so the held set covers all, some or none of the routed experts."""
    expert_ids = torch.randint(0, spread, (rows, top_k), generator=torch.Generator().manual_seed(seed))
    _assert_aligned(expert_ids, sorted(held), block_m)


@pytest.mark.parametrize(
    ("rows", "top_k", "held", "block_m", "step_rows"),
    [
        (1, 6, list(range(384)), 16, None),  # a decode row among every expert of the config
        (40, 6, [7], 16, None),  # every pair on the one held expert: 240 pairs, 15 blocks
        (4096, 6, list(range(1, 384, 2)), 64, None),  # a prefill's pairs, half of them another rank's
        (400, 6, list(range(0, 384, 5)), 32, 64),  # a GPU's steps: 16 one-hot steps per span
    ],
)
def test_alignment_at_the_configs_sizes(
    rows: int, top_k: int, held: list[int], block_m: int, step_rows: int | None
) -> None:
    """The same at the sizes a step meets: spans of several alignment programs (1024
    pairs each), several one-hot steps per span, 384 experts (held: all, half, a fifth
    or one)."""
    g = torch.Generator().manual_seed(rows)
    expert_ids = torch.full((rows, top_k), 7) if len(held) == 1 else torch.randint(0, 384, (rows, top_k), generator=g)
    _assert_aligned(expert_ids, held, block_m, step_rows)


def test_mxfp4_bank_refuses_weights_off_the_grid() -> None:
    """Packing is exact or refused: a weight that MXFP4 cannot hold is named, never rounded."""
    experts = _experts([0, 3], 64, 64, torch.float32, "plain", seed=10)
    with pytest.raises(ValueError, match="expert 0 w1: weights are not on the MXFP4 grid"):
        TritonKernels().expert_bank(experts, "mxfp4")
    with pytest.raises(ValueError, match="weight_format"):
        TritonKernels().expert_bank(experts, "fp8")


class _OneLaunchAtATime(TritonKernels):
    """Triton's interpreter patches triton.language module-wide while it runs a launch,
    so two threads cannot interpret kernels at once (seen with triton 3.9.0: "Did you
    forget to add @triton.jit ?"); the ranks' threads take turns at the router and the
    expert GEMMs. Compiled kernels need no turns; the lock changes nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def route(self, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float) -> Routing:
        with self.lock:
            return super().route(x, gate, bias, top_k, scaling)

    def routed_expert_slots(self, x: torch.Tensor, routing: Routing, bank: ExpertBank, limit: float) -> torch.Tensor:
        with self.lock:
            return super().routed_expert_slots(x, routing, bank, limit)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="gloo among threads on CPU tensors: the interpreted kernels' case"
)
def test_the_dp_exchange_runs_its_shard_on_the_triton_kernels(tiny_quantized_dir: Path) -> None:
    """Two EP ranks in threads, the Triton kernels reading their FP4 experts packed,
    one rank idle: each rank's rows get moe_forward over every expert."""
    whole, _ = load_model_params(tiny_quantized_dir)
    layer_id = 1
    cfg = whole.config
    rows = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(11))
    moe = whole.layers[layer_id].moe
    want = moe_forward(rows, moe, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)
    shards = [load_model_params(tiny_quantized_dir, shard=ExpertShard("ep", r, 2))[0] for r in range(2)]
    split = {0: rows, 1: rows[:0]}
    got: dict[int, torch.Tensor] = {}
    banks: dict[int, TritonExpertBank] = {}
    errors: list[BaseException] = []
    store = dist.HashStore()
    kernels = _OneLaunchAtATime()

    def run(rank: int) -> None:
        try:
            group = open_process_group(GroupSpec("gloo", 2), rank, store)
            exchange = DPExpertExchange(cfg, group, rank, "gloo", kernels=kernels)
            exchange.begin_step([7, 0])
            layer = shards[rank].layers[layer_id]
            got[rank] = exchange(layer, split[rank])
            banks[rank] = exchange.experts.bank(layer)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)
            raise

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
    assert got[1].shape == (0, cfg.hidden_size)
    half = cfg.n_routed_experts // 2
    assert [banks[r].expert_ids for r in range(2)] == [tuple(range(half)), tuple(range(half, 2 * half))]
    assert {bank.weight_format for bank in banks.values()} == {"mxfp4"}


def test_the_engine_on_triton_reads_fp4_experts_packed_and_gives_the_torch_tokens(tiny_quantized_dir: Path) -> None:
    """The quantised tiny checkpoint (FP4 experts) through the whole engine: the
    Triton backend's MoE reads MXFP4 packs and gives the torch backend's greedy tokens
    (fp32) over a prefill and a decode step."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = torch.randint(3, 500, (4,), generator=torch.Generator().manual_seed(12)).tolist()
    tokens = {}
    for backend in ("torch", "triton"):
        engine = Engine.from_pretrained(
            tiny_quantized_dir, block_size=32, kernel_backend=backend, enable_prefix_caching=False, device=DEVICE
        )
        tokens[backend] = engine.generate([prompt], params)[0].token_ids
        runtime = engine.runner.runtime
        assert runtime.experts.weight_format == "mxfp4"
    assert isinstance(runtime.experts.bank(engine.params.layers[0]), TritonExpertBank)
    assert tokens["triton"] == tokens["torch"]
