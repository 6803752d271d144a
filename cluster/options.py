"""How a replica runs: its options, and the pools and scheduler every process of it derives.

Owns ``EngineOptions`` (every field checked before any weight is read, its defaults
resolved once: the batch-invariant mode, the prefill cap, ...), ``engine_options``
(keyword options, unknown ones refused), the context limit a replica serves
(``default_max_model_len``) and ``RankLayout``: the geometry, pool size and scheduler of
one rank, which a scheduler in one process and the pools of its rank in another derive
identically from the same options.

Must not import: actors, deploy, ray, cluster.engine, cluster.ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.cache.block_manager import BlockManager, CacheConfig, StateTransfer
from dsv41.cache.geometry import V41PoolGeometry
from dsv41.cache.offload import TieredStore
from dsv41.cache.pools import PoolSize
from dsv41.cluster.cuda_graphs import CUDAGRAPH_MODES, DecodeBuckets
from dsv41.cluster.token_graphs import token_buckets
from dsv41.cluster.offload_connector import OffloadConnector
from dsv41.cluster.pool_layout import pool_geometry
from dsv41.cluster.scheduler import Scheduler, SchedulerConfig
from dsv41.model.config import V41Config
from dsv41.model.kernels import KERNEL_BACKENDS
from dsv41.model.linalg import default_batch_invariant
from dsv41.model.loader import WEIGHT_STORAGE

DEFAULT_CACHE_BYTES = 512 << 20
# The context a CPU replica gets unless max_model_len says otherwise. A prefill's cost
# grows faster than its length on the CPU (the tiny model, one core of a shared 2-core
# box: 2k tokens in about 2.2 s, 16k in 159 s; BENCHMARKS.md, prefill_fairness), so the
# model's own limit (1,048,576 positions) would admit requests that run for hours;
# 4,096 tokens prefill in seconds.
CPU_DEFAULT_MAX_MODEL_LEN = 4096
SPECULATIVE_METHODS = ("dspark",)
# The spec's native DSpark drafts five tokens a step: its whole block (dspark_block_size).
DSPARK_NUM_SPECULATIVE_TOKENS = 5


class EngineError(ValueError):
    """A request or option the engine refuses; nothing was queued or changed."""


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
    # The pools' bytes per rank. None: DEFAULT_CACHE_BYTES, unless gpu_memory_bytes is
    # given: then the memory plan (cluster/memory_plan.py) sets it to what the rank's
    # stored weights and the reserve leave of gpu_memory_bytes when the replica is
    # built (gpu_memory_reserve_bytes None: DEFAULT_RESERVE_FRACTION of it).
    cache_memory_bytes: int | None = None
    gpu_memory_bytes: int | None = None
    gpu_memory_reserve_bytes: int | None = None
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
    # Prefill two-batch overlap under DP attention (cluster/tbo.py; the spec's
    # --enable-tbo prefill): a prefill step's rows run as two microbatches, one's MoE
    # collectives in flight while the other computes. Needs more than one DP rank.
    # tbo_prefill_min_tokens: every rank's rows at least this (ATOM_TBO_PREFILL_MIN_
    # TOKENS; the default is not tuned: no GPU measured it). tbo_prefill_token_split:
    # the cut may fall inside a request (ATOM_TBO_PREFILL_TOKEN_SPLIT=1, the default),
    # else only between requests.
    enable_tbo_prefill: bool = False
    tbo_prefill_min_tokens: int = 256
    tbo_prefill_token_split: bool = True
    # Offload store of PAGE units and STATE images (0: none): host bytes, then an
    # optional disk tier.
    offload_host_bytes: int = 0
    offload_disk_dir: str | None = None
    offload_disk_bytes: int = 0
    # Speculative decoding (cluster/speculative.py): None, or "dspark" (the checkpoint's
    # mtp stages draft num_speculative_tokens per step; None: the spec's 5).
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    # The spec's graph modes: "none" (eager, the baseline), "full" (every decode step
    # one CUDA graph replay, one graph per batch-size and PAGE-count bucket captured at
    # startup; prefill stays eager; cluster/cuda_graphs.py) or "tr_hybrid" (every
    # step's token-wise parts of each layer replayed from graphs recorded per row-count
    # bucket, attention eager between them; cluster/token_graphs.py). Needs
    # the Triton kernels on a CUDA device. cudagraph_batch_sizes: the buckets, of
    # requests under "full" (None: 1, 2, 4, then multiples of 8 up to max_num_seqs), of
    # rows under "tr_hybrid" (None: powers of two up to max_num_batched_tokens or 512).
    cudagraph_mode: str = "none"
    cudagraph_batch_sizes: tuple[int, ...] | None = None
    # Async scheduling (vLLM's --async-scheduling; cluster/engine.Engine._step_async):
    # the next step is scheduled and launched while the previous one runs on the
    # device, a decode row whose token is still being drawn reading it there. Ranks in
    # this process (one, or DP ranks in threads); not on the Ray engine group, not with
    # speculation or an offload store.
    async_scheduling: bool = False
    # How the FP8 / FP4 weights of a quantised checkpoint live on the device: "stored"
    # (the checkpoint's bytes, model/stored_weights.py; every kernel decodes its tiles
    # exactly) or "decoded" (the compute dtype, 2-4x the bytes).
    weight_storage: str = "stored"
    # Whether the projections through FP8 weights quantise their activations to FP8
    # E4M3 per token and 32 channels (model/linalg.py's FP8-activation mode: a
    # prefill's GEMMs then run at the tensor cores' FP8 rate). Off: the activations
    # stay in the compute dtype, the reference's arithmetic. On, logits differ from
    # the reference's within the bound bench/stored_parity.py --fp8-activations measures.
    fp8_activations: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise EngineError(f"dtype: {self.dtype} (allowed: torch.float32, torch.bfloat16)")
        if self.kv_cache_dtype not in ("bf16", "fp4"):
            raise EngineError(f"kv_cache_dtype: {self.kv_cache_dtype!r} (allowed: 'bf16', 'fp4')")
        if self.index_cache_dtype not in ("fp8", "fp4"):
            raise EngineError(f"index_cache_dtype: {self.index_cache_dtype!r} (allowed: 'fp8', 'fp4')")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise EngineError(f"kernel_backend: {self.kernel_backend!r} (allowed: {', '.join(KERNEL_BACKENDS)})")
        if self.weight_storage not in WEIGHT_STORAGE:
            raise EngineError(f"weight_storage: {self.weight_storage!r} (allowed: {', '.join(map(repr, WEIGHT_STORAGE))})")
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
        self._check_memory()
        for name in ("num_pages", "num_state_slots", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise EngineError(f"{name}: {value!r} (allowed: None or a positive integer)")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise EngineError(f"{name}: {value!r} (allowed: a positive integer)")
        self._check_speculation()
        self._check_graphs()
        self._check_async_scheduling()
        for name in ("enable_tbo_prefill", "tbo_prefill_token_split", "fp8_activations"):
            if not isinstance(getattr(self, name), bool):
                raise EngineError(f"{name}: {getattr(self, name)!r} (allowed: True, False)")
        if self.fp8_activations and self.weight_storage != "stored":
            raise EngineError(
                f"fp8_activations: True with weight_storage {self.weight_storage!r} (allowed: with 'stored', where "
                "the FP8 weights whose projections it quantises stay FP8)"
            )
        minimum = self.tbo_prefill_min_tokens
        if not isinstance(minimum, int) or isinstance(minimum, bool) or minimum < 0:
            raise EngineError(f"tbo_prefill_min_tokens: {minimum!r} (allowed: an integer >= 0)")
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            object.__setattr__(self, "long_prefill_token_threshold", default_prefill_threshold(self.max_num_batched_tokens))
        elif not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise EngineError(f"long_prefill_token_threshold: {threshold!r} (allowed: None, 0 = off, or a positive integer)")

    def _check_memory(self) -> None:
        """Resolves ``cache_memory_bytes`` (DEFAULT_CACHE_BYTES when neither it nor
        ``gpu_memory_bytes`` is given) and refuses both at once."""
        for name in ("cache_memory_bytes", "gpu_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise EngineError(f"{name}: {value!r} (allowed: None or a positive integer of bytes)")
        reserve = self.gpu_memory_reserve_bytes
        if reserve is not None and (not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < 0):
            raise EngineError(f"gpu_memory_reserve_bytes: {reserve!r} (allowed: None or an integer of bytes >= 0)")
        if reserve is not None and self.gpu_memory_bytes is None:
            raise EngineError("gpu_memory_reserve_bytes: set without gpu_memory_bytes (allowed: with gpu_memory_bytes)")
        if self.gpu_memory_bytes is not None and self.cache_memory_bytes is not None:
            raise EngineError(
                f"cache_memory_bytes / gpu_memory_bytes: {self.cache_memory_bytes} / {self.gpu_memory_bytes} (allowed: "
                "one of them: gpu_memory_bytes sizes the pools as what the weights and the reserve leave)"
            )
        if self.gpu_memory_bytes is None and self.cache_memory_bytes is None:
            object.__setattr__(self, "cache_memory_bytes", DEFAULT_CACHE_BYTES)

    def _check_async_scheduling(self) -> None:
        if not isinstance(self.async_scheduling, bool):
            raise EngineError(f"async_scheduling: {self.async_scheduling!r} (allowed: True, False)")
        if not self.async_scheduling:
            return
        if self.speculative_method is not None:
            raise EngineError(
                f"async_scheduling: True with speculative_method {self.speculative_method!r} (allowed: None; a "
                "verify's kept rows are known only once its draws are on the host)"
            )
        if self.offload_host_bytes:
            raise EngineError(
                "async_scheduling: True with offload_host_bytes (allowed: 0; a PAGE a placeholder row completes is "
                "keyed by the hash of a token not known when the step is scheduled)"
            )

    def _check_graphs(self) -> None:
        """Refuses a graph mode this replica cannot capture, before any weight."""
        mode, sizes = self.cudagraph_mode, self.cudagraph_batch_sizes
        if mode not in CUDAGRAPH_MODES:
            raise EngineError(f"cudagraph_mode: {mode!r} (allowed: {', '.join(map(repr, CUDAGRAPH_MODES))})")
        if sizes is not None:
            if isinstance(sizes, list):
                sizes = tuple(sizes)
                object.__setattr__(self, "cudagraph_batch_sizes", sizes)
            if mode == "none":
                raise EngineError(
                    "cudagraph_batch_sizes: set with cudagraph_mode 'none' (allowed: with 'full' or 'tr_hybrid')"
                )
            limit, name = (
                (self.max_num_batched_tokens, "max_num_batched_tokens")
                if mode == "tr_hybrid"
                else (self.max_num_seqs, "max_num_seqs")
            )
            if (
                not isinstance(sizes, tuple)
                or not sizes
                or any(not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= limit for v in sizes)
            ):
                raise EngineError(
                    f"cudagraph_batch_sizes: {sizes!r} with cudagraph_mode {mode!r} (allowed: None, or integers in "
                    f"1..{name} = {limit})"
                )
        if mode == "none":
            return
        if self.kernel_backend != "triton" or torch.device(self.device).type != "cuda":
            raise EngineError(
                f"cudagraph_mode: {mode!r} with kernel_backend {self.kernel_backend!r} on {self.device!r} (allowed: "
                "kernel_backend 'triton' on a CUDA device: a graph replays CUDA kernels, and the torch backend's "
                "padding writes select rows on the host)"
            )
        if self.speculative_method is not None:
            raise EngineError(
                f"cudagraph_mode: {mode!r} with speculative_method {self.speculative_method!r} (allowed: 'none'; "
                "verify steps are not captured here yet)"
            )

    def _check_speculation(self) -> None:
        """Resolves ``num_speculative_tokens`` (0 without a method, the spec's 5 with
        DSpark) and refuses what the spec refuses with speculation, before any weight."""
        method, count = self.speculative_method, self.num_speculative_tokens
        if method is None:
            if count not in (None, 0):
                raise EngineError(
                    f"num_speculative_tokens: {count!r} without speculative_method (allowed: None or 0, "
                    "or set speculative_method='dspark')"
                )
            object.__setattr__(self, "num_speculative_tokens", 0)
            return
        if method not in SPECULATIVE_METHODS:
            raise EngineError(f"speculative_method: {method!r} (allowed: None, {', '.join(map(repr, SPECULATIVE_METHODS))})")
        if count is None:
            count = DSPARK_NUM_SPECULATIVE_TOKENS
            object.__setattr__(self, "num_speculative_tokens", count)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise EngineError(
                f"num_speculative_tokens: {count!r} with speculative_method {method!r} (allowed: the checkpoint's "
                f"dspark_block_size, {DSPARK_NUM_SPECULATIVE_TOKENS} for V4.1)"
            )
        if (self.kv_cache_dtype, self.index_cache_dtype) != ("bf16", "fp8"):
            raise EngineError(
                f"speculative_method: {method!r} with kv_cache_dtype={self.kv_cache_dtype!r}, "
                f"index_cache_dtype={self.index_cache_dtype!r} (allowed: kv_cache_dtype 'bf16' and "
                "index_cache_dtype 'fp8': the spec refuses packed speculative caches)"
            )


def check_speculation_config(config: V41Config, options: EngineOptions) -> None:
    """Refuses, from the config alone (before any weight is read), speculation the
    checkpoint cannot run: one without DSpark stages, or a count other than its block."""
    if options.speculative_method is None:
        return
    if not config.topology.dspark_layers:
        raise EngineError(
            f"speculative_method: {options.speculative_method!r}, but the checkpoint has no DSpark stages "
            f"(num_nextn_predict_layers {config.num_nextn_predict_layers}: no mtp.* stages) (allowed: None)"
        )
    if options.num_speculative_tokens != config.dspark_block_size:
        raise EngineError(
            f"num_speculative_tokens: {options.num_speculative_tokens} (allowed: {config.dspark_block_size}, the "
            "checkpoint's dspark_block_size: DSpark drafts its whole block)"
        )


def check_replica_options(config: V41Config, options: EngineOptions, world: int) -> None:
    """Refuses, from the config alone (before any weight is read), options the
    checkpoint or a replica of ``world`` DP ranks cannot run: speculation the
    checkpoint cannot run or over more than one DP rank; prefill two-batch overlap on
    one rank (the spec refuses plain TP and effective single-rank DP attention alike:
    one rank has no collectives to hide)."""
    check_speculation_config(config, options)
    if options.speculative_method is not None and world != 1:
        raise EngineError(
            f"speculative_method: {options.speculative_method!r} with {world} DP ranks (allowed: one rank; DSpark "
            "under DP attention is not implemented here yet: the draft stages' MoE joins no DP exchange)"
        )
    if options.cudagraph_mode == "tr_hybrid" and options.enable_tbo_prefill:
        raise EngineError(
            "cudagraph_mode: 'tr_hybrid' with enable_tbo_prefill (allowed: one of them; a split step's microbatches "
            "yield inside their MoE, which a token graph records whole)"
        )
    if options.enable_tbo_prefill and world < 2:
        raise EngineError(
            f"enable_tbo_prefill: True on a replica of {world} DP rank (allowed: DP attention over >= 2 ranks; "
            "prefill two-batch overlap hides one microbatch's MoE collectives across the DP ranks behind the other's "
            "attention, and one rank has no collectives to hide)"
        )


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
        if options.cache_memory_bytes is None:
            raise EngineError(
                f"gpu_memory_bytes: {options.gpu_memory_bytes:,} not yet turned into a pool budget (allowed: build the "
                "replica through Engine.from_pretrained, Engine.in_process or EngineGroup, which size the pools by "
                "cluster.memory_plan.sized_options, or give cache_memory_bytes)"
            )
        geometry = cls.geometry_of(config, options)
        slots = cls.slots_of(options)
        pool_size = PoolSize.from_budget(
            geometry, options.cache_memory_bytes, num_slots=slots, max_num_pages=options.num_pages
        )
        return cls(geometry=geometry, pool_size=pool_size, num_slots=slots)

    @staticmethod
    def geometry_of(config: V41Config, options: EngineOptions) -> V41PoolGeometry:
        """The PAGE/STATE geometry every rank lays its pools out in."""
        check_speculation_config(config, options)
        return pool_geometry(
            config,
            block_size=options.block_size,
            kv_cache_dtype=options.kv_cache_dtype,
            index_cache_dtype=options.index_cache_dtype,
            num_speculative_tokens=options.num_speculative_tokens,
            encoder_replay=options.state_transfer == "replay",
        )

    @staticmethod
    def slots_of(options: EngineOptions) -> int:
        """STATE slots per rank: num_state_slots, else one per request max_num_seqs runs."""
        return options.num_state_slots or options.max_num_seqs

    def token_buckets(self, options: EngineOptions) -> tuple[int, ...] | None:
        """The token graphs' row buckets under ``options`` (None: not "tr_hybrid")."""
        if options.cudagraph_mode != "tr_hybrid":
            return None
        return token_buckets(options.max_num_batched_tokens, options.cudagraph_batch_sizes)

    def decode_buckets(self, config: V41Config, options: EngineOptions) -> DecodeBuckets | None:
        """The decode graphs' buckets under ``options`` (None: graphs off): batch sizes
        up to max_num_seqs, PAGE counts up to the replica's context limit."""
        if options.cudagraph_mode != "full":
            return None
        pool_tokens = self.pool_size.num_pages * options.block_size
        max_pages = -(-default_max_model_len(config, options, pool_tokens) // options.block_size)
        return DecodeBuckets.of(options.max_num_seqs, max_pages, options.cudagraph_batch_sizes)

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
            CacheConfig(
                num_pages=self.pool_size.num_pages,
                num_slots=self.num_slots,
                block_size=options.block_size,
                state_transfer=StateTransfer(options.state_transfer),
                enable_prefix_caching=options.enable_prefix_caching,
            )
        )
        return Scheduler(
            SchedulerConfig(
                max_num_seqs=options.max_num_seqs,
                max_num_batched_tokens=options.max_num_batched_tokens,
                long_prefill_token_threshold=options.long_prefill_token_threshold,
                engram_history=config.engram_max_ngram_size - 1,
                decoder_replay_window=config.sliding_window if options.decoder_swa_bounded_replay else None,
                async_scheduling=options.async_scheduling,
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
