"""The one engine interface every replica shape implements and its callers are typed against.

Owns ``EngineClient``: what the in-process engine (one rank or DP ranks in threads,
cluster/engine.py), the Ray engine group (actors/engine_group.py) and anything else
``AsyncEngine``, the validation scenarios and the Serve replica drive all offer; and
``EngineStats``, the snapshot ``stats`` returns.

Must not import: actors, deploy, ray, cluster.engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from tokenizers import Tokenizer

from dsv41.cache.block_manager import BlockManagerStats
from dsv41.cluster.request import Request, RequestOutput
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.config import V41Config


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of what a replica holds: requests by queue, and each rank's PAGE
    and prefix-cache counters and how many requests its scheduler preempted (both in
    rank order)."""

    requests_running: int
    requests_waiting: int
    ranks: tuple[BlockManagerStats, ...]
    preemptions: tuple[int, ...]


@runtime_checkable
class EngineClient(Protocol):
    """A replica's engine: requests in, each step's delta outputs out.

    ``add_request`` queues a request (``n`` > 1: one sequence per sample, ids
    ``{id}#{i}``) or raises with nothing queued; ``step`` runs one step and returns the
    outputs of the requests that gained a token or finished in it
    (``cluster.request.RequestOutput``, deltas); ``abort`` cancels a request and its
    samples (False when unknown or finished); ``generate`` runs prompts to completion
    and returns each sample's whole output, in prompt order."""

    config: V41Config
    tokenizer: Tokenizer
    max_model_len: int

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def request(self, request_id: str) -> Request | None: ...

    def stats(self) -> EngineStats: ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]: ...
