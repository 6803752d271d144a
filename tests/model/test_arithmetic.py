"""Per-concept arithmetic against straightforward formulas (MODEL_FACTS sections 3-5)."""

from __future__ import annotations

import math

import torch

from dsv41.model.attention import sparse_attention
from dsv41.model.config import RopeScaling
from dsv41.model.indexer import EMPTY, candidate_mask, select_topk
from dsv41.model.mhc import HcMix, collapse, expand, first_pre, hc_mix, sinkhorn
from dsv41.model.moe import (
    ExpertWeights,
    MoEWeights,
    combine_slots,
    expert_ffn,
    moe_forward,
    route,
    routed_expert_slots,
    routed_experts,
)
from dsv41.model.norm import rms_norm
from dsv41.model.rope import Rope, rope_inv_freq


def test_sinkhorn_is_doubly_stochastic() -> None:
    """After enough rounds every row and every column of the comb matrix sums to 1
    (columns exactly after the last column step; rows converge with the rounds)."""
    g = torch.Generator().manual_seed(0)
    m = sinkhorn(torch.randn(64, 4, 4, generator=g), iters=20, eps=1e-6)
    assert torch.all(m > 0)
    torch.testing.assert_close(m.sum(-1), torch.ones(64, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(m.sum(-2), torch.ones(64, 4), atol=1e-5, rtol=0)


def test_hc_mix_matches_the_formula() -> None:
    """pre = sigmoid + eps, post = 2 sigmoid, comb = sinkhorn of the last hc*hc logits,
    with logits = base + (flat @ fn^T) * rsqrt(mean(flat^2) + eps) * scale."""
    g = torch.Generator().manual_seed(1)
    hc, hidden, tokens = 4, 8, 3
    streams = torch.randn(tokens, hc, hidden, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * hidden, generator=g) * 0.1
    base = torch.randn((2 + hc) * hc, generator=g)
    scale = torch.tensor([0.5, 0.7, 0.9])
    mix = hc_mix(streams, fn, base, scale, sinkhorn_iters=5, hc_eps=1e-6, norm_eps=1e-20)
    for t in range(tokens):
        flat = streams[t].reshape(-1)
        m = (fn @ flat) / torch.sqrt(flat.pow(2).mean() + 1e-20)
        s = torch.cat([scale[0].repeat(hc), scale[1].repeat(hc), scale[2].repeat(hc * hc)])
        logits = base + m * s
        torch.testing.assert_close(mix.pre[t], torch.sigmoid(logits[:hc]) + 1e-6)
        torch.testing.assert_close(mix.post[t], 2 * torch.sigmoid(logits[hc : 2 * hc]))
        torch.testing.assert_close(mix.comb[t], sinkhorn(logits[2 * hc :].view(hc, hc), 5, 1e-6))


def test_collapse_and_expand_follow_stream_indices() -> None:
    """collapse sums pre-weighted streams; expand writes post[o] * y + sum_i comb[i, o] s_i."""
    g = torch.Generator().manual_seed(2)
    streams = torch.randn(2, 3, 5, generator=g)
    pre = torch.rand(2, 3, generator=g)
    post = torch.rand(2, 3, generator=g)
    comb = torch.rand(2, 3, 3, generator=g)
    y = torch.randn(2, 5, generator=g)
    out = expand(streams, y, HcMix(pre=pre, post=post, comb=comb))
    for t in range(2):
        torch.testing.assert_close(collapse(streams, pre)[t], sum(pre[t, i] * streams[t, i] for i in range(3)))
        for o in range(3):
            want = post[t, o] * y[t] + sum(comb[t, i, o] * streams[t, i] for i in range(3))
            torch.testing.assert_close(out[t, o], want)
    assert torch.equal(collapse(streams, first_pre(2, 3)), streams[:, 0])


def test_rms_norm_formula() -> None:
    """w * x * rsqrt(mean(x^2) + eps), computed in fp32 whatever the input dtype."""
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.rand(16)
    want = (w * x.float() / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-20)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-20), want)


def test_inverse_rope_undoes_rope_and_leaves_nope_channels() -> None:
    """Rotating back at the same position restores x; only the last rope_dim channels move."""
    yarn = RopeScaling(factor=16, original_max_position_embeddings=64, beta_fast=32, beta_slow=1)
    rope = Rope.build(16, 160000.0, yarn)
    x = torch.randn(50, 4, 48, dtype=torch.float64).float()
    pos = torch.arange(50) * 37
    y = rope.apply(x, pos)
    assert torch.equal(y[..., :32], x[..., :32])
    torch.testing.assert_close(rope.apply(y, pos, inverse=True), x, atol=1e-5, rtol=1e-5)


def test_rope_rotates_adjacent_pairs_by_position_times_frequency() -> None:
    """Pair (2i, 2i+1) rotates by pos * inv_freq[i]; dot products depend only on distance."""
    rope = Rope.build(8, 10000.0, None)
    x = torch.randn(1, 8)
    y = rope.apply(x, torch.tensor([5]))
    f = rope_inv_freq(8, 10000.0, None)
    for i in range(4):
        a = 5 * f[i].item()
        e, o = x[0, 2 * i].item(), x[0, 2 * i + 1].item()
        assert math.isclose(y[0, 2 * i].item(), e * math.cos(a) - o * math.sin(a), abs_tol=1e-5)
        assert math.isclose(y[0, 2 * i + 1].item(), e * math.sin(a) + o * math.cos(a), abs_tol=1e-5)
    q, k = torch.randn(1, 8), torch.randn(1, 8)
    d1 = (rope.apply(q, torch.tensor([10])) * rope.apply(k, torch.tensor([3]))).sum()
    d2 = (rope.apply(q, torch.tensor([107])) * rope.apply(k, torch.tensor([100]))).sum()
    assert math.isclose(d1.item(), d2.item(), rel_tol=1e-4)


def test_yarn_frequencies_follow_the_ramp() -> None:
    """freq' = freq / factor * ramp + freq * (1 - ramp) with the facts' low/high bounds."""
    d, theta = 64, 160000.0
    yarn = RopeScaling(factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1)
    got = rope_inv_freq(d, theta, yarn)
    low = max(math.floor(d * math.log(65536 / (32 * 2 * math.pi)) / (2 * math.log(theta))), 0)
    high = min(math.ceil(d * math.log(65536 / (1 * 2 * math.pi)) / (2 * math.log(theta))), d - 1)
    for i in range(d // 2):
        freq = theta ** (-2 * i / d)
        ramp = min(max((i - low) / max(high - low, 1e-3), 0), 1)
        assert math.isclose(got[i].item(), freq / 16 * ramp + freq * (1 - ramp), rel_tol=1e-12)


def test_sparse_attention_matches_explicit_softmax_with_sink() -> None:
    """One extra zero-value key with logit sink[h]; invalid keys carry no weight."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 8, generator=g)
    keys = torch.randn(3, 5, 8, generator=g)
    valid = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    sink = torch.tensor([0.3, -1.0])
    out = sparse_attention(q, keys, valid, sink, 8**-0.5)
    for t in range(3):
        for h in range(2):
            ks = keys[t][valid[t]]
            logits = torch.cat([ks @ q[t, h] * 8**-0.5, sink[h : h + 1]])
            p = torch.softmax(logits, 0)[:-1]
            torch.testing.assert_close(out[t, h], p @ ks)


def _brute_topk(scores: torch.Tensor, k: int) -> list[list[int]]:
    rows = []
    for row in scores.tolist():
        finite = [(s, j) for j, s in enumerate(row) if s != float("-inf")]
        finite.sort(key=lambda p: (-p[0], p[1]))
        chosen = sorted(j for _, j in finite[:k])
        rows.append(chosen + [EMPTY] * (k - len(chosen)))
    return rows


def test_select_topk_is_sorted_deterministic_and_prefers_smaller_positions() -> None:
    """Top-k by score, ties to the smaller position, ascending, -1 padded, -inf never chosen."""
    g = torch.Generator().manual_seed(4)
    scores = torch.randint(0, 4, (20, 30), generator=g).float()
    scores[scores == 0] = float("-inf")
    got = select_topk(scores, torch.arange(30), 8)
    assert got.tolist() == _brute_topk(scores, 8)
    assert select_topk(scores[:, :5], torch.arange(5), 8).tolist() == _brute_topk(scores[:, :5], 8)


def test_candidate_blocks_keep_top_blocks_and_force_the_newest() -> None:
    """Block score = max of its visible entries; the newest visible block is always in."""
    g = torch.Generator().manual_seed(5)
    tokens, entries, block, keep = 12, 24, 4, 2
    scores = torch.randn(tokens, entries, generator=g)
    visible = torch.randint(1, entries + 1, (tokens,), generator=g)
    scores = scores.masked_fill(torch.arange(entries) >= visible.unsqueeze(1), float("-inf"))
    got = candidate_mask(scores, visible, block, keep)
    for t in range(tokens):
        v = int(visible[t])
        nblocks = (v + block - 1) // block
        newest = (v - 1) // block
        block_scores = [max(scores[t, b * block : min((b + 1) * block, v)].tolist()) for b in range(nblocks)]
        others = sorted((b for b in range(nblocks) if b != newest), key=lambda b: (-block_scores[b], b))
        chosen = {newest, *others[: keep - 1]}
        want = [j < v and j // block in chosen for j in range(entries)]
        assert got[t].tolist() == want


def test_routing_sqrtsoftplus_with_bias_for_selection_only() -> None:
    """Experts are chosen by s + bias but weighted by s alone, normalised and scaled."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 16, generator=g)
    gate = torch.randn(8, 16, generator=g)
    bias = torch.randn(8, generator=g)
    r = route(x, gate, bias, 3, 1.5)
    s = torch.sqrt(torch.nn.functional.softplus(x @ gate.t()))
    for t in range(5):
        want = torch.topk(s[t] + bias, 3).indices
        assert r.expert_ids[t].tolist() == want.tolist()
        torch.testing.assert_close(r.weights[t], s[t, want] / s[t, want].sum() * 1.5)


def _expert(g: torch.Generator, hidden: int, inter: int) -> ExpertWeights:
    return ExpertWeights(
        w1=torch.randn(inter, hidden, generator=g), w2=torch.randn(hidden, inter, generator=g),
        w3=torch.randn(inter, hidden, generator=g),
    )


def test_expert_clamps_gate_from_above_and_up_on_both_sides() -> None:
    """w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L)) with the routing weight before w2."""
    g = torch.Generator().manual_seed(7)
    w = _expert(g, 8, 6)
    x = torch.randn(4, 8, generator=g) * 5
    weight = torch.rand(4, generator=g)
    got = expert_ffn(x, w, 2.0, weight)
    want = ((torch.nn.functional.silu((x @ w.w1.t()).clamp(max=2.0)) * (x @ w.w3.t()).clamp(-2.0, 2.0))
            * weight[:, None]) @ w.w2.t()
    torch.testing.assert_close(got, want)


def test_expert_shards_sum_to_the_whole_layer() -> None:
    """Partial sums over disjoint expert sets add up to the full MoE (what EP relies on)."""
    g = torch.Generator().manual_seed(8)
    experts = {e: _expert(g, 16, 8) for e in range(8)}
    w = MoEWeights(gate=torch.randn(8, 16, generator=g), bias=torch.zeros(8), experts=experts, shared=_expert(g, 16, 8))
    x = torch.randn(6, 16, generator=g)
    whole = moe_forward(x, w, 2, 1.0, 10.0)
    r = route(x, w.gate, w.bias, 2, 1.0)
    parts = sum(routed_experts(x, r, {e: experts[e] for e in range(k, 8, 3)}, 10.0) for k in range(3))
    torch.testing.assert_close(parts + expert_ffn(x, w.shared, 10.0), whole)


def test_expert_shards_slots_add_up_exactly() -> None:
    """Slot form: each (row, slot) has one owning shard and zeros elsewhere, so the
    shards' slots sum to the whole layer's bit for bit, and combining them in slot order
    gives exactly routed_experts over every expert (what the batch-invariant EP
    exchange relies on)."""
    g = torch.Generator().manual_seed(9)
    experts = {e: _expert(g, 16, 8) for e in range(8)}
    x = torch.randn(6, 16, generator=g)
    r = route(x, torch.randn(8, 16, generator=g), torch.zeros(8), 3, 1.0)
    shards = [routed_expert_slots(x, r, {e: experts[e] for e in range(k, 8, 3)}, 10.0) for k in range(3)]
    whole = routed_expert_slots(x, r, experts, 10.0)
    assert torch.equal(shards[0] + shards[1] + shards[2], whole)
    assert torch.equal(combine_slots(whole), routed_experts(x, r, experts, 10.0))
