"""The V4.1 mixture of experts: sqrt-softplus routing with a correction bias, clamped
SwiGLU experts and one always-on shared expert (MODEL_FACTS section 5).

Owns routing and expert arithmetic. A row's routed output is the sum of its top-k
slots' weighted expert outputs, added in slot order (``combine_slots``), so it does not
depend on which experts sit in which call or on which rank: ``routed_expert_slots``
gives each (row, slot) the contribution of the experts a rank holds (zero where the
slot's expert is elsewhere), so expert-parallel ranks can exchange whole slots and
combine them in the same order as one rank holding every expert.
The runtime runs the router, the shared expert and the layer's output through
``MoeKernels``: a kernels backend may fuse each step's pointwise work into a launch of
its own, computing this module's function; ``TorchMoe`` is this module's arithmetic
itself (the torch backend's).
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

import torch
import torch.nn.functional as F

from dsv41.model.linalg import linear, ordered_sum, pointwise, small_sum
from dsv41.model.stored_weights import Weight


@dataclass(frozen=True)
class ExpertWeights:
    w1: Weight  # [inter, hidden]
    w2: Weight  # [hidden, inter]
    w3: Weight  # [inter, hidden]


@dataclass(frozen=True)
class MoEWeights:
    gate: torch.Tensor  # [n_experts, hidden] fp32 (check_gate)
    bias: torch.Tensor  # [n_experts] fp32 correction bias (selection only)
    experts: Mapping[int, ExpertWeights]  # the experts this rank holds, by global id
    shared: ExpertWeights | None

    def __post_init__(self) -> None:
        check_gate(self.gate, "MoEWeights.gate")


@dataclass(frozen=True)
class Routing:
    """Each row's top-k experts and their weights, from a router of ``num_experts``
    experts: every id lies in [0, num_experts), so a rank holding that many holds every
    pair's expert."""

    weights: torch.Tensor  # [T, k] fp32, already scaled by routed_scaling_factor
    expert_ids: torch.Tensor  # [T, k] int64
    num_experts: int

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"Routing.num_experts: {self.num_experts} (allowed: >= 1, the router's experts)")


def check_gate(gate: torch.Tensor, name: str = "gate") -> None:
    """Raises unless the router's gate is float32. Its logits are fp32, so every step
    reads the gate in fp32: a layer holds it so from its load (model/weights.py declares
    ``ffn.gate.weight`` held_fp32, the compute dtype's values in float32) instead of
    copying a bf16 gate to fp32 in every call."""
    if gate.dtype != torch.float32:
        raise ValueError(f"{name}: {gate.dtype} (allowed: torch.float32, the router's logits' dtype)")


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float) -> Routing:
    """s = sqrt(softplus(x @ gate^T)) in fp32 (``gate`` float32: check_gate); choose
    top-k of s + bias; weights are s at the chosen experts over their sum, times
    ``scaling``."""
    check_gate(gate)
    scores = torch.sqrt(pointwise(F.softplus, linear(x.float(), gate)))
    chosen = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    picked = torch.gather(scores, 1, chosen)
    weights = picked / (small_sum(picked, -1) + 1e-20) * scaling
    return Routing(weights=weights, expert_ids=chosen, num_experts=gate.shape[0])


def expert_ffn(x: torch.Tensor, w: ExpertWeights, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit)), the routing weight
    applied before w2. Returns fp32."""
    gate = linear(x, w.w1).float().clamp(max=limit)
    up = linear(x, w.w3).float().clamp(-limit, limit)
    h = pointwise(F.silu, gate) * up
    if weight is not None:
        h = h * weight.unsqueeze(-1)
    return linear(h.to(x.dtype), w.w2).float()


def routed_expert_slots(
    x: torch.Tensor, routing: Routing, experts: Mapping[int, ExpertWeights], limit: float
) -> torch.Tensor:
    """Each (row, slot)'s weighted output of its expert [T, k, hidden] fp32, zero where
    the slot's expert is not among ``experts`` (another rank's)."""
    rows_total, top_k = routing.expert_ids.shape
    out = torch.zeros(rows_total, top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for expert_id, w in experts.items():
        rows, slot = torch.nonzero(routing.expert_ids == expert_id, as_tuple=True)
        if rows.numel():
            out[rows, slot] = expert_ffn(x[rows], w, limit, routing.weights[rows, slot])
    return out


def combine_slots(slots: torch.Tensor) -> torch.Tensor:
    """[T, k, hidden] -> [T, hidden]: a row's slots added in slot order."""
    return ordered_sum(slots.unbind(1))


def routed_experts(x: torch.Tensor, routing: Routing, experts: Mapping[int, ExpertWeights], limit: float) -> torch.Tensor:
    """The held experts' routed sum [T, hidden] fp32."""
    return combine_slots(routed_expert_slots(x, routing, experts, limit))


class MoeKernels(Protocol):
    """The layer's steps around the routed experts as a kernels backend runs them. Each
    computes, for every row alone, the function of this module it names."""

    def route(self, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float) -> Routing:
        """``route(x, gate, bias, top_k, scaling)``."""
        ...

    def shared_expert(self, x: torch.Tensor, w: ExpertWeights, limit: float) -> torch.Tensor:
        """``expert_ffn(x, w, limit)``'s values, in fp32 or in x's dtype (its last
        projection comes out in x's dtype; expert_ffn widens it exactly)."""
        ...

    def moe_output(self, slots: torch.Tensor, shared: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """``(combine_slots(slots) + shared).to(dtype)``: ``shared`` [T, hidden] added as
        its fp32 values, or nothing where None."""
        ...


class TorchMoe:
    """``MoeKernels`` as this module's own arithmetic."""

    def route(self, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float) -> Routing:
        return route(x, gate, bias, top_k, scaling)

    def shared_expert(self, x: torch.Tensor, w: ExpertWeights, limit: float) -> torch.Tensor:
        return expert_ffn(x, w, limit)

    def moe_output(self, slots: torch.Tensor, shared: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        out = combine_slots(slots)
        if shared is not None:
            out = out + shared.float()
        return out.to(dtype)


def moe_forward(x: torch.Tensor, w: MoEWeights, top_k: int, scaling: float, limit: float) -> torch.Tensor:
    """The whole layer on one rank that holds every expert; returns x's dtype."""
    routing = route(x, w.gate, w.bias, top_k, scaling)
    out = routed_experts(x, routing, w.experts, limit)
    if w.shared is not None:
        out = out + expert_ffn(x, w.shared, limit)
    return out.to(x.dtype)
