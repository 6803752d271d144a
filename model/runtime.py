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
So do the mHC site steps and each projection's epilogue (model/epilogue.py: the
RMSNorm, RoPE and rounding after the q, kv, index-query, compressor and before the
output projections), which the dense reference runs as model/'s torch composition.

Under decoder SWA bounded replay (model/bounded_replay.py) a step also names the rows
its decoder runs (``DecoderPlan``): every row runs the encoder and the KV source's
compression, the decoder rows the decoder layers (their windows, ring writes and tiles
are the plan's), and the last layer's query, attention and FFN run on the rows whose
logits are wanted while its window KV covers every decoder row.

Prefill two-batch overlap runs a step as two microbatches of its rows
(``forward_microbatches``): the forward is written as steps (model/microbatch.py)
that yield while a microbatch's MoE collectives are in flight, and the two are
interleaved layer by layer.

Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Protocol, Sequence

import torch

from dsv41.model.attention import output_projection, project_query, project_window_kv, query_latent
from dsv41.model.bounded_replay import selection_rows
from dsv41.model.compressor import finish_entries, ratio1_latent, ratio2_projections
from dsv41.model.config import LayerMode, V41Config
from dsv41.model.indexer import EMPTY, SelectionState, index_query
from dsv41.model.kernels.interface import ExpertBank, PagedKernels, PlaneSource
from dsv41.model.kernels.torch_backend import TorchKernels
from dsv41.model.linalg import batch_invariant, fp8_activations, linear
from dsv41.model.mhc import HcMix, final_hidden, first_pre, open_site, run_site, site_input
from dsv41.model.microbatch import EngramRows, EngramSource, MoESteps, StagedEngramRows, Steps, interleave, run_steps
from dsv41.model.moe import ExpertWeights, Routing
from dsv41.model.params import LayerParams, ModelParams


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
    # A speculative verify's rows that may become pending: staged in the slot's tail
    # row ``staged_tail_rows`` (never the committed row 0) until acceptance commits one.
    staged_rows: torch.Tensor
    staged_slots: torch.Tensor
    staged_tail_rows: torch.Tensor


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


class DecoderPlan(Protocol):
    """Under decoder SWA bounded replay, the step rows the decoder layers run and
    their addresses (cache/addressing.DecoderAddresses fits it)."""

    rows: torch.Tensor  # [D] step rows, ascending
    plan: StepPlan  # over those rows: positions, windows (from each tail's start), ring writes, tiles


@dataclass(frozen=True)
class _RowWindow:
    chunk_rows: torch.Tensor
    ring_rows: torch.Tensor
    valid: torch.Tensor
    write_rows: torch.Tensor
    write_dst: torch.Tensor


@dataclass(frozen=True)
class _RowTile:
    ratio: int
    entry_rows: torch.Tensor
    visible: torch.Tensor


@dataclass(frozen=True)
class _QueryPlan:
    """A stage's plan for a subset of its rows as queries: their positions, segments,
    windows and visible counts, the stage's ring writes (its KV rows are all of the
    stage's). Fits StepPlan (without compression: the subset compresses nothing)."""

    positions: torch.Tensor
    row_segments: torch.Tensor
    window: _RowWindow
    tiles: dict[int, _RowTile]
    compression: dict[int, CompressionAddresses]

    @classmethod
    def of(cls, plan: StepPlan, rows: torch.Tensor) -> "_QueryPlan":
        win = plan.window
        return cls(
            positions=plan.positions[rows],
            row_segments=plan.row_segments[rows],
            window=_RowWindow(
                win.chunk_rows[rows], win.ring_rows[rows], win.valid[rows], win.write_rows, win.write_dst
            ),
            tiles={r: _RowTile(r, tile.entry_rows, tile.visible[rows]) for r, tile in plan.tiles.items()},
            compression={},
        )


class PagedStore(PlaneSource, Protocol):
    """One rank's pools, which the kernels read and write in place (cache/plane_io.PlaneIO
    fits it): the planes, whose formats the kernels' write_rows stores into, and the
    ratio-2 owners' compressor tails."""

    def tail_plane(self, owner: int) -> torch.Tensor:
        """[slots, 2, head_dim] fp32: each slot's pending ratio-2 token's v (0) and g (1)."""
        ...

    def stage_tails(
        self, owner: int, slots: torch.Tensor, rows: torch.Tensor, v: torch.Tensor, g: torch.Tensor
    ) -> None:
        """Stores speculative rows' (v, g) [N, head_dim] in tail rows ``rows`` (>= 1) of ``slots``."""
        ...


# The MoE of one layer for the step's rows; the distributed runner replaces it with one
# that joins expert shards across ranks.
MoEFn = Callable[[LayerParams, torch.Tensor], torch.Tensor]


class LayerSegments(Protocol):
    """What runs each layer's row-by-row parts around its attention, which a forward
    runs itself between them (PagedRuntime's own methods, or the TR_HYBRID graph mode's
    token graphs recording them, cluster/token_graphs.py)."""

    def open_layer(
        self, layer: LayerParams, streams: torch.Tensor, pre: torch.Tensor, table_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, HcMix, torch.Tensor]:
        """PagedRuntime.open_layer's result."""
        ...

    def close_layer(
        self, layer: LayerParams, streams: torch.Tensor, y: torch.Tensor, mix: HcMix, moe: MoESteps | None
    ) -> Steps[tuple[torch.Tensor, torch.Tensor]]:
        """PagedRuntime.close_layer's result."""
        ...

    def pad_layer(self, layer: LayerParams, moe: MoESteps | None) -> Steps[None]:
        """The layer's MoE collectives for a rank none of whose rows reach it (under DP
        attention), as PagedRuntime.pad_layer meets them."""
        ...


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
    # Under decoder replay a decoder layer's rows outside its stage hold EMPTY only.
    selections: dict[int, torch.Tensor]
    # Per layer of ``capture_layers``: the residual streams entering it [rows, hc,
    # hidden] (before its Engram) of the rows it runs: under decoder replay a decoder
    # layer's are the decoder rows' (what the DSpark drafter's features read).
    layer_inputs: dict[int, torch.Tensor]


@dataclass(frozen=True)
class Microbatch:
    """One microbatch of a split step (prefill two-batch overlap): consecutive rows of
    the step, with their own plan over them (positions, slots and PAGEs are the
    rows' own; compression plans and tiles are this microbatch's), the rows of it
    whose logits are wanted, its decoder rows under replay, and its MoE."""

    token_ids: torch.Tensor  # [r]
    plan: StepPlan
    logit_rows: torch.Tensor  # rows of this microbatch
    decoder: DecoderPlan | None
    moe: MoESteps


class PagedRuntime:
    """Runs the target model over a step. Stateless between steps: everything a
    request carries lives in the store."""

    def __init__(
        self,
        params: ModelParams,
        moe: MoEFn | None = None,
        kernels: PagedKernels | None = None,
        batch_invariant: bool = False,
        fp8_activations: bool = False,
    ) -> None:
        self.params = params
        self.batch_invariant = batch_invariant
        self.fp8_activations = fp8_activations
        self.config = params.config
        self.dtype = params.embed.dtype
        self.moe: MoEFn = moe or self._local_moe
        self.kernels: PagedKernels = kernels or TorchKernels()
        self.experts = ExpertBanks(self.config, self.kernels)
        # Engram rows are read where the kernels backend reads them: on the host, or on
        # the weights' device from the host tables mapped for it (the spec's mapped host
        # table storage), so the n-grams are hashed there too.
        self.engram_device = params.embed.device if self.kernels.engram_on_device else torch.device("cpu")
        hashing = params.engram_hashing
        self._engram_hashing = None if hashing is None else hashing.to(self.engram_device)
        if self._engram_hashing is not None and self.kernels.engram_on_device:
            for layer in params.layers:
                if layer.engram is not None:
                    self._map_engram_table(layer)

    @contextmanager
    def arithmetic(self) -> Iterator[None]:
        """The block under this runtime's arithmetic modes (model/linalg.py): the
        batch-invariant mode and the FP8 activations of the FP8-weight projections as
        it was built with. Every forward runs under it, and so must anything recorded
        for one (a graph keeps the kernels chosen while it was recorded)."""
        with batch_invariant(self.batch_invariant), fp8_activations(self.fp8_activations):
            yield

    def _map_engram_table(self, layer: LayerParams) -> None:
        """Makes ``layer``'s Engram table readable by the device's kernels, after
        checking that every row id its hashing gives falls inside it (the device reads
        them unchecked), and reads its first and last rows there against the host."""
        table, layer_id = layer.engram.table, layer.layer_id
        rows = self._engram_hashing.layer_rows(layer_id)
        if table.num_rows != rows:
            raise ValueError(
                f"layer {layer_id} Engram table: {table.num_rows} rows (allowed: {rows}, the sum of the layer's "
                "primes, where its hashing lands)"
            )
        table.map_for(self.engram_device)
        probe = torch.tensor([[0, rows - 1]], dtype=torch.long)
        if not torch.equal(self.kernels.engram_rows(table, probe.to(self.engram_device)).cpu(), table.lookup(probe)):
            raise RuntimeError(
                f"layer {layer_id} Engram table: rows read by {self.engram_device} differ from the host's (its "
                "mapped host memory is not read at the host's addresses)"
            )

    def engram_rows(self, layer: LayerParams, ngrams: torch.Tensor) -> torch.Tensor:
        """Engram ``layer``'s table rows [N, input_dim] (float32, on ``engram_device``)
        of compressed n-grams [N, max_ngram] there: hashed, then read by the kernels."""
        return self.kernels.engram_rows(layer.engram.table, self._engram_hashing.row_ids(layer.layer_id, ngrams))

    def _local_moe(self, layer: LayerParams, h: torch.Tensor) -> torch.Tensor:
        """model/moe.moe_forward with its steps through the kernels (router, routed and
        shared experts, output)."""
        cfg = self.config
        routing = self.kernels.route(
            h, layer.moe.gate, layer.moe.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        )
        slots = self.experts.slots(layer, h, routing)
        moe = layer.moe
        shared = None if moe.shared is None else self.kernels.shared_expert(h, moe.shared, cfg.swiglu_limit)
        return self.kernels.moe_output(slots, shared, h.dtype)

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,
        engram_ngrams: torch.Tensor,
        plan: StepPlan,
        store: PagedStore,
        logit_rows: torch.Tensor,
        decoder: DecoderPlan | None = None,
        capture_layers: tuple[int, ...] = (),
        segments: LayerSegments | None = None,
    ) -> StepOutput:
        """token_ids [R] (on the weights' device); engram_ngrams [R, max_ngram]
        compressed ids at t, t-1, ... (pad-substituted; moved to ``engram_device``);
        logit_rows: the rows whose next-token logits are wanted. In the
        batch-invariant mode (model/linalg.py) every row's logits are what that row
        gets in any other step. ``decoder``: decoder SWA bounded replay's rows (None:
        every row runs every layer); every logit row must be one of them. Every
        layer's MoE is called, in layer order, on the rows that reach it, none
        included: a DP exchange's collectives meet every peer's. ``capture_layers``:
        target layers whose input streams the output carries (``layer_inputs``).
        ``segments``: what runs each layer's row-by-row parts around its attention
        (the TR_HYBRID graph mode's token graphs; None: this runtime, eagerly)."""
        rows = token_ids.numel()
        engram = EngramRows(
            self.engram_rows,
            engram_ngrams.to(self.engram_device),
            self.config.topology.decoder_start,
            None if decoder is None else decoder.rows,
        )
        with self.arithmetic():
            steps = self._steps(
                token_ids, engram, torch.arange(rows), plan, store, logit_rows, decoder, None, capture_layers, segments
            )
            return run_steps(steps)

    @torch.no_grad()
    def forward_staged(
        self, token_ids: torch.Tensor, engram_ngrams: torch.Tensor, plan: StepPlan, store: PagedStore
    ) -> torch.Tensor:
        """The logits [R, vocab] of every row of a step whose every row runs every
        layer, its inputs, Engram n-grams included, already on ``engram_device`` (the
        weights' device where the kernels read Engram there): the forward a decode graph
        captures, with no host work and no host sync. In the batch-invariant mode each
        row's logits are ``forward``'s bits for that row."""
        rows = token_ids.numel()
        logit_rows = torch.arange(rows, device=token_ids.device)
        engram = StagedEngramRows(self.engram_rows, engram_ngrams)
        with self.arithmetic():
            steps = self._steps(token_ids, engram, torch.arange(rows), plan, store, logit_rows, None, None)
            return run_steps(steps).logits

    @torch.no_grad()
    def forward_microbatches(
        self, microbatches: Sequence[Microbatch], engram_ngrams: torch.Tensor, store: PagedStore
    ) -> StepOutput:
        """One step's forward as consecutive microbatches of its rows (prefill
        two-batch overlap), interleaved layer by layer: while one microbatch's MoE
        collectives are in flight the other computes. ``engram_ngrams`` are the whole
        step's rows' (each microbatch reads its slice of one lookup per Engram layer).
        Each microbatch keeps its rows' positions, slots and PAGEs (its plan) and has
        its own compression plans and selection state; a request split across the two
        is two consecutive chunks of it, the second reading the first's rings, tails
        and entries, which the first writes at each layer before the second reaches
        that layer. The output is the step's, rows in step order: in the
        batch-invariant mode the unsplit forward's bits."""
        bases = [0]
        for mb in microbatches:
            bases.append(bases[-1] + mb.token_ids.numel())
        decoder_rows = None
        if any(mb.decoder is not None for mb in microbatches):
            if not all(mb.decoder is not None for mb in microbatches):
                raise ValueError("microbatches: decoder replay on some and not others (allowed: all or none)")
            decoder_rows = torch.cat([base + mb.decoder.rows.cpu() for base, mb in zip(bases, microbatches)])
        engram = EngramRows(
            self.engram_rows,
            engram_ngrams.to(self.engram_device),
            self.config.topology.decoder_start,
            decoder_rows,
            readers=len(microbatches),
        )
        with self.arithmetic():
            outputs = interleave(
                [
                    self._steps(
                        mb.token_ids,
                        engram,
                        torch.arange(base, base + mb.token_ids.numel()),
                        mb.plan,
                        store,
                        mb.logit_rows,
                        mb.decoder,
                        mb.moe,
                    )
                    for base, mb in zip(bases, microbatches)
                ]
            )
        selections = {}
        for layer in sorted({layer for out in outputs for layer in out.selections}):
            parts = []
            for mb, out in zip(microbatches, outputs):
                picked = out.selections.get(layer)
                if picked is None:
                    # A microbatch none of whose rows reached the layer (a decoder
                    # layer under replay): EMPTY, as the unsplit step's spread gives.
                    picked = torch.full((mb.token_ids.numel(), self.config.index_topk), EMPTY, dtype=torch.long)
                parts.append(picked.to(out.logits.device))
            selections[layer] = torch.cat(parts)
        # No layer inputs: a split step never speculates (speculation runs on one rank).
        return StepOutput(logits=torch.cat([out.logits for out in outputs]), selections=selections, layer_inputs={})

    def moe_padding(
        self, layers: Sequence[LayerParams], segments: LayerSegments | None = None, eager_layer: int | None = None
    ) -> None:
        """Each of ``layers``' MoE on zero rows, in order: the side of a DP exchange's
        collectives of a rank whose rows do not reach them. ``segments``: what pads a
        layer (token graphs pad to the step's bucket), but at ``eager_layer`` (the last
        layer under decoder replay, whose MoE runs its query rows eagerly)."""
        run_steps(self._padding_steps(layers, None, segments, eager_layer))

    def pad_layer(self, layer: LayerParams, moe: MoESteps | None) -> Steps[None]:
        """The layer's MoE on zero rows of this rank (``moe``'s steps, else the
        runtime's own)."""
        yield from self._moe_steps(layer, self.params.embed.new_zeros(0, self.config.hidden_size), moe)

    def _padding_steps(
        self,
        layers: Sequence[LayerParams],
        moe: MoESteps | None,
        segments: LayerSegments | None = None,
        eager_layer: int | None = None,
    ) -> Steps[None]:
        for layer in layers:
            pads = self if segments is None or layer.layer_id == eager_layer else segments
            yield from pads.pad_layer(layer, moe)

    def _moe_steps(self, layer: LayerParams, h: torch.Tensor, moe: MoESteps | None) -> Steps[torch.Tensor]:
        """The layer's MoE: ``moe``'s steps (a microbatch's), else the runtime's own
        MoE in one call (no yield)."""
        if moe is None:
            return self.moe(layer, h)
        return (yield from moe(layer, h))

    def _steps(
        self,
        token_ids: torch.Tensor,
        engram: EngramSource,
        engram_rows: torch.Tensor,
        plan: StepPlan,
        store: PagedStore,
        logit_rows: torch.Tensor,
        decoder: DecoderPlan | None,
        moe: MoESteps | None,
        capture_layers: tuple[int, ...] = (),
        segments: LayerSegments | None = None,
    ) -> Steps[StepOutput]:
        """The forward of ``token_ids``' rows (``engram_rows``: theirs in ``engram``),
        yielding while ``moe``'s collectives are in flight (never with ``moe`` None);
        the output carries the input streams of ``capture_layers``. ``segments`` runs
        each layer's row-by-row parts around its attention (None: this runtime's
        own ``open_layer`` and ``close_layer``)."""
        cfg = self.config
        segments = segments or self
        layer_inputs: dict[int, torch.Tensor] = {}
        rows = token_ids.numel()
        streams = self.params.embed[token_ids].to(self.dtype).unsqueeze(1)
        streams = streams.expand(rows, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = first_pre(rows, cfg.hc_mult, device=token_ids.device)
        state = SelectionState()
        stage, out_rows = plan, logit_rows
        queries = None
        if decoder is not None:
            queries = _rows_within(decoder.rows, logit_rows, rows)
            out_rows = torch.arange(queries.numel(), device=logit_rows.device)
        decoder_start = cfg.topology.decoder_start
        last = self.params.layers[-1].layer_id
        for i, layer in enumerate(self.params.layers):
            replay_source = decoder is not None and layer.layer_id == decoder_start
            if replay_source:
                # The KV source compresses every row's attention input; from here on
                # only the decoder rows run.
                h_all = site_input(streams, pre, layer.attn_norm, cfg.rms_norm_eps, self.kernels)
                self._compress(layer, h_all, plan.compression[layer.topology.ratio], store)
                streams, pre = streams[decoder.rows], pre[decoder.rows]
                engram_rows, stage = engram_rows[decoder.rows.cpu()], decoder.plan
                if decoder.rows.numel() == 0:
                    yield from self._padding_steps(self.params.layers[i:], moe, segments, last)
                    layer_inputs.update({lid: streams for lid in capture_layers if lid >= layer.layer_id})
                    break
            if layer.layer_id in capture_layers:
                layer_inputs[layer.layer_id] = streams
            table_rows = None if layer.engram is None else engram.embeddings(layer, engram_rows)
            if queries is not None and layer.layer_id == last:
                if table_rows is not None:
                    streams = layer.engram.update(streams, table_rows, cfg.rms_norm_eps, self.kernels)
                streams, pre = yield from self._last_layer(layer, streams, pre, stage, queries, store, state, moe)
                continue

            def attention(
                h: torch.Tensor,
                layer: LayerParams = layer,
                stage: StepPlan = stage,
                compress: bool = layer.topology.mode is LayerMode.FULL and not replay_source,
            ) -> torch.Tensor:
                if compress:
                    self._compress(layer, h, stage.compression[layer.topology.ratio], store)
                return self._attention(layer, h, stage, store, state)

            streams, mix, h = segments.open_layer(layer, streams, pre, table_rows)
            streams, pre = yield from segments.close_layer(layer, streams, attention(h), mix, moe)
        h = final_hidden(streams[out_rows], pre[out_rows], self.params.norm, cfg.rms_norm_eps, self.kernels)
        selections = state.selections
        if decoder is not None and queries is not None:
            selections = self._step_selections(selections, rows, decoder.rows, queries)
        return StepOutput(logits=linear(h, self.params.head.float()), selections=selections, layer_inputs=layer_inputs)

    def open_layer(
        self, layer: LayerParams, streams: torch.Tensor, pre: torch.Tensor, table_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, HcMix, torch.Tensor]:
        """A layer up to its attention, row by row: the Engram update (``table_rows``:
        the rows' Engram table rows; None at a layer without Engram), then the
        attention site's mix and input. Returns the streams, the mix and the input."""
        if table_rows is not None:
            streams = layer.engram.update(streams, table_rows, self.config.rms_norm_eps, self.kernels)
        mix, h = open_site(streams, pre, layer.hc_attn, layer.attn_norm, self.config, self.kernels)
        return streams, mix, h

    def close_layer(
        self, layer: LayerParams, streams: torch.Tensor, y: torch.Tensor, mix: HcMix, moe: MoESteps | None
    ) -> Steps[tuple[torch.Tensor, torch.Tensor]]:
        """A layer after its attention's output ``y``, row by row: the attention
        site's expand, then the FFN site (its MoE: ``moe``'s steps, else the runtime's
        own). Returns the streams and the FFN site's pre."""
        cfg = self.config
        streams = self.kernels.hc_expand(streams, y, mix)
        ffn_mix, h = open_site(streams, mix.pre, layer.hc_ffn, layer.ffn_norm, cfg, self.kernels)
        out = yield from self._moe_steps(layer, h, moe)
        return self.kernels.hc_expand(streams, out, ffn_mix), ffn_mix.pre

    def _last_layer(
        self,
        layer: LayerParams,
        streams: torch.Tensor,
        pre: torch.Tensor,
        plan: StepPlan,
        queries: torch.Tensor,
        store: PagedStore,
        state: SelectionState,
        moe: MoESteps | None,
    ) -> Steps[tuple[torch.Tensor, torch.Tensor]]:
        """The last layer under decoder replay: window KV (and its ring writes) on the
        stage's rows, query, attention and FFN on ``queries`` (rows of the stage).
        Returns the queries' streams and pre."""
        cfg = self.config
        h_kv = site_input(streams, pre, layer.attn_norm, cfg.rms_norm_eps, self.kernels)
        kv = project_window_kv(h_kv, layer.attn, cfg.rms_norm_eps, layer.rope, plan.positions, self.kernels)
        if queries.numel() == 0:
            # A step whose decoder rows all precede the prompts' last rows: the ring
            # keeps their KV, and nothing reaches the head.
            self._write_window(layer, plan, kv, store)
            yield from self._padding_steps([layer], moe)
            return streams[queries], pre[queries]
        query_plan = _QueryPlan.of(plan, queries)
        query_state = selection_rows(state, queries)

        def attention(h: torch.Tensor) -> torch.Tensor:
            return self._attention(layer, h, query_plan, store, query_state, kv)

        streams, pre = run_site(
            streams[queries], pre[queries], layer.hc_attn, layer.attn_norm, attention, cfg, self.kernels
        )
        mix, h = open_site(streams, pre, layer.hc_ffn, layer.ffn_norm, cfg, self.kernels)
        y = yield from self._moe_steps(layer, h, moe)
        streams, pre = self.kernels.hc_expand(streams, y, mix), mix.pre
        if layer.layer_id in query_state.selections:
            state.selections[layer.layer_id] = query_state.selections[layer.layer_id]
        return streams, pre

    def _step_selections(
        self, selections: dict[int, torch.Tensor], rows: int, decoder_rows: torch.Tensor, queries: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        """Each selection over the step's rows: a decoder layer's (over the decoder
        rows, the last layer's over the queries) spread out, EMPTY elsewhere."""
        decoder_start = self.config.topology.decoder_start
        last = self.params.layers[-1].layer_id
        out = {}
        for layer, picked in selections.items():
            if layer < decoder_start:
                out[layer] = picked
                continue
            where = decoder_rows[queries] if layer == last else decoder_rows
            spread = picked.new_full((rows, picked.shape[1]), EMPTY)
            spread[where] = picked
            out[layer] = spread
        return out

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
            if plan.staged_rows.numel():
                rows = plan.staged_rows
                store.stage_tails(owner, plan.staged_slots, plan.staged_tail_rows, v[rows], g[rows])
        else:
            pooled = ratio1_latent(h[plan.second_rows], w)
        entries = finish_entries(
            pooled, w, cfg.rms_norm_eps, layer.rope, plan.entry_positions, self.dtype, self.kernels
        )
        self.kernels.write_rows(store.main_plane(owner), plan.dst, entries.kv_unrounded, round_to="nvfp4")
        self.kernels.write_rows(store.index_plane(owner), plan.dst, entries.index_keys)

    def _attention(
        self,
        layer: LayerParams,
        h: torch.Tensor,
        plan: StepPlan,
        store: PagedStore,
        state: SelectionState,
        kv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention of ``plan``'s rows (``h``) over their windows and selected
        entries. ``kv``: the window KV of the rows the plan's chunk rows and ring writes
        index, when those are not the query rows themselves (the last layer under
        decoder replay); None: ``h``'s own."""
        cfg = self.config
        topo = layer.topology
        positions = plan.positions
        win = plan.window
        q_lat = query_latent(h, layer.attn, cfg.rms_norm_eps, self.kernels)
        q = project_query(q_lat, layer.attn, cfg.num_attention_heads, layer.rope, positions, self.kernels)
        if kv is None:
            kv = project_window_kv(h, layer.attn, cfg.rms_norm_eps, layer.rope, positions, self.kernels)
        entry_rows = None
        main = None
        if topo.mode is not LayerMode.WINDOW:
            tile = plan.tiles[topo.ratio]
            if layer.indexer is not None:
                iq, iw = index_query(q_lat, h, layer.indexer, cfg.index_n_heads, layer.rope, positions, self.kernels)
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
        self._write_window(layer, plan, kv, store)
        return output_projection(o, layer.attn, cfg.o_groups, layer.rope, positions, self.kernels)

    def _write_window(self, layer: LayerParams, plan: StepPlan, kv: torch.Tensor, store: PagedStore) -> None:
        """Stores the plan's ring writes of the layer's window KV (after its attention
        has read the ring)."""
        self.kernels.write_rows(store.window_plane(layer.layer_id), plan.window.write_dst, kv[plan.window.write_rows])


def _rows_within(rows: torch.Tensor, subset: torch.Tensor, total: int) -> torch.Tensor:
    """Where each of ``subset`` (rows of the step) is in ``rows``; an error if one is not."""
    where = torch.full((total,), -1, dtype=torch.long, device=rows.device)
    where[rows] = torch.arange(rows.numel(), device=rows.device)
    found = where[subset]
    if bool((found < 0).any()):
        raise RuntimeError("logit_rows: a row the decoder does not run (only decoder rows reach the LM head)")
    return found
