"""Engine-group lifecycle and the client handle of a group.

Owns ``RankGroup``: the RankActors of one replica in a placement group (one bundle
per rank, STRICT_PACK), their rendezvous (a free TCP port on the head rank's node,
every rank joining the process group at once), one Ray call per rank per step
gathered with a deadline, health checks, and restart: when any rank dies or misses
the deadline the whole group is torn down and started again (a process group cannot
lose a member). And ``EngineGroup``, the context-managed client: it starts a
``SchedulerActor`` (which owns a RankGroup) and forwards the engine interface to it.

Must not import: deploy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tokenizers import Tokenizer

from actors.rank import RankActor
from cluster.batch import ScheduledBatch
from cluster.distributed import GroupSpec
from cluster.dp_engine import DPLayout, RankFailure
from cluster.engine import EngineOptions, EngineStats
from cluster.engine import engine_options as parse_engine_options
from cluster.request import Request, RequestOutput, SamplingParams
from cluster.runner import StepResult

logger = logging.getLogger(__name__)


class RankGroupFailure(RankFailure):
    """A rank died, failed or missed a deadline; the group must restart."""


@dataclass(frozen=True)
class GroupOptions:
    """How a group runs on Ray: CPUs reserved per rank, the deadline of a step's
    calls (a dead peer otherwise blocks the living ranks in a collective until the
    process group's own timeout), and the deadline of starting the group."""

    rank_num_cpus: float = 0.5
    step_timeout_s: float = 20.0
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("rank_num_cpus", "step_timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"GroupOptions.{name}: {value!r} (allowed: a positive number)")


class RankGroup:
    """The RankActors of one replica (a ``DPStepExecutor``)."""

    def __init__(
        self, name: str, model_dir: str, options: EngineOptions, dp: DPLayout, group_options: GroupOptions
    ) -> None:
        self.name = name
        self.model_dir = model_dir
        self.options = options
        self.dp = dp
        self.group_options = group_options
        self.generation = 0
        self.ranks: list[Any] = []
        self._placement: PlacementGroup | None = None

    def rank_name(self, rank: int) -> str:
        """The Ray actor name of a rank of the current generation."""
        return f"{self.name}-g{self.generation}-rank{rank}"

    def start(self) -> None:
        """Places, wires and loads every rank; raises RankGroupFailure if any fails
        to come up within the start deadline."""
        self.generation += 1
        opts = self.group_options
        self._placement = placement_group([{"CPU": opts.rank_num_cpus}] * self.dp.world, strategy="STRICT_PACK")
        if not self._placement.wait(opts.start_timeout_s):
            raise RankGroupFailure(f"group {self.name}: placement group of {self.dp.world} ranks not ready")
        actor_class = ray.remote(RankActor)
        self.ranks = [
            actor_class.options(
                name=self.rank_name(rank),
                num_cpus=opts.rank_num_cpus,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._placement, placement_group_bundle_index=rank
                ),
            ).remote(self.model_dir, self.options, self.dp, rank)
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
        logger.info("group %s: generation %d up, %d rank(s)", self.name, self.generation, self.dp.world)

    def execute(self, batches: Sequence[ScheduledBatch], metadata: torch.Tensor) -> list[StepResult]:
        refs = [rank.execute.remote(batch, metadata) for rank, batch in zip(self.ranks, batches)]
        return self._gather(refs, self.group_options.step_timeout_s)

    def health(self) -> list[int]:
        """Every rank's answer to a ping; raises RankGroupFailure if one is down."""
        return self._gather([r.ping.remote() for r in self.ranks], self.group_options.step_timeout_s)

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        self.ranks = []
        if self._placement is not None:
            remove_placement_group(self._placement)
            self._placement = None

    def _gather(self, refs: list[ray.ObjectRef], timeout_s: float) -> list[Any]:
        """The calls' results in order; the first failure (a dead rank answers at once)
        or the deadline raises RankGroupFailure without waiting for the rest."""
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RankGroupFailure(f"group {self.name}: {len(pending)} rank call(s) missed a {timeout_s:.0f} s deadline")
            try:
                ray.get(ready[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                raise RankGroupFailure(f"group {self.name}: {type(exc).__name__}: {exc}") from exc
        return ray.get(list(refs))


class EngineGroup:
    """Client of one engine group: ``with EngineGroup(model_dir, dp=2) as group:``
    starts a SchedulerActor and its ranks, and stops them on exit."""

    def __init__(
        self,
        model_dir: str,
        *,
        dp: int = 1,
        expert_mode: str = "ep",
        group_options: GroupOptions = GroupOptions(),
        name: str = "dsv41",
        **engine_options: object,
    ) -> None:
        # actors.scheduler builds on RankGroup above: imported here, not at the top.
        from actors.scheduler import SchedulerActor

        self.name = name
        self.model_dir = str(model_dir)
        self.dp = DPLayout(dp, expert_mode)
        self.options = parse_engine_options(dict(engine_options))
        self.group_options = group_options
        self._actor_class = ray.remote(SchedulerActor)
        self.actor: Any = None

    def __enter__(self) -> "EngineGroup":
        self.actor = self._actor_class.options(num_cpus=0, max_concurrency=4).remote(
            self.name, self.model_dir, self.options, self.dp, self.group_options
        )
        ray.get(self.actor.ready.remote())
        self.config, tokenizer_json, self.max_model_len = ray.get(self.actor.describe.remote())
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.actor is not None:
            ray.get(self.actor.shutdown.remote())
            ray.kill(self.actor)
            self.actor = None

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]:
        return ray.get(self.actor.generate.remote([list(p) for p in prompts], params))

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        ray.get(self.actor.add_request.remote(request_id, list(prompt_token_ids), params))

    def step(self) -> list[RequestOutput]:
        return ray.get(self.actor.step.remote())

    def abort(self, request_id: str) -> bool:
        return ray.get(self.actor.abort.remote(request_id))

    def has_unfinished_requests(self) -> bool:
        return ray.get(self.actor.has_unfinished_requests.remote())

    def request(self, request_id: str) -> Request | None:
        """A snapshot of an unfinished request's record (None once finished)."""
        return ray.get(self.actor.request.remote(request_id))

    def stats(self) -> EngineStats:
        """Requests by queue and every rank's PAGE counters (EngineFrontend.stats)."""
        return ray.get(self.actor.engine_stats.remote())

    def group_stats(self) -> dict[str, Any]:
        """The group's life: its generation, restarts and each rank's counters."""
        return ray.get(self.actor.stats.remote())

    def rank_names(self) -> list[str]:
        """The Ray actor names of the current ranks (``ray.get_actor`` finds them)."""
        return ray.get(self.actor.rank_names.remote())
