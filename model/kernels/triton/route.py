"""The MoE layer's pointwise work around its GEMMs, one Triton launch each: the router
(model/moe.py ``route``) after its projection (``route_kernel``), the shared expert's
clamped SwiGLU between its projections (``swiglu_kernel``), and the layer's output, the
routed slots added in slot order plus the shared expert's output, in the activations'
dtype (``moe_output_kernel``). Unfused they are about nine, seven and eight torch ops a
layer, each a launch on a GPU.

The output is exact: fp32 adds in torch's order, then the rounding to bf16 (nearest
even). The SwiGLU is exact but for exp: clamps, silu as torch's x / (1 + exp(-x)) with
IEEE division, the product, the rounding; its exp is libdevice's expf compiled, and
under the interpreter float64's rounded once (the correctly rounded expf; torch's CPU
one is Sleef's, whose last bit differs at times: silu within a few ulps, before the
rounding to bf16).

The router: from the logits (model/linalg.linear of the fp32 rows and the fp32 gate,
the torch path's own call, so its bits) to the routing, one program per token row
(BLOCK_T rows under the interpreter): s = sqrt(softplus(logits)), the top-k of s +
bias, the chosen s over their sum, times the scaling.
The arithmetic follows route's order in float32: softplus is x above torch's threshold
20, else log1p(exp(x)); the square root is IEEE's (``sqrt_rn``); the weights are
(picked / (sum + 1e-20)) * scaling with IEEE division and no multiply-add fusion.
Compiled, exp and log1p are libdevice's expf and log1pf, the functions torch's CUDA
softplus calls (tests/model/test_kernels_route.py passed on an H200, 2026-12-02); the interpreter cannot
call libdevice, so there log1p(exp(x)) is computed in float64 (log(1 + u) * u / ((1 +
u) - 1), accurate where 1 + u rounds) and rounded once: the correctly rounded value,
from which torch's CPU softplus (Sleef's 1-ulp log1p and exp) differs by one ulp at
about 18% of inputs (measured over 10^6 normal values times 3).
Where the two differ from torch:
- the k picked scores are added first to last (``ordered_sum``, what small_sum does on a
  GPU in the batch-invariant mode); torch's CPU sum of 5 to 7 elements adds in another
  order (k = 6: ((((p0 + p4) + p5) + p1) + p2) + p3 on the dev box), and a CUDA sum's
  order is its kernel configuration's;
- ties of s + bias (equal fp32 values) go to the lower expert id, in slot order;
  torch.topk has no tie rule (the CPU one's order of equal values follows its partial
  sort: a row of zeros over 16 experts picks 12, 9, 10, 11, 14, 15). Real rows do not
  tie: s + bias of distinct experts are equal only for equal gate rows or equal bias.
- under the interpreter, through softplus's last bit, on near ties: 3 of 180,000
  random rows chose other experts or another slot order (two values of s + bias within
  an ulp), and the weights of the others differ by up to 6 ulps
  (tests/model/test_kernels_route.py).
A program of any of the three reads and writes its own rows (or values) only and its
shape is fixed by the device: a row's result does not depend on the other rows of the
call.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv41.model.kernels.triton.mhc import rows_per_program
from dsv41.model.kernels.triton.moe import TL_DTYPES, round_to_activation
from dsv41.model.linalg import linear
from dsv41.model.moe import ExpertWeights, Routing, check_gate

# torch's softplus threshold (beta 1): above it softplus(x) is x.
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)
# The epsilon of route's normalisation.
WEIGHT_EPS = tl.constexpr(1e-20)
# Values one SwiGLU program computes; hidden channels one output program adds.
SWIGLU_BLOCK = 1024
OUTPUT_BLOCK = 256


@triton.jit
def _sqrt_softplus(x, LIBDEVICE: tl.constexpr):
    """sqrt(softplus(x)) of fp32 ``x``, softplus as torch's (beta 1, threshold 20)."""
    if LIBDEVICE:
        soft = libdevice.log1p(libdevice.exp(x))
    else:
        u = tl.exp(x.to(tl.float64))
        w = 1.0 + u
        # log1p(u) from log(1 + u): the quotient corrects 1 + u's rounding.
        soft = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0))).to(tl.float32)
    return tl.sqrt_rn(tl.where(x > SOFTPLUS_THRESHOLD, x, soft))


@triton.jit
def route_kernel(
    logits_ptr,
    bias_ptr,
    weight_ptr,
    id_ptr,
    tokens,
    experts,
    stride_logits,
    scaling,
    TOP_K: tl.constexpr,
    E_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """BLOCK_T token rows: logits [experts] fp32 -> the top-k expert ids (int64) and
    their weights (fp32), in slot order (model/moe.route after its projection)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < tokens
    e = tl.arange(0, E_P)
    real = e < experts
    rows = logits_ptr + t[:, None] * stride_logits + e[None, :]
    logits = tl.load(rows, mask=live[:, None] & real[None, :], other=0.0)
    scores = _sqrt_softplus(logits, LIBDEVICE)
    bias = tl.load(bias_ptr + e, mask=real, other=0.0)
    choice = tl.where(real[None, :], scores + bias[None, :], float("-inf"))
    picked = ()
    for slot in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        expert = tl.min(tl.where(choice == best[:, None], e[None, :], E_P), axis=1)
        chosen = e[None, :] == expert[:, None]
        # The chosen expert's score, exactly: one entry, the rest -inf.
        picked = picked + (tl.max(tl.where(chosen, scores, float("-inf")), axis=1),)
        choice = tl.where(chosen, float("-inf"), choice)
        tl.store(id_ptr + t * TOP_K + slot, expert.to(tl.int64), mask=live)
    total = picked[0]
    for slot in tl.static_range(1, TOP_K):
        total = total + picked[slot]
    total = total + WEIGHT_EPS
    for slot in tl.static_range(TOP_K):
        tl.store(weight_ptr + t * TOP_K + slot, tl.math.div_rn(picked[slot], total) * scaling, mask=live)


def fused_route(
    x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, block_t: int | None = None
) -> Routing:
    """model/moe.route: the projection through model/linalg.linear, then one launch.
    ``block_t``: rows per program (default ``rows_per_program``)."""
    tokens, experts = x.shape[0], gate.shape[0]
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k: {top_k} (allowed: 1..{experts}, the gate's experts)")
    check_gate(gate)
    logits = linear(x.float(), gate).contiguous()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    expert_ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    block_t = block_t or rows_per_program(x.device)
    if tokens:
        route_kernel[(triton.cdiv(tokens, block_t),)](
            logits,
            bias.float().contiguous(),
            weights,
            expert_ids,
            tokens,
            experts,
            logits.stride(0),
            float(scaling),
            TOP_K=top_k,
            E_P=triton.next_power_of_2(experts),
            BLOCK_T=block_t,
            # libdevice is compiled-only: the interpreter cannot call it.
            LIBDEVICE=x.device.type == "cuda",
            enable_fp_fusion=False,
        )
    return Routing(weights=weights, expert_ids=expert_ids, num_experts=experts)


@triton.jit
def swiglu_kernel(
    gate_ptr, up_ptr, out_ptr, count, limit, ACT: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr
):
    """out = silu(min(gate, limit)) * clamp(up, -limit, limit) over BLOCK values of the
    projections (the activations' dtype), in fp32, rounded to that dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < count
    gate = tl.minimum(tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32), limit)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    if LIBDEVICE:
        decay = libdevice.exp(-gate)
    else:
        # expf correctly rounded (from float64); numpy's float32 exp is not.
        decay = tl.exp(-gate.to(tl.float64)).to(tl.float32)
    h = tl.math.div_rn(gate, 1.0 + decay) * up
    tl.store(out_ptr + offsets, round_to_activation(h, ACT).to(ACT), mask=mask)


@triton.jit
def moe_output_kernel(
    slots_ptr,
    shared_ptr,
    out_ptr,
    tokens,
    hidden,
    stride_row,
    stride_slot,
    stride_shared,
    stride_out,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """BLOCK_T rows, BLOCK_H channels: the k slots (fp32) added first to last, then the
    shared output (as fp32), rounded to the activations' dtype."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (t < tokens)[:, None] & (c < hidden)[None, :]
    rows = slots_ptr + t[:, None] * stride_row + c[None, :]
    total = tl.load(rows, mask=mask, other=0.0)
    for slot in tl.static_range(1, TOP_K):
        total = total + tl.load(rows + slot * stride_slot, mask=mask, other=0.0)
    if SHARED:
        total = total + tl.load(shared_ptr + t[:, None] * stride_shared + c[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
    tl.store(out_ptr + t[:, None] * stride_out + c[None, :], round_to_activation(total, ACT).to(ACT), mask=mask)


def fused_shared_expert(x: torch.Tensor, w: ExpertWeights, limit: float) -> torch.Tensor:
    """model/moe.expert_ffn without a routing weight, in x's dtype (expert_ffn's value
    before its exact widening to fp32): the three projections through
    model/linalg.linear, the SwiGLU between them one launch."""
    gate = linear(x, w.w1).contiguous()
    up = linear(x, w.w3).contiguous()
    if x.dtype not in TL_DTYPES:
        raise ValueError(f"x: {x.dtype} (allowed: {', '.join(map(str, TL_DTYPES))})")
    h = torch.empty_like(gate)
    if h.numel():
        swiglu_kernel[(triton.cdiv(h.numel(), SWIGLU_BLOCK),)](
            gate,
            up,
            h,
            h.numel(),
            float(limit),
            ACT=TL_DTYPES[x.dtype],
            BLOCK=SWIGLU_BLOCK,
            LIBDEVICE=x.device.type == "cuda",
            enable_fp_fusion=False,
        )
    return linear(h, w.w2)


def fused_moe_output(
    slots: torch.Tensor, shared: torch.Tensor | None, dtype: torch.dtype, block_t: int | None = None
) -> torch.Tensor:
    """(model/moe.combine_slots(slots) + shared).to(dtype) in one launch: ``slots`` [T,
    k, hidden] fp32, ``shared`` [T, hidden] (any float dtype, added as its fp32 values)
    or None."""
    if slots.dtype != torch.float32 or slots.stride(-1) != 1:
        raise ValueError(f"slots: {slots.dtype}, strides {slots.stride()} (allowed: float32, contiguous channels)")
    if dtype not in TL_DTYPES:
        raise ValueError(f"dtype: {dtype} (allowed: {', '.join(map(str, TL_DTYPES))})")
    tokens, top_k, hidden = slots.shape
    out = torch.empty(tokens, hidden, dtype=dtype, device=slots.device)
    if shared is not None:
        shared = shared.contiguous()
    block_t = block_t or rows_per_program(slots.device)
    block_h = min(OUTPUT_BLOCK, triton.next_power_of_2(hidden))
    if tokens:
        moe_output_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(hidden, block_h))](
            slots,
            shared if shared is not None else out,
            out,
            tokens,
            hidden,
            slots.stride(0),
            slots.stride(1),
            shared.stride(0) if shared is not None else 0,
            out.stride(0),
            TOP_K=top_k,
            SHARED=shared is not None,
            ACT=TL_DTYPES[dtype],
            BLOCK_T=block_t,
            BLOCK_H=block_h,
        )
    return out
