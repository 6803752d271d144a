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
model/reference.py. The routed experts run through the kernels backend too: each
layer's held experts are arranged once into that backend's bank (``ExpertBanks``).

Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import torch

from model.attention import output_projection, project_query, project_window_kv, query_latent
from model.compressor import finish_entries, ratio1_latent, ratio2_projections
from model.config import LayerMode, V41Config
from model.indexer import SelectionState, index_query
from model.kernels.interface import ExpertBank, PagedKernels, PlaneSource
from model.kernels.torch_backend import TorchKernels
from model.linalg import batch_invariant, linear
from model.mhc import final_hidden, first_pre, run_site
from model.moe import ExpertWeights, Routing, combine_slots, expert_ffn, route
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
    """One rank's pools, which the kernels read and write in place (cache/plane_io.PlaneIO
    fits it): the planes, whose formats the kernels' write_rows stores into, and the
    ratio-2 owners' compressor tails."""

    def tail_plane(self, owner: int) -> torch.Tensor:
        """[slots, 2, head_dim] fp32: each slot's pending ratio-2 token's v (0) and g (1)."""
        ...


# The MoE of one layer for the step's rows; the distributed runner replaces it with one
# that joins expert shards across ranks.
MoEFn = Callable[[LayerParams, torch.Tensor], torch.Tensor]


def expert_weight_format(config: V41Config) -> str:
    """How the expert GEMMs read the routed experts: packed MXFP4 when the checkpoint
    stores them as FP4 (the loader decodes them exactly, so the packs are exact), else
    as the params hold them."""
    quantization = config.quantization
    return "mxfp4" if quantization is not None and quantization.expert_dtype == "fp4" else "plain"


class ExpertBanks:
    """Each layer's held routed experts as one kernels backend's bank, made the first
    time the layer runs (the arrangement, e.g. FP4 packing, is done once, not per
    step) and kept. One instance serves one rank's params: a layer id whose experts
    are not the ones its bank was made from is an error."""

    def __init__(self, config: V41Config, kernels: PagedKernels) -> None:
        self.kernels = kernels
        self.weight_format = expert_weight_format(config)
        self.limit = config.swiglu_limit
        self._banks: dict[int, tuple[Mapping[int, ExpertWeights], ExpertBank]] = {}

    def bank(self, layer: LayerParams) -> ExpertBank:
        experts = layer.moe.experts
        made = self._banks.get(layer.layer_id)
        if made is None:
            made = (experts, self.kernels.expert_bank(experts, self.weight_format))
            self._banks[layer.layer_id] = made
        elif made[0] is not experts:
            raise RuntimeError(
                f"layer {layer.layer_id}: its experts are not the ones this ExpertBanks arranged "
                "(one ExpertBanks serves one rank's params)"
            )
        return made[1]

    def slots(self, layer: LayerParams, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The layer's held experts' contribution to each (row, slot) of ``x``: [T, k,
        hidden] fp32 (model/moe.routed_expert_slots)."""
        return self.kernels.routed_expert_slots(x, routing, self.bank(layer), self.limit)


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [len(logit_rows), vocab] fp32
    # Per selecting layer, [R, index_topk] entry ids (EMPTY-padded): for parity tests.
    selections: dict[int, torch.Tensor]


class PagedRuntime:
    """Runs the target model over a step. Stateless between steps: everything a
    request carries lives in the store."""

    def __init__(
        self,
        params: ModelParams,
        moe: MoEFn | None = None,
        kernels: PagedKernels | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.params = params
        self.batch_invariant = batch_invariant
        self.config = params.config
        self.dtype = params.embed.dtype
        self.moe: MoEFn = moe or self._local_moe
        self.kernels: PagedKernels = kernels or TorchKernels()
        self.experts = ExpertBanks(self.config, self.kernels)

    def _local_moe(self, layer: LayerParams, h: torch.Tensor) -> torch.Tensor:
        """model/moe.moe_forward with the routed experts through the kernels."""
        cfg = self.config
        routing = route(h, layer.moe.gate, layer.moe.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        out = combine_slots(self.experts.slots(layer, h, routing))
        if layer.moe.shared is not None:
            out = out + expert_ffn(h, layer.moe.shared, cfg.swiglu_limit)
        return out.to(h.dtype)

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
        tables are); logit_rows: the rows whose next-token logits are wanted. In the
        batch-invariant mode (model/linalg.py) every row's logits are what that row
        gets in any other step."""
        with batch_invariant(self.batch_invariant):
            return self._forward(token_ids, engram_ngrams, plan, store, logit_rows)

    def _forward(
        self,
        token_ids: torch.Tensor,
        engram_ngrams: torch.Tensor,
        plan: StepPlan,
        store: PagedStore,
        logit_rows: torch.Tensor,
    ) -> StepOutput:
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
        return StepOutput(logits=linear(h, self.params.head.float()), selections=state.selections)

    def _compress(self, layer: LayerParams, h: torch.Tensor, plan: CompressionAddresses, store: PagedStore) -> None:
        """Completes every group the step closes, in one call, and writes the owner's
        main and index planes; pending odd tokens go to the STATE tails. Stored values
        are the model's rounded ones exactly: window KV and index keys arrive on their
        grids, and the compressed KV is NVFP4-rounded where it is stored
        (CompressedEntries.kv_unrounded says why)."""
        cfg = self.config
        w = layer.compressor
        owner = layer.layer_id
        if w is None:
            raise RuntimeError(f"layer {owner}: Full layer without compressor weights")
        if plan.ratio == 2:
            v, g = ratio2_projections(h, w)
            pooled = self.kernels.pool_ratio2(v, g, plan, store.tail_plane(owner))
        else:
            pooled = ratio1_latent(h[plan.second_rows], w)
        entries = finish_entries(pooled, w, cfg.rms_norm_eps, layer.rope, plan.entry_positions, self.dtype)
        self.kernels.write_rows(store.main_plane(owner), plan.dst, entries.kv_unrounded, round_to="nvfp4")
        self.kernels.write_rows(store.index_plane(owner), plan.dst, entries.index_keys)

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
        self.kernels.write_rows(store.window_plane(topo.layer_id), win.write_dst, kv[win.write_rows])
        return output_projection(o, layer.attn, cfg.o_groups, layer.rope, positions)
