"""The DP ranks of one replica and how a step reaches them.

Owns ``DPLayout`` (how a replica spreads over ranks: world, expert split, collective
backend), ``DPRank`` (one rank's side of a step: its ModelRunner with TP1 attention,
embeddings, head and pools, whose MoE is the DP expert exchange over its expert shard),
the ``DPStepExecutor`` contract the engine steps its ranks through, and two of its
implementations: ``LocalRank`` (a replica of one rank in the engine's thread) and
``ThreadedRanks`` (the ranks of a replica in threads of this process, gloo among them).
The Ray actors of ``actors/`` implement the same contract over a step transport.

Must not import: actors, deploy, ray, cluster.engine.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from dsv41.cache.addressing import DecodeWidth
from dsv41.cluster.batch import DPMetadata, ScheduledBatch
from dsv41.cluster.cuda_graphs import DecodeBuckets
from dsv41.cluster.distributed import DPExpertExchange, GroupSpec, open_process_group
from dsv41.cluster.offload_connector import OffloadConnector
from dsv41.cluster.options import EngineOptions, RankLayout, check_replica_options
from dsv41.cluster.runner import LaunchedStep, ModelRunner, StepResult, stage_rows
from dsv41.cluster.tbo import TBOOptions, microbatch_rows, runs_split, split
from dsv41.model.kernels import load_kernels, register_gpu_linalg_kernels
from dsv41.model.kernels.interface import PagedKernels
from dsv41.model.loader import ExpertShard
from dsv41.model.params import ModelParams
from dsv41.model.source import ModelSource

logger = logging.getLogger(__name__)

EXPERT_MODES = ("ep", "tp")


class DPError(ValueError):
    """A DP option or a rank's input outside what the replica allows."""


@dataclass(frozen=True)
class DPLayout:
    """How a replica spreads over ranks: ``world`` DP-attention ranks, the routed
    experts split into whole experts per rank (``ep``) or every expert's intermediate
    dim split (``tp``), collectives on ``backend``."""

    world: int
    expert_mode: str = "ep"
    backend: str = "gloo"

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise DPError(f"DPLayout.world: {self.world!r} (allowed: an int >= 1)")
        if self.expert_mode not in EXPERT_MODES:
            raise DPError(f"DPLayout.expert_mode: {self.expert_mode!r} (allowed: {', '.join(EXPERT_MODES)})")
        GroupSpec(backend=self.backend, world=self.world)

    def shard(self, rank: int) -> ExpertShard | None:
        return ExpertShard(self.expert_mode, rank, self.world) if self.world > 1 else None


class RankFailure(RuntimeError):
    """A rank of the replica died or missed a step's deadline: the step is lost and
    the ranks' pools with it."""


class DPStepExecutor(Protocol):
    """Runs one step on every DP rank of a replica together; one result per rank.
    ``metadata`` is the step's packed DPMetadata (None for a replica of one rank: no
    exchange reads it). ``execute`` raises RankFailure when a rank is lost;
    ``restart`` then brings every rank back with empty pools."""

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[StepResult]: ...

    def restart(self) -> None: ...


@runtime_checkable
class StepLauncher(Protocol):
    """An executor that can issue a step on every rank without waiting for its draws
    (async scheduling: LocalRank, ThreadedRanks); one launch per rank, whose results
    are what ``execute`` returns."""

    def launch(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[LaunchedStep]: ...


class DPRank:
    """One DP rank's execution: its pools and runner, and its side of the MoE
    exchange (None when the replica has one rank and holds every expert)."""

    def __init__(
        self,
        params: ModelParams,
        layout: RankLayout,
        rank: int,
        exchange: DPExpertExchange | None,
        *,
        device: str = "cpu",
        kernels: PagedKernels | None = None,
        offload: OffloadConnector | None = None,
        batch_invariant: bool = False,
        fp8_activations: bool = False,
        decoder_replay: bool = False,
        tbo: TBOOptions | None = None,
        decode_graphs: DecodeBuckets | None = None,
        token_graphs: Sequence[int] | None = None,
        feed_samples: bool = False,
    ) -> None:
        if tbo is not None and exchange is None:
            raise DPError(f"tbo: {tbo} on a rank without an exchange (allowed: a rank of a replica of >= 2 ranks)")
        on_gpu = torch.device(device).type != "cpu"
        graphs = decode_graphs is not None or token_graphs is not None
        if graphs and exchange is not None and exchange.backend == "gloo" and on_gpu:
            raise DPError(
                f"decode_graphs / token_graphs: with the gloo exchange on {device!r} (allowed: the NCCL backend on a "
                "GPU, whose collectives a CUDA graph captures; on the CPU the graphs' functions run eagerly over gloo)"
            )
        register_gpu_linalg_kernels(device)
        self.rank = rank
        self.exchange = exchange
        self.tbo = tbo
        self.decoder_layers = params.config.topology.decoder_layers
        self.runner = ModelRunner(
            params,
            layout.geometry,
            layout.pool_size,
            device=device,
            moe=exchange,
            kernels=kernels,
            offload=offload,
            batch_invariant=batch_invariant,
            fp8_activations=fp8_activations,
            decoder_replay=decoder_replay,
            decode_graphs=decode_graphs,
            begin_decode_width=None if exchange is None else lambda width: exchange.begin_uniform_step(width.requests),
            token_graphs=token_graphs,
            begin_token_rows=None if exchange is None else exchange.begin_uniform_step,
            feed_samples=feed_samples,
        )

    @classmethod
    def load(
        cls,
        model: ModelSource,
        options: EngineOptions,
        dp: DPLayout,
        rank: int,
        group: dist.ProcessGroup | None,
        offload: OffloadConnector | None = None,
    ) -> "DPRank":
        """Loads the rank's expert shard of ``model`` (and everything else whole) on
        its device and joins ``group`` (required when ``dp.world`` > 1); ``offload``
        is the replica's offload store, shared by every rank."""
        check_replica_options(model.config(), options, dp.world)
        params, _ = model.load_params(
            dtype=options.dtype, device=options.device, weight_storage=options.weight_storage, shard=dp.shard(rank)
        )
        kernels = load_kernels(options.kernel_backend)
        exchange = None
        if dp.world > 1:
            if group is None:
                raise DPError(f"group: None for rank {rank} of a {dp.world}-rank replica (allowed: its process group)")
            exchange = DPExpertExchange(
                params.config,
                group,
                rank,
                dp.backend,
                kernels,
                dp.expert_mode,
                bool(options.batch_invariant),
                device=options.device,
            )
        layout = RankLayout.build(params.config, options)
        return cls(
            params,
            layout,
            rank,
            exchange,
            device=options.device,
            kernels=kernels,
            offload=offload,
            batch_invariant=bool(options.batch_invariant),
            fp8_activations=options.fp8_activations,
            decoder_replay=options.decoder_swa_bounded_replay,
            tbo=TBOOptions.of(options),
            decode_graphs=layout.decode_buckets(params.config, options),
            token_graphs=layout.token_buckets(options),
            feed_samples=options.async_scheduling,
        )

    def execute(self, batch: ScheduledBatch, metadata_wire: torch.Tensor | None) -> StepResult:
        """Runs this rank's batch of a step to its result (``launch``, then its result)."""
        return self.launch(batch, metadata_wire).result()

    def launch(self, batch: ScheduledBatch, metadata_wire: torch.Tensor | None) -> LaunchedStep:
        """Issues this rank's batch of a step (padding when it has no rows): a decode
        graph's replay is handed back with its draws in flight (ModelRunner.launch),
        any other step once it has run. Under decoder replay the decoder's layers run
        fewer rows: the exchange learns every rank's count at each of them from the
        metadata. A rank alone (no exchange) reads no metadata. Under prefill two-batch
        overlap, when every rank agrees from the metadata (cluster/tbo.runs_split), its
        forward runs as the two microbatches the metadata names, each with its MoE's
        own counts."""
        if self.exchange is None:
            return self.runner.launch(batch, width=self.runner.decode_width(batch.segments))
        if metadata_wire is None:
            raise DPError(f"rank {self.rank}: a step without DPMetadata (allowed only for a replica of one rank)")
        metadata = DPMetadata.from_wire(metadata_wire)
        own = metadata.ranks[self.rank]
        stages = (own.decoder_rows, own.query_rows)
        if self.runner.decoder_replay:
            expected = stage_rows(batch, self.runner.shape.window)
        else:
            expected = (batch.num_tokens, batch.num_tokens)
        if own.num_tokens != batch.num_tokens or stages != expected:
            raise DPError(
                f"rank {self.rank}: batch of {batch.num_tokens} rows ({expected[0]} decoder, {expected[1]} "
                f"query), the step's metadata says {own.num_tokens} ({stages[0]}, {stages[1]})"
            )
        width = self._common_decode_width(metadata)
        if width is not None:
            # The graph's replay begins the exchange's step at its width.
            if batch.is_empty:
                return LaunchedStep.done(self.runner.execute_padding(batch, width))
            return self.runner.launch(batch, width=width)
        if self.runner.token_graphs is not None:
            self._begin_token_step(metadata)
            if batch.is_empty:
                return LaunchedStep.done(self.runner.execute_padding(batch))
            return self.runner.launch(batch)
        parts = None
        microbatches = []
        if self.tbo is not None and runs_split(metadata, self.tbo.min_tokens):
            parts = split(batch, self.tbo.token_split)
            rows = microbatch_rows(parts, self.runner.shape.window if self.runner.decoder_replay else None)
            if parts is None or rows != own.microbatches:
                raise DPError(
                    f"rank {self.rank}: batch splits into microbatches {rows}, the step's metadata says "
                    f"{own.microbatches}"
                )
            microbatches = [metadata.microbatch_counts(i, self.decoder_layers) for i in range(len(parts))]
        self.exchange.begin_step(metadata.row_counts, metadata.decoder_row_counts(self.decoder_layers), microbatches)
        if batch.is_empty:
            return LaunchedStep.done(self.runner.execute_padding(batch))
        if parts is None:
            return self.runner.launch(batch)
        return self.runner.launch(batch, [(part, self.exchange.microbatch(i)) for i, part in enumerate(parts)])

    def _common_decode_width(self, metadata: DPMetadata) -> DecodeWidth | None:
        """The decode graph every rank of the step replays (each computes the same from
        the same metadata): when every rank with rows runs a plain decode, the bucket
        of the largest rank's rows and PAGEs; None (every rank eager) otherwise, and
        when this replica has no graphs."""
        graphs = self.runner.graphs
        ranks = metadata.ranks
        if graphs is None or any(r.decode_pages < 0 for r in ranks) or not any(r.num_tokens for r in ranks):
            return None
        return graphs.width_of(max(r.num_tokens for r in ranks), max(r.decode_pages for r in ranks))

    def _begin_token_step(self, metadata: DPMetadata) -> None:
        """Under TR_HYBRID, every rank's buckets of the step (each rank computes the
        same from the same metadata): the encoder's, of the largest rank's rows, and
        the decoder's, of the largest rank's decoder rows (None where no rank has rows
        there, or beyond the largest bucket: those parts run eagerly); and the
        exchange's counts: each stage's bucket on every rank, or the ranks' own rows
        where the stage runs eagerly, and under decoder replay the last layer's query
        rows (that layer runs eagerly)."""
        graphs = self.runner.token_graphs
        ranks = metadata.ranks
        world = len(ranks)

        def bucket(rows: int) -> int | None:
            return None if rows == 0 else graphs.bucket_for(rows)

        encoder = bucket(max(r.num_tokens for r in ranks))
        decoder = None if encoder is None else bucket(max(r.decoder_rows for r in ranks))
        graphs.use_step_buckets(encoder, decoder)
        layer_counts = metadata.decoder_row_counts(self.decoder_layers)
        if decoder is not None:
            eager = self.decoder_layers[-1] if self.runner.decoder_replay else None
            layer_counts = {
                layer: counts if layer == eager else (decoder,) * world for layer, counts in layer_counts.items()
            }
        row_counts = metadata.row_counts if encoder is None else (encoder,) * world
        self.exchange.begin_step(row_counts, layer_counts)


class ThreadedRanks:
    """The DP ranks of a replica in threads of this process, gloo among them."""

    def __init__(
        self, model: ModelSource, options: EngineOptions, dp: DPLayout, offload: OffloadConnector | None = None
    ) -> None:
        check_replica_options(model.config(), options, dp.world)
        self.model = model
        self.options = options
        self.dp = dp
        self.offload = offload
        self._threads = ThreadPoolExecutor(max_workers=dp.world, thread_name_prefix="dp-rank")
        self.ranks = self._load()

    def _load(self) -> tuple[DPRank, ...]:
        dp = self.dp
        store = dist.HashStore()
        spec = GroupSpec(backend=dp.backend, world=dp.world)

        def load_rank(rank: int) -> DPRank:
            group = open_process_group(spec, rank, dist.PrefixStore("dp", store)) if dp.world > 1 else None
            return DPRank.load(self.model, self.options, dp, rank, group, self.offload)

        # Every rank must be in its rendezvous at once: one thread each.
        return tuple(self._threads.map(load_rank, range(dp.world)))

    def restart(self) -> None:
        self.ranks = self._load()

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor) -> list[StepResult]:
        futures = [self._threads.submit(rank.execute, b, metadata) for rank, b in zip(self.ranks, batches)]
        return [f.result() for f in futures]

    def launch(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor) -> list[LaunchedStep]:
        """Every rank's launch, in its thread (their collectives meet there); the
        draws of a decode graph's replay are still in flight when this returns."""
        futures = [self._threads.submit(rank.launch, b, metadata) for rank, b in zip(self.ranks, batches)]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._threads.shutdown(wait=True)


class LocalRank:
    """The one rank of a replica in this thread: no exchange, no threads."""

    def __init__(self, rank: DPRank) -> None:
        if rank.exchange is not None:
            raise DPError("rank: a rank with an exchange needs its peers (allowed: a replica of one rank)")
        self.rank = rank
        self.runner = rank.runner

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[StepResult]:
        (batch,) = batches
        return [self.rank.execute(batch, None)]

    def launch(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[LaunchedStep]:
        """Issues the step's batch without waiting for its draws (async scheduling)."""
        (batch,) = batches
        return [self.rank.launch(batch, None)]

    def restart(self) -> None:
        raise RankFailure("a rank in this thread does not restart: its failure is the engine's")

