"""The engine of one replica whose attention is data-parallel over several ranks.

Owns ``DPEngine`` (the public interface of ``Engine`` — add_request, step, abort,
generate, has_unfinished_requests, tokenizer — over one scheduler and block manager
per DP rank, each rank having its own pools), the per-step packing of every rank's
batch into one ``DPMetadata``, and ``DPRank``, one rank's side of a step: its own
ModelRunner (TP1 attention, embeddings, head, pools) whose MoE is the DP expert
exchange over its expert shard. ``ThreadedRanks`` runs the ranks of a replica in
threads of this process (gloo among them); the Ray actors of ``actors/`` implement the
same ``DPStepExecutor`` over a step transport (``actors.transport``).

Must not import: actors, deploy, ray.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from dsv41.cluster.batch import DPMetadata, ScheduledBatch
from dsv41.cluster.distributed import DPExpertExchange, GroupSpec, open_process_group
from dsv41.cluster.engine import EngineFrontend, EngineOptions, RankLayout, engine_options
from dsv41.cluster.offload_connector import LocalOffload, OffloadConnector
from dsv41.cluster.placement import RankLoad, place
from dsv41.cluster.request import Request, RequestOutput, RequestStatus
from dsv41.cluster.runner import ModelRunner, StepResult, stage_rows
from dsv41.cluster.scheduler import Scheduler
from dsv41.model.config import V41Config
from dsv41.model.kernels import load_kernels
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
    ``execute`` raises RankFailure when a rank is lost; ``restart`` then brings every
    rank back with empty pools."""

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor) -> list[StepResult]: ...

    def restart(self) -> None: ...


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
        decoder_replay: bool = False,
    ) -> None:
        self.rank = rank
        self.exchange = exchange
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
            decoder_replay=decoder_replay,
        )

    @classmethod
    def load(
        cls,
        model: str | Path | ModelSource,
        options: EngineOptions,
        dp: DPLayout,
        rank: int,
        group: dist.ProcessGroup | None,
        offload: OffloadConnector | None = None,
    ) -> "DPRank":
        """Loads the rank's expert shard of ``model`` (and everything else whole) on
        its device and joins ``group`` (required when ``dp.world`` > 1); ``offload``
        is the replica's offload store, shared by every rank."""
        source = ModelSource.parse(model)
        params, _ = source.load_params(dtype=options.dtype, device=options.device, shard=dp.shard(rank))
        kernels = load_kernels(options.kernel_backend)
        exchange = None
        if dp.world > 1:
            if group is None:
                raise DPError(f"group: None for rank {rank} of a {dp.world}-rank replica (allowed: its process group)")
            exchange = DPExpertExchange(
                params.config, group, rank, dp.backend, kernels, dp.expert_mode, bool(options.batch_invariant)
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
            decoder_replay=options.decoder_swa_bounded_replay,
        )

    def execute(self, batch: ScheduledBatch, metadata_wire: torch.Tensor) -> StepResult:
        """Runs this rank's batch of a step (padding when it has no rows). Under
        decoder replay the decoder's layers run fewer rows: the exchange learns every
        rank's count at each of them from the metadata."""
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
        if self.exchange is None:
            return self.runner.execute(batch)
        self.exchange.begin_step(metadata.row_counts, metadata.decoder_row_counts(self.decoder_layers))
        if batch.is_empty:
            return self.runner.execute_padding(batch.step_id)
        return self.runner.execute(batch)


class ThreadedRanks:
    """The DP ranks of a replica in threads of this process, gloo among them."""

    def __init__(
        self, model: str | Path | ModelSource, options: EngineOptions, dp: DPLayout, offload: OffloadConnector | None = None
    ) -> None:
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

    def close(self) -> None:
        self._threads.shutdown(wait=True)


class DPEngine(EngineFrontend):
    """One replica over ``world`` DP ranks: a scheduler and block manager per rank,
    placement of each request on one rank, and one step of every rank at a time."""

    def __init__(
        self,
        config: V41Config,
        tokenizer: Tokenizer,
        options: EngineOptions,
        world: int,
        executor: DPStepExecutor,
        offload: OffloadConnector | None = None,
    ) -> None:
        if not isinstance(world, int) or world < 1:
            raise DPError(f"world: {world!r} (allowed: an int >= 1)")
        self.layout = RankLayout.build(config, options)
        super().__init__(config, tokenizer, options, self.layout)
        self.world = world
        self.executor = executor
        self.offload = offload
        self.schedulers = self._fresh_schedulers()
        self._rank_of: dict[str, int] = {}
        self._step_id = 0
        self.num_restarts = 0

    @classmethod
    def over(
        cls,
        model: str | Path | ModelSource,
        dp: DPLayout,
        executor: DPStepExecutor,
        options: EngineOptions,
        offload: OffloadConnector | None = None,
    ) -> "DPEngine":
        """The engine of ranks already running ``model`` under ``dp`` (with
        ``offload``, the store its ranks publish to); it reads the config and
        tokenizer only, never a weight."""
        source = ModelSource.parse(model)
        return cls(source.config(), source.tokenizer(), options, dp.world, executor, offload)

    @classmethod
    def in_process(cls, model: str | Path | ModelSource, dp: DPLayout, **options: object) -> "DPEngine":
        """A replica whose ranks are threads of this process (tests, one-box runs),
        sharing one in-process offload store when ``offload_host_bytes`` asks."""
        parsed = engine_options(options)
        source = ModelSource.parse(model)
        store = RankLayout.build(source.config(), parsed).offload_store(parsed)
        offload = LocalOffload(store) if store is not None else None
        return cls.over(source, dp, ThreadedRanks(source, parsed, dp, offload), parsed, offload)

    def _fresh_schedulers(self) -> list[Scheduler]:
        return [self.layout.scheduler(self.config, self.options, self.offload) for _ in range(self.world)]

    # -- requests -----------------------------------------------------------------------

    def _enqueue(self, request: Request) -> None:
        loads = [
            RankLoad(
                unfinished=len(s.running) + len(s.waiting),
                cached_prefix_tokens=s.block_manager.cached_prefix_tokens(request.all_token_ids),
            )
            for s in self.schedulers
        ]
        rank = place(loads, self.options.max_num_seqs)
        self._rank_of[request.request_id] = rank
        self.schedulers[rank].add(request)

    def _scheduler_of(self, request_id: str) -> Scheduler:
        return self.schedulers[self._rank_of[request_id]]

    def rank_of(self, request_id: str) -> int | None:
        """The DP rank an unfinished request was placed on."""
        return self._rank_of.get(request_id) if request_id in self._requests else None

    def abort(self, request_id: str) -> bool:
        ids = self._children.get(request_id, (request_id,))
        aborted = super().abort(request_id)
        for rid in ids:
            self._rank_of.pop(rid, None)
        return aborted

    def _forget(self, request: Request) -> None:
        super()._forget(request)
        self._rank_of.pop(request.request_id, None)

    def _all_schedulers(self) -> Sequence[Scheduler]:
        return self.schedulers

    # -- the step loop --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batches = tuple(s.schedule()[0] for s in self.schedulers)
        if all(b.is_empty for b in batches):
            return []
        self._step_id += 1
        stages = None
        if self.options.decoder_swa_bounded_replay:
            stages = [stage_rows(b, self.config.sliding_window) for b in batches]
        metadata = DPMetadata.of(self._step_id, batches, stages)
        try:
            results = self.executor.execute(batches, metadata.to_wire())
        except RankFailure as exc:
            return self.recover(f"a rank failed: {exc}")
        outputs: list[RequestOutput] = []
        for scheduler, batch, result in zip(self.schedulers, batches, results):
            outputs.extend(self._apply(scheduler, batch, result))
        return outputs

    def recover(self, reason: str) -> list[RequestOutput]:
        """After a rank failure: ends every unfinished request (``fail_all``), counts
        the restart and restarts the ranks. Returns the ended requests' outputs."""
        outputs = self.fail_all(reason)
        self.num_restarts += 1
        self.executor.restart()
        return outputs

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """Ends every unfinished request with finish_reason "error" and starts every
        rank's bookkeeping afresh (the ranks' pools are gone with them: nothing they
        cached can be hit again). Returns the ended requests' final outputs."""
        logger.error("dp engine: ending %d request(s): %s", len(self._requests), reason)
        outputs = []
        for request in list(self._requests.values()):
            if not request.is_finished:
                request.finish(RequestStatus.FINISHED_ERROR)
                outputs.append(request.take_output())
        self._requests.clear()
        self._children.clear()
        self._rank_of.clear()
        self.schedulers = self._fresh_schedulers()
        return outputs
