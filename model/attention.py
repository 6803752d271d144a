"""DeepSeek-V4.1 attention arithmetic: projections, sparse attention with a sink, and
the grouped output projection.

Owns what one attention layer computes for a set of query rows, given the keys each
row reads (its own sliding window plus the compressed entries selected for it). Where
those keys come from — a dense sequence (model/reference.py) or paged storage
(model/runtime.py) — is the caller's business; the arithmetic is the same.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.model.epilogue import TORCH_EPILOGUE, Epilogue, EpilogueKernels
from dsv41.model.linalg import batched_matmul, grouped_linear, linear, softmax
from dsv41.model.rope import Rope
from dsv41.model.stored_weights import Weight


@dataclass(frozen=True)
class AttentionWeights:
    wq_a: Weight  # [q_lora, hidden]
    q_norm: torch.Tensor  # [q_lora]
    wq_b: Weight  # [heads * head_dim, q_lora]
    wkv: Weight  # [head_dim, hidden]
    kv_norm: torch.Tensor  # [head_dim]
    wo_a: Weight  # [o_groups * o_lora, heads * head_dim / o_groups]
    wo_b: Weight  # [hidden, o_groups * o_lora]
    attn_sink: torch.Tensor  # [heads] fp32


def query_latent(
    x: torch.Tensor, w: AttentionWeights, eps: float, kernels: EpilogueKernels = TORCH_EPILOGUE
) -> torch.Tensor:
    """q_norm(wq_a(x)) [T, q_lora]: shared by the attention query and the index query."""
    return kernels.epilogue(linear(x, w.wq_a), Epilogue(x.dtype, norm=w.q_norm, eps=eps))


def project_query(
    q_latent: torch.Tensor,
    w: AttentionWeights,
    heads: int,
    rope: Rope,
    positions: torch.Tensor,
    kernels: EpilogueKernels = TORCH_EPILOGUE,
) -> torch.Tensor:
    """rope(wq_b(q_latent)) as [T, heads, head_dim]; V4.1 has no per-head q norm."""
    q = linear(q_latent, w.wq_b).reshape(q_latent.shape[0], heads, -1)
    return kernels.epilogue(q, Epilogue(q.dtype, rope=rope), positions)


def project_window_kv(
    x: torch.Tensor,
    w: AttentionWeights,
    eps: float,
    rope: Rope,
    positions: torch.Tensor,
    kernels: EpilogueKernels = TORCH_EPILOGUE,
) -> torch.Tensor:
    """FP8(rope(kv_norm(wkv(x)))) [T, head_dim] (fp32 up to the rounding, then x's
    dtype): one latent is both key and value."""
    spec = Epilogue(x.dtype, norm=w.kv_norm, eps=eps, rope=rope, round_to="fp8")
    return kernels.epilogue(linear(x, w.wkv), spec, positions)


def sparse_attention(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """Each query row attends over its own key rows.

    q [T, H, D]; keys [T, K, D] (window rows and selected compressed rows, in any
    order, duplicates allowed: the model does not de-duplicate); valid [T, K] bool.
    Softmax in fp32 with one extra zero-value key whose logit is ``sink[h]``.
    Returns [T, H, D] in q's dtype.
    """
    kf = keys.float()
    logits = batched_matmul(q.float(), kf) * softmax_scale  # [T, H, K]: each row's heads . its keys
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink_logits = sink.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    probs = softmax(torch.cat((logits, sink_logits), dim=-1))[..., :-1]
    return batched_matmul(probs, kf.transpose(1, 2)).to(q.dtype)  # [T, H, D]: probs x values


def output_projection(
    o: torch.Tensor,
    w: AttentionWeights,
    o_groups: int,
    rope: Rope,
    positions: torch.Tensor,
    kernels: EpilogueKernels = TORCH_EPILOGUE,
) -> torch.Tensor:
    """Inverse RoPE at the query position, then ``wo_a`` per head group and ``wo_b``."""
    tokens = o.shape[0]
    o = kernels.epilogue(o, Epilogue(o.dtype, rope=rope, inverse=True), positions).reshape(tokens, o_groups, -1)
    return linear(grouped_linear(o, w.wo_a).reshape(tokens, -1), w.wo_b)
