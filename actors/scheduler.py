"""SchedulerActor: the central scheduler of one engine group.

Owns the group's step loop in one Ray actor: a ``DPEngine`` (a scheduler and block
manager per DP rank, placement of each request on a rank) whose executor is the
group's ``RankGroup`` — each step one call per rank carrying its ScheduledBatch and
the packed DP metadata. When a rank fails, every in-flight request ends with
finish_reason "error" and the whole group restarts with empty pools (DPEngine.step handles RankFailure).

Must not import: deploy.
"""

from __future__ import annotations

from typing import Any, Sequence

from actors.group import GroupOptions, RankGroup, RankGroupFailure
from cluster.dp_engine import DPEngine, DPLayout
from cluster.engine import EngineOptions, EngineStats
from cluster.request import Request, RequestOutput, SamplingParams
from model.config import V41Config


class SchedulerActor:
    """One engine group's scheduler; use through ``actors.group.EngineGroup``."""

    def __init__(
        self, name: str, model_dir: str, options: EngineOptions, dp: DPLayout, group_options: GroupOptions
    ) -> None:
        self.ranks = RankGroup(name, model_dir, options, dp, group_options)
        self.ranks.start()
        self.engine = DPEngine.over(model_dir, dp, self.ranks, options)

    def ready(self) -> int:
        return self.ranks.generation

    def describe(self) -> tuple[V41Config, str, int]:
        """What a client needs to validate and encode requests: the config, the
        tokenizer (as its JSON) and the context limit."""
        return self.engine.config, self.engine.tokenizer.to_str(), self.engine.max_model_len

    def engine_stats(self) -> EngineStats:
        return self.engine.stats()

    def request(self, request_id: str) -> Request | None:
        return self.engine.request(request_id)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step of every rank; after a rank failure, the error outputs of every
        request that was in flight (the group is serving again when it returns)."""
        return self.engine.step()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]:
        """Runs prompts to completion (each ends in error if the group fails)."""
        return self.engine.generate(prompts, params)

    def health(self) -> list[int]:
        """Pings every rank; restarts the group (ending in-flight requests) if one
        is down."""
        try:
            return self.ranks.health()
        except RankGroupFailure as exc:
            self.engine.fail_all(f"health check failed: {exc}")
            self.engine.num_restarts += 1
            self.ranks.restart()
            return self.ranks.health()

    def stats(self) -> dict[str, Any]:
        return {
            "generation": self.ranks.generation,
            "restarts": self.engine.num_restarts,
            "ranks": [vars(s.block_manager.stats()) for s in self.engine.schedulers],
        }

    def rank_names(self) -> list[str]:
        return [self.ranks.rank_name(r) for r in range(len(self.ranks.ranks))]

    def shutdown(self) -> None:
        self.ranks.stop()
