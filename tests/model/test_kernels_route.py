"""The fused MoE steps (model/kernels/triton/route.py) compute model/moe.py's route, the
shared expert (expert_ffn) and the layer's output: compiled on a GPU when one is
present, else under TRITON_INTERPRET=1 on the CPU (tests/conftest.py sets it). The
torch reference is model/moe.py on the same device.

The output (slots added in slot order, plus the shared expert's) is torch's bit for
bit. The shared expert's SwiGLU differs from torch's only through exp's last bit
(the SwiGLU within ``SWIGLU_ULPS``), which the rounding to bf16 hides on these tests' inputs.

Its projection is model/linalg.linear, the reference's own call, so the logits are the
same bits. The kernel picks the same experts in the same slot order (under the
interpreter but for near ties: see WEIGHT_ULPS); its weights
differ from the reference's by at most ``WEIGHT_ULPS`` float32 ulps, through softplus
(the interpreter's is the correctly rounded value, torch's CPU one is Sleef's, one ulp
off at about 18% of inputs) and the order of the k-term sum (first to last here). A
row's routing does not depend on the other rows of the call, nor on how many rows a
program takes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv41.model.linalg import batch_invariant
from dsv41.model.moe import ExpertWeights, Routing, TorchMoe, expert_ffn, route

pytest.importorskip("triton")

from dsv41.model.kernels.triton import TritonKernels  # noqa: E402  (needs triton)
from dsv41.model.kernels.triton.moe import TL_DTYPES  # noqa: E402
from dsv41.model.kernels.triton.route import fused_moe_output, fused_route, swiglu_kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The worst weight difference measured (CPU, interpreter, 2026-12-02) over 180,000 rows:
# 384 experts top 6, 128 top 3, 64 top 8, 16 top 4 and 8 top 2; bf16 and fp32 rows
# whose logits reach about +-5, +-20 and +-60 (past softplus's threshold of 20); in
# and out of the batch-invariant mode. On 3 of those rows the interpreted kernel chose
# other experts or another slot order: two values of s + bias an ulp of softplus
# apart (rows left out of the weights' bound). These tests' inputs have none.
WEIGHT_ULPS = 6
SHAPES = ((384, 6), (16, 4), (8, 2), (64, 8))
# The worst SwiGLU difference measured (CPU, interpreter, 2026-12-02) over 10^6 pairs
# of normal values (times 1 and 3), limit 1.5: 4 ulps (96.4% of values equal), from
# numpy's float64 exp rounded once against torch's vectorised (Sleef) expf in silu.
SWIGLU_ULPS = 4
LIMIT = 1.5  # small enough that both clamps bind on some values


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest difference of two fp32 tensors of one sign in units in the last place."""
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def _router(experts: int, rows: int, dtype: torch.dtype, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = 64
    x = (torch.randn(rows, hidden, generator=g) * scale).to(dtype).to(DEVICE)
    # A ``dtype`` model's gate as its layer holds it: the dtype's values in float32.
    gate = (torch.randn(experts, hidden, generator=g) * hidden**-0.5 * 2).to(dtype).float().to(DEVICE)
    bias = (torch.randn(experts, generator=g) * 0.1).to(DEVICE)
    return x, gate, bias


@pytest.mark.parametrize("batch_invariant_mode", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("experts", "top_k"), SHAPES)
def test_fused_route_picks_the_torch_experts_with_weights_within_bound(
    experts: int, top_k: int, dtype: torch.dtype, batch_invariant_mode: bool
) -> None:
    """The same expert ids, in the same slots, as model/moe.route; weights within
    WEIGHT_ULPS, the scaling applied; logits up to about +-24 (softplus's threshold is
    20)."""
    for seed, scale in enumerate((0.5, 2.0)):
        x, gate, bias = _router(experts, 128, dtype, scale, seed)
        with batch_invariant(batch_invariant_mode):
            want = route(x, gate, bias, top_k, 1.5)
            got = TritonKernels().route(x, gate, bias, top_k, 1.5)
        assert got.expert_ids.dtype == torch.int64 and got.weights.dtype == torch.float32
        assert torch.equal(got.expert_ids, want.expert_ids)
        assert _ulps(got.weights, want.weights) <= WEIGHT_ULPS


def test_ties_go_to_the_lower_expert_id() -> None:
    """Equal scores + bias: the lower id first (torch.topk has no tie rule). A row of
    equal logits and no bias takes experts 0..k-1 with equal weights; equal biases on a
    tie at the k-th place take the lower id."""
    experts, top_k = 16, 4
    gate = torch.zeros(experts, 8, device=DEVICE)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    bias = torch.zeros(experts, device=DEVICE)
    even = fused_route(x, gate, bias, top_k, 1.0)
    assert even.expert_ids.tolist() == [[0, 1, 2, 3]] * 2
    assert torch.equal(even.weights, torch.full((2, top_k), 0.25, device=DEVICE))
    bias[[2, 5, 9, 11, 13]] = torch.tensor([3.0, 2.0, 1.0, 1.0, 1.0], device=DEVICE)
    assert fused_route(x, gate, bias, top_k, 1.0).expert_ids.tolist() == [[2, 5, 9, 11]] * 2


@batch_invariant(True)
def test_a_rows_routing_does_not_depend_on_the_other_rows() -> None:
    """Bitwise, in the batch-invariant mode (which the projection needs; the launch's
    part mixes no rows in any mode): a row alone, a few rows picked out of a batch of
    200, and the whole batch, with the default rows per program and with one."""
    x, gate, bias = _router(384, 200, torch.bfloat16, 2.0, seed=7)
    whole = fused_route(x, gate, bias, 6, 1.5)
    for pick in (torch.tensor([5, 100, 199]), torch.tensor([17])):
        for block_t in (None, 1):
            part = fused_route(x[pick.to(DEVICE)], gate, bias, 6, 1.5, block_t=block_t)
            assert torch.equal(part.expert_ids, whole.expert_ids[pick.to(DEVICE)])
            assert torch.equal(part.weights, whole.weights[pick.to(DEVICE)])
    empty = fused_route(x[:0], gate, bias, 6, 1.5)
    assert isinstance(empty, Routing) and empty.weights.shape == empty.expert_ids.shape == (0, 6)
    with pytest.raises(ValueError, match="top_k: 385"):
        fused_route(x, gate, bias, 385, 1.5)


def test_the_router_takes_its_gate_in_fp32_only() -> None:
    """A bf16 gate is refused by both routers (a layer holds its gate in float32, so no
    step copies it to the logits' dtype)."""
    x, gate, bias = _router(16, 4, torch.bfloat16, 1.0, seed=9)
    for router in (route, fused_route):
        with pytest.raises(ValueError, match="gate: torch.bfloat16"):
            router(x, gate.bfloat16(), bias, 2, 1.0)


def test_the_swiglu_is_torchs_within_the_silu_bound() -> None:
    """fp32: silu(min(g, limit)) * clamp(u, -limit, limit) within SWIGLU_ULPS of torch's;
    the clamps are exact."""
    g = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(2, 5000, generator=g) * 3).to(DEVICE).unbind(0)
    h = torch.empty_like(gate)
    swiglu_kernel[(5,)](gate, up, h, h.numel(), LIMIT, ACT=TL_DTYPES[torch.float32], BLOCK=1024,
                        LIBDEVICE=h.is_cuda, enable_fp_fusion=False)  # fmt: skip
    want = F.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)
    assert (gate > LIMIT).any() and (up.abs() > LIMIT).any()
    assert _ulps(h, want) <= SWIGLU_ULPS


@pytest.mark.parametrize("batch_invariant_mode", [False, True])
def test_the_bf16_shared_expert_is_expert_ffn_bit_for_bit(batch_invariant_mode: bool) -> None:
    """bf16 rows and weights: the three projections are model/linalg.linear's and the
    SwiGLU rounds to bf16 where expert_ffn does; the values are expert_ffn's."""
    g = torch.Generator().manual_seed(6)
    hidden, inter = 64, 96

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * cols**-0.5 * 3).to(torch.bfloat16).to(DEVICE)

    w = ExpertWeights(w1=weight(inter, hidden), w2=weight(hidden, inter), w3=weight(inter, hidden))
    x = torch.randn(100, hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    with batch_invariant(batch_invariant_mode):
        got = TritonKernels().shared_expert(x, w, LIMIT)
        want = expert_ffn(x, w, LIMIT)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("top_k", [1, 6])
def test_the_output_is_the_torch_sum_bit_for_bit(top_k: int, dtype: torch.dtype) -> None:
    """The slots added first to last, then the shared output (bf16 or fp32, or none),
    rounded to the activations' dtype: TorchMoe.moe_output's bits, with the default rows
    per program and with one; no rows, no output."""
    g = torch.Generator().manual_seed(top_k)
    slots = torch.randn(37, top_k, 300, generator=g).to(DEVICE)
    others = (torch.randn(37, 300, generator=g).to(DEVICE), torch.randn(37, 300, generator=g).to(dtype).to(DEVICE))
    for shared in (None, *others):
        want = TorchMoe().moe_output(slots, shared, dtype)
        for block_t in (None, 1):
            got = fused_moe_output(slots, shared, dtype, block_t=block_t)
            assert got.dtype == dtype and torch.equal(got, want)
    assert fused_moe_output(slots[:0], None, dtype).shape == (0, 300)
