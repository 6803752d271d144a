"""The engine: the one step loop of a model replica, over however many DP ranks.

Owns ``Engine``, the public Python interface of DESIGN.md (``from_pretrained``,
``add_request``, ``step``, ``abort``, ``generate``; cluster/interface.py's
``EngineClient``) and what joins its parts: request validation (nothing is queued for a
bad request), a scheduler and block manager per DP rank (where every request lives),
the placement of each request on one rank, one step of every rank at a time through a
``DPStepExecutor`` (cluster/ranks.py: the one rank in this thread, ranks in threads, or
Ray actors), stop checking and the delta outputs handed back, and the restart after a
lost rank. A replica of one rank is this same loop with one scheduler; it also offers
``prompt_logits``, the parity path of ``dsv41 logits``, and async scheduling (one step
launched while the previous one's draws are on their way, ``_step_async``).

Must not import: actors, deploy, ray.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
from tokenizers import Tokenizer

from dsv41.cache.block_manager import BlockManager
from dsv41.cache.geometry import V41PoolGeometry
from dsv41.cache.pools import PoolSize
from dsv41.cluster.batch import DPMetadata, NewRequestData, ScheduledBatch, ScheduledSegment, SlotReset
from dsv41.cluster.interface import EngineClient, EngineStats
from dsv41.cluster.memory_plan import sized_options
from dsv41.cluster.offload_connector import LocalOffload, OffloadConnector
from dsv41.cluster.options import (
    EngineError,
    EngineOptions,
    RankLayout,
    check_replica_options,
    default_max_model_len,
    engine_options,
)
from dsv41.cluster.placement import RankLoad, place
from dsv41.cluster.ranks import (
    DPError,
    DPLayout,
    DPRank,
    DPStepExecutor,
    LocalRank,
    RankFailure,
    StepLauncher,
    ThreadedRanks,
)
from dsv41.cluster.request import CumulativeOutputs, Request, RequestOutput, RequestStatus, SeedSource
from dsv41.cluster.runner import LaunchedStep, ModelRunner, StepResult, stage_rows
from dsv41.cluster.sampler import prompt_logprobs
from dsv41.cluster.sampling_guide import SamplingGuide, penalty_counts
from dsv41.cluster.sampling_params import SamplingParams, SamplingParamsError
from dsv41.cluster.scheduler import Scheduler
from dsv41.cluster.stopping import StopChecker
from dsv41.cluster.tbo import microbatch_rows, split
from dsv41.model.config import V41Config
from dsv41.model.kernels import load_kernels
from dsv41.model.params import ModelParams
from dsv41.model.source import ModelSource

if TYPE_CHECKING:
    from dsv41.cluster.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

PARITY_REQUEST_ID = "__prompt_logits__"


@dataclass(frozen=True)
class InFlightStep:
    """Under async scheduling, the step the ranks run while the next is scheduled:
    each rank's batch and launch, and the requests it was scheduled for (a request id
    that finished and was reused since names another request, whose tokens these are
    not)."""

    batches: tuple[ScheduledBatch, ...]
    launched: tuple[LaunchedStep, ...]
    requests: dict[str, Request]


@dataclass(frozen=True)
class PromptScores:
    """Every position's logits [len, vocab] and, per selecting layer, every
    position's top-k entries [len, index_topk]."""

    logits: torch.Tensor
    selections: dict[int, torch.Tensor]


class Engine(EngineClient):
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
        check_replica_options(config, options, world)
        if options.async_scheduling and not isinstance(executor, StepLauncher):
            raise EngineError(
                f"async_scheduling: True with ranks run by a {type(executor).__name__} (allowed: ranks in this "
                "process, LocalRank or ThreadedRanks, which launch a step without waiting for its draws)"
            )
        self.config = config
        self.tokenizer = tokenizer
        self.options = options
        self.layout = RankLayout.build(config, options)
        self.world = world
        self.executor = executor
        self.offload = offload
        self.stop_checker = StopChecker(tokenizer, config.eos_token_id)
        self.seeds = SeedSource(options.seed)
        self.max_model_len = default_max_model_len(
            config, options, self.layout.pool_size.num_pages * options.block_size
        )
        self.schedulers = self._fresh_schedulers()
        # Under DP attention with decode graphs every rank picks the step's graph from
        # the DP metadata's PAGE counts (counted in PAGEs of this size).
        graphs = self.layout.decode_buckets(config, options) is not None
        self._graph_block_size = options.block_size if graphs and world > 1 else None
        self._requests: dict[str, Request] = {}
        self._children: dict[str, tuple[str, ...]] = {}
        self._rank_of: dict[str, int] = {}
        self._step_id = 0
        self._in_flight: InFlightStep | None = None
        self.num_restarts = 0
        self._structured: StructuredOutputManager | None = None
        logger.info(
            "engine: %d rank(s), %d PAGEs x %d tokens, %d STATE slots per rank, layout %s",
            world,
            self.layout.pool_size.num_pages,
            options.block_size,
            self.layout.num_slots,
            self.layout.geometry.layout_id,
        )

    # -- building ---------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model: str | Path | ModelSource, **options: object) -> "Engine":
        """Loads ``model`` (a checkpoint directory in the official format, or a
        generated slice: model/source.py) into a replica of one rank in this thread.
        Options are EngineOptions' fields; unknown ones are refused."""
        source = ModelSource.parse(model)
        parsed = sized_options(source, DPLayout(1), engine_options(options))
        params, tokenizer = source.load_params(
            dtype=parsed.dtype, device=parsed.device, weight_storage=parsed.weight_storage
        )
        return cls.from_params(params, tokenizer, parsed)

    @classmethod
    def from_params(cls, params: ModelParams, tokenizer: Tokenizer, options: EngineOptions) -> "Engine":
        """A replica of one rank in this thread over loaded weights (moved to
        ``options.device``), with its own offload store when ``offload_host_bytes`` asks."""
        check_replica_options(params.config, options, 1)
        layout = RankLayout.build(params.config, options)
        store = layout.offload_store(options)
        offload = LocalOffload(store) if store is not None else None
        rank = DPRank(
            params.to(options.device),
            layout,
            0,
            None,
            device=options.device,
            kernels=load_kernels(options.kernel_backend),
            offload=offload,
            batch_invariant=bool(options.batch_invariant),
            fp8_activations=options.fp8_activations,
            decoder_replay=options.decoder_swa_bounded_replay,
            decode_graphs=layout.decode_buckets(params.config, options),
            token_graphs=layout.token_buckets(options),
            feed_samples=options.async_scheduling,
        )
        return cls(params.config, tokenizer, options, 1, LocalRank(rank), offload)

    @classmethod
    def over(
        cls,
        model: ModelSource,
        dp: DPLayout,
        executor: DPStepExecutor,
        options: EngineOptions,
        offload: OffloadConnector | None = None,
    ) -> "Engine":
        """The engine of ranks already running ``model`` under ``dp`` (with
        ``offload``, the store its ranks publish to); it reads the config and
        tokenizer only, never a weight."""
        return cls(model.config(), model.tokenizer(), options, dp.world, executor, offload)

    @classmethod
    def in_process(cls, model: str | Path | ModelSource, dp: DPLayout, **options: object) -> "Engine":
        """A replica whose ranks are threads of this process (tests, one-box runs),
        sharing one in-process offload store when ``offload_host_bytes`` asks."""
        source = ModelSource.parse(model)
        parsed = sized_options(source, dp, engine_options(options))
        store = RankLayout.build(source.config(), parsed).offload_store(parsed)
        offload = LocalOffload(store) if store is not None else None
        return cls.over(source, dp, ThreadedRanks(source, parsed, dp, offload), parsed, offload)

    def _fresh_schedulers(self) -> list[Scheduler]:
        return [self.layout.scheduler(self.config, self.options, self.offload) for _ in range(self.world)]

    # -- a replica of one rank --------------------------------------------------------

    @property
    def runner(self) -> ModelRunner:
        """The ModelRunner of a replica of one rank in this thread."""
        if not isinstance(self.executor, LocalRank):
            raise EngineError(f"runner: the engine's ranks are a {type(self.executor).__name__} (allowed: one local rank)")
        return self.executor.runner

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of a replica of one rank."""
        if self.world != 1:
            raise EngineError(f"scheduler: the engine has {self.world} ranks (allowed: one; see schedulers)")
        return self.schedulers[0]

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    @property
    def params(self) -> ModelParams:
        return self.runner.params

    @property
    def geometry(self) -> V41PoolGeometry:
        return self.layout.geometry

    @property
    def pool_size(self) -> PoolSize:
        return self.layout.pool_size

    @property
    def structured(self) -> StructuredOutputManager:
        """The grammar matchers and compiled-grammar cache, built with the first
        request that has a grammar (the vocabulary tables cost a pass over it)."""
        if self._structured is None:
            # xgrammar takes seconds to import: only an engine asked for a grammar pays it.
            from dsv41.cluster.structured_output import GrammarCache, StructuredOutputManager, grammar_tokenizer_info

            info = grammar_tokenizer_info(self.tokenizer, self.config.vocab_size, [self.config.eos_token_id])
            self._structured = StructuredOutputManager(GrammarCache(info))
        return self._structured

    # -- requests -----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Queues a request (``n`` > 1: one sequence per sample, ids ``{id}#{i}``).
        Raises EngineError / SamplingParamsError with nothing queued when it cannot run,
        among them a request the empty pools of one rank could not hold: its prompt
        and ``max_tokens`` in PAGEs (a checkpoint image is never needed: an admission
        resumes without one that does not fit, and a checkpoint is skipped when PAGEs
        are short). Each sample of ``n`` > 1 is a sequence of its own and need not fit
        beside the others."""
        if not isinstance(params, SamplingParams):
            raise EngineError(f"params: expected SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise EngineError(f"request_id: must be a non-empty string, got {request_id!r}")
        if request_id in self._requests or request_id in self._children:
            raise EngineError(f"request_id: {request_id!r} is already running")
        prompt = tuple(prompt_token_ids)
        if not prompt:
            raise EngineError("prompt_token_ids: empty (allowed: at least one token)")
        if not all(isinstance(t, int) and 0 <= t < self.config.vocab_size for t in prompt):
            raise EngineError(f"prompt_token_ids: every id must be an integer in [0, {self.config.vocab_size})")
        self._check_fits_pool(request_id, len(prompt), params)
        params.validate_for(self.config.vocab_size, self.max_model_len, len(prompt))
        if self.options.num_speculative_tokens and (params.structured_outputs is not None or params.uses_penalties):
            field = "structured_outputs" if params.structured_outputs is not None else next(
                name for name, off in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1))
                if getattr(params, name) != off
            )
            raise SamplingParamsError(
                f"{field}: grammars and presence / frequency / repetition penalties are not served with speculative "
                f"decoding (speculative_method={self.options.speculative_method!r}): a draft's row would be sampled "
                "without the state the tokens before it leave"
            )
        if params.structured_outputs is not None:
            self.structured.cache.get(params.structured_outputs)  # compiled (or refused) before anything is queued
        ids = (request_id,) if params.n == 1 else tuple(f"{request_id}#{i}" for i in range(params.n))
        seeds = self.seeds.seeds_for(params)
        now = time.monotonic()
        for rid, seed in zip(ids, seeds):
            request = Request(rid, prompt, params, sampling_seed=seed, arrival_time=now)
            if params.structured_outputs is not None:
                self.structured.add(rid, params.structured_outputs)
            self._requests[rid] = request
            self._place(request)
        if params.n > 1:
            self._children[request_id] = ids

    def _check_fits_pool(self, request_id: str, prompt_len: int, params: SamplingParams) -> None:
        block_size = self.options.block_size
        pages = self.layout.pool_size.num_pages
        tokens = prompt_len + params.max_tokens
        if tokens > pages * block_size:
            raise EngineError(
                f"request {request_id!r}: prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {tokens} "
                f"tokens need {-(-tokens // block_size)} PAGEs of {block_size} tokens, and the pools hold "
                f"{pages} PAGEs ({pages * block_size} tokens) (allowed: prompt + max_tokens <= {pages * block_size})"
            )

    def _place(self, request: Request) -> None:
        """Queues a validated request on the rank with the longest cached prefix of it,
        then the least loaded (cluster/placement.py)."""
        rank = 0
        if self.world > 1:
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

    def abort(self, request_id: str) -> bool:
        """Cancels a request (all its samples) wherever it is; its PAGEs and slot are
        freed at once. False if it is unknown or already finished."""
        ids = self._children.pop(request_id, (request_id,))
        aborted = False
        for rid in ids:
            request = self._requests.pop(rid, None)
            rank = self._rank_of.pop(rid, None)
            if request is None or request.is_finished or rank is None:
                continue
            request.finish(RequestStatus.FINISHED_ABORTED)
            self.schedulers[rank].finish(request)
            self._release_grammar(rid)
            aborted = True
        return aborted

    def request(self, request_id: str) -> Request | None:
        """The live record of an unfinished request (None once finished or unknown)."""
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or while a rank still holds a request
        that left it: the step that tells it to drop them is work too, else an idle
        engine's ranks would keep the last requests' state until the next arrival."""
        return self._in_flight is not None or any(s.has_unfinished() or s.has_releases() for s in self.schedulers)

    def stats(self) -> EngineStats:
        return EngineStats(
            requests_running=sum(len(s.running) for s in self.schedulers),
            requests_waiting=sum(len(s.waiting) for s in self.schedulers),
            ranks=tuple(s.block_manager.stats() for s in self.schedulers),
            preemptions=tuple(s.num_preemptions for s in self.schedulers),
        )

    # -- the step loop --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step of every rank; returns the delta outputs of the
        requests that got a token or finished in it (after a lost rank: every request
        in flight, ended in error, and the ranks restarted). A step with no rows still
        runs when it releases requests, so that no rank holds a request that left.
        Under async scheduling the outputs are the previous step's (``_step_async``)."""
        if self.options.async_scheduling:
            return self._step_async()
        batches = tuple(self._guided(s.schedule()) for s in self.schedulers)
        if all(b.is_empty and not b.released_request_ids for b in batches):
            return []
        self._mark_scheduled(batches, time.monotonic())
        self._step_id += 1
        try:
            results = self.executor.execute(batches, self._step_metadata(batches))
        except RankFailure as exc:
            return self.recover(f"a rank failed: {exc}")
        sampled_at = time.monotonic()
        outputs: list[RequestOutput] = []
        for scheduler, batch, result in zip(self.schedulers, batches, results):
            outputs.extend(self._apply(scheduler, batch, result, sampled_at))
        return outputs

    def _step_metadata(self, batches: tuple[ScheduledBatch, ...]) -> torch.Tensor | None:
        """The step's packed DPMetadata for ``batches`` (None for a replica of one rank)."""
        if self.world == 1:
            return None
        window = self.config.sliding_window if self.options.decoder_swa_bounded_replay else None
        stages = None if window is None else [stage_rows(b, window) for b in batches]
        microbatches = None
        if self.options.enable_tbo_prefill:
            token_split = self.options.tbo_prefill_token_split
            microbatches = [microbatch_rows(split(b, token_split), window) for b in batches]
        return DPMetadata.of(self._step_id, batches, stages, microbatches, self._graph_block_size).to_wire()

    def _step_async(self) -> list[RequestOutput]:
        """Async scheduling: schedules and launches a step on every rank while the
        previous one runs on the devices, then waits for the previous one's draws and
        returns its outputs, so the host's scheduling, staging and output work of one
        step overlaps the devices' work of the other. A row whose token the running
        step draws carries a placeholder, read on its rank's device. A request that
        stops at a step has a row in the next, whose draw is dropped; the tokens of
        every request are the synchronous loop's. When a running request's sampling
        reads its tokens on the host (a grammar, penalties), the step in flight is
        finished before scheduling. A lost rank ends every request, as in ``step``."""
        try:
            return self._schedule_and_launch()
        except RankFailure as exc:
            return self.recover(f"a rank failed: {exc}")

    def _schedule_and_launch(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and any(
            r.num_pending_tokens and (r.params.uses_penalties or r.params.structured_outputs is not None)
            for scheduler in self.schedulers
            for r in scheduler.running
        ):
            outputs.extend(self._finish_in_flight())
        batches = tuple(self._guided(s.schedule()) for s in self.schedulers)
        if all(b.is_empty for b in batches):
            # Nothing to run ahead: the ranks drop what left them, the step in flight ends.
            if any(b.released_request_ids for b in batches):
                self._step_id += 1
                self._launch(batches)
            outputs.extend(self._finish_in_flight())
            return outputs
        self._mark_scheduled(batches, time.monotonic())
        self._step_id += 1
        requests = {seg.request_id: self._requests[seg.request_id] for b in batches for seg in b.segments}
        launched = self._launch(batches)
        previous, self._in_flight = self._in_flight, InFlightStep(batches, launched, requests)
        outputs.extend(self._finish(previous))
        return outputs

    def _launch(self, batches: tuple[ScheduledBatch, ...]) -> tuple[LaunchedStep, ...]:
        launcher = self.executor
        if not isinstance(launcher, StepLauncher):
            raise EngineError(f"async_scheduling: the engine's ranks are a {type(launcher).__name__}, which launches no step")
        return tuple(launcher.launch(batches, self._step_metadata(batches)))

    def _finish_in_flight(self) -> list[RequestOutput]:
        previous, self._in_flight = self._in_flight, None
        return self._finish(previous)

    def _finish(self, step: InFlightStep | None) -> list[RequestOutput]:
        """Waits for a launched step's draws on every rank and commits them."""
        if step is None:
            return []
        results = [launched.result() for launched in step.launched]
        sampled_at = time.monotonic()
        outputs: list[RequestOutput] = []
        for scheduler, batch, result in zip(self.schedulers, step.batches, results):
            outputs.extend(self._apply(scheduler, batch, result, sampled_at, step.requests))
        return outputs

    def _guided(self, batch: ScheduledBatch) -> ScheduledBatch:
        """The batch with a SamplingGuide on each sampling segment whose request has a
        grammar (the mask its matcher allows now) or penalties (its token counts)."""
        segments = list(batch.segments)
        changed = False
        for i, seg in enumerate(segments):
            request = self._requests.get(seg.request_id)
            if not seg.sample or request is None:
                continue
            grammar = self._structured is not None and seg.request_id in self._structured
            if not grammar and not request.params.uses_penalties:
                continue
            ids, counts = (
                penalty_counts(request.prompt_token_ids, request.output_token_ids)
                if request.params.uses_penalties
                else ((), ())
            )
            allowed = self.structured.allowed_tokens(seg.request_id) if grammar else None
            segments[i] = replace(seg, guide=SamplingGuide(allowed, ids, counts))
            changed = True
        return replace(batch, segments=tuple(segments)) if changed else batch

    def _mark_scheduled(self, batches: Sequence[ScheduledBatch], now: float) -> None:
        """Stamps the requests the scheduler gives rows for the first time (their queue
        time ends here; a preempted request keeps its first stamp, as in vLLM)."""
        for batch in batches:
            for seg in batch.segments:
                request = self._requests.get(seg.request_id)
                if request is not None and request.scheduled_time is None:
                    request.scheduled_time = now

    def _apply(
        self,
        scheduler: Scheduler,
        batch: ScheduledBatch,
        result: StepResult,
        sampled_at: float,
        scheduled_for: dict[str, Request] | None = None,
    ) -> list[RequestOutput]:
        """Commits a batch's forward on its scheduler; returns the requests that got a
        token or finished in it. ``scheduled_for``: the requests the batch was
        scheduled for (async scheduling), where a live request under the same id is
        another's."""
        outputs: list[RequestOutput] = []
        for seg in batch.segments:
            request = self._requests.get(seg.request_id)
            if scheduled_for is not None and request is not scheduled_for.get(seg.request_id):
                request = None
            if request is not None and seg.request_id in result.row_logits:
                self._record_prompt_logprobs(request, seg, result.row_logits[seg.request_id])
            if request is None or not seg.sample:
                scheduler.commit(seg, request)
                continue
            if self.options.async_scheduling:
                request.num_pending_tokens -= 1
            # A verify emits its accepted drafts, then the target's token; the tokens
            # go in before the commit, which hashes the PAGEs the kept rows fill.
            accepted = result.accepted.get(seg.request_id, ())
            if request.first_token_time is None:
                request.first_token_time = sampled_at
            stopped = False
            for token in (*accepted, result.sampled[seg.request_id]):
                request.append_output_token(token.token_id, token.logprobs)
                if seg.guide is not None and seg.guide.allowed_tokens is not None:
                    self.structured.accept(seg.request_id, token.token_id)
                stopped = self.stop_checker.check_stop(request)
                if stopped:
                    break
            committed = seg.end - seg.num_draft_tokens + len(accepted)
            scheduler.commit(seg, request, min(committed, request.num_tokens), result.drafts.get(seg.request_id, ()))
            if stopped:
                scheduler.finish(request)
                self._forget(request)
            outputs.append(request.take_output())
        return outputs

    def recover(self, reason: str) -> list[RequestOutput]:
        """After a rank failure: ends every unfinished request, counts the restart and
        restarts the ranks (which then hold nothing). Returns the ended requests'
        outputs."""
        outputs = self._end_all(reason, ranks_kept=False)
        self.num_restarts += 1
        self.executor.restart()
        return outputs

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """Ends every unfinished request with finish_reason "error" and starts every
        rank's bookkeeping afresh (nothing the ranks cached can be hit again); the
        ranks keep running, and the next step's batches tell them to drop every
        request they hold. Returns the ended requests' final outputs."""
        return self._end_all(reason, ranks_kept=True)

    def _end_all(self, reason: str, *, ranks_kept: bool) -> list[RequestOutput]:
        logger.error("engine: ending %d request(s): %s", len(self._requests), reason)
        outputs = []
        for request in list(self._requests.values()):
            if not request.is_finished:
                request.finish(RequestStatus.FINISHED_ERROR)
                outputs.append(request.take_output())
        self._requests.clear()
        self._children.clear()
        self._rank_of.clear()
        # Its draws are dropped; the device finishes it before any later step.
        self._in_flight = None
        if self._structured is not None:
            self._structured.clear()
        held = [s.requests_on_rank() if ranks_kept else () for s in self.schedulers]
        self.schedulers = self._fresh_schedulers()
        for scheduler, request_ids in zip(self.schedulers, held):
            scheduler.release_on_rank(request_ids)
        return outputs

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]:
        """Runs prompts to completion; one whole output per prompt (per sample when
        n > 1), in prompt order."""
        prefix = f"generate-{next(_generate_ids)}"
        order: list[str] = []
        for i, prompt in enumerate(prompts):
            rid = f"{prefix}-{i}"
            self.add_request(rid, prompt, params)
            order.extend(self._children.get(rid, (rid,)))
        wanted = set(order)
        whole = CumulativeOutputs()
        final: dict[str, RequestOutput] = {}
        while len(final) < len(order):
            for out in self.step():
                if out.request_id in wanted and (done := whole.add(out)) is not None:
                    final[out.request_id] = done
        return [final[rid] for rid in order]

    def _release_grammar(self, request_id: str) -> None:
        if self._structured is not None:
            self._structured.remove(request_id)

    def _forget(self, request: Request) -> None:
        self._release_grammar(request.request_id)
        self._requests.pop(request.request_id, None)
        self._rank_of.pop(request.request_id, None)
        parent = request.request_id.rpartition("#")[0]
        if parent in self._children and all(rid not in self._requests for rid in self._children[parent]):
            del self._children[parent]

    def _record_prompt_logprobs(self, request: Request, seg: ScheduledSegment, logits: torch.Tensor) -> None:
        entries = request.prompt_logprobs
        if entries is None:
            return
        prompt = request.prompt_token_ids
        # Row i predicts the token after position start + i; after a preemption the
        # recomputed rows that were already reported are skipped.
        for i in range(seg.length):
            target = seg.start + i + 1
            if target == len(entries) and target < len(prompt):
                entries.extend(prompt_logprobs(logits[i : i + 1], [prompt[target]], request.params.prompt_logprobs))

    # -- arithmetic checks ----------------------------------------------------------------

    def prompt_logits(self, token_ids: Sequence[int], chunk_sizes: Sequence[int] | None = None) -> PromptScores:
        """Logits and selections of every position of one prompt, fed to the paged
        runtime of a replica of one local rank in ``chunk_sizes`` (cycling; default:
        one chunk) outside the scheduler. The engine must be idle; nothing of the run
        stays cached."""
        runner = self.runner
        if self.scheduler.has_unfinished() or self._in_flight is not None:
            raise EngineError("prompt_logits: the engine is serving requests (allowed only when idle)")
        prompt = tuple(token_ids)
        sizes = itertools.cycle(chunk_sizes or (len(prompt),))
        bm = self.block_manager
        if not bm.allocate_prompt(PARITY_REQUEST_ID, prompt, bm.miss(prompt)):
            raise EngineError(f"prompt_logits: {len(prompt)} tokens do not fit the pools")
        table = bm.page_table(PARITY_REQUEST_ID)
        data = NewRequestData(params=SamplingParams(max_tokens=1, temperature=0.0), seed=0)
        rows: list[torch.Tensor] = []
        selections: list[dict[int, torch.Tensor]] = []
        try:
            start = 0
            while start < len(prompt):
                end = min(start + next(sizes), len(prompt))
                first = start == 0
                seg = ScheduledSegment(
                    request_id=PARITY_REQUEST_ID,
                    slot=bm.slot(PARITY_REQUEST_ID),
                    start=start,
                    token_ids=prompt[start:end],
                    write_from=0,
                    window_start=0,
                    sample=False,
                    output_index=0,
                    num_prompt_tokens=len(prompt),
                    new_pages=table if first else (),
                    kept_pages=0 if first else len(table),
                    new_request=data if first else None,
                    reset=SlotReset(position=0, history_token_ids=()) if first else None,
                    want_prompt_logits=True,
                )
                # The first batch also drops what the rank still holds of requests
                # that finished since the scheduler's last batch (their slots).
                released = self.scheduler.take_releases() if first else ()
                result = runner.execute(ScheduledBatch(step_id=-1, segments=(seg,), released_request_ids=released))
                rows.append(result.row_logits[PARITY_REQUEST_ID])
                selections.append(result.row_selections[PARITY_REQUEST_ID])
                start = end
        finally:
            bm.free(PARITY_REQUEST_ID)
            if PARITY_REQUEST_ID in runner.requests:
                runner.requests.release((PARITY_REQUEST_ID,))
        return PromptScores(
            logits=torch.cat(rows),
            selections={layer: torch.cat([part[layer] for part in selections]) for layer in selections[0]},
        )


_generate_ids = itertools.count()
