"""SchedulerActor: the central scheduler of one engine group.

Owns the group's step loop in one Ray actor: a ``Engine`` (a scheduler and block
manager per DP rank, placement of each request on a rank) whose executor is the
group's ``RankGroup`` (each step every rank's ScheduledBatch and the packed DP
metadata, through the group's transport), and the group's health loop: while no step
runs, the ranks are pinged every ``GroupOptions.health_interval_s``. When a rank fails
(in a step or a ping), every in-flight request ends with finish_reason "error" and
the whole group restarts with empty pools, in the background (the failing step returns
its error outputs at once; the next step waits for the new ranks); outputs ended by the
health loop are handed out by the next ``step``. When the options ask for offload it
also starts the group's ``OffloadActor``, which outlives rank restarts: a group that
comes back with empty pools restores prefixes from it. Ray restarts the OffloadActor
when its process dies (empty); meanwhile ``RayOffloadConnector`` answers every lookup
with misses, so prompts are recomputed and the engine serves on.

The actor itself is the group's one point of failure: it holds every request and the
ranks' bookkeeping, and the ranks and the store die with it (it owns them). A client
sees it gone through ``check_health`` (``EngineGroup.check_alive``) and replaces the
whole group; in Serve that is the replica (``deploy.llm_server.LLMServer``).

Must not import: deploy.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

import ray

from dsv41.actors.group import GroupOptions, GroupPlacement, RankGroup, RankGroupDead, RankGroupFailure
from dsv41.actors.offload import OffloadActor, RayOffloadConnector
from dsv41.actors.output_wire import OutputFrame, OutputSender
from dsv41.cluster.engine import Engine
from dsv41.cluster.interface import EngineStats
from dsv41.cluster.options import EngineOptions, RankLayout
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.request import Request, RequestOutput
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.config import V41Config
from dsv41.model.source import ModelSource

logger = logging.getLogger(__name__)


class SchedulerActor:
    """One engine group's scheduler; use through ``actors.group.EngineGroup``. The
    actor is threaded (calls may arrive together, and the health loop is a thread of
    its own): one lock admits one caller of the engine and the ranks at a time."""

    def __init__(
        self, name: str, model: ModelSource, options: EngineOptions, dp: DPLayout, group_options: GroupOptions, placement: GroupPlacement
    ) -> None:
        self.group_options = group_options
        self.offload_actor: Any = None
        self.offload: RayOffloadConnector | None = None
        if options.offload_host_bytes:
            layout = RankLayout.build(model.config(), options)
            # Restarted by Ray when its process dies (a cache may come back empty);
            # calls in flight then fail rather than run twice.
            self.offload_actor = (
                ray.remote(OffloadActor)
                .options(
                    name=f"{name}-offload",
                    num_cpus=0,
                    max_restarts=-1,
                    scheduling_strategy=placement.strategy(placement.actors_bundle),
                )
                .remote(
                    layout.geometry.layout_id,
                    layout.geometry.page_bytes,
                    options.offload_host_bytes,
                    options.offload_disk_dir,
                    options.offload_disk_bytes,
                )
            )
            self.offload = RayOffloadConnector(self.offload_actor, layout.geometry.layout_id)
            ray.get(self.offload_actor.ping.remote(), timeout=group_options.start_timeout_s)
        self.ranks = RankGroup(name, model, options, dp, group_options, placement, self.offload)
        self.ranks.start()
        self.engine = Engine.over(model, dp, self.ranks, options, self.offload)
        self.num_health_checks = 0
        self._lock = threading.Lock()
        self._undelivered: list[RequestOutput] = []
        self._output_sender = OutputSender()
        self._last_contact = time.monotonic()
        self._stopping = threading.Event()
        self._health_thread = threading.Thread(target=self._health_loop, name=f"{name}-health", daemon=True)
        self._health_thread.start()

    def ready(self) -> int:
        return self.ranks.generation

    def check_health(self) -> None:
        """Answers at once (no lock: a step may be running) unless the group is dead
        (a generation failed to start: RankGroupDead). A failed rank is not a failure
        here: the group restarts it on its own."""
        if self.ranks.dead:
            raise RankGroupDead(f"group {self.ranks.name}: generation {self.ranks.generation} failed to start")

    def describe(self) -> tuple[V41Config, str, int]:
        """What a client needs to validate and encode requests: the config, the
        tokenizer (as its JSON) and the context limit."""
        return self.engine.config, self.engine.tokenizer.to_str(), self.engine.max_model_len

    def engine_stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def request(self, request_id: str) -> Request | None:
        with self._lock:
            return self.engine.request(request_id)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        with self._lock:
            self.engine.add_request(request_id, prompt_token_ids, params)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            return self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or while outputs the health loop ended
        are still to be handed out by ``step``."""
        with self._lock:
            return bool(self._undelivered) or self.engine.has_unfinished_requests()

    def step(self) -> OutputFrame:
        """One step of every rank, after the outputs of requests a failed health
        check ended; after a rank failure in the step, the error outputs of every
        request that was in flight (the group is serving again when it returns). The
        outputs travel as deltas (``actors.output_wire``)."""
        with self._lock:
            outputs, self._undelivered = self._undelivered, []
            outputs.extend(self.engine.step())
            self._last_contact = time.monotonic()
            return self._output_sender.frame(outputs)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]:
        """Runs prompts to completion (each ends in error if the group fails)."""
        with self._lock:
            outputs = self.engine.generate(prompts, params)
            self._last_contact = time.monotonic()
            return outputs

    def health(self) -> list[int]:
        """Pings every rank; if one is down, restarts the group (ending in-flight
        requests, whose outputs the next ``step`` hands out) and pings the new one."""
        with self._lock:
            answers = self._check_health()
            return self.ranks.health() if answers is None else answers

    def _check_health(self) -> list[int] | None:
        """Every rank's answer to a ping; if one is down, ends the in-flight requests,
        restarts the group (in the background) and returns None."""
        self.num_health_checks += 1
        self._last_contact = time.monotonic()
        try:
            return self.ranks.health()
        except RankGroupFailure as exc:
            self._undelivered.extend(self.engine.recover(f"health check failed: {exc}"))
            return None

    def _health_loop(self) -> None:
        """Pings the ranks once no step or ping has reached them for an interval (not
        while a new generation starts). Ends when the group is stopped or dead."""
        interval = self.group_options.health_interval_s
        wait_s = interval
        while not self._stopping.wait(wait_s):
            with self._lock:
                wait_s = self._last_contact + interval - time.monotonic()
                if self._stopping.is_set() or self.ranks.starting or wait_s > 0:
                    wait_s = max(wait_s, interval / 4)
                    continue
                wait_s = interval
                try:
                    self._check_health()
                except RankGroupDead:
                    logger.exception("group %s: dead, no more health checks", self.ranks.name)
                    return

    def stats(self) -> dict[str, Any]:
        """The group's life: its generation, transport, restarts, health checks, the
        last failure, each rank's PAGE counters and the offload store's
        (``RayOffloadConnector.stats``)."""
        with self._lock:
            return {
                "generation": self.ranks.generation,
                "transport": self.group_options.transport,
                "restarts": self.engine.num_restarts,
                "health_checks": self.num_health_checks,
                "last_failure": self.ranks.last_failure,
                "ranks": [vars(s.block_manager.stats()) for s in self.engine.schedulers],
                "offload": self.offload.stats() if self.offload is not None else None,
            }

    def rank_names(self) -> list[str]:
        with self._lock:
            return self.ranks.rank_names()

    def shutdown(self) -> None:
        self._stopping.set()
        self._health_thread.join()
        with self._lock:
            self.ranks.stop()
            if self.offload_actor is not None:
                ray.kill(self.offload_actor)
                self.offload_actor = None
