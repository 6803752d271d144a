"""The ModelRunner: one rank's execution of a step.

Owns the rank's pools and what happens to them around a forward: readying slots
(reset with an Engram history, or a checkpoint image restored), the step's addresses
(cache/addressing), the Engram n-grams of every row from the slots' cursors, the
forward (model/runtime), sampling, advancing each slot's cursor after the forward
(position and Engram history), storing checkpoint images at PAGE boundaries, and the
offload traffic its segments name: fetched PAGEs and images written before anything
else of the step, completed ones published after the forward; and what it keeps of
its requests between steps (``requests``, a PersistentBatch: their sampling data and
PAGE tables, updated from each batch's deltas before anything else, the step's page
tables a gather of its rows: cluster/persistent_batch.py). Under decoder SWA
bounded replay it also derives, from each segment, the rows its decoder runs
(``decoder_view``; model/bounded_replay.py states the rule). With speculation
(cluster/speculative.py) a verify segment's rows are all sampled, only its accepted
prefix advances the cursor, and every sampling segment gets its next drafts. A step is
launched (``launch``: a decode graph's draws left in flight) and its result taken when
wanted; under async scheduling each launch's draws stay in the token feed on the
device, where the next step's placeholder rows read them.

Must not import: actors, deploy, ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dsv41.cache.addressing import (
    DecodeWidth,
    DecoderAddresses,
    PoolShape,
    SegmentSpec,
    StepAddresses,
    build_decoder_addresses,
    build_step_addresses,
)
from dsv41.cache.checkpoints import Checkpoints
from dsv41.cache.geometry import CURSOR_POSITION, V41PoolGeometry
from dsv41.cache.plane_io import PlaneIO
from dsv41.cache.pools import PoolSize, V41Pools
from dsv41.cluster.batch import ScheduledBatch, ScheduledSegment
from dsv41.cluster.cuda_graphs import DecodeBuckets, DecodeGraphs, DeviceStepState
from dsv41.cluster.offload_connector import OffloadConnector
from dsv41.cluster.persistent_batch import PersistentBatch
from dsv41.cluster.sampler import PendingSamples, Sampler, SamplingMetadata
from dsv41.cluster.speculative import DraftRequest, Speculator, accepted_count
from dsv41.cluster.token_graphs import TokenGraphs
from dsv41.model.bounded_replay import tail_start
from dsv41.model.device import move_tensors
from dsv41.model.kernels.interface import PagedKernels
from dsv41.model.linalg import cpu_threads
from dsv41.model.microbatch import MoESteps
from dsv41.model.params import LayerParams, ModelParams
from dsv41.model.runtime import Microbatch, PagedRuntime


class DecoderReplayError(RuntimeError):
    """A segment decoder SWA bounded replay cannot run: the decoder rows it needs
    below its first row were never computed."""


def decoder_view(seg: ScheduledSegment, window: int) -> tuple[int, int]:
    """Under decoder SWA bounded replay, (the first position of ``seg`` whose rows run
    the decoder, the first position the decoder's windows may read there).

    The decoder runs a prompt's tail (model/bounded_replay.py) and every row after
    it, each row in whichever forward computes it, its windows never reaching below
    the tail: a chunk ending before the tail runs no decoder row, one reaching past it
    the rows from there, reading the decoder rows its request's earlier forwards
    wrote. A segment that wants its rows' logits (prompt logprobs, parity checks)
    runs the full prefill instead: every row. A slot just reset or restored holds no
    decoder row of the request: its forward must start at or before the tail (the
    scheduler resumes no image above it).
    """
    if seg.want_prompt_logits:
        return seg.start, seg.window_start
    tail = tail_start(seg.num_prompt_tokens, window)
    first = max(seg.start, tail)
    if first >= seg.end:
        return seg.end, seg.window_start
    if first > tail and (seg.reset is not None or seg.restore is not None):
        raise DecoderReplayError(
            f"request {seg.request_id}: its forward from {seg.start} needs the decoder rows of positions "
            f"[{tail}, {seg.start}) (decoder bounded replay runs the prompt's last {window} rows), which no forward "
            "of its slot computed: the scheduler must start the forward at or before the tail"
        )
    return first, max(seg.window_start, tail)


def stage_rows(batch: ScheduledBatch, window: int) -> tuple[int, int]:
    """(decoder rows, rows reaching the LM head) of a step under decoder SWA bounded
    replay: what its MoE runs from the decoder's first layer on, and at the last
    layer."""
    decoder = sum(seg.end - decoder_view(seg, window)[0] for seg in batch.segments)
    return decoder, ModelRunner.logit_rows(batch.segments)[0].numel()


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None


@dataclass(frozen=True)
class StepResult:
    step_id: int
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # Logits of every row of segments that asked (prompt logprobs, parity checks),
    # and those rows' top-k selections per selecting layer.
    row_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    row_selections: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    # Speculation: the drafts a verify accepted (emitted before ``sampled``, the
    # target's token after them), and each sampling request's drafts for its next step.
    accepted: dict[str, tuple[SampledToken, ...]] = field(default_factory=dict)
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)


class LaunchedStep:
    """A step whose forward and draws are issued on the device: ``result`` waits for
    its draws to reach the host and returns its StepResult (computed once)."""

    def __init__(self, finish: Callable[[], StepResult]) -> None:
        self._finish: Callable[[], StepResult] | None = finish
        self._result: StepResult | None = None

    @classmethod
    def done(cls, result: StepResult) -> "LaunchedStep":
        step = cls(lambda: result)
        step.result()
        return step

    def result(self) -> StepResult:
        if self._result is None:
            if self._finish is None:
                raise RuntimeError("a launched step's result failed before; it has none")
            finish, self._finish = self._finish, None
            self._result = finish()
        return self._result


class ModelRunner:
    """Runs steps over its own pools; of its requests it holds their STATE slots and
    what its PersistentBatch keeps (``requests``)."""

    def __init__(
        self,
        params: ModelParams,
        geometry: V41PoolGeometry,
        size: PoolSize,
        *,
        device: torch.device | str = "cpu",
        moe: Callable[[LayerParams, torch.Tensor], torch.Tensor] | None = None,
        kernels: PagedKernels | None = None,
        offload: OffloadConnector | None = None,
        batch_invariant: bool = False,
        fp8_activations: bool = False,
        decoder_replay: bool = False,
        decode_graphs: DecodeBuckets | None = None,
        begin_decode_width: Callable[[DecodeWidth], None] | None = None,
        token_graphs: Sequence[int] | None = None,
        begin_token_rows: Callable[[int], None] | None = None,
        feed_samples: bool = False,
    ) -> None:
        config = params.config
        self.decoder_replay = decoder_replay
        self.offload = offload
        self.params = params
        self.geometry = geometry
        self.pools = V41Pools(geometry, size, device)
        self.store = PlaneIO(self.pools)
        self.checkpoints = Checkpoints(self.pools)
        self.requests = PersistentBatch(size.num_slots)
        cpu_threads(batch_invariant, device)
        self.runtime = PagedRuntime(
            params, moe=moe, kernels=kernels, batch_invariant=batch_invariant, fp8_activations=fp8_activations
        )
        self.sampler = Sampler(config.vocab_size)
        self.eos_token_id = config.eos_token_id
        self.shape = PoolShape.of(geometry, config.sliding_window)
        self.hashing = params.engram_hashing
        self.history_len = config.engram_max_ngram_size - 1
        # Each slot's committed position as the host last set it (what a step's segments
        # are checked against without reading the device's cursors).
        self._positions = [0] * size.num_slots
        # Async scheduling: each step's draws stay on the device (the token feed, one
        # row per sampling segment) for the next step's rows the host cannot fill yet.
        self.feed_samples = feed_samples
        self._feed = torch.zeros(max(size.num_slots, 1), dtype=torch.long, device=self.pools.device)
        self._feed_rows: dict[str, int] = {}
        self._last: LaunchedStep | None = None
        self.speculator = None
        if geometry.num_speculative_tokens:
            self.speculator = Speculator(
                params,
                self.runtime.kernels,
                self.store,
                self.shape,
                geometry.num_speculative_tokens,
                batch_invariant,
            )
        # FULL graph mode: every bucket's decode step captured now (on a CUDA device;
        # elsewhere the same static steps run eagerly).
        self.graphs = None
        if feed_samples and self.speculator is not None:
            raise ValueError("feed_samples: with speculation (allowed: without a speculator)")
        if decode_graphs is not None:
            if self.speculator is not None:
                raise ValueError("decode_graphs: with speculation (allowed: decode graphs without a speculator)")
            device = self.pools.device
            state = DeviceStepState(
                cursor=self.pools.cursor,
                token_map=params.token_map.to(device),
                feed=self._feed,
                hashing=params.engram_hashing,
            )
            self.graphs = DecodeGraphs(
                self.runtime,
                self.store,
                self.shape,
                decode_graphs,
                device,
                state,
                capture=device.type == "cuda",
                begin_width=begin_decode_width,
            )
            self.graphs.capture_all()
        # TR_HYBRID mode: every layer's token-wise parts recorded per row bucket now
        # (on a CUDA device; elsewhere run eagerly on the buckets' buffers).
        self.token_graphs = None
        if token_graphs is not None:
            if self.speculator is not None:
                raise ValueError("token_graphs: with speculation (allowed: token graphs without a speculator)")
            device = self.pools.device
            self.token_graphs = TokenGraphs(
                self.runtime, token_graphs, device, capture=device.type == "cuda", begin_rows=begin_token_rows
            )
            self.token_graphs.capture_all()

    def execute(
        self,
        batch: ScheduledBatch,
        microbatches: Sequence[tuple[ScheduledBatch, MoESteps]] = (),
        width: DecodeWidth | None = None,
    ) -> StepResult:
        """Runs ``batch`` to its result (``launch``, then its result)."""
        return self.launch(batch, microbatches, width).result()

    def launch(
        self,
        batch: ScheduledBatch,
        microbatches: Sequence[tuple[ScheduledBatch, MoESteps]] = (),
        width: DecodeWidth | None = None,
    ) -> LaunchedStep:
        """Issues ``batch``; with ``microbatches`` (prefill two-batch overlap: its rows
        cut in consecutive parts, cluster/tbo.split_batch, each with its MoE) its
        forward runs as those parts interleaved, everything around it as one step; with
        ``width`` (a plain decode, ``decode_width``'s or, under DP attention, the width
        every rank agreed on) its forward is that decode graph's replay, and the step
        is handed back with its draws still on their way to the host: nothing here
        waits for the device. Any other step runs to its result first. A row whose
        token is a placeholder reads the previous launch's draw: a graph on the device
        (the token feed), an eager step once that launch's result is in."""
        self.requests.update(batch)
        if batch.is_empty:
            # No draw is pending once a step has no rows: keep nothing of the requests.
            self._last, self._feed_rows = None, {}
            return LaunchedStep.done(StepResult(step_id=batch.step_id))
        if width is not None:
            if microbatches:
                raise ValueError(f"width: {width} with microbatches (allowed: a decode graph runs unsplit)")
            step = self._launch_decode_graph(batch, width)
        else:
            segments = self._with_known_tokens(batch.segments)
            step = LaunchedStep.done(self._run_eager(batch.step_id, segments, microbatches))
        if self.feed_samples:
            self._last = step
        return step

    def _run_eager(
        self,
        step_id: int,
        segments: tuple[ScheduledSegment, ...],
        microbatches: Sequence[tuple[ScheduledBatch, MoESteps]],
    ) -> StepResult:
        # Fills first: a segment later in the batch may restore or read what an
        # earlier one fetched.
        for seg in segments:
            for fill in seg.fetch:
                self.pools.write_pages(fill.pages, self._connector().fetch(fill.handle))
        for seg in segments:
            self._ready_slot(seg)
        tokens = torch.tensor([t for seg in segments for t in seg.token_ids], dtype=torch.long)
        # Engram n-grams are host work (the tables are on the host); the rest runs on
        # the pools' device.
        compressed = self.params.token_map[tokens]
        cursors = self._committed_cursors(segments)
        histories = cursors[:, CURSOR_POSITION + 1 :]
        if self.speculator is None and any(s.num_draft_tokens for s in segments):
            raise RuntimeError("a segment carries drafts, but this rank does not speculate (num_speculative_tokens 0)")
        logit_rows, logit_ranges, sample_rows = self.logit_rows(segments)
        device = self.pools.device
        ngrams = self._ngrams(segments, compressed, histories)
        decoder = None
        if not microbatches:
            addresses, decoder = self._plan(segments)
            output = self.runtime.forward(
                tokens.to(device),
                ngrams,
                addresses,
                self.store,
                logit_rows.to(device),
                decoder=decoder,
                capture_layers=() if self.speculator is None else self.speculator.capture_layers,
                segments=self.token_graphs,
            )
        else:
            # Never with a speculator: speculation runs on one rank, TBO on several
            # (options.check_replica_options).
            parts = []
            for part, moe in microbatches:
                plan, part_decoder = self._plan(part.segments)
                part_tokens = torch.tensor([t for seg in part.segments for t in seg.token_ids], dtype=torch.long)
                part_rows = self.logit_rows(part.segments)[0]
                parts.append(Microbatch(part_tokens.to(device), plan, part_rows.to(device), part_decoder, moe))
            output = self.runtime.forward_microbatches(parts, ngrams, self.store)
        drawn = self._drawn(*self._launch_sampling(segments, output.logits[sample_rows]))
        accepted, sampled, committed = self._verify(segments, drawn)
        self._advance_cursors(segments, compressed, cursors, committed)
        drafts_next: dict[str, tuple[int, ...]] = {}
        if self.speculator is not None:
            stage = addresses if decoder is None else decoder.plan
            drafts_next = self._speculate(
                self.speculator, segments, output.layer_inputs, stage, committed, accepted, sampled
            )
        self._store_and_publish(segments)
        row_logits = {rid: output.logits[a:b].cpu() for rid, (a, b) in logit_ranges.items()}
        row_selections = {}
        base = 0
        for seg in segments:
            if seg.want_prompt_logits:
                row_selections[seg.request_id] = {
                    layer: picked[base : base + seg.length].cpu() for layer, picked in output.selections.items()
                }
            base += seg.length
        return StepResult(
            step_id=step_id,
            sampled=sampled,
            row_logits=row_logits,
            row_selections=row_selections,
            accepted={rid: tokens for rid, tokens in accepted.items() if tokens},
            drafts=drafts_next,
        )

    def _launch_decode_graph(self, batch: ScheduledBatch, width: DecodeWidth) -> LaunchedStep:
        """A plain decode step replayed from the graph of ``width``: staged (token
        ids, token-feed rows, addresses: one copy), replayed, its draws issued; the
        graph advances the cursors itself. Its result waits for the draws."""
        if self.graphs is None:
            raise ValueError(f"width: {width} on a runner without decode graphs (allowed: None)")
        segments = batch.segments
        if not all(seg.is_plain_decode for seg in segments):
            raise ValueError(f"width: {width} for step {batch.step_id}, which is not a plain decode (allowed: None)")
        self._check_positions(segments)
        feed_rows = torch.tensor([self._feed_row(seg) for seg in segments], dtype=torch.long)
        tokens = torch.tensor([0 if seg.has_placeholder else seg.token_ids[0] for seg in segments], dtype=torch.long)
        page_tables = self.requests.page_tables(segments, self.shape.block_size)
        logits = self.graphs.run(width, tokens, feed_rows, self._specs(segments), page_tables)
        per_row, pending = self._launch_sampling(segments, logits)
        for seg in segments:
            self._positions[seg.slot] = seg.end
        self._store_and_publish(segments)

        def finish() -> StepResult:
            _, sampled, _ = self._verify(segments, self._drawn(per_row, pending))
            return StepResult(step_id=batch.step_id, sampled=sampled)

        return LaunchedStep(finish)

    def _store_and_publish(self, segments: tuple[ScheduledSegment, ...]) -> None:
        """After a forward: the checkpoint images its segments store, then the PAGEs
        and images they publish to the offload store."""
        for seg in segments:
            if seg.store_after is not None:
                self.checkpoints.store(seg.slot, seg.store_after)
        for seg in segments:
            for unit in seg.publish:
                self._connector().publish(unit.key, self.pools.read_pages(unit.pages))

    def _feed_row(self, seg: ScheduledSegment) -> int:
        """The token-feed row a graph reads ``seg``'s token from (-1: its token is
        staged)."""
        if not seg.has_placeholder:
            return -1
        if not self.feed_samples:
            raise RuntimeError(f"request {seg.request_id}: a placeholder token on a rank that does not feed its draws")
        row = self._feed_rows.get(seg.request_id)
        if row is None:
            raise RuntimeError(f"request {seg.request_id}: a placeholder token, but the previous step drew none for it")
        return row

    def _with_known_tokens(self, segments: tuple[ScheduledSegment, ...]) -> tuple[ScheduledSegment, ...]:
        """``segments`` with each placeholder replaced by the previous launch's draw
        (waiting for its result: an eager step's Engram n-grams are host work)."""
        if not any(seg.has_placeholder for seg in segments):
            return segments
        if not self.feed_samples or self._last is None:
            raise RuntimeError("a placeholder token with no launched step before it on this rank")
        sampled = self._last.result().sampled
        resolved = []
        for seg in segments:
            if seg.has_placeholder:
                if seg.request_id not in sampled:
                    raise RuntimeError(f"request {seg.request_id}: a placeholder token, but the previous step drew none for it")
                seg = dataclasses.replace(seg, token_ids=(sampled[seg.request_id].token_id,))
            resolved.append(seg)
        return tuple(resolved)

    @torch.no_grad()
    def execute_padding(self, batch: ScheduledBatch, width: DecodeWidth | None = None) -> StepResult:
        """An idle DP rank's step (``batch`` has no segments): its releases applied,
        then every layer's MoE runs on zero rows, in the forward's layer order, so the
        collectives of the rank's exchange meet every peer; with ``width`` (the decode
        graph every rank of the step replays) that graph's replay on padding rows
        alone. No PAGE or STATE is read or written."""
        if not batch.is_empty:
            raise ValueError(f"execute_padding: step {batch.step_id} has {len(batch.segments)} segments (allowed: none)")
        self.requests.update(batch)
        if width is not None:
            if self.graphs is None:
                raise ValueError(f"width: {width} on a runner without decode graphs (allowed: None)")
            self.graphs.run_padding(width)
            return StepResult(step_id=batch.step_id)
        # Under decoder replay the last layer's MoE runs its query rows eagerly.
        eager_layer = self.params.layers[-1].layer_id if self.decoder_replay else None
        with self.runtime.arithmetic():
            self.runtime.moe_padding(self.params.layers, self.token_graphs, eager_layer)
        return StepResult(step_id=batch.step_id)

    # -- around the forward -------------------------------------------------------------

    @staticmethod
    def _verify(
        segments: tuple[ScheduledSegment, ...], drawn: dict[str, tuple[SampledToken, ...]]
    ) -> tuple[dict[str, tuple[SampledToken, ...]], dict[str, SampledToken], dict[str, int]]:
        """Each sampling segment's accepted drafts (a verify's: those equal to the
        tokens drawn at the rows before them) and the token drawn after them; and every
        segment's committed rows (a verify: its anchor and accepted drafts)."""
        accepted: dict[str, tuple[SampledToken, ...]] = {}
        sampled: dict[str, SampledToken] = {}
        committed = {seg.request_id: seg.length for seg in segments}
        for seg in segments:
            if not seg.sample:
                continue
            tokens = drawn[seg.request_id]
            drafts = seg.token_ids[seg.length - seg.num_draft_tokens :] if seg.num_draft_tokens else ()
            count = accepted_count(drafts, [t.token_id for t in tokens])
            accepted[seg.request_id], sampled[seg.request_id] = tokens[:count], tokens[count]
            committed[seg.request_id] = seg.length - seg.num_draft_tokens + count
        return accepted, sampled, committed

    def _speculate(
        self,
        speculator: Speculator,
        segments: tuple[ScheduledSegment, ...],
        layer_inputs: dict[int, torch.Tensor],
        stage: StepAddresses,
        committed: dict[str, int],
        accepted: dict[str, tuple[SampledToken, ...]],
        sampled: dict[str, SampledToken],
    ) -> dict[str, tuple[int, ...]]:
        """After a speculating forward: the drafter's rings from its rows (the
        decoder's, under decoder replay), each verify's staged tail committed, and a
        block drafted after every sampling request that has tokens left to generate."""
        speculator.write_context(layer_inputs, stage)
        wanted = []
        for seg in segments:
            if not seg.sample:
                continue
            end = seg.start + committed[seg.request_id]
            if seg.num_draft_tokens:
                speculator.commit_tail(seg.slot, seg.start, end)
            emitted = len(accepted[seg.request_id]) + 1
            if self.requests.data(seg.request_id).params.max_tokens - seg.output_index - emitted <= 1:
                continue
            window_start = decoder_view(seg, self.shape.window)[1] if self.decoder_replay else seg.window_start
            wanted.append(
                DraftRequest(seg.request_id, seg.slot, sampled[seg.request_id].token_id, end - 1, window_start)
            )
        return speculator.draft(wanted)

    def decode_width(self, segments: Sequence[ScheduledSegment]) -> DecodeWidth | None:
        """The decode graph a step of ``segments`` replays: its bucket's width; None
        when the replica has no graphs, a segment is not a plain decode
        (``ScheduledSegment.is_plain_decode``), or no bucket holds it. Every row of such
        a step runs every layer with its whole window, also under decoder replay (a
        decode row's window starts past its prompt's tail)."""
        if self.graphs is None or not segments or not all(seg.is_plain_decode for seg in segments):
            return None
        return self.graphs.width_for(self._specs(tuple(segments)))

    @staticmethod
    def _specs(segments: tuple[ScheduledSegment, ...]) -> list[SegmentSpec]:
        return [
            SegmentSpec(s.slot, s.start, s.length, s.write_from, s.window_start, s.num_draft_tokens) for s in segments
        ]

    def _plan(self, segments: tuple[ScheduledSegment, ...]) -> tuple[StepAddresses, DecoderAddresses | None]:
        """The forward's addresses of ``segments`` on the pools' device, and under
        decoder replay its decoder rows'."""
        specs = self._specs(segments)
        page_tables = self.requests.page_tables(segments, self.shape.block_size)
        device = self.pools.device
        # On a GPU the window's [rows, window] addresses are expanded there: numpy
        # took 8-11 ms of host time for a 4,096-token prefill at window 128 (CPU box,
        # bench.step_plan).
        expand_on = None if device.type == "cpu" else device
        plan = move_tensors(build_step_addresses(specs, page_tables, self.shape, device=expand_on), device)
        if not self.decoder_replay:
            return plan, None
        return plan, move_tensors(self._decoder_addresses(segments, specs, page_tables), device)

    def _decoder_addresses(
        self, segments: tuple[ScheduledSegment, ...], specs: list[SegmentSpec], page_tables: torch.Tensor
    ) -> DecoderAddresses:
        """The step's decoder rows and addresses under decoder replay (decoder_view)."""
        views = []
        for seg, spec in zip(segments, specs):
            first, window_start = decoder_view(seg, self.shape.window)
            views.append(dataclasses.replace(spec, start=first, length=seg.end - first, window_start=window_start))
        return build_decoder_addresses(specs, views, page_tables, self.shape)

    def _connector(self) -> OffloadConnector:
        if self.offload is None:
            raise RuntimeError("a segment names offload traffic, but this rank has no offload store")
        return self.offload

    def _ready_slot(self, seg: ScheduledSegment) -> None:
        if seg.reset is not None:
            self.pools.reset_state(seg.slot)
            cursor = self.pools.cursor[seg.slot]
            cursor[CURSOR_POSITION] = seg.reset.position
            self._positions[seg.slot] = seg.reset.position
            if self.hashing is not None and seg.reset.history_token_ids:
                history = self.params.token_map[torch.tensor(seg.reset.history_token_ids, dtype=torch.long)]
                cursor[CURSOR_POSITION + 1 + self.history_len - history.numel() :] = history
        elif seg.restore is not None:
            self.checkpoints.restore(seg.restore, seg.slot)
            self._positions[seg.slot] = seg.restore.num_tokens

    def _committed_cursors(self, segments: tuple[ScheduledSegment, ...]) -> torch.Tensor:
        """Each segment's slot cursor [S, 1 + history] (position, Engram history) on the
        host, read in one copy; an error unless each slot is committed at its
        segment's start."""
        cursors = self.pools.cursor[[seg.slot for seg in segments]].cpu()
        self._check_positions(segments, cursors[:, CURSOR_POSITION].tolist())
        return cursors

    def _check_positions(self, segments: tuple[ScheduledSegment, ...], positions: list[int] | None = None) -> None:
        """An error unless each segment's slot is committed at its start: per
        ``positions`` (read from the device), else per the host's own record."""
        for i, seg in enumerate(segments):
            committed = self._positions[seg.slot] if positions is None else positions[i]
            if committed != seg.start:
                raise RuntimeError(
                    f"request {seg.request_id}: slot {seg.slot} is committed at {committed}, "
                    f"but the step computes from {seg.start}"
                )

    @staticmethod
    def _lengths(segments: tuple[ScheduledSegment, ...]) -> torch.Tensor:
        return torch.tensor([seg.length for seg in segments], dtype=torch.long)

    def _ngrams(self, segments: tuple[ScheduledSegment, ...], compressed: torch.Tensor, histories: torch.Tensor) -> torch.Tensor:
        if self.hashing is None:
            return compressed.unsqueeze(1)
        return self.hashing.step_ngram_ids(compressed, histories, self._lengths(segments))

    def _advance_cursors(
        self,
        segments: tuple[ScheduledSegment, ...],
        compressed: torch.Tensor,
        cursors: torch.Tensor,
        committed: dict[str, int],
    ) -> None:
        """Each slot's cursor past the rows its segment commits (a verify: its
        accepted prefix), and its Engram history over those rows' tokens: built on
        the host from ``cursors`` (the step's, ``_committed_cursors``) and written in
        one copy."""
        kept = torch.tensor([committed[seg.request_id] for seg in segments], dtype=cursors.dtype)
        rows = cursors.clone()
        rows[:, CURSOR_POSITION] = cursors[:, CURSOR_POSITION] + kept
        if self.hashing is not None:
            histories = cursors[:, CURSOR_POSITION + 1 :]
            rows[:, CURSOR_POSITION + 1 :] = self.hashing.step_next_history(
                compressed, histories, self._lengths(segments), kept
            )
        slots = torch.tensor([seg.slot for seg in segments], dtype=rows.dtype).unsqueeze(1)
        written = torch.cat((slots, rows), dim=1).to(self.pools.device)
        self.pools.cursor[written[:, 0]] = written[:, 1:]
        for seg, position in zip(segments, rows[:, CURSOR_POSITION].tolist()):
            self._positions[seg.slot] = position

    @staticmethod
    def logit_rows(
        segments: tuple[ScheduledSegment, ...],
    ) -> tuple[torch.Tensor, dict[str, tuple[int, int]], list[int]]:
        """Which rows the head runs on: every row of segments that want them, the last
        row of each sampling segment (a verify: its anchor's and every draft's). Returns
        the rows, each wanting segment's range in the logits, and the logits rows the
        sampler draws from, each sampling segment's in order."""
        rows: list[int] = []
        ranges: dict[str, tuple[int, int]] = {}
        sample_rows: list[int] = []
        base = 0
        for seg in segments:
            if seg.want_prompt_logits:
                ranges[seg.request_id] = (len(rows), len(rows) + seg.length)
                rows.extend(range(base, base + seg.length))
                if seg.sample:
                    sample_rows.append(len(rows) - 1)
            elif seg.sample:
                drawn = range(base + seg.length - 1 - seg.num_draft_tokens, base + seg.length)
                sample_rows.extend(range(len(rows), len(rows) + len(drawn)))
                rows.extend(drawn)
            base += seg.length
        return torch.tensor(rows, dtype=torch.long), ranges, sample_rows

    def _launch_sampling(
        self, segments: tuple[ScheduledSegment, ...], logits: torch.Tensor
    ) -> tuple[list[tuple[ScheduledSegment, int]], PendingSamples | None]:
        """Issues the draws of every sampling segment's rows from their ``logits``
        (one row, or a verify's one per row, each at the output index its token would
        have, the anchor's row first): the rows, each a (segment, index in its
        verify), and the pending draws (None when nothing samples). Under
        ``feed_samples`` the draws are also left in the token feed, one row per
        segment, for the next step."""
        sampling = [seg for seg in segments if seg.sample]
        if not sampling:
            return [], None
        per_row = [(seg, i) for seg in sampling for i in range(seg.num_draft_tokens + 1)]
        # A guide is the request's state after its committed tokens: it cannot mask or
        # penalise rows after drafts, so the engine refuses such requests under
        # speculation.
        guided_verify = [seg.request_id for seg in sampling if seg.guide is not None and seg.num_draft_tokens]
        if guided_verify:
            raise ValueError(f"segments {guided_verify}: a verify with drafts cannot carry a sampling guide")
        data = [self.requests.data(seg.request_id) for seg, _ in per_row]
        metadata = SamplingMetadata.from_params(
            [d.params for d in data],
            [d.seed for d in data],
            [seg.output_index + i for seg, i in per_row],
            device=logits.device,
            guides=[seg.guide for seg, _ in per_row],
            vocab_size=self.sampler.vocab_size,
            eos_token_id=self.eos_token_id,
        )
        pending = self.sampler.launch(logits, metadata)
        if self.feed_samples:
            # A refused row (-1) feeds token 0 to its request's next row, whose draw is
            # never committed: this step's result raises first.
            self._feed[: len(per_row)].copy_(pending.token_ids.clamp(min=0))
            self._feed_rows = {seg.request_id: row for row, (seg, _) in enumerate(per_row)}
        return per_row, pending

    @staticmethod
    def _drawn(
        per_row: list[tuple[ScheduledSegment, int]], pending: PendingSamples | None
    ) -> dict[str, tuple[SampledToken, ...]]:
        """Every sampling segment's drawn tokens, once the draws are on the host."""
        if pending is None:
            return {}
        out = pending.output()
        drawn: dict[str, list[SampledToken]] = {seg.request_id: [] for seg, _ in per_row}
        for (seg, _), token, logprobs in zip(per_row, out.token_ids.tolist(), out.logprobs):
            drawn[seg.request_id].append(SampledToken(int(token), logprobs))
        return {rid: tuple(tokens) for rid, tokens in drawn.items()}
