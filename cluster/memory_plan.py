"""One rank's memory plan: its weights as its device holds them, and the cache pools the rest of a device holds.

Owns ``WeightBytes`` (one rank's weights by kind: FP8 E4M3 values, FP4 E2M1 values,
their E8M0 scales, BF16 and FP32 tensors on the device; Engram tables on the host),
``rank_weight_bytes`` (a model source's bytes for one rank's expert shard as the
checkpoint stores them) and ``rank_device_bytes`` (as the rank's device holds them
after the load, under the engine's compute dtype and ``weight_storage``),
``MemoryPlan`` (weights, the reserve, what is left for the PAGE/STATE pools, the pools
``RankLayout`` builds from it and the tokens of cache they hold; ``render`` is the one
table ``dsv41 plan`` prints and the engine logs at startup), ``plan_memory`` and
``sized_options``: the engine's pool sizing under ``EngineOptions.gpu_memory_bytes``,
which is this plan, so the table and the pools cannot disagree.

A stored form is counted as the checkpoint holds it (FP8 E4M3: 1 byte a value plus one
E8M0 byte per 32x32 tile; FP4 E2M1: 2 values a byte plus one E8M0 byte per 32 values;
BF16: 2 bytes; FP32: 4); on the device, under ``weight_storage="stored"`` (the
default) the quantised weights keep that form, under "decoded" they take the compute
dtype, as every plain tensor but the FP32 kinds does. A checkpoint directory is read
from its safetensors headers; a directory with a config and no weights (e.g.
``model/configs/v41_flash``) and a generated slice are counted from the declarations
(``model/weights.py``) in the form they are stored in.

Must not import: actors, deploy, ray.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from dsv41.cache.pools import PoolError, PoolSize
from dsv41.cluster.options import EngineError, EngineOptions, RankLayout, check_replica_options
from dsv41.cluster.ranks import EXPERT_MODES, DPLayout
from dsv41.model.config import V41Config
# The loader's rules of which files a checkpoint has and which tensors a rank holds:
# the plan calls them rather than restating them, so it counts what a load reads.
from dsv41.model.loader import (
    INDEX_FILE,
    SINGLE_FILE,
    ExpertShard,
    HeaderEntry,
    rank_part,
    read_headers,
    shard_experts,
)
from dsv41.model.source import ModelSource
from dsv41.model.weights import (
    SCALE_SUFFIX,
    WEIGHT_SUFFIX,
    TensorKind,
    TensorSpec,
    canonical_name,
    checkpoint_tensors,
    is_vision_tensor,
)

logger = logging.getLogger(__name__)

# The share of gpu_memory_bytes kept back for activations, CUDA graphs, the NCCL and
# CUDA contexts and allocator fragmentation when no reserve is given. vLLM's default
# gpu_memory_utilization (0.9) keeps the same share back; it then also subtracts a
# profiled activation peak, which no GPU run here has measured, so this is a stated
# assumption, not a measurement (give gpu_memory_reserve_bytes to replace it).
DEFAULT_RESERVE_FRACTION = 0.10
# Bytes per stored value of the plain kinds (safetensors dtype names).
_PLAIN_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


class PlanError(ValueError):
    """A model or plan input the plan cannot count; the message names it."""


@dataclass(frozen=True)
class WeightBytes:
    """One rank's weights in their stored form, by kind. ``engram_host``: the Engram
    tables (values and scales), which live on the host, never on the device."""

    fp8_values: int = 0
    fp4_values: int = 0
    e8m0_scales: int = 0
    bf16: int = 0
    fp32: int = 0
    engram_host: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PlanError(f"WeightBytes.{f.name}: {value!r} (allowed: an int >= 0)")

    @property
    def device(self) -> int:
        """Bytes on the rank's device: everything but the Engram tables."""
        return self.fp8_values + self.fp4_values + self.e8m0_scales + self.bf16 + self.fp32


# Bytes counted so far by WeightBytes field.
_Tally = dict[str, int]
_FIELDS = tuple(f.name for f in dataclasses.fields(WeightBytes))


def _add(tally: _Tally, spec: TensorSpec, values_field: str, values: int, scale: int) -> None:
    """Counts a declared tensor's stored bytes: ``values`` under ``values_field`` and
    ``scale`` E8M0 bytes; an Engram table's both on the host."""
    if spec.kind is TensorKind.ENGRAM_TABLE:
        tally["engram_host"] += values + scale
        return
    tally[values_field] += values
    tally["e8m0_scales"] += scale


def _quantized_field(spec: TensorSpec) -> str:
    return "fp4_values" if spec.kind is TensorKind.FP4_EXPERT else "fp8_values"


def _held_shape(shape: tuple[int, ...], axis: int | None, shard: ExpertShard | None) -> tuple[int, ...]:
    """The part of a stored tensor of ``shape`` a rank holds (its TP slice along ``axis``)."""
    if axis is None or shard is None:
        return shape
    span = shard.part(shape[axis])
    return shape[:axis] + (span.stop - span.start,) + shape[axis + 1 :]


def declared_quantized_kinds(source: ModelSource, config: V41Config) -> frozenset[TensorKind]:
    """The kinds a model without safetensors stores quantised: a generated slice
    quantises its routed experts under ``experts=fp4`` and its FP8_WEIGHT kinds under
    ``dense=fp8``, and stores the rest plain (model/reference_slice.py); a config-only directory stores every quantisable kind
    quantised under a quantization_config (routed experts as its expert_dtype), none
    without one. Plain tensors are BF16, FP32 kinds FP32 (as make_tiny writes them)."""
    if source.slice_name is not None:
        experts = {TensorKind.FP4_EXPERT} if source.expert_format == "fp4" else set()
        dense = {TensorKind.FP8_WEIGHT} if source.dense_format == "fp8" else set()
        return frozenset(experts | dense)
    quantization = config.quantization
    if quantization is None:
        return frozenset()
    if quantization.expert_dtype not in ("fp4", "bf16"):
        raise PlanError(
            f"quantization_config.expert_dtype: {quantization.expert_dtype!r} (allowed: 'fp4', 'bf16': the loader's)"
        )
    dense = frozenset({TensorKind.FP8_WEIGHT, TensorKind.ENGRAM_TABLE})
    return dense | ({TensorKind.FP4_EXPERT} if quantization.expert_dtype == "fp4" else frozenset())


def _declared_quantized(source: ModelSource, config: V41Config) -> Callable[[TensorSpec], bool]:
    """Whether a model counted from its declarations stores a tensor quantised."""
    kinds = declared_quantized_kinds(source, config)
    return lambda spec: spec.kind in kinds


def _device_bytes(
    specs: dict[str, TensorSpec],
    stored_quantized: Callable[[TensorSpec], bool],
    holding: "_Holding",
    dtype: torch.dtype,
    weight_storage: str,
    on_device: bool,
) -> _Tally:
    """A rank's weights as its device holds them after the load (model/loader.py
    post_load): FP32 kinds (and ``on_device`` the ``held_fp32`` tensors) in float32; a
    quantised FP8 / FP4 weight as its stored values and E8M0 scales under
    ``weight_storage="stored"``, else decoded; every other tensor in the compute
    ``dtype``; Engram tables as stored, on the host. (With bf16, "stored" and not
    ``on_device`` this is the stored form of a model counted from its declarations.)"""
    tally = dict.fromkeys(_FIELDS, 0)
    compute_field = "bf16" if dtype == torch.bfloat16 else "fp32"
    sizes: dict[tuple[TensorKind, bool, tuple[int, ...], int | None, bool], tuple[str, int, int]] = {}
    for name, spec in specs.items():
        holds, axis = holding(name)
        if not holds:
            continue
        quantized = spec.kind.quantizable and stored_quantized(spec)
        key = (spec.kind, spec.held_fp32, spec.shape, axis, quantized)
        if key not in sizes:
            held = dataclasses.replace(spec, shape=_held_shape(spec.shape, axis, holding.shard))
            elements = math.prod(held.shape)
            if quantized and (spec.kind is TensorKind.ENGRAM_TABLE or weight_storage == "stored"):
                sizes[key] = (_quantized_field(spec), math.prod(held.quantized_shape), math.prod(held.scale_shape))
            elif spec.kind is TensorKind.FP32 or (on_device and spec.held_fp32):
                sizes[key] = ("fp32", elements * _PLAIN_ITEMSIZE["F32"], 0)
            elif spec.kind is TensorKind.ENGRAM_TABLE:
                sizes[key] = ("engram_host", elements * _PLAIN_ITEMSIZE["BF16"], 0)
            else:
                sizes[key] = (compute_field, elements * dtype.itemsize, 0)
        _add(tally, spec, *sizes[key])
    return tally


def rank_device_bytes(
    source: ModelSource, config: V41Config, shards: Sequence[ExpertShard | None], options: EngineOptions
) -> list[WeightBytes]:
    """Each rank's weights as its device holds them under ``options`` (compute dtype,
    weight_storage): what is stored quantised is read from a checkpoint's headers (a
    tensor with a .scale), else from ``declared_quantized_kinds``."""
    specs = checkpoint_tensors(config)
    if source.checkpoint_dir is not None and _has_weights(source.checkpoint_dir):
        names = {canonical_name(name) for name in read_headers(source.checkpoint_dir)}

        def stored_quantized(spec: TensorSpec) -> bool:
            return spec.scale_name in names

    else:
        stored_quantized = _declared_quantized(source, config)
    return [
        WeightBytes(
            **_device_bytes(
                specs,
                stored_quantized,
                _Holding.of(config, shard),
                options.dtype,
                options.weight_storage,
                on_device=True,
            )
        )
        for shard in shards
    ]


def _has_weights(root: Path) -> bool:
    return (root / SINGLE_FILE).is_file() or (root / INDEX_FILE).is_file()


def _header_bytes(entries: dict[str, HeaderEntry], specs: dict[str, TensorSpec], holding: "_Holding") -> _Tally:
    """A rank's stored bytes from the checkpoint's safetensors header entries (by
    canonical name; a vision tower is not counted: the runtime loads text only)."""
    tally = dict.fromkeys(_FIELDS, 0)
    for name, entry in entries.items():
        if is_vision_tensor(name):
            continue
        is_scale = name.endswith(SCALE_SUFFIX)
        owner = name[: -len(SCALE_SUFFIX)] + WEIGHT_SUFFIX if is_scale else name
        spec = specs.get(owner)
        if spec is None:
            raise PlanError(f"{entry.stored_name}: a tensor this config does not declare (in {entry.file.name})")
        holds, axis = holding(owner)
        if not holds:
            continue
        nbytes = math.prod(_held_shape(entry.shape, axis, holding.shard)) * (entry.nbytes // math.prod(entry.shape))
        if is_scale:
            _add(tally, spec, "e8m0_scales", 0, nbytes)
        elif spec.kind.quantizable and spec.scale_name in entries:
            _add(tally, spec, _quantized_field(spec), nbytes, 0)
        elif entry.dtype in _PLAIN_ITEMSIZE:
            _add(tally, spec, "fp32" if entry.dtype == "F32" else "bf16", nbytes, 0)
        else:
            raise PlanError(
                f"{entry.stored_name}: stored {entry.dtype} without a .scale (allowed plain: {', '.join(_PLAIN_ITEMSIZE)})"
            )
    return tally


@dataclass(frozen=True)
class _Holding:
    """Which declared tensors one rank holds, and the axis of the TP slice it holds:
    the loader's own rule, so the plan counts what a load of that rank reads."""

    shard: ExpertShard | None
    expert_ids: tuple[int, ...]
    dspark_expert_ids: tuple[int, ...]

    @classmethod
    def of(cls, config: V41Config, shard: ExpertShard | None) -> "_Holding":
        return cls(shard, *shard_experts(config, shard))

    def __call__(self, name: str) -> tuple[bool, int | None]:
        return rank_part(name, self.shard, self.expert_ids, self.dspark_expert_ids)


def rank_weight_bytes(
    source: ModelSource, config: V41Config, shards: Sequence[ExpertShard | None]
) -> list[WeightBytes]:
    """Each rank's weights (a shard: its experts; None: all of them) in their stored
    form: from the safetensors headers of a checkpoint directory, else from the
    declarations in the form ``declared_quantized_kinds`` says."""
    specs = checkpoint_tensors(config)
    if source.checkpoint_dir is not None and _has_weights(source.checkpoint_dir):
        entries = {canonical_name(name): entry for name, entry in read_headers(source.checkpoint_dir).items()}
        return [WeightBytes(**_header_bytes(entries, specs, _Holding.of(config, shard))) for shard in shards]
    stored_quantized = _declared_quantized(source, config)
    # Declared plain tensors are stored BF16, FP32 kinds FP32 (as make_tiny writes them).
    return [
        WeightBytes(
            **_device_bytes(
                specs, stored_quantized, _Holding.of(config, shard), torch.bfloat16, "stored", on_device=False
            )
        )
        for shard in shards
    ]


def default_reserve(gpu_memory_bytes: int) -> int:
    """The reserve kept back of ``gpu_memory_bytes`` when none is given."""
    return int(gpu_memory_bytes * DEFAULT_RESERVE_FRACTION)


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory under ``options`` on a replica of ``dp`` ranks (every rank
    holds the same bytes: EP gives each the same number of whole experts, TP the same
    slice of each). With ``gpu_memory_bytes`` the pools get what the weights and the
    reserve leave; without it they get ``cache_memory_bytes`` (reserve 0).
    ``pool_size`` is what ``RankLayout`` builds from that budget, None where the
    budget holds the STATE slots and no PAGE (the plan does not fit)."""

    model: str
    dp: int
    expert_mode: str
    weights: WeightBytes
    gpu_memory_bytes: int | None
    reserve_bytes: int
    pool_budget_bytes: int
    page_bytes: int
    state_bytes: int
    block_size: int
    num_slots: int
    pool_size: PoolSize | None

    def __post_init__(self) -> None:
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1:
            raise PlanError(f"MemoryPlan.dp: {self.dp!r} (allowed: an int >= 1)")
        if self.expert_mode not in EXPERT_MODES:
            raise PlanError(f"MemoryPlan.expert_mode: {self.expert_mode!r} (allowed: {', '.join(EXPERT_MODES)})")
        if self.gpu_memory_bytes is not None and self.gpu_memory_bytes <= 0:
            raise PlanError(f"MemoryPlan.gpu_memory_bytes: {self.gpu_memory_bytes!r} (allowed: None or > 0)")
        if self.reserve_bytes < 0 or (self.gpu_memory_bytes is None and self.reserve_bytes):
            raise PlanError(
                f"MemoryPlan.reserve_bytes: {self.reserve_bytes!r} (allowed: >= 0, and 0 without gpu_memory_bytes)"
            )
        if self.gpu_memory_bytes is not None and self.pool_budget_bytes != (
            self.gpu_memory_bytes - self.weights.device - self.reserve_bytes
        ):
            raise PlanError(
                f"MemoryPlan.pool_budget_bytes: {self.pool_budget_bytes:,} (allowed: gpu_memory_bytes - device "
                f"weights - reserve = {self.gpu_memory_bytes - self.weights.device - self.reserve_bytes:,})"
            )
        for name in ("page_bytes", "state_bytes", "block_size", "num_slots"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise PlanError(f"MemoryPlan.{name}: {value!r} (allowed: a positive int)")
        if self.pool_size is not None and (
            self.pool_size.num_slots != self.num_slots or self.pool_bytes > self.pool_budget_bytes
        ):
            raise PlanError(
                f"MemoryPlan.pool_size: {self.pool_size} (allowed: {self.num_slots} slots within "
                f"pool_budget_bytes {self.pool_budget_bytes:,})"
            )

    @property
    def fits(self) -> bool:
        return self.pool_size is not None

    @property
    def pool_bytes(self) -> int:
        """Bytes the pools allocate (0 when the plan does not fit)."""
        if self.pool_size is None:
            return 0
        return self.pool_size.num_pages * self.page_bytes + self.pool_size.num_slots * self.state_bytes

    @property
    def cache_tokens(self) -> int:
        """Tokens of global (PAGE) cache one rank holds: its PAGEs times block_size."""
        return 0 if self.pool_size is None else self.pool_size.num_pages * self.block_size

    @property
    def replica_cache_tokens(self) -> int:
        """Tokens of cache of the whole replica: a request lives on one rank, so each
        rank's pools serve its own requests."""
        return self.dp * self.cache_tokens

    def verdict(self) -> str:
        """One line: whether the plan fits and the tokens of cache it leaves."""
        memory = (
            f"pools of cache_memory_bytes {_gb(self.pool_budget_bytes)}"
            if self.gpu_memory_bytes is None
            else f"a {_gb(self.gpu_memory_bytes)} GPU"
        )
        shape = f"{self.model} DP{self.dp}+{self.expert_mode.upper()} on {memory}"
        if self.fits:
            return (
                f"{shape}: fits; {self.cache_tokens:,} tokens of cache per rank ({self.replica_cache_tokens:,} per "
                f"replica), {self.num_slots} STATE slots per rank"
            )
        need = self.num_slots * self.state_bytes + self.page_bytes
        return (
            f"{shape}: does not fit; {_gb(max(self.pool_budget_bytes, 0))} left for the pools, "
            f"{_gb(need - self.pool_budget_bytes)} short of {self.num_slots} STATE slots and one PAGE"
        )

    def render(self) -> str:
        """The plan as one table: bytes per rank by kind, then the pools and the verdict."""
        w = self.weights
        rows: list[tuple[str, int | None]] = [
            ("FP8 E4M3 values (dense weights)", w.fp8_values),
            ("FP4 E2M1 values (routed experts)", w.fp4_values),
            ("E8M0 scales (of both)", w.e8m0_scales),
            ("BF16 tensors", w.bf16),
            ("FP32 tensors", w.fp32),
            ("= weights on the device", w.device),
        ]
        if self.gpu_memory_bytes is not None:
            rows += [
                ("GPU memory", self.gpu_memory_bytes),
                ("- reserve (activations, graphs, contexts)", self.reserve_bytes),
            ]
        rows += [
            ("= left for the PAGE/STATE pools", self.pool_budget_bytes),
            (f"STATE: {self.num_slots} slots x {self.state_bytes:,} B", self.num_slots * self.state_bytes),
        ]
        if self.pool_size is not None:
            rows.append(
                (
                    f"PAGE: {self.pool_size.num_pages:,} x {self.page_bytes:,} B ({self.block_size} tokens)",
                    self.pool_size.num_pages * self.page_bytes,
                )
            )
        rows.append(("Engram tables (host memory, not device)", w.engram_host))
        label = max(len(name) for name, _ in rows)
        lines = [
            f"memory plan per rank: {self.model}, {self.dp} DP rank(s), experts {self.expert_mode} "
            "(weights as the device holds them: FP8/FP4 values + E8M0 scales, BF16, FP32)",
            f"{'':<{label}}  {'bytes':>19}  {'GB':>9}",
        ]
        lines += [f"{name:<{label}}  {value:>19,}  {value / 1e9:>9.2f}" for name, value in rows]
        lines.append(self.verdict())
        return "\n".join(lines)


def _gb(nbytes: int) -> str:
    """Decimal GB, as device sheets print them; bytes where that would round to nothing."""
    return f"{nbytes / 1e9:.1f} GB" if abs(nbytes) >= 10**8 else f"{nbytes:,} bytes"


def plan_memory(source: ModelSource, dp: DPLayout, options: EngineOptions) -> MemoryPlan:
    """The memory plan of every rank of ``dp`` running ``source`` under ``options``;
    the pools are ``RankLayout.build``'s under the budget the plan leaves."""
    config = source.config()
    check_replica_options(config, options, dp.world)
    shards = [dp.shard(rank) for rank in range(dp.world)]
    per_rank = rank_device_bytes(source, config, shards, options)
    # The pools are the same on every rank, so the rank with the most device bytes
    # sizes them (all ranks hold the same bytes unless a checkpoint stores one rank's
    # experts differently from another's).
    weights = max(per_rank, key=lambda w: w.device)
    if options.gpu_memory_bytes is None:
        assert options.cache_memory_bytes is not None
        reserve, budget = 0, options.cache_memory_bytes
    else:
        reserve = options.gpu_memory_reserve_bytes
        if reserve is None:
            reserve = default_reserve(options.gpu_memory_bytes)
        budget = options.gpu_memory_bytes - weights.device - reserve
    geometry = RankLayout.geometry_of(config, options)
    num_slots = RankLayout.slots_of(options)
    pool_size = _pools(config, options, budget)
    return MemoryPlan(
        model=str(source),
        dp=dp.world,
        expert_mode=dp.expert_mode,
        weights=weights,
        gpu_memory_bytes=options.gpu_memory_bytes,
        reserve_bytes=reserve,
        pool_budget_bytes=budget,
        page_bytes=geometry.page_bytes,
        state_bytes=geometry.state_bytes,
        block_size=options.block_size,
        num_slots=num_slots,
        pool_size=pool_size,
    )


def _pools(config: V41Config, options: EngineOptions, budget: int) -> PoolSize | None:
    """The pools ``RankLayout`` builds from ``budget`` bytes; None where the budget
    holds the STATE slots and no PAGE (the plan does not fit)."""
    if budget <= 0:
        return None
    try:
        return RankLayout.build(config, _with_budget(options, budget)).pool_size
    except PoolError:
        return None


def _with_budget(options: EngineOptions, budget: int) -> EngineOptions:
    """``options`` with the pools' budget resolved to ``budget`` bytes."""
    return dataclasses.replace(options, cache_memory_bytes=budget, gpu_memory_bytes=None, gpu_memory_reserve_bytes=None)


def sized_options(source: ModelSource, dp: DPLayout, options: EngineOptions) -> EngineOptions:
    """``options`` with the pools sized as the memory plan says, logged as one table at
    startup: under ``gpu_memory_bytes``, ``cache_memory_bytes`` becomes what the rank's
    weights and the reserve leave (refused where that holds no PAGE); without it,
    ``options`` unchanged."""
    plan = plan_memory(source, dp, options)
    logger.info("%s", plan.render())
    if options.gpu_memory_bytes is None:
        return options
    if not plan.fits:
        raise EngineError(f"gpu_memory_bytes: {options.gpu_memory_bytes:,}: {plan.verdict()}")
    return _with_budget(options, plan.pool_budget_bytes)
