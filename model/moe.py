"""The V4.1 mixture of experts: sqrt-softplus routing with a correction bias, clamped
SwiGLU experts and one always-on shared expert (MODEL_FACTS section 5).

Owns routing and expert arithmetic. ``routed_experts`` sums only the experts a rank
holds, so an expert-parallel or tensor-parallel rank returns its partial sum and the
collective that joins ranks adds them; partial sums are fp32 so that the order of
that addition does not change the result beyond fp32 rounding.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertWeights:
    w1: torch.Tensor  # [inter, hidden]
    w2: torch.Tensor  # [hidden, inter]
    w3: torch.Tensor  # [inter, hidden]


@dataclass(frozen=True)
class MoEWeights:
    gate: torch.Tensor  # [n_experts, hidden]
    bias: torch.Tensor  # [n_experts] fp32 correction bias (selection only)
    experts: Mapping[int, ExpertWeights]  # the experts this rank holds, by global id
    shared: ExpertWeights | None


@dataclass(frozen=True)
class Routing:
    weights: torch.Tensor  # [T, k] fp32, already scaled by routed_scaling_factor
    expert_ids: torch.Tensor  # [T, k] int64


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float) -> Routing:
    """s = sqrt(softplus(x @ gate^T)) in fp32; choose top-k of s + bias; weights are
    s at the chosen experts over their sum, times ``scaling``."""
    scores = torch.sqrt(F.softplus(x.float() @ gate.float().t()))
    chosen = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    picked = torch.gather(scores, 1, chosen)
    weights = picked / (picked.sum(-1, keepdim=True) + 1e-20) * scaling
    return Routing(weights=weights, expert_ids=chosen)


def expert_ffn(x: torch.Tensor, w: ExpertWeights, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit)), the routing weight
    applied before w2. Returns fp32."""
    gate = (x @ w.w1.t()).float().clamp(max=limit)
    up = (x @ w.w3.t()).float().clamp(-limit, limit)
    h = F.silu(gate) * up
    if weight is not None:
        h = h * weight.unsqueeze(-1)
    return (h.to(x.dtype) @ w.w2.t()).float()


def routed_experts(x: torch.Tensor, routing: Routing, experts: Mapping[int, ExpertWeights], limit: float) -> torch.Tensor:
    """Sum over the held experts of their weighted outputs [T, hidden] fp32."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert_id, w in experts.items():
        rows, slot = torch.nonzero(routing.expert_ids == expert_id, as_tuple=True)
        if rows.numel():
            out.index_add_(0, rows, expert_ffn(x[rows], w, limit, routing.weights[rows, slot]))
    return out


def moe_forward(x: torch.Tensor, w: MoEWeights, top_k: int, scaling: float, limit: float) -> torch.Tensor:
    """The whole layer on one rank that holds every expert; returns x's dtype."""
    routing = route(x, w.gate, w.bias, top_k, scaling)
    out = routed_experts(x, routing, w.experts, limit)
    if w.shared is not None:
        out = out + expert_ffn(x, w.shared, limit)
    return out.to(x.dtype)
