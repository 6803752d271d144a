"""The dense full-sequence forward of DeepSeek-V4.1: the arithmetic oracle.

Owns nothing but the obvious composition of the arithmetic modules over one whole
sequence: every layer sees every row, compressed entries and selections are computed
densely with masks. Slow and plain on purpose; the paged runtime is tested against it.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.attention import output_projection, project_query, project_window_kv, query_latent, sparse_attention
from model.compressor import CompressedEntries, finish_entries, pool_pairs, ratio1_latent, ratio2_projections
from model.config import LayerMode
from model.engram import DEAD
from model.indexer import SelectionState, index_query, index_scores, visible_entries
from model.linalg import batch_invariant, default_batch_invariant, linear
from model.mhc import final_hidden, first_pre, run_site
from model.moe import moe_forward
from model.params import LayerParams, ModelParams


@dataclass(frozen=True)
class ReferenceOutput:
    logits: torch.Tensor  # [T, vocab] fp32
    # Per layer that computes a selection (FULL, REINDEX): [T, index_topk] entry ids, EMPTY-padded.
    selections: dict[int, torch.Tensor] = field(default_factory=dict)
    # Per layer asked for (``capture_layers``): the residual streams entering it
    # [T, hc, hidden] (before its Engram), what the DSpark drafter's features read.
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)


class ReferenceModel:
    """One sequence at a time, in ``params``' compute dtype (fp32 or bf16).
    ``batch_invariant`` (default: on the CPU, as the engine's default there) runs the
    arithmetic in model/linalg.py's batch-invariant mode, the mode a paged run it is
    compared with bit for bit uses."""

    def __init__(self, params: ModelParams, batch_invariant: bool | None = None) -> None:
        self.params = params
        self.config = params.config
        self.dtype = params.embed.dtype
        device = params.embed.device
        self.batch_invariant = default_batch_invariant(device) if batch_invariant is None else batch_invariant

    @torch.no_grad()
    def forward(self, token_ids: list[int] | torch.Tensor, *, capture_layers: tuple[int, ...] = ()) -> ReferenceOutput:
        """The logits of every row; ``capture_layers`` (target layer ids) also returns
        the residual streams entering those layers. Capturing changes nothing else."""
        return self.differentiable_forward(token_ids, capture_layers=capture_layers)

    def differentiable_forward(
        self, token_ids: list[int] | torch.Tensor, *, capture_layers: tuple[int, ...] = ()
    ) -> ReferenceOutput:
        """``forward`` under the caller's grad mode: the same arithmetic, recorded for
        autograd where gradients are on (training the tiny model: model/training.py)."""
        with batch_invariant(self.batch_invariant):
            return self._forward(token_ids, capture_layers)

    def _forward(self, token_ids: list[int] | torch.Tensor, capture_layers: tuple[int, ...]) -> ReferenceOutput:
        cfg = self.config
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError("token_ids: a non-empty 1-D sequence of token ids")
        unknown = sorted(set(capture_layers) - set(range(cfg.num_hidden_layers)))
        if unknown:
            raise ValueError(f"capture_layers: {unknown} (allowed: target layer ids 0..{cfg.num_hidden_layers - 1})")
        tokens = ids.numel()
        device = self.params.embed.device
        positions = torch.arange(tokens, device=device)
        streams = self.params.embed[ids.to(device)].to(self.dtype).unsqueeze(1)
        streams = streams.expand(tokens, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = first_pre(tokens, cfg.hc_mult, device=device)
        ngrams = self._ngrams(ids)
        published: dict[int, CompressedEntries] = {}
        state = SelectionState()
        layer_inputs: dict[int, torch.Tensor] = {}
        for layer in self.params.layers:
            if layer.layer_id in capture_layers:
                layer_inputs[layer.layer_id] = streams
            if layer.engram is not None:
                streams = layer.engram.apply(layer.layer_id, streams, self.params.engram_hashing, ngrams, cfg.rms_norm_eps)

            def attention(h: torch.Tensor, layer: LayerParams = layer) -> torch.Tensor:
                return self._attention(layer, h, positions, published, state)

            def moe(h: torch.Tensor, layer: LayerParams = layer) -> torch.Tensor:
                return moe_forward(h, layer.moe, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)

            streams, pre = run_site(streams, pre, layer.hc_attn, layer.attn_norm, attention, cfg)
            streams, pre = run_site(streams, pre, layer.hc_ffn, layer.ffn_norm, moe, cfg)
        h = final_hidden(streams, pre, self.params.norm, cfg.rms_norm_eps)
        return ReferenceOutput(
            logits=linear(h, self.params.head.float()), selections=state.selections, layer_inputs=layer_inputs
        )

    def _ngrams(self, ids: torch.Tensor) -> torch.Tensor:
        """Each position's compressed n-gram ids, the sequence starting from nothing."""
        hashing = self.params.engram_hashing
        if hashing is None:
            return ids.unsqueeze(1)
        token_map = self.params.token_map
        history = torch.full((hashing.history_size,), DEAD, dtype=torch.long, device=token_map.device)
        return hashing.ngram_ids(token_map[ids.to(token_map.device)], history)

    def _compress(self, layer: LayerParams, h: torch.Tensor) -> CompressedEntries:
        w = layer.compressor
        if w is None:
            raise RuntimeError(f"layer {layer.layer_id}: Full layer without compressor weights")
        if layer.topology.ratio == 2:
            v, g = ratio2_projections(h, w)
            groups, dim = h.shape[0] // 2, v.shape[-1]
            pooled = pool_pairs(v[: 2 * groups].reshape(groups, 2, dim), g[: 2 * groups].reshape(groups, 2, dim))
            entry_positions = torch.arange(groups, device=h.device) * 2
        else:
            pooled = ratio1_latent(h, w)
            entry_positions = torch.arange(h.shape[0], device=h.device)
        return finish_entries(pooled, w, self.config.rms_norm_eps, layer.rope, entry_positions, self.dtype)

    def _attention(
        self,
        layer: LayerParams,
        h: torch.Tensor,
        positions: torch.Tensor,
        published: dict[int, CompressedEntries],
        state: SelectionState,
    ) -> torch.Tensor:
        cfg = self.config
        topo = layer.topology
        q_lat = query_latent(h, layer.attn, cfg.rms_norm_eps)
        q = project_query(q_lat, layer.attn, cfg.num_attention_heads, layer.rope, positions)
        kv = project_window_kv(h, layer.attn, cfg.rms_norm_eps, layer.rope, positions)
        window = positions.unsqueeze(1) - cfg.sliding_window + 1 + torch.arange(cfg.sliding_window, device=positions.device)
        keys, valid = kv[window.clamp_min(0)], window >= 0
        if topo.mode is not LayerMode.WINDOW:
            if topo.mode is LayerMode.FULL:
                published[topo.layer_id] = self._compress(layer, h)
            owner = published[topo.kv_owner]
            if layer.indexer is not None:
                iq, iw = index_query(q_lat, h, layer.indexer, cfg.index_n_heads, layer.rope, positions)
                scores = index_scores(iq, iw, owner.index_keys)
                state.select(topo, scores, visible_entries(positions, topo.ratio), cfg)
            selected = state.selections[topo.topk_owner]
            # Every row reads index_topk entry slots, as a paged step does, empty or
            # not: the attention's reductions then have one length on both sides.
            entries = owner.kv if owner.kv.shape[0] else owner.kv.new_zeros(1, owner.kv.shape[1])
            keys = torch.cat((keys, entries[selected.clamp_min(0)]), dim=1)
            valid = torch.cat((valid, selected >= 0), dim=1)
        o = sparse_attention(q, keys, valid, layer.attn.attn_sink, cfg.head_dim**-0.5)
        return output_projection(o, layer.attn, cfg.o_groups, layer.rope, positions)
