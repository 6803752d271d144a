"""The one engine interface every replica shape implements and its callers are typed against.

Owns ``SteppedEngine`` (what a step loop drives: deploy/async_engine.py's, over an
engine in this process or in a child process, deploy/engine_process.py) and
``EngineClient``: what the in-process engine (one rank or DP ranks in threads,
cluster/engine.py), the Ray engine group (actors/engine_group.py) and anything else
``AsyncEngine``, the validation scenarios and the Serve replica drive all offer; and
``EngineStats``, the snapshot ``stats`` returns, and ``RequestRefused``.

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


class RequestRefused(Exception):
    """Raised by ``SteppedEngine.step`` of an engine that answers adds later (one in
    another process): the add of ``request_id`` was refused with ``error`` (an
    ``EngineError`` / ``SamplingParamsError``) and nothing was queued; the next
    ``step`` call returns the step's outputs."""

    def __init__(self, request_id: str, error: Exception) -> None:
        super().__init__(request_id, error)
        self.request_id = request_id
        self.error = error


@runtime_checkable
class SteppedEngine(Protocol):
    """What a step loop drives: requests in, each step's delta outputs out.

    ``add_request`` queues a request (``n`` > 1: one sequence per sample, ids
    ``{id}#{i}``) or raises with nothing queued (an engine in another process raises
    its refusal from a later ``step``, as :class:`RequestRefused`); ``step`` returns
    the outputs of the requests that gained a token or finished in one step
    (``cluster.request.RequestOutput``, deltas); ``abort`` cancels a request and its
    samples (False when unknown or finished); ``stats`` is what the engine holds."""

    config: V41Config
    tokenizer: Tokenizer
    max_model_len: int

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...


@runtime_checkable
class EngineClient(SteppedEngine, Protocol):
    """A replica's engine in this process or driven from it, step by step: a
    ``SteppedEngine`` whose ``step`` runs the step, with its requests readable
    (``request``) and ``generate``, which runs prompts to completion and returns each
    sample's whole output, in prompt order."""

    def request(self, request_id: str) -> Request | None: ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]: ...
