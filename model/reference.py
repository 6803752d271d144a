"""The dense full-sequence forward of DeepSeek-V4.1: the arithmetic oracle.

Owns nothing but the obvious composition of the arithmetic modules over one whole
sequence: every layer sees every row, compressed entries and selections are computed
densely with masks. Slow and plain on purpose; the paged runtime is tested against it.
With ``decoder_replay`` it is the oracle of decoder SWA bounded replay instead
(model/bounded_replay.py): the decoder runs the prompt's tail alone, its windows cut
at the tail, and the last layer's query, attention and FFN run the rows whose logits
are wanted.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.model.attention import output_projection, project_query, project_window_kv, query_latent, sparse_attention
from dsv41.model.bounded_replay import selection_rows, tail_start
from dsv41.model.compressor import CompressedEntries, finish_entries, pool_pairs, ratio1_latent, ratio2_projections
from dsv41.model.config import LayerMode
from dsv41.model.engram import DEAD
from dsv41.model.indexer import SelectionState, index_query, index_scores, visible_entries
from dsv41.model.linalg import batch_invariant, default_batch_invariant, linear
from dsv41.model.mhc import final_hidden, first_pre, run_site, site_input
from dsv41.model.moe import moe_forward
from dsv41.model.params import LayerParams, ModelParams


@dataclass(frozen=True)
class ReferenceOutput:
    """A forward's results. Each layer's rows are positions [first, T): every row (a
    full forward), or under decoder replay the tail for the decoder layers (``first``
    is ``tail_start``) and, for the last layer's selection and the logits, the rows
    from the prompt's last on."""

    logits: torch.Tensor  # [rows, vocab] fp32: every position's, or from the prompt's last on
    # Per layer that computes a selection (FULL, REINDEX): [rows, index_topk] entry ids, EMPTY-padded.
    selections: dict[int, torch.Tensor] = field(default_factory=dict)
    # Per layer asked for (``capture_layers``): the residual streams entering it (before
    # its Engram; the rows it computes), what the DSpark drafter's features read.
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    # Per layer, the window KV of every row it computes one for ([rows, head_dim]): what
    # its sliding-window ring holds after the forward.
    window_kv: dict[int, torch.Tensor] = field(default_factory=dict)
    # Per Full owner, the compressed KV and index keys it published.
    entries: dict[int, CompressedEntries] = field(default_factory=dict)
    tail_start: int = 0  # the first position the decoder computed (0: a full forward)


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
    def forward(
        self,
        token_ids: list[int] | torch.Tensor,
        decoder_replay: bool = False,
        prompt_len: int | None = None,
        *,
        capture_layers: tuple[int, ...] = (),
    ) -> ReferenceOutput:
        """The full forward of ``token_ids``, or with ``decoder_replay`` the bounded
        replay of its first ``prompt_len`` tokens (default: all of them) followed by
        one decode step per further token: the decoder computes the rows from the
        prompt's tail on, and the logits are those of the prompt's last row and every
        row after it. ``capture_layers`` (target layer ids) also returns the residual
        streams entering those layers; capturing changes nothing else."""
        return self.differentiable_forward(token_ids, decoder_replay, prompt_len, capture_layers=capture_layers)

    def differentiable_forward(
        self,
        token_ids: list[int] | torch.Tensor,
        decoder_replay: bool = False,
        prompt_len: int | None = None,
        *,
        capture_layers: tuple[int, ...] = (),
    ) -> ReferenceOutput:
        """``forward`` under the caller's grad mode: the same arithmetic, recorded for
        autograd where gradients are on (training the tiny model: model/training.py)."""
        with batch_invariant(self.batch_invariant):
            return self._forward(token_ids, decoder_replay, prompt_len, capture_layers)

    def _forward(
        self,
        token_ids: list[int] | torch.Tensor,
        decoder_replay: bool,
        prompt_len: int | None,
        capture_layers: tuple[int, ...],
    ) -> ReferenceOutput:
        cfg = self.config
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError("token_ids: a non-empty 1-D sequence of token ids")
        unknown = sorted(set(capture_layers) - set(range(cfg.num_hidden_layers)))
        if unknown:
            raise ValueError(f"capture_layers: {unknown} (allowed: target layer ids 0..{cfg.num_hidden_layers - 1})")
        tokens = ids.numel()
        if prompt_len is not None and not (decoder_replay and 1 <= prompt_len <= tokens):
            raise ValueError(
                f"prompt_len: {prompt_len} (allowed: None, or 1..{tokens} with decoder_replay: a full forward "
                "computes every row)"
            )
        prompt = tokens if prompt_len is None else prompt_len
        tail = tail_start(prompt, cfg.sliding_window) if decoder_replay else 0
        decoder_start = cfg.topology.decoder_start
        last = self.params.layers[-1].layer_id
        device = self.params.embed.device
        positions = torch.arange(tokens, device=device)
        streams = self.params.embed[ids.to(device)].to(self.dtype).unsqueeze(1)
        streams = streams.expand(tokens, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = first_pre(tokens, cfg.hc_mult, device=device)
        ngrams = self._ngrams(ids)
        published: dict[int, CompressedEntries] = {}
        state = SelectionState()
        window_kv: dict[int, torch.Tensor] = {}
        layer_inputs: dict[int, torch.Tensor] = {}
        first = 0
        for layer in self.params.layers:
            replay_source = decoder_replay and layer.layer_id == decoder_start
            if replay_source:
                # The KV source compresses every row's attention input; from here on
                # only the tail runs.
                h_all = site_input(streams, pre, layer.attn_norm, cfg.rms_norm_eps)
                published[layer.layer_id] = self._compress(layer, h_all)
                streams, pre, positions, ngrams = streams[tail:], pre[tail:], positions[tail:], ngrams[tail:]
                first = tail
            if layer.layer_id in capture_layers:
                layer_inputs[layer.layer_id] = streams
            if layer.engram is not None:
                streams = layer.engram.apply(
                    layer.layer_id, streams, self.params.engram_hashing, ngrams, cfg.rms_norm_eps
                )
            if decoder_replay and layer.layer_id == last:
                query_from = prompt - 1 - tail
                streams, pre = self._last_layer(layer, streams, pre, positions, query_from, published, state, window_kv)
                continue

            def attention(
                h: torch.Tensor, layer: LayerParams = layer, positions: torch.Tensor = positions, first: int = first,
                compress: bool = layer.topology.mode is LayerMode.FULL and not replay_source,
            ) -> torch.Tensor:
                if compress:
                    published[layer.layer_id] = self._compress(layer, h)
                kv = project_window_kv(h, layer.attn, cfg.rms_norm_eps, layer.rope, positions)
                window_kv[layer.layer_id] = kv
                return self._attention(layer, h, positions, published, state, kv, first)

            def moe(h: torch.Tensor, layer: LayerParams = layer) -> torch.Tensor:
                return self._moe(layer, h)

            streams, pre = run_site(streams, pre, layer.hc_attn, layer.attn_norm, attention, cfg)
            streams, pre = run_site(streams, pre, layer.hc_ffn, layer.ffn_norm, moe, cfg)
        h = final_hidden(streams, pre, self.params.norm, cfg.rms_norm_eps)
        return ReferenceOutput(
            logits=linear(h, self.params.head.float()),
            selections=state.selections,
            window_kv=window_kv,
            entries=published,
            tail_start=tail,
            layer_inputs=layer_inputs,
        )

    def _moe(self, layer: LayerParams, h: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return moe_forward(h, layer.moe, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)

    def _last_layer(
        self,
        layer: LayerParams,
        streams: torch.Tensor,
        pre: torch.Tensor,
        positions: torch.Tensor,
        query_from: int,
        published: dict[int, CompressedEntries],
        state: SelectionState,
        window_kv: dict[int, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer under decoder replay: window KV on every tail row (what its
        ring keeps), query, attention and FFN on the rows from ``query_from`` on.
        Returns those rows' streams and pre."""
        cfg = self.config
        h_kv = site_input(streams, pre, layer.attn_norm, cfg.rms_norm_eps)
        kv = project_window_kv(h_kv, layer.attn, cfg.rms_norm_eps, layer.rope, positions)
        window_kv[layer.layer_id] = kv
        queries = slice(query_from, None)
        query_state = selection_rows(state, queries)
        first = int(positions[0])

        def attention(h: torch.Tensor) -> torch.Tensor:
            return self._attention(layer, h, positions[queries], published, query_state, kv, first)

        streams, pre = run_site(streams[queries], pre[queries], layer.hc_attn, layer.attn_norm, attention, cfg)
        streams, pre = run_site(streams, pre, layer.hc_ffn, layer.ffn_norm, lambda h: self._moe(layer, h), cfg)
        if layer.layer_id in query_state.selections:
            state.selections[layer.layer_id] = query_state.selections[layer.layer_id]
        return streams, pre

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
        kv: torch.Tensor,
        kv_first: int,
    ) -> torch.Tensor:
        """The attention of the query rows ``h`` at ``positions`` over the window KV
        ``kv`` of positions [kv_first, ...): a window reads nothing below kv_first."""
        cfg = self.config
        topo = layer.topology
        q_lat = query_latent(h, layer.attn, cfg.rms_norm_eps)
        q = project_query(q_lat, layer.attn, cfg.num_attention_heads, layer.rope, positions)
        offsets = torch.arange(cfg.sliding_window, device=positions.device)
        window = positions.unsqueeze(1) - cfg.sliding_window + 1 + offsets
        keys, valid = kv[(window - kv_first).clamp_min(0)], window >= kv_first
        if topo.mode is not LayerMode.WINDOW:
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
