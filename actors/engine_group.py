"""The client handle of an engine group: the engine interface over Ray.

Owns ``EngineGroup``, the context-managed client, and ``check_group_options`` (what its
wires cannot carry, refused before Ray starts): the client starts a ``SchedulerActor``
(actors/scheduler.py, which owns the group's RankGroup) in the group's placement, and
forwards the engine interface to it; each step's outputs (the engine's deltas) come back
in a numbered frame (``actors.output_wire``).

Lifetimes (stated here only; actors/group.py refers here) follow Ray's ownership: the
client owns the SchedulerActor, which owns the ranks and the OffloadActor, and an
actor that is not detached dies with its owner, so whatever kills the client or the
scheduler takes everything below it along. A placement group outlives its creator
(until the creator's job ends), so the group never creates one it does not remove: the
placement is given (a Serve replica's own, created and removed by Serve with the
replica) or made and removed by the EngineGroup.

Must not import: deploy.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path
from typing import Any, Sequence

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from tokenizers import Tokenizer

from dsv41.actors.group import GroupOptions, GroupPlacement, RankGroupDead
from dsv41.actors.output_wire import OutputReceiver
from dsv41.actors.scheduler import SchedulerActor
from dsv41.cluster.interface import EngineClient, EngineStats
from dsv41.cluster.memory_plan import sized_options
from dsv41.cluster.options import EngineError, EngineOptions
from dsv41.cluster.options import engine_options as parse_engine_options
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.request import Request, RequestOutput
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.source import ModelSource

logger = logging.getLogger(__name__)


def check_group_options(options: EngineOptions) -> None:
    """Refuses engine options the group's wires cannot carry, before Ray or any actor
    starts: speculation (the step and result wires carry no drafts) and async
    scheduling (a rank actor runs each step to its result; no step is in flight on
    the wire)."""
    if options.speculative_method is not None:
        raise EngineError(
            f"speculative_method: {options.speculative_method!r} on the Ray engine group (allowed: None; "
            "DSpark runs on the in-process engine for now: the step and result wires carry no drafts)"
        )
    if options.async_scheduling:
        raise EngineError(
            "async_scheduling: True on the Ray engine group (allowed: False; its rank actors run each step to "
            "its result, and the step wire carries no step in flight: async scheduling runs on the in-process "
            "engine, one rank or DP ranks in threads)"
        )


class EngineGroup(EngineClient):
    """Client of one engine group: ``with EngineGroup(model, dp=2) as group:``
    starts a SchedulerActor and its ranks, and stops them on exit. ``model`` is a
    checkpoint directory or a generated slice (``model.source.ModelSource``), which
    every rank loads (its expert shard) on its own device.

    ``name`` prefixes every Ray actor name of the group (``{name}-scheduler``,
    ``{name}-offload``, ``{name}-g{generation}-rank{i}``): groups that share a Ray
    namespace need distinct names (the default is a fresh one). ``placement``: the
    placement group the group runs in, which its caller made and removes (a Serve
    replica's own); without one the group makes its own and removes it on close."""

    def __init__(
        self,
        model: str | Path | ModelSource,
        *,
        dp: int = 1,
        expert_mode: str = "ep",
        backend: str = "gloo",
        group_options: GroupOptions = GroupOptions(),
        name: str | None = None,
        placement: GroupPlacement | None = None,
        **engine_options: object,
    ) -> None:
        self.name = name if name is not None else f"dsv41-{uuid.uuid4().hex[:8]}"
        self.model = ModelSource.parse(model)
        self.dp = DPLayout(dp, expert_mode, backend)
        options = parse_engine_options(dict(engine_options))
        check_group_options(options)
        # Checks the replica's options and sizes its pools once, here, so every actor
        # builds the same layout from the options it is sent.
        self.options = sized_options(self.model, self.dp, options)
        self.group_options = group_options
        self._given_placement = placement
        self._own_placement: PlacementGroup | None = None
        self._actor_class = ray.remote(SchedulerActor)
        self.actor: Any = None
        self._outputs = OutputReceiver()

    def __enter__(self) -> "EngineGroup":
        self._outputs = OutputReceiver()
        placement = self._given_placement
        if placement is None:
            placement = GroupPlacement.create(self.name, self.dp.world, self.group_options)
            self._own_placement = placement.placement_group
        try:
            self.actor = self._actor_class.options(
                name=f"{self.name}-scheduler",
                num_cpus=0,
                max_concurrency=4,
                scheduling_strategy=placement.strategy(placement.actors_bundle),
            ).remote(self.name, self.model, self.options, self.dp, self.group_options, placement)
            ray.get(self.actor.ready.remote())
            self.config, tokenizer_json, self.max_model_len = ray.get(self.actor.describe.remote())
        except BaseException:
            self.close()
            raise
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops the group and releases what it holds; idempotent. A scheduler that
        died took its ranks and store along (it owned them); one that does not answer
        within the start deadline is killed."""
        actor, self.actor = self.actor, None
        if actor is not None:
            try:
                ray.get(actor.shutdown.remote(), timeout=self.group_options.start_timeout_s)
            except ray.exceptions.RayError as exc:
                logger.warning("group %s: the scheduler did not shut down (%s); killing it", self.name, type(exc).__name__)
            ray.kill(actor)
        if self._own_placement is not None:
            remove_placement_group(self._own_placement)
            self._own_placement = None

    async def check_alive(self) -> None:
        """Raises RankGroupDead when the group cannot serve: its scheduler is dead or
        gives no answer within a step's deadline (it answers without waiting for a
        step), or its ranks could not be started again."""
        if self.actor is None:
            raise RankGroupDead(f"group {self.name}: closed")
        try:
            await asyncio.wait_for(self.actor.check_health.remote(), self.group_options.step_timeout_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
            raise RankGroupDead(f"group {self.name}: the scheduler cannot serve ({type(exc).__name__})") from exc

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]:
        return ray.get(self.actor.generate.remote([list(p) for p in prompts], params))

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        ray.get(self.actor.add_request.remote(request_id, list(prompt_token_ids), params))

    def step(self) -> list[RequestOutput]:
        return self._outputs.outputs(ray.get(self.actor.step.remote()))

    def abort(self, request_id: str) -> bool:
        return ray.get(self.actor.abort.remote(request_id))

    def has_unfinished_requests(self) -> bool:
        return ray.get(self.actor.has_unfinished_requests.remote())

    def request(self, request_id: str) -> Request | None:
        """A snapshot of an unfinished request's record (None once finished)."""
        return ray.get(self.actor.request.remote(request_id))

    def stats(self) -> EngineStats:
        """Requests by queue and every rank's PAGE counters (EngineClient.stats)."""
        return ray.get(self.actor.engine_stats.remote())

    def group_stats(self) -> dict[str, Any]:
        """The group's life: its generation, restarts and each rank's counters."""
        return ray.get(self.actor.stats.remote())

    def rank_names(self) -> list[str]:
        """The Ray actor names of the current ranks (``ray.get_actor`` finds them)."""
        return ray.get(self.actor.rank_names.remote())
