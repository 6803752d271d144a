"""The dense full-sequence forward of DeepSeek-V4.1: the arithmetic oracle.

Owns nothing but the obvious composition of the arithmetic modules over one whole
sequence: every layer sees every row, compressed entries and selections are computed
densely with masks. Slow and plain on purpose; the paged runtime is tested against it.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.attention import (
    output_projection,
    project_query,
    project_window_kv,
    query_latent,
    sparse_attention,
)
from model.compressor import CompressedEntries, finish_entries, pool_pairs, ratio1_latent, ratio2_projections
from model.config import LayerMode
from model.engram import DEAD, engram_update
from model.indexer import candidate_mask, index_query, index_scores, select_topk, visible_entries
from model.mhc import collapse, expand, first_pre, hc_mix
from model.moe import moe_forward
from model.norm import rms_norm
from model.params import LayerParams, ModelParams


@dataclass(frozen=True)
class ReferenceOutput:
    logits: torch.Tensor  # [T, vocab] fp32
    # Per layer that computes a selection (FULL, REINDEX): [T, index_topk] entry ids, EMPTY-padded.
    selections: dict[int, torch.Tensor] = field(default_factory=dict)


class ReferenceModel:
    """One sequence at a time, in ``params``' compute dtype (fp32 or bf16)."""

    def __init__(self, params: ModelParams) -> None:
        self.params = params
        self.config = params.config
        self.dtype = params.embed.dtype

    @torch.no_grad()
    def forward(self, token_ids: list[int] | torch.Tensor) -> ReferenceOutput:
        cfg = self.config
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError("token_ids: a non-empty 1-D sequence of token ids")
        tokens = ids.numel()
        positions = torch.arange(tokens)
        x = self.params.embed[ids].to(self.dtype)
        streams = x.unsqueeze(1).expand(tokens, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = first_pre(tokens, cfg.hc_mult)
        published: dict[int, CompressedEntries] = {}
        selections: dict[int, torch.Tensor] = {}
        candidates: torch.Tensor | None = None
        for layer in self.params.layers:
            if layer.engram is not None:
                streams = self._engram(layer, ids, streams)
            mix = self._mix(layer.hc_attn, streams)
            h = rms_norm(collapse(streams, pre), layer.attn_norm, cfg.rms_norm_eps, out_dtype=self.dtype)
            y, candidates = self._attention(layer, h, positions, published, selections, candidates)
            streams, pre = expand(streams, y, mix), mix.pre
            mix = self._mix(layer.hc_ffn, streams)
            h = rms_norm(collapse(streams, pre), layer.ffn_norm, cfg.rms_norm_eps, out_dtype=self.dtype)
            y = moe_forward(h, layer.moe, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)
            streams, pre = expand(streams, y, mix), mix.pre
        h = rms_norm(collapse(streams, pre), self.params.norm, cfg.rms_norm_eps, out_dtype=torch.float32)
        logits = h @ self.params.head.float().t()
        return ReferenceOutput(logits=logits, selections=selections)

    def _mix(self, site, streams: torch.Tensor):
        cfg = self.config
        return hc_mix(
            streams,
            site.fn,
            site.base,
            site.scale,
            sinkhorn_iters=cfg.hc_sinkhorn_iters,
            hc_eps=cfg.hc_eps,
            norm_eps=cfg.rms_norm_eps,
        )

    def _engram(self, layer: LayerParams, ids: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        hashing = self.params.engram_hashing
        engram = layer.engram
        assert hashing is not None and engram is not None
        compressed = self.params.token_map[ids]
        history = torch.full((cfg.engram_max_ngram_size - 1,), DEAD, dtype=torch.long)
        rows = hashing.row_ids(layer.layer_id, hashing.ngram_ids(compressed, history))
        embeddings = engram.table.lookup(rows).to(self.dtype)
        return engram_update(streams, embeddings, engram.wkv, engram.q_weight, engram.k_weight, cfg.rms_norm_eps)

    def _compress(self, layer: LayerParams, h: torch.Tensor) -> CompressedEntries:
        cfg = self.config
        w = layer.compressor
        assert w is not None
        if layer.topology.ratio == 2:
            v, g = ratio2_projections(h, w)
            groups = h.shape[0] // 2
            dim = v.shape[-1]
            pooled = pool_pairs(v[: 2 * groups].reshape(groups, 2, dim), g[: 2 * groups].reshape(groups, 2, dim))
            entry_positions = torch.arange(groups) * 2
        else:
            pooled = ratio1_latent(h, w)
            entry_positions = torch.arange(h.shape[0])
        return finish_entries(pooled, w, cfg.rms_norm_eps, layer.rope, entry_positions, self.dtype)

    def _attention(
        self,
        layer: LayerParams,
        h: torch.Tensor,
        positions: torch.Tensor,
        published: dict[int, CompressedEntries],
        selections: dict[int, torch.Tensor],
        candidates: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = self.config
        topo = layer.topology
        q_lat = query_latent(h, layer.attn, cfg.rms_norm_eps)
        q = project_query(q_lat, layer.attn, cfg.num_attention_heads, layer.rope, positions)
        kv = project_window_kv(h, layer.attn, cfg.rms_norm_eps, layer.rope, positions)
        window = positions.unsqueeze(1) - cfg.sliding_window + 1 + torch.arange(cfg.sliding_window)
        keys, valid = kv[window.clamp_min(0)], window >= 0
        if topo.mode is not LayerMode.WINDOW:
            if topo.mode is LayerMode.FULL:
                published[topo.layer_id] = self._compress(layer, h)
            owner = published[topo.kv_owner]
            if topo.mode in (LayerMode.FULL, LayerMode.REINDEX):
                assert layer.indexer is not None
                entry_ids = torch.arange(owner.kv.shape[0])
                iq, iw = index_query(q_lat, h, layer.indexer, cfg.index_n_heads, layer.rope, positions)
                visible = visible_entries(positions, topo.ratio)
                scores = index_scores(iq, iw, owner.index_keys)
                scores = scores.masked_fill(entry_ids.unsqueeze(0) >= visible.unsqueeze(1), float("-inf"))
                if topo.is_candidate_source:
                    candidates = candidate_mask(
                        scores, entry_ids, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks
                    )
                if topo.uses_candidates:
                    assert candidates is not None
                    scores = scores.masked_fill(~candidates, float("-inf"))
                selections[topo.layer_id] = select_topk(scores, entry_ids, cfg.index_topk)
            selected = selections[topo.topk_owner]
            if owner.kv.shape[0]:
                keys = torch.cat((keys, owner.kv[selected.clamp_min(0)]), dim=1)
                valid = torch.cat((valid, selected >= 0), dim=1)
        o = sparse_attention(q, keys, valid, layer.attn.attn_sink, cfg.head_dim**-0.5)
        return output_projection(o, layer.attn, cfg.o_groups, layer.rope, positions), candidates
