"""The V4.1 arithmetic over a step's flat token batch and paged storage (the
ModelRunner contract).

Owns one forward over every row of a step — prefill chunks and decode tokens of many
requests side by side — reading and writing cache state only through addresses it is
given: Q/KV/O projections run over all rows at once; compression takes every group the
batch completes in one call; index scoring reads each request's tile of entry rows;
attention gathers its window rows (this step's rows, or the slot's ring) and its
selected entry rows; the rings are written after attention, so a chunk wider than the
ring still reads every causal prefix. There is no per-request Python loop here.

The step's addresses and the storage are structural protocols below; ``cache/``
provides both (the addresses as plain tensors, the storage with its formats), and
``cluster/`` joins them. The arithmetic is model/'s own modules, shared with
model/reference.py.

Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import torch

from model.attention import output_projection, project_query, project_window_kv, query_latent
from model.compressor import finish_entries, pool_pairs, ratio1_latent, ratio2_projections
from model.config import LayerMode
from model.indexer import SelectionState, index_query
from model.kernels.interface import PagedKernels, PlaneSource
from model.kernels.torch_backend import TorchKernels
from model.mhc import final_hidden, first_pre, run_site
from model.moe import moe_forward
from model.params import LayerParams, ModelParams


class WindowAddresses(Protocol):
    chunk_rows: torch.Tensor  # [R, W]
    ring_rows: torch.Tensor  # [R, W]
    valid: torch.Tensor  # [R, W]
    write_rows: torch.Tensor  # [N]
    write_dst: torch.Tensor  # [N]


class CompressionAddresses(Protocol):
    ratio: int
    first_rows: torch.Tensor
    first_tail_slots: torch.Tensor
    second_rows: torch.Tensor
    entry_positions: torch.Tensor
    dst: torch.Tensor
    tail_write_rows: torch.Tensor
    tail_write_slots: torch.Tensor


class TileAddresses(Protocol):
    ratio: int
    entry_rows: torch.Tensor  # [S, C]
    visible: torch.Tensor  # [R]


class StepPlan(Protocol):
    """What a step tells the forward (cache/addressing.StepAddresses fits it)."""

    positions: torch.Tensor
    row_segments: torch.Tensor
    window: WindowAddresses
    compression: Mapping[int, CompressionAddresses]
    tiles: Mapping[int, TileAddresses]


class PagedStore(PlaneSource, Protocol):
    """One rank's pools: planes in place for the kernels, and format-aware writes
    (cache/plane_io.PlaneIO fits it). What is stored holds the model's rounded values
    exactly."""

    def write_window(self, layer: int, ring_rows: torch.Tensor, kv: torch.Tensor) -> None: ...
    def write_main(self, owner: int, entry_rows: torch.Tensor, kv_unrounded: torch.Tensor) -> None:
        """Stores NVFP4(kv_unrounded): the compressed KV is rounded where it is stored."""
    def write_index(self, owner: int, entry_rows: torch.Tensor, keys: torch.Tensor) -> None: ...
    def read_tail(self, owner: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def write_tail(self, owner: int, slots: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None: ...


# The MoE of one layer for the step's rows; the distributed runner replaces it with one
# that joins expert shards across ranks.
MoEFn = Callable[[LayerParams, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [len(logit_rows), vocab] fp32
    # Per selecting layer, [R, index_topk] entry ids (EMPTY-padded): for parity tests.
    selections: dict[int, torch.Tensor]


class PagedRuntime:
    """Runs the target model over a step. Stateless between steps: everything a
    request carries lives in the store."""

    def __init__(self, params: ModelParams, moe: MoEFn | None = None, kernels: PagedKernels | None = None) -> None:
        self.params = params
        self.config = params.config
        self.dtype = params.embed.dtype
        self.moe: MoEFn = moe or self._local_moe
        self.kernels: PagedKernels = kernels or TorchKernels()

    def _local_moe(self, layer: LayerParams, h: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return moe_forward(h, layer.moe, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,
        engram_ngrams: torch.Tensor,
        plan: StepPlan,
        store: PagedStore,
        logit_rows: torch.Tensor,
    ) -> StepOutput:
        """token_ids [R] (on the weights' device); engram_ngrams [R, max_ngram]
        compressed ids at t, t-1, ... (pad-substituted; on the host, where the Engram
        tables are); logit_rows: the rows whose next-token logits are wanted."""
        cfg = self.config
        rows = token_ids.numel()
        streams = self.params.embed[token_ids].to(self.dtype).unsqueeze(1)
        streams = streams.expand(rows, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = first_pre(rows, cfg.hc_mult, device=token_ids.device)
        state = SelectionState()
        for layer in self.params.layers:
            if layer.engram is not None:
                streams = layer.engram.apply(
                    layer.layer_id, streams, self.params.engram_hashing, engram_ngrams, cfg.rms_norm_eps
                )

            def attention(h: torch.Tensor, layer: LayerParams = layer) -> torch.Tensor:
                return self._attention(layer, h, plan, store, state)

            def moe(h: torch.Tensor, layer: LayerParams = layer) -> torch.Tensor:
                return self.moe(layer, h)

            streams, pre = run_site(streams, pre, layer.hc_attn, layer.attn_norm, attention, cfg)
            streams, pre = run_site(streams, pre, layer.hc_ffn, layer.ffn_norm, moe, cfg)
        h = final_hidden(streams[logit_rows], pre[logit_rows], self.params.norm, cfg.rms_norm_eps)
        return StepOutput(logits=h @ self.params.head.float().t(), selections=state.selections)

    def _compress(self, layer: LayerParams, h: torch.Tensor, plan: CompressionAddresses, store: PagedStore) -> None:
        """Completes every group the step closes, in one call, and writes the owner's
        main and index planes; pending odd tokens go to the STATE tails."""
        cfg = self.config
        w = layer.compressor
        owner = layer.layer_id
        if w is None:
            raise RuntimeError(f"layer {owner}: Full layer without compressor weights")
        if plan.ratio == 2:
            v, g = ratio2_projections(h, w)
            tail_v, tail_g = store.read_tail(owner, plan.first_tail_slots.clamp_min(0))
            from_chunk = (plan.first_rows >= 0).unsqueeze(1)
            first_v = torch.where(from_chunk, v[plan.first_rows.clamp_min(0)], tail_v)
            first_g = torch.where(from_chunk, g[plan.first_rows.clamp_min(0)], tail_g)
            pooled = pool_pairs(
                torch.stack((first_v, v[plan.second_rows]), dim=1), torch.stack((first_g, g[plan.second_rows]), dim=1)
            )
            store.write_tail(owner, plan.tail_write_slots, v[plan.tail_write_rows], g[plan.tail_write_rows])
        else:
            pooled = ratio1_latent(h[plan.second_rows], w)
        entries = finish_entries(pooled, w, cfg.rms_norm_eps, layer.rope, plan.entry_positions, self.dtype)
        store.write_main(owner, plan.dst, entries.kv_unrounded)
        store.write_index(owner, plan.dst, entries.index_keys)

    def _attention(
        self, layer: LayerParams, h: torch.Tensor, plan: StepPlan, store: PagedStore, state: SelectionState
    ) -> torch.Tensor:
        cfg = self.config
        topo = layer.topology
        positions = plan.positions
        win = plan.window
        q_lat = query_latent(h, layer.attn, cfg.rms_norm_eps)
        q = project_query(q_lat, layer.attn, cfg.num_attention_heads, layer.rope, positions)
        kv = project_window_kv(h, layer.attn, cfg.rms_norm_eps, layer.rope, positions)
        entry_rows = None
        main = None
        if topo.mode is not LayerMode.WINDOW:
            tile = plan.tiles[topo.ratio]
            if topo.mode is LayerMode.FULL:
                self._compress(layer, h, plan.compression[topo.ratio], store)
            if layer.indexer is not None:
                iq, iw = index_query(q_lat, h, layer.indexer, cfg.index_n_heads, layer.rope, positions)
                scores = self.kernels.score(
                    iq, iw, tile.entry_rows, plan.row_segments, store.index_plane(topo.index_owner)
                )
                state.select(topo, scores, tile.visible, cfg)
            selected = state.selections[topo.topk_owner]
            row_tiles = tile.entry_rows[plan.row_segments]  # [R, C]
            entry_rows = torch.gather(row_tiles, 1, selected.clamp_min(0)) if row_tiles.shape[1] else selected
            entry_rows = entry_rows.masked_fill(selected < 0, -1)
            main = store.main_plane(topo.kv_owner)
        o = self.kernels.attend(
            q,
            kv,
            win.chunk_rows,
            win.ring_rows,
            win.valid,
            store.window_plane(topo.layer_id),
            entry_rows,
            main,
            layer.attn.attn_sink,
            cfg.head_dim**-0.5,
        )
        store.write_window(topo.layer_id, win.write_dst, kv[win.write_rows])
        return output_projection(o, layer.attn, cfg.o_groups, layer.rope, positions)
