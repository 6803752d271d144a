"""The memory plan (cluster/memory_plan.py): what it counts equals what a checkpoint
stores and what the pools allocate, the engine's pools under gpu_memory_bytes are the
plan's, and V4.1-Flash's plans follow from its shipped config."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

from dsv41.cache.pools import PoolSize, V41Pools
from dsv41.cluster.engine import Engine
from dsv41.cluster.memory_plan import (
    DEFAULT_RESERVE_FRACTION,
    WeightBytes,
    plan_memory,
    rank_device_bytes,
    rank_weight_bytes,
    sized_options,
)
from dsv41.cluster.options import EngineError, EngineOptions, RankLayout
from dsv41.cluster.ranks import DPLayout
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.loader import ExpertShard, LoadedCheckpoint, TensorPart, load_checkpoint, read_safetensors_header
from dsv41.model.reference_slice import SliceWeights, load_slice
from dsv41.model.stored_weights import Fp4Weight, Fp8Weight
from dsv41.model.source import ModelSource
from dsv41.model.weights import checkpoint_tensors, is_vision_tensor, routed_expert

# The five shapes issue 18 asks about: (DP ranks, expert mode, GPU memory in bytes).
# "TP4" is this runtime's tensor parallelism: four DP attention ranks, each routed
# expert's intermediate dim split over them.
FLASH_SHAPES = ((4, "ep", 288 * 10**9), (4, "tp", 288 * 10**9), (4, "ep", 141 * 10**9), (4, "tp", 141 * 10**9), (8, "ep", 141 * 10**9))


def _header_kind_bytes(model_dir: Path, shard: ExpertShard) -> WeightBytes:
    """One rank's stored bytes summed straight from the safetensors headers, each entry
    by its stored dtype: E4M3 values are FP8 (on the host for an Engram table), I8/U8
    values packed FP4, .scale entries E8M0 (the host's for an Engram table), BF16 and
    F32 plain. A rank holds routed expert ``e`` of ``E`` under EP when
    ``rank * E / world <= e < (rank + 1) * E / world``, and 1/world of each under TP."""
    config = V41Config.from_pretrained(model_dir, text_only=True)
    totals = dict.fromkeys(("fp8_values", "fp4_values", "e8m0_scales", "bf16", "fp32", "engram_host"), 0)
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, entry in read_safetensors_header(path).items():
            if is_vision_tensor(name):
                continue
            nbytes = entry.nbytes
            expert = routed_expert(name)
            if expert is not None:
                count = config.dspark_n_routed_experts if name.startswith("mtp.") else config.n_routed_experts
                if shard.mode == "tp":
                    assert nbytes % shard.world == 0
                    nbytes //= shard.world
                elif not shard.rank * count // shard.world <= expert[0] < (shard.rank + 1) * count // shard.world:
                    continue
            if ".engram.embed." in name:
                totals["engram_host"] += nbytes
            elif name.endswith(".scale"):
                totals["e8m0_scales"] += nbytes
            else:
                field = {"F8_E4M3": "fp8_values", "I8": "fp4_values", "U8": "fp4_values", "BF16": "bf16", "F32": "fp32"}
                totals[field[entry.dtype]] += nbytes
    return WeightBytes(**totals)


def _config_only(model_dir: Path, tmp_path: Path) -> Path:
    bare = tmp_path / f"{model_dir.name}-config-only"
    bare.mkdir()
    shutil.copy(model_dir / "config.json", bare / "config.json")
    return bare


@pytest.mark.parametrize("mode", ["ep", "tp"])
@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "quantized"])
def test_weights_are_the_checkpoints_stored_bytes(
    tiny_dir: Path, tiny_quantized_dir: Path, tmp_path: Path, mode: str, quantized: bool
) -> None:
    """For each rank of a 2-rank EP or TP replica of the tiny checkpoint (plain, and
    quantised: FP8 / FP4 / E8M0 / FP8 Engram rows), the plan's bytes by kind equal the
    sum of that rank's safetensors entries read from the headers; and the same
    directory's config alone (no weights: counted from the declarations, as V4.1-Flash
    is) gives the same bytes, so the declared arithmetic is the stored form's."""
    model_dir = tiny_quantized_dir if quantized else tiny_dir
    config = V41Config.from_pretrained(model_dir, text_only=True)
    shards = [ExpertShard(mode, rank, 2) for rank in range(2)]
    from_headers = rank_weight_bytes(ModelSource.parse(model_dir), config, shards)
    declared = rank_weight_bytes(ModelSource.parse(_config_only(model_dir, tmp_path)), config, shards)
    for shard, counted, from_declarations in zip(shards, from_headers, declared):
        expected = _header_kind_bytes(model_dir, shard)
        assert counted == expected
        assert from_declarations == expected
    if quantized:
        assert expected.fp8_values and expected.fp4_values and expected.e8m0_scales and expected.engram_host
    else:
        assert not (expected.fp8_values or expected.fp4_values or expected.e8m0_scales)


def test_a_generated_slices_weights_are_what_its_maker_makes() -> None:
    """For rank 0 of a 2-rank TP replica of generated:small-slice with FP4 experts, the
    plan's bytes by kind equal the bytes of the tensors the slice's maker makes for that
    rank (FP4 experts + E8M0 scales, every other tensor plain; Engram tables on the host)."""
    source = ModelSource.parse("generated:small-slice,experts=fp4")
    config = source.config()
    shard = ExpertShard("tp", 0, 2)
    maker = SliceWeights(seed=0, expert_format="fp4", device="cpu")
    totals = dict.fromkeys(("fp8_values", "fp4_values", "e8m0_scales", "bf16", "fp32", "engram_host"), 0)
    for name, spec in checkpoint_tensors(config).items():
        part = None
        if routed_expert(name) is not None:
            axis = 1 if routed_expert(name)[1] == "w2" else 0
            span = shard.part(spec.shape[axis])
            part = TensorPart(axis, span.start, span.stop)
        values, scale = maker(spec, part)
        stored = values.nbytes + (0 if scale is None else scale.nbytes)
        if ".engram.embed." in name:
            totals["engram_host"] += stored
        elif scale is not None:
            totals["fp4_values"] += values.nbytes
            totals["e8m0_scales"] += scale.nbytes
        else:
            totals["fp32" if values.element_size() == 4 else "bf16"] += values.nbytes
    (counted,) = rank_weight_bytes(source, config, [shard])
    assert counted == WeightBytes(**totals)
    assert counted.fp4_values and not counted.fp8_values


@pytest.mark.parametrize("num_pages, num_slots", [(1, 1), (7, 3), (40, 16)])
def test_pool_bytes_are_what_the_pools_allocate(tiny_dir: Path, num_pages: int, num_slots: int) -> None:
    """For a budget of exactly N PAGEs and S slots, the plan's pools are N PAGEs and S
    slots, and their bytes are the bytes V41Pools allocates for that geometry."""
    config = V41Config.from_pretrained(tiny_dir, text_only=True)
    options = EngineOptions(block_size=32, max_num_seqs=num_slots)
    geometry = RankLayout.geometry_of(config, options)
    budget = PoolSize(num_pages, num_slots).nbytes(geometry)
    plan = plan_memory(ModelSource.parse(tiny_dir), DPLayout(1), EngineOptions(block_size=32, max_num_seqs=num_slots, cache_memory_bytes=budget))
    assert plan.pool_size == PoolSize(num_pages, num_slots)
    pools = V41Pools(geometry, plan.pool_size)
    assert plan.pool_bytes == pools.buffer.numel() == budget
    assert plan.cache_tokens == num_pages * 32


def test_the_engine_sizes_its_pools_by_the_plan(tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Under gpu_memory_bytes the engine's pools are the plan's: the budget is the GPU
    memory less the rank's stored weights and the reserve (10% by default), the pools
    are the most PAGEs that budget holds beside the slots, and the engine logs the
    plan's table at startup."""
    source = ModelSource.parse(tiny_dir)
    gpu = 64 << 20
    options = EngineOptions(block_size=32, max_num_seqs=4, gpu_memory_bytes=gpu)
    plan = plan_memory(source, DPLayout(1), options)
    assert plan.reserve_bytes == int(gpu * DEFAULT_RESERVE_FRACTION)
    assert plan.pool_budget_bytes == gpu - plan.weights.device - plan.reserve_bytes
    assert plan.pool_bytes <= plan.pool_budget_bytes < plan.pool_bytes + plan.page_bytes
    with caplog.at_level(logging.INFO, logger="dsv41.cluster.memory_plan"):
        engine = Engine.from_pretrained(tiny_dir, block_size=32, max_num_seqs=4, gpu_memory_bytes=gpu)
    assert engine.layout.pool_size == plan.pool_size
    assert plan.render() in caplog.text
    with pytest.raises(EngineError, match="gpu_memory_bytes.*does not fit"):
        sized_options(source, DPLayout(1), EngineOptions(gpu_memory_bytes=plan.weights.device + 1))


def test_memory_options_refuse_what_they_cannot_mean(tiny_dir: Path) -> None:
    """Both budgets at once, a reserve without GPU memory and a layout built from
    options whose GPU memory was never turned into a pool budget are refused, naming
    the field."""
    with pytest.raises(EngineError, match="cache_memory_bytes / gpu_memory_bytes"):
        EngineOptions(cache_memory_bytes=1 << 20, gpu_memory_bytes=1 << 30)
    with pytest.raises(EngineError, match="gpu_memory_reserve_bytes"):
        EngineOptions(gpu_memory_reserve_bytes=1)
    with pytest.raises(EngineError, match="gpu_memory_bytes"):
        EngineOptions(gpu_memory_bytes=0)
    config = V41Config.from_pretrained(tiny_dir, text_only=True)
    with pytest.raises(EngineError, match="gpu_memory_bytes.*not yet turned into a pool budget"):
        RankLayout.build(config, EngineOptions(gpu_memory_bytes=1 << 30))


@pytest.fixture(scope="module")
def flash_plans() -> dict[tuple[int, str, int], object]:
    source = ModelSource.parse(FLASH_CONFIG_DIR)
    return {
        (dp, mode, gpu): plan_memory(source, DPLayout(dp, mode), EngineOptions(gpu_memory_bytes=gpu))
        for dp, mode, gpu in FLASH_SHAPES
    }


def test_flash_plans_follow_from_the_shipped_config(flash_plans: dict) -> None:
    """V4.1-Flash's config (no weights: its declared FP8 / FP4 / E8M0 / BF16 / FP32 form):
    every rank's dense weights are the same whatever the split; EP and TP over the same
    ranks hold the same bytes (whole experts, or the same slice of each), so they leave
    the same pools; 8 ranks hold half the routed-expert values of 4; DP4+EP fits on
    288 GB; a plan's pools are the most whole PAGEs the budget holds beside its 64
    slots, and its tokens of cache are those PAGEs times 128 (derived here, not typed)."""
    plans = flash_plans
    config = V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True)
    big_ep, big_tp = plans[(4, "ep", 288 * 10**9)], plans[(4, "tp", 288 * 10**9)]
    assert big_ep.fits
    assert big_ep.weights == big_tp.weights and big_ep.pool_size == big_tp.pool_size
    four, eight = plans[(4, "ep", 141 * 10**9)].weights, plans[(8, "ep", 141 * 10**9)].weights
    assert four.fp4_values == 2 * eight.fp4_values
    assert (four.fp8_values, four.bf16, four.fp32, four.engram_host) == (eight.fp8_values, eight.bf16, eight.fp32, eight.engram_host)
    for (dp, _, gpu), plan in plans.items():
        assert plan.weights.engram_host > 0 and plan.num_slots == EngineOptions().max_num_seqs
        assert plan.pool_budget_bytes == gpu - plan.weights.device - math.floor(gpu * DEFAULT_RESERVE_FRACTION)
        if plan.fits:
            assert plan.pool_bytes <= plan.pool_budget_bytes < plan.pool_bytes + plan.page_bytes
            assert plan.cache_tokens == plan.pool_size.num_pages * EngineOptions().block_size
            assert plan.replica_cache_tokens == dp * plan.cache_tokens
    # The routed experts are FP4: 3 projections of hidden x moe_intermediate per expert,
    # 2 values a byte, split over the ranks (the DSpark stages' experts likewise).
    experts = config.num_hidden_layers * config.n_routed_experts + config.num_nextn_predict_layers * config.dspark_n_routed_experts
    assert four.fp4_values * 4 == experts * 3 * config.hidden_size * config.moe_intermediate_size // 2


def _loaded_kind_bytes(checkpoint: LoadedCheckpoint) -> WeightBytes:
    """What a load put in memory, tensor by tensor: stored FP8 / FP4 weights' values and
    scales, every other tensor by the dtype it was cast to; Engram tables as mapped."""
    totals = dict.fromkeys(("fp8_values", "fp4_values", "e8m0_scales", "bf16", "fp32", "engram_host"), 0)
    for weight in checkpoint.tensors.values():
        if isinstance(weight, (Fp8Weight, Fp4Weight)):
            totals["fp8_values" if isinstance(weight, Fp8Weight) else "fp4_values"] += weight.values.nbytes
            totals["e8m0_scales"] += weight.scale.nbytes
        else:
            totals["bf16" if weight.dtype == torch.bfloat16 else "fp32"] += weight.nbytes
    for table in checkpoint.engram_tables.values():
        totals["engram_host"] += table.values.nbytes + (0 if table.scales is None else table.scales.nbytes)
    return WeightBytes(**totals)


@pytest.mark.parametrize("storage", ["stored", "decoded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "quantized"])
def test_device_bytes_are_what_a_load_holds(
    tiny_dir: Path, tiny_quantized_dir: Path, storage: str, dtype: torch.dtype, quantized: bool
) -> None:
    """For each rank of a 2-rank EP replica of the tiny checkpoint, under each compute
    dtype and weight storage, the plan's device bytes by kind are the bytes that rank's
    load holds, counted tensor by tensor (the plan the engine sizes its pools by is the
    memory its weights take)."""
    model_dir = tiny_quantized_dir if quantized else tiny_dir
    source = ModelSource.parse(model_dir)
    config = source.config()
    options = EngineOptions(dtype=dtype, weight_storage=storage)
    shards = [ExpertShard("ep", rank, 2) for rank in range(2)]
    planned = rank_device_bytes(source, config, shards, options)
    for shard, plan in zip(shards, planned):
        loaded = load_checkpoint(model_dir, dtype=dtype, weight_storage=storage, shard=shard, text_only=True)
        assert plan == _loaded_kind_bytes(loaded), shard
    if quantized and storage == "stored":
        assert planned[0].fp8_values and planned[0].fp4_values


def test_a_slice_with_fp8_dense_weights_plans_what_it_loads() -> None:
    """generated:small-slice,experts=fp4,dense=fp8 loaded stored in bf16: the plan's
    device bytes are the load's."""
    source = ModelSource.parse("generated:small-slice,experts=fp4,dense=fp8")
    options = EngineOptions(dtype=torch.bfloat16)
    (planned,) = rank_device_bytes(source, source.config(), [None], options)
    loaded = load_slice(source._slice(), dtype=torch.bfloat16, weight_storage="stored", dense_format="fp8")
    assert planned == _loaded_kind_bytes(loaded)
    assert planned.fp8_values and planned.fp4_values
