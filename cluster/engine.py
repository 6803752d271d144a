"""The engine: the step loop of one model replica over pluggable rank executors.

Owns the public Python interface of DESIGN.md — ``Engine.from_pretrained``,
``add_request``, ``step``, ``abort``, ``generate`` — and what joins its parts: request
validation (nothing is queued for a bad request), the scheduler and block manager
(where every request lives), the rank executor that runs each ScheduledBatch (in
process here; Ray actors implement the same ``RankExecutor``), stop checking and the
outputs handed back.

Must not import: actors, deploy, ray.
"""

from __future__ import annotations

import abc
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch
from tokenizers import Tokenizer

from dsv41.cache.block_manager import BlockManager, BlockManagerStats, StateTransfer
from dsv41.cache.geometry import V41PoolGeometry
from dsv41.cache.offload import TieredStore
from dsv41.cache.pools import PoolSize
from dsv41.cluster.batch import ScheduledBatch, ScheduledSegment, SlotReset
from dsv41.cluster.offload_connector import LocalOffload, OffloadConnector
from dsv41.cluster.pool_layout import pool_geometry
from dsv41.cluster.request import (
    CumulativeOutputs,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    SeedSource,
)
from dsv41.cluster.runner import ModelRunner, StepResult
from dsv41.cluster.sampler import prompt_logprobs
from dsv41.cluster.scheduler import Scheduler, SchedulerConfig
from dsv41.cluster.stopping import StopChecker
from dsv41.model.config import V41Config
from dsv41.model.kernels import KERNEL_BACKENDS, load_kernels
from dsv41.model.linalg import default_batch_invariant
from dsv41.model.params import ModelParams
from dsv41.model.source import ModelSource

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 512 << 20
# The context a CPU replica gets unless max_model_len says otherwise. A prefill's cost
# grows faster than its length on the CPU (the tiny model, one core of a shared 2-core
# box: 2k tokens in about 2.2 s, 16k in 159 s; BENCHMARKS.md, prefill_fairness), so the
# model's own limit (1,048,576 positions) would admit requests that run for hours;
# 4,096 tokens prefill in seconds.
CPU_DEFAULT_MAX_MODEL_LEN = 4096
PARITY_REQUEST_ID = "__prompt_logits__"


class EngineError(ValueError):
    """A request or option the engine refuses; nothing was queued or changed."""


@dataclass(frozen=True)
class PromptScores:
    """Every position's logits [len, vocab] and, per selecting layer, every
    position's top-k entries [len, index_topk]."""

    logits: torch.Tensor
    selections: dict[int, torch.Tensor]


class RankExecutor(Protocol):
    """Runs one ScheduledBatch on the ranks of a replica and returns its samples."""

    def execute(self, batch: ScheduledBatch) -> StepResult: ...


class InProcessExecutor:
    """One rank in this process."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, batch: ScheduledBatch) -> StepResult:
        return self.runner.execute(batch)


@dataclass(frozen=True)
class EngineOptions:
    """How a replica runs; every field is checked before any weight is read."""

    dtype: torch.dtype = torch.float32
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # A request's prefill tokens per step (0: off, only the step budget bounds them).
    # None: half of max_num_batched_tokens, so that a long prefill leaves room in every
    # step for new requests' prefills and running decodes (see default_prefill_threshold).
    long_prefill_token_threshold: int | None = None
    block_size: int = 128
    num_pages: int | None = None  # cap on PAGEs (tests force preemption with it)
    num_state_slots: int | None = None  # default: max_num_seqs
    cache_memory_bytes: int = DEFAULT_CACHE_BYTES
    kv_cache_dtype: str = "bf16"
    index_cache_dtype: str = "fp8"
    state_transfer: str = "replay"
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: default_max_model_len
    seed: int = 0
    kernel_backend: str = "torch"  # "torch" (reference, anywhere) | "triton" (GPU) | "aiter" (ROCm)
    device: str = "cpu"  # where weights, pools and the forward live ("cuda", "cuda:1", ...)
    # Every row computed in an order that does not depend on the step's other rows
    # (model/linalg.py), so a scheduled run is token for token an uninterrupted one.
    # None: on for the CPU, off on a GPU (it costs GEMM throughput there).
    batch_invariant: bool | None = None
    # Decoder SWA bounded replay (model/bounded_replay.py; the spec's default): the
    # decoder runs a prompt's last sliding_window rows and the rows after, with windows
    # cut at that tail, and only the logit rows reach the last layer's attention and
    # FFN. It changes a prompt's last logits from a full prefill's (the spec's
    # accuracy note); prompt logits and prompt logprobs always run the full prefill.
    decoder_swa_bounded_replay: bool = True
    # Offload store of PAGE units and STATE images (0: none): host bytes, then an
    # optional disk tier.
    offload_host_bytes: int = 0
    offload_disk_dir: str | None = None
    offload_disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise EngineError(f"dtype: {self.dtype} (allowed: torch.float32, torch.bfloat16)")
        if self.kv_cache_dtype not in ("bf16", "fp4"):
            raise EngineError(f"kv_cache_dtype: {self.kv_cache_dtype!r} (allowed: 'bf16', 'fp4')")
        if self.index_cache_dtype not in ("fp8", "fp4"):
            raise EngineError(f"index_cache_dtype: {self.index_cache_dtype!r} (allowed: 'fp8', 'fp4')")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise EngineError(f"kernel_backend: {self.kernel_backend!r} (allowed: {', '.join(KERNEL_BACKENDS)})")
        if self.state_transfer not in ("replay", "copy"):
            raise EngineError(f"state_transfer: {self.state_transfer!r} (allowed: 'replay', 'copy')")
        if self.offload_host_bytes < 0 or self.offload_disk_bytes < 0:
            raise EngineError(
                f"offload_host_bytes / offload_disk_bytes: {self.offload_host_bytes} / {self.offload_disk_bytes} "
                "(allowed: >= 0)"
            )
        if (self.offload_disk_dir is not None or self.offload_disk_bytes) and not self.offload_host_bytes:
            raise EngineError(
                "offload_disk_dir / offload_disk_bytes: set without offload_host_bytes (allowed: a disk tier behind a host tier)"
            )
        if (self.offload_disk_dir is None) != (self.offload_disk_bytes == 0):
            raise EngineError(
                f"offload_disk_dir / offload_disk_bytes: {self.offload_disk_dir!r} / {self.offload_disk_bytes} "
                "(allowed: both set, or neither)"
            )
        if self.offload_host_bytes and not self.enable_prefix_caching:
            raise EngineError("offload_host_bytes: needs enable_prefix_caching (offloaded units are prefix-cache PAGEs)")
        if self.batch_invariant is None:
            object.__setattr__(self, "batch_invariant", default_batch_invariant(self.device))
        if self.batch_invariant and self.kernel_backend == "torch" and not self.device.startswith("cpu"):
            raise EngineError(
                f"batch_invariant: True with kernel_backend 'torch' on {self.device!r} (allowed: kernel_backend "
                "'triton' on a GPU, or the CPU: the torch backend's attention there runs cuBLAS batched GEMMs, "
                "whose algorithm follows the batch)"
            )
        for name in ("num_pages", "num_state_slots", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise EngineError(f"{name}: {value!r} (allowed: None or a positive integer)")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise EngineError(f"{name}: {value!r} (allowed: a positive integer)")
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            object.__setattr__(self, "long_prefill_token_threshold", default_prefill_threshold(self.max_num_batched_tokens))
        elif not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise EngineError(f"long_prefill_token_threshold: {threshold!r} (allowed: None, 0 = off, or a positive integer)")


def default_prefill_threshold(max_num_batched_tokens: int) -> int:
    """The per-request prefill cap of a step when none is given: half the step's token
    budget. vLLM's V1 scheduler applies the same cap (a request's new tokens per step
    cut to ``long_prefill_token_threshold`` when that is > 0) but defaults it to 0,
    setting 4% of max_model_len only when ``max_num_partial_prefills`` > 1; a cap tied
    to max_model_len does nothing once it exceeds the step budget, so this one is tied
    to the budget: one long prefill takes at most half of every step, and a request
    that arrives behind it is admitted at the next step instead of after it."""
    return max(max_num_batched_tokens // 2, 1)


def default_max_model_len(config: V41Config, options: EngineOptions, pool_tokens: int) -> int:
    """A replica's context limit: ``options.max_model_len`` if given, else the model's
    ``max_position_embeddings`` (on a CPU device at most CPU_DEFAULT_MAX_MODEL_LEN),
    never more than the pools hold (one sequence may fill them)."""
    if options.max_model_len is not None:
        return min(options.max_model_len, pool_tokens)
    limit = config.max_position_embeddings
    if torch.device(options.device).type == "cpu":
        limit = min(limit, CPU_DEFAULT_MAX_MODEL_LEN)
    return min(limit, pool_tokens)


@dataclass(frozen=True)
class RankLayout:
    """The pools one rank allocates under ``options`` and the scheduler over them: the
    geometry and pool size every process of a replica derives identically, so a
    scheduler in one process and the pools of its rank in another agree on every
    PAGE and slot id."""

    geometry: V41PoolGeometry
    pool_size: PoolSize
    num_slots: int

    @classmethod
    def build(cls, config: V41Config, options: EngineOptions) -> "RankLayout":
        geometry = pool_geometry(
            config,
            block_size=options.block_size,
            kv_cache_dtype=options.kv_cache_dtype,
            index_cache_dtype=options.index_cache_dtype,
            encoder_replay=options.state_transfer == "replay",
        )
        slots = options.num_state_slots or options.max_num_seqs
        pool_size = PoolSize.from_budget(
            geometry, options.cache_memory_bytes, num_slots=slots, max_num_pages=options.num_pages
        )
        return cls(geometry=geometry, pool_size=pool_size, num_slots=slots)

    def offload_store(self, options: EngineOptions) -> TieredStore | None:
        """The offload store ``options`` ask for (None: no offload), serving this
        layout."""
        if not options.offload_host_bytes:
            return None
        return TieredStore(
            self.geometry.layout_id,
            self.geometry.page_bytes,
            options.offload_host_bytes,
            disk_dir=options.offload_disk_dir,
            disk_budget_bytes=options.offload_disk_bytes,
        )

    def scheduler(self, config: V41Config, options: EngineOptions, offload: OffloadConnector | None = None) -> Scheduler:
        """A fresh scheduler over a fresh block manager of these pools."""
        block_manager = BlockManager(
            num_pages=self.pool_size.num_pages,
            num_slots=self.num_slots,
            block_size=options.block_size,
            state_transfer=StateTransfer(options.state_transfer),
            enable_prefix_caching=options.enable_prefix_caching,
        )
        return Scheduler(
            SchedulerConfig(
                max_num_seqs=options.max_num_seqs,
                max_num_batched_tokens=options.max_num_batched_tokens,
                long_prefill_token_threshold=options.long_prefill_token_threshold,
                block_size=options.block_size,
                state_transfer=StateTransfer(options.state_transfer),
                enable_prefix_caching=options.enable_prefix_caching,
                engram_history=config.engram_max_ngram_size - 1,
                decoder_replay_window=config.sliding_window if options.decoder_swa_bounded_replay else None,
            ),
            block_manager,
            layout_id=self.geometry.layout_id,
            image_pages=self.geometry.image_pages,
            image_bytes=self.geometry.image_bytes,
            offload=offload,
        )


def engine_options(options: dict[str, object]) -> EngineOptions:
    """EngineOptions from keyword options; unknown ones are refused."""
    known = set(EngineOptions.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise EngineError(f"options: unknown {unknown} (allowed: {sorted(known)})")
    return EngineOptions(**options)  # type: ignore[arg-type]


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of what a replica holds: requests by queue, and each rank's PAGE
    and prefix-cache counters and how many requests its scheduler preempted (both in
    rank order)."""

    requests_running: int
    requests_waiting: int
    ranks: tuple[BlockManagerStats, ...]
    preemptions: tuple[int, ...]


class EngineFrontend(abc.ABC):
    """What every replica shape shares: request validation and bookkeeping, applying
    a rank's step result (commit, stop checks, outputs), abort and generate. A
    subclass says where a request is queued and how a step runs."""

    def __init__(self, config: V41Config, tokenizer: Tokenizer, options: EngineOptions, layout: RankLayout) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.options = options
        self.stop_checker = StopChecker(tokenizer, config.eos_token_id)
        self.seeds = SeedSource(options.seed)
        self.pool_pages = layout.pool_size.num_pages
        pool_tokens = self.pool_pages * options.block_size
        self.max_model_len = default_max_model_len(config, options, pool_tokens)
        self._requests: dict[str, Request] = {}
        self._children: dict[str, tuple[str, ...]] = {}

    @abc.abstractmethod
    def _enqueue(self, request: Request) -> None:
        """Queues a validated request on the scheduler that will run it."""

    @abc.abstractmethod
    def _scheduler_of(self, request_id: str) -> Scheduler:
        """The scheduler holding an unfinished request."""

    @abc.abstractmethod
    def _all_schedulers(self) -> Sequence[Scheduler]:
        """Every scheduler of the replica (one per DP rank)."""

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished() for s in self._all_schedulers())

    def stats(self) -> EngineStats:
        schedulers = self._all_schedulers()
        return EngineStats(
            requests_running=sum(len(s.running) for s in schedulers),
            requests_waiting=sum(len(s.waiting) for s in schedulers),
            ranks=tuple(s.block_manager.stats() for s in schedulers),
            preemptions=tuple(s.num_preemptions for s in schedulers),
        )

    @abc.abstractmethod
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the requests that got a token or
        finished in it."""

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
        ids = (request_id,) if params.n == 1 else tuple(f"{request_id}#{i}" for i in range(params.n))
        seeds = self.seeds.seeds_for(params)
        now = time.monotonic()
        for rid, seed in zip(ids, seeds):
            request = Request(rid, prompt, params, sampling_seed=seed, arrival_time=now)
            self._requests[rid] = request
            self._enqueue(request)
        if params.n > 1:
            self._children[request_id] = ids

    def _check_fits_pool(self, request_id: str, prompt_len: int, params: SamplingParams) -> None:
        block_size = self.options.block_size
        tokens = prompt_len + params.max_tokens
        if tokens > self.pool_pages * block_size:
            raise EngineError(
                f"request {request_id!r}: prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {tokens} "
                f"tokens need {-(-tokens // block_size)} PAGEs of {block_size} tokens, and the pools hold "
                f"{self.pool_pages} PAGEs ({self.pool_pages * block_size} tokens) (allowed: prompt + max_tokens "
                f"<= {self.pool_pages * block_size})"
            )

    def abort(self, request_id: str) -> bool:
        """Cancels a request (all its samples) wherever it is; its PAGEs and slot are
        freed at once. False if it is unknown or already finished."""
        ids = self._children.pop(request_id, (request_id,))
        aborted = False
        for rid in ids:
            request = self._requests.pop(rid, None)
            if request is None or request.is_finished:
                continue
            request.finish(RequestStatus.FINISHED_ABORTED)
            self._scheduler_of(rid).finish(request)
            aborted = True
        return aborted

    def request(self, request_id: str) -> Request | None:
        """The live record of an unfinished request (None once finished or unknown)."""
        return self._requests.get(request_id)

    # -- the step loop --------------------------------------------------------------------

    def _apply(self, scheduler: Scheduler, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """Commits a batch's forward on its scheduler; returns the requests that got a
        token or finished in it."""
        outputs: list[RequestOutput] = []
        for seg in batch.segments:
            request = self._requests.get(seg.request_id)
            scheduler.commit(seg, request)
            if request is None:
                continue
            if seg.request_id in result.row_logits:
                self._record_prompt_logprobs(request, seg, result.row_logits[seg.request_id])
            if seg.sample:
                sampled = result.sampled[seg.request_id]
                request.append_output_token(sampled.token_id, sampled.logprobs)
                if self.stop_checker.check_stop(request):
                    scheduler.finish(request)
                    self._forget(request)
                outputs.append(request.take_output())
        return outputs

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]:
        """Runs prompts to completion; one output per prompt (per sample when n > 1),
        in prompt order."""
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
                if out.request_id in wanted:
                    cumulative = whole.add(out)
                    if out.finished:
                        final[out.request_id] = cumulative
        return [final[rid] for rid in order]

    def _forget(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
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

class Engine(EngineFrontend):
    """One replica: a scheduler over one rank executor."""

    def __init__(
        self,
        params: ModelParams,
        tokenizer: Tokenizer,
        options: EngineOptions,
        executor: RankExecutor | None = None,
    ) -> None:
        layout = RankLayout.build(params.config, options)
        super().__init__(params.config, tokenizer, options, layout)
        params = params.to(options.device)
        self.params = params
        self.geometry = layout.geometry
        self.pool_size = layout.pool_size
        store = layout.offload_store(options)
        self.offload = LocalOffload(store) if store is not None else None
        self.scheduler = layout.scheduler(params.config, options, self.offload)
        self.block_manager = self.scheduler.block_manager
        self.executor = executor or InProcessExecutor(
            ModelRunner(
                params,
                self.geometry,
                self.pool_size,
                device=options.device,
                kernels=load_kernels(options.kernel_backend),
                offload=self.offload,
                batch_invariant=bool(options.batch_invariant),
                decoder_replay=options.decoder_swa_bounded_replay,
            )
        )
        logger.info(
            "engine: %d PAGEs x %d tokens, %d STATE slots, layout %s",
            self.pool_size.num_pages,
            options.block_size,
            layout.num_slots,
            self.geometry.layout_id,
        )

    @classmethod
    def from_pretrained(cls, model: str | Path | ModelSource, **options: object) -> "Engine":
        """Loads ``model`` (a checkpoint directory in the official format, or a
        generated slice: model/source.py) into an in-process replica. Options are
        EngineOptions' fields; unknown ones are refused."""
        parsed = engine_options(options)
        params, tokenizer = ModelSource.parse(model).load_params(dtype=parsed.dtype, device=parsed.device)
        return cls(params, tokenizer, parsed)

    def _enqueue(self, request: Request) -> None:
        self.scheduler.add(request)

    def _scheduler_of(self, request_id: str) -> Scheduler:
        return self.scheduler

    def _all_schedulers(self) -> Sequence[Scheduler]:
        return (self.scheduler,)

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the requests that got a token or
        finished in it."""
        batch, _ = self.scheduler.schedule()
        if batch.is_empty:
            return []
        return self._apply(self.scheduler, batch, self.executor.execute(batch))

    # -- arithmetic checks ----------------------------------------------------------------

    def prompt_logits(self, token_ids: Sequence[int], chunk_sizes: Sequence[int] | None = None) -> PromptScores:
        """Logits and selections of every position of one prompt, fed to the paged
        runtime in ``chunk_sizes`` (cycling; default: one chunk) outside the scheduler.
        The engine must be idle; nothing of the run stays cached."""
        if self.scheduler.has_unfinished():
            raise EngineError("prompt_logits: the engine is serving requests (allowed only when idle)")
        prompt = tuple(token_ids)
        sizes = itertools.cycle(chunk_sizes or (len(prompt),))
        bm = self.block_manager
        if not bm.allocate_prompt(PARITY_REQUEST_ID, prompt, bm.miss(prompt)):
            raise EngineError(f"prompt_logits: {len(prompt)} tokens do not fit the pools")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        rows: list[torch.Tensor] = []
        selections: list[dict[int, torch.Tensor]] = []
        try:
            start = 0
            while start < len(prompt):
                end = min(start + next(sizes), len(prompt))
                seg = ScheduledSegment(
                    request_id=PARITY_REQUEST_ID,
                    slot=bm.slot(PARITY_REQUEST_ID),
                    page_table=bm.page_table(PARITY_REQUEST_ID),
                    start=start,
                    token_ids=prompt[start:end],
                    write_from=0,
                    window_start=0,
                    sample=False,
                    params=params,
                    seed=0,
                    output_index=0,
                    num_prompt_tokens=len(prompt),
                    reset=SlotReset(position=0, history_token_ids=()) if start == 0 else None,
                    want_prompt_logits=True,
                )
                result = self.executor.execute(ScheduledBatch(step_id=-1, segments=(seg,)))
                rows.append(result.row_logits[PARITY_REQUEST_ID])
                selections.append(result.row_selections[PARITY_REQUEST_ID])
                start = end
        finally:
            bm.free(PARITY_REQUEST_ID)
        return PromptScores(
            logits=torch.cat(rows),
            selections={layer: torch.cat([part[layer] for part in selections]) for layer in selections[0]},
        )


_generate_ids = itertools.count()
