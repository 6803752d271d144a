"""The ranks of one engine group and where they run.

Owns ``GroupOptions``, ``GroupPlacement`` (which placement group a group's actors go
in, and which bundle each takes) and ``RankGroup``: the RankActors of one replica, one
bundle each, their rendezvous (a free TCP port on the head rank's node, every rank
joining the process group at once), the step transport of each generation
(``GroupOptions.transport``, one of ``actors.transport``), each step gathered with a
deadline, health pings, and restart: when any rank dies or misses the deadline the
whole group is torn down and started again (a process group cannot lose a member).
The client of a group is actors/engine_group.py's ``EngineGroup``, above the
SchedulerActor that owns a RankGroup. Which process owns which actor and who removes
a group's placement group: actors/engine_group.py's Lifetimes. A RankGroup only uses
the placement it is handed (``GroupPlacement.create`` makes one for a caller that
removes it).

Must not import: deploy, actors.scheduler, actors.engine_group.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dsv41.actors.rank import RankActor
from dsv41.actors.step_wire import pack_step, unpack_result
from dsv41.actors.transport import (
    TRANSPORTS,
    RankGroupDead,
    RankGroupFailure,
    StepTransport,
    failing_as,
    open_transport,
)
from dsv41.cluster.batch import DPMetadata, ScheduledBatch
from dsv41.cluster.distributed import GroupSpec
from dsv41.cluster.offload_connector import OffloadConnector
from dsv41.cluster.options import EngineOptions
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.runner import StepResult
from dsv41.model.source import ModelSource

logger = logging.getLogger(__name__)

__all__ = ["GroupOptions", "GroupPlacement", "RankGroup", "RankGroupDead", "RankGroupFailure", "TRANSPORTS"]


@dataclass(frozen=True)
class GroupOptions:
    """How a group runs on Ray: CPUs reserved per rank; the deadline of a step (a dead
    peer otherwise blocks the living ranks in a collective until the process group's
    own timeout) and of starting the group; how often an idle group pings its ranks,
    so that a dead rank is replaced before the next request needs it; and the step
    ``transport`` (``actors.transport``): ``"sockets"`` (the default: one TCP
    connection per rank, a step one framed write and read each; waiting ranks sleep),
    ``"compiled"`` (a Ray compiled graph over shared-memory channels; its waiting
    readers poll, so idle ranks keep most of a core busy each) or ``"calls"`` (one Ray
    actor call per rank per step, the slowest). Figures in BENCHMARKS.md, ray_step.
    ``rank_num_gpus``: GPUs per rank (0 on CPU; 1 for a rank per GPU, whose device
    is then its one visible GPU)."""

    rank_num_cpus: float = 0.5
    rank_num_gpus: float = 0
    step_timeout_s: float = 20.0
    start_timeout_s: float = 120.0
    health_interval_s: float = 5.0
    transport: str = "sockets"

    def __post_init__(self) -> None:
        for name in ("rank_num_cpus", "step_timeout_s", "start_timeout_s", "health_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"GroupOptions.{name}: {value!r} (allowed: a positive number)")
        if isinstance(self.rank_num_gpus, bool) or not isinstance(self.rank_num_gpus, (int, float)) or self.rank_num_gpus < 0:
            raise ValueError(f"GroupOptions.rank_num_gpus: {self.rank_num_gpus!r} (allowed: a number >= 0)")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"GroupOptions.transport: {self.transport!r} (allowed: {', '.join(TRANSPORTS)})")

    def rank_bundle(self) -> dict[str, float]:
        """The placement-group bundle one rank takes."""
        return {"CPU": self.rank_num_cpus} | ({"GPU": self.rank_num_gpus} if self.rank_num_gpus else {})


@dataclass(frozen=True)
class GroupPlacement:
    """Where a group's actors run: ``placement_group``, the bundle of each rank
    (``rank_bundles``, one per rank, each a ``GroupOptions.rank_bundle``), and the bundle
    the group's zero-resource actors share (``actors_bundle``: the SchedulerActor and the
    OffloadActor). Whoever made the placement group removes it; removing it also ends
    every actor placed in it."""

    placement_group: PlacementGroup
    rank_bundles: tuple[int, ...]
    actors_bundle: int

    def __post_init__(self) -> None:
        count = self.placement_group.bundle_count
        bundles = (*self.rank_bundles, self.actors_bundle)
        if not self.rank_bundles or any(not isinstance(b, int) or not 0 <= b < count for b in bundles):
            raise ValueError(
                f"GroupPlacement: bundles {self.rank_bundles} / {self.actors_bundle} "
                f"(allowed: at least one rank bundle, each index in 0..{count - 1})"
            )
        if len(set(self.rank_bundles)) != len(self.rank_bundles):
            raise ValueError(f"GroupPlacement.rank_bundles: {self.rank_bundles} (allowed: one bundle per rank, distinct)")

    @classmethod
    def create(cls, name: str, world: int, options: GroupOptions) -> "GroupPlacement":
        """A new STRICT_PACK placement group of ``world`` rank bundles (the caller
        removes it); the zero-resource actors share rank 0's bundle."""
        group = placement_group([options.rank_bundle()] * world, strategy="STRICT_PACK", name=f"{name}-ranks")
        return cls(group, tuple(range(world)), 0)

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.placement_group, placement_group_bundle_index=bundle)


class RankGroup:
    """The RankActors of one replica (a ``DPStepExecutor``), each in its bundle of
    ``placement`` (which the group only uses: a restart places the new ranks in the
    same bundles).

    ``restart`` ends the generation at once and starts the next one in a background
    thread, so that the step which found the failure returns its error outputs without
    waiting for a whole group to load; the next step or ping waits for the new
    generation. A generation that fails to start leaves the group dead: every later
    call raises RankGroupDead."""

    def __init__(
        self,
        name: str,
        model: ModelSource,
        options: EngineOptions,
        dp: DPLayout,
        group_options: GroupOptions,
        placement: GroupPlacement,
        offload: OffloadConnector | None = None,
    ) -> None:
        if len(placement.rank_bundles) != dp.world:
            raise ValueError(f"placement.rank_bundles: {placement.rank_bundles} (allowed: one per rank, {dp.world})")
        self.name = name
        self.model = model
        self.options = options
        self.dp = dp
        self.group_options = group_options
        self.placement = placement
        self.offload = offload
        self.generation = 0
        self.last_failure: str | None = None
        self.ranks: list[Any] = []
        self._transport: StepTransport | None = None
        self._starter: threading.Thread | None = None
        self._start_error: BaseException | None = None

    def rank_name(self, rank: int) -> str:
        """The Ray actor name of a rank of the current generation."""
        return f"{self.name}-g{self.generation}-rank{rank}"

    def rank_names(self) -> list[str]:
        """The Ray actor names of the ranks, once the current generation is up."""
        self._settle()
        return [self.rank_name(rank) for rank in range(len(self.ranks))]

    @property
    def starting(self) -> bool:
        """Whether a generation is starting in the background."""
        return self._starter is not None and self._starter.is_alive()

    @property
    def dead(self) -> bool:
        """Whether the group can serve no more (a generation failed to start)."""
        return self._start_error is not None

    def start(self) -> None:
        """Places, wires and loads every rank, opens the step transport and runs one
        padding step through it (every rank's MoE collectives on zero rows); raises
        RankGroupFailure, with nothing left running, if any of it fails within the
        start deadline."""
        self.generation += 1
        self._start_generation()

    def restart(self) -> None:
        """Stops this generation now; the next one starts in the background."""
        self._settle()
        self._stop(ranks_first=True)
        self.generation += 1
        self._starter = threading.Thread(
            target=self._start_in_background, name=f"{self.name}-g{self.generation}-start", daemon=True
        )
        self._starter.start()

    def _start_in_background(self) -> None:
        try:
            self._start_generation()
        except BaseException as exc:  # noqa: BLE001 - kept and raised by the next caller (_settle)
            logger.exception("group %s: generation %d failed to start", self.name, self.generation)
            self._start_error = exc

    def _settle(self) -> None:
        """Waits for a background start; raises RankGroupDead if it failed."""
        if self._starter is not None:
            self._starter.join()
            self._starter = None
        if self._start_error is not None:
            raise RankGroupDead(
                f"group {self.name}: generation {self.generation} failed to start: {self._start_error}"
            ) from self._start_error

    def _start_generation(self) -> None:
        try:
            self._open()
        except BaseException:
            self._stop(ranks_first=True)
            raise
        logger.info(
            "group %s: generation %d up, %d rank(s), %s transport",
            self.name,
            self.generation,
            self.dp.world,
            self.group_options.transport,
        )

    def _open(self) -> None:
        opts = self.group_options
        if not self.placement.placement_group.wait(opts.start_timeout_s):
            raise RankGroupFailure(f"group {self.name}: placement group of {self.dp.world} ranks not ready")
        actor_class = ray.remote(RankActor)
        self.ranks = [
            actor_class.options(
                name=self.rank_name(rank),
                num_cpus=opts.rank_num_cpus,
                num_gpus=opts.rank_num_gpus,
                max_restarts=0,
                scheduling_strategy=self.placement.strategy(self.placement.rank_bundles[rank]),
            ).remote(self.model, self.options, self.dp, rank, self.offload)
            for rank in range(self.dp.world)
        ]
        host, port = self._gather([self.ranks[0].rendezvous_address.remote()], opts.start_timeout_s)[0]
        spec = GroupSpec(
            backend=self.dp.backend,
            world=self.dp.world,
            master_addr=host,
            master_port=port,
            timeout_s=opts.step_timeout_s,
        )
        self._gather([r.join.remote(spec) for r in self.ranks], opts.start_timeout_s)
        with failing_as(f"group {self.name}: opening the {opts.transport} transport"):
            transport = open_transport(opts.transport, self.name, self.ranks, opts.step_timeout_s)
        # The first step also waits for a compiled graph's loops to start on every
        # rank (seconds on a loaded box): it gets the start deadline, not a step's.
        padding = tuple(ScheduledBatch(step_id=0) for _ in range(self.dp.world))
        self._transport = transport
        self._exchange(transport, padding, DPMetadata.of(0, padding).to_wire(), opts.start_timeout_s)

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None) -> list[StepResult]:
        return self._exchange(self._running(), batches, metadata, self.group_options.step_timeout_s)

    def health(self) -> list[int]:
        """Every rank's answer to a ping; raises RankGroupFailure if one is down."""
        self._running()
        with self._recording_failure():
            return self._gather([r.ping.remote() for r in self.ranks], self.group_options.step_timeout_s)

    def _running(self) -> StepTransport:
        self._settle()
        if self._transport is None:
            raise RankGroupDead(f"group {self.name}: not running (generation {self.generation} stopped)")
        return self._transport

    def _exchange(
        self, transport: StepTransport, batches: Sequence[ScheduledBatch], metadata: torch.Tensor | None, timeout_s: float
    ) -> list[StepResult]:
        with self._recording_failure():
            words = None if metadata is None else metadata.tolist()
            steps = [pack_step(batch, words) for batch in batches]
            packed = transport.exchange(steps, timeout_s)
        return [unpack_result(result) for result in packed]

    @contextmanager
    def _recording_failure(self) -> Iterator[None]:
        """Keeps the message of a failure raised inside as ``last_failure`` (stats)."""
        try:
            yield
        except RankGroupFailure as exc:
            self.last_failure = str(exc)
            raise

    def stop(self) -> None:
        """Ends the group (after any background start); it serves no more."""
        if self._starter is not None:
            self._starter.join()
            self._starter = None
        self._stop(ranks_first=False)

    def _stop(self, *, ranks_first: bool) -> None:
        """Ends the generation. After a failure the ranks go first: a living rank may
        be stuck in a collective with a dead peer, and a compiled graph's teardown
        waits for every rank's loop to end (RAY_CGRAPH_teardown_timeout, 30 s). On a
        clean stop the graph goes first, so that its loops end before their actors."""
        transport, self._transport = self._transport, None
        if transport is not None and not ranks_first:
            transport.close()
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        self.ranks = []
        if transport is not None and ranks_first:
            transport.close()

    def _gather(self, refs: list[ray.ObjectRef], timeout_s: float) -> list[Any]:
        """The calls' results in order, or RankGroupFailure (see ``failing_as``)."""
        with failing_as(f"group {self.name}"):
            return ray.get(refs, timeout=timeout_s)
