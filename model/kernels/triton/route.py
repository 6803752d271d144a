"""The MoE router (model/moe.py ``route``) as one Triton launch after its projection.

Owns ``route_kernel`` and its launch: from the router logits (model/linalg.linear of
the fp32 rows and gate, the torch path's own call, so its bits) to the routing, one
program per token row (BLOCK_T rows under the interpreter): s = sqrt(softplus(logits)),
the top-k of s + bias, the chosen s over their sum, times the scaling. Unfused that is
about nine torch ops a layer (softplus, sqrt, the bias add, topk, gather, sum, the
epsilon, the division, the scaling), each a launch on a GPU.

The arithmetic follows route's order in float32: softplus is x above torch's threshold
20, else log1p(exp(x)); the square root is IEEE's (``sqrt_rn``); the weights are
(picked / (sum + 1e-20)) * scaling with IEEE division and no multiply-add fusion.
Compiled, exp and log1p are libdevice's expf and log1pf, the functions torch's CUDA
softplus calls (equality with torch on a GPU is not measured); the interpreter cannot
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
A program reads and writes its own rows only and its shape is fixed by the device: a
row's routing does not depend on the other rows of the call.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv41.model.kernels.triton.mhc import rows_per_program
from dsv41.model.linalg import linear
from dsv41.model.moe import Routing

# torch's softplus threshold (beta 1): above it softplus(x) is x.
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)
# The epsilon of route's normalisation.
WEIGHT_EPS = tl.constexpr(1e-20)


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
    logits = tl.load(logits_ptr + t[:, None] * stride_logits + e[None, :], mask=live[:, None] & real[None, :], other=0.0)
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
    logits = linear(x.float(), gate.float()).contiguous()
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
    return Routing(weights=weights, expert_ids=expert_ids)
