"""The reference slice (model/reference_slice.py) and the loader's in-memory seam
(model/loader.load_generated): the slice is V4.1-Flash with exactly the issue's layer
roles, and weights generated in memory equal the weights of a checkpoint written from
the same generator and loaded from disk, for every expert format and rank shard."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsv41.cluster.engine import Engine

from dsv41.cluster.options import EngineOptions
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.config import FLASH_CONFIG_DIR, LayerMode, V41Config
from dsv41.model.loader import (
    SINGLE_FILE,
    TOKENIZER_FILE,
    CheckpointError,
    ExpertShard,
    LoadedCheckpoint,
    load_checkpoint,
    load_generated,
)
from dsv41.model.params import ModelParams
from dsv41.model.reference_slice import REFERENCE_SLICE, SMALL_SLICE, SliceModel, SliceWeights, load_slice
from dsv41.model.tiny import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
from dsv41.model.weights import checkpoint_tensors

FLASH = FLASH_CONFIG_DIR

# SMALL_SLICE's layer roles at the smallest widths the formats allow, so every
# (expert format, shard) pair generates and loads in well under a second.
TEST_SLICE = dataclasses.replace(
    SMALL_SLICE,
    name="test-slice",
    engram_vocab_size=101,
    n_routed_experts=4,
    widths=(
        ("vocab_size", 300),
        ("hidden_size", 64),
        ("num_attention_heads", 4),
        ("head_dim", 32),
        ("qk_rope_head_dim", 16),
        ("q_lora_rank", 32),
        ("o_groups", 2),
        ("o_lora_rank", 32),
        ("sliding_window", 16),
        ("candidate_topk_blocks", 8),
        ("candidate_block_size", 4),
        ("index_n_heads", 2),
        ("index_head_dim", 32),
        ("index_topk", 8),
        ("num_experts_per_tok", 2),
        ("moe_intermediate_size", 64),
        ("engram_n_heads", 2),
        ("engram_head_dim", 32),
    ),
)
SHARDS = (None, ExpertShard("ep", 0, 2), ExpertShard("ep", 1, 2), ExpertShard("tp", 0, 2), ExpertShard("tp", 1, 2))


@pytest.fixture(scope="module")
def flash() -> V41Config:
    return V41Config.from_pretrained(FLASH, text_only=True)


@pytest.fixture(scope="module")
def reference(flash: V41Config) -> SliceModel:
    return SliceModel.build(REFERENCE_SLICE, flash)


def test_reference_slice_has_the_issue_layer_roles(reference: SliceModel) -> None:
    """Layers 0-1 window (Engram on 1), ratio-2 Full 2 and 4 with Reuse 3, ratio-1 Full
    5 (candidate source, decoder start), Reuse 6, Reindex 7 against 5's keys inside
    the candidates; 64 routed experts, top-6 + 1 shared; DSpark off."""
    config = reference.config
    topology = config.topology
    layers = topology.target_layers
    assert [t.ratio for t in layers] == [0, 0, 2, 2, 2, 1, 1, 1]
    assert [t.mode for t in layers] == [
        LayerMode.WINDOW, LayerMode.WINDOW, LayerMode.FULL, LayerMode.REUSE,
        LayerMode.FULL, LayerMode.FULL, LayerMode.REUSE, LayerMode.REINDEX,
    ]
    assert [t.kv_owner for t in layers] == [None, None, 2, 2, 4, 5, 5, 5]
    assert [t.index_owner for t in layers] == [None, None, 2, 2, 4, 5, 5, 5]
    assert [t.topk_owner for t in layers] == [None, None, 2, 2, 4, 5, 5, 7]
    assert [t.layer_id for t in layers if t.uses_candidates] == [7]
    assert [t.layer_id for t in layers if t.is_engram] == [1]
    assert topology.full_owners == (2, 4, 5) and topology.candidate_source == 5 and topology.decoder_start == 5
    assert config.index_source_layer_ids == (2, 4, 5, 7)
    assert (config.engram_layer_ids, config.engram_vocab_size) == ((1,), 100003)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (64, 6, 1)
    assert topology.dspark_layers == () and config.num_nextn_predict_layers == 0
    assert config.quantization is None


def test_reference_slice_is_flash_outside_what_the_issue_changes(reference: SliceModel, flash: V41Config) -> None:
    """Every config field the slice does not change is V4.1-Flash's (hidden 5120, 64
    heads x 512, q_lora 1280, o_groups 8 x 1024, index 32 x 128, top-k 512, window 128,
    candidates 2048 x 8, moe_intermediate 2304, hc 4, vocab, rope, ...): the fields that
    differ are exactly the layer pattern, the Engram table, the expert count, DSpark, and
    what the slice's tokenizer derives."""
    ours, theirs = reference.config.to_text_config(), flash.to_text_config()
    differing = {name for name in theirs if ours[name] != theirs[name]}
    assert differing == {
        "num_hidden_layers", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
        "candidate_source_layer_id", "engram_layer_ids", "engram_vocab_size", "engram_num_embeddings",
        "n_routed_experts", "num_nextn_predict_layers", "dspark_target_layer_ids",
        "engram_compressed_vocab_size", "dspark_noise_token_id",
    }
    assert (ours["hidden_size"], ours["num_attention_heads"], ours["head_dim"]) == (5120, 64, 512)
    assert (ours["index_n_heads"], ours["index_head_dim"], ours["index_topk"]) == (32, 128, 512)
    assert (ours["candidate_topk_blocks"], ours["candidate_block_size"]) == (2048, 8)
    assert (ours["moe_intermediate_size"], ours["hc_mult"], ours["sliding_window"]) == (2304, 4, 128)
    assert (ours["q_lora_rank"], ours["o_groups"], ours["o_lora_rank"]) == (1280, 8, 1024)


def test_slice_tokenizer_gives_every_id_its_own_engram_id(reference: SliceModel) -> None:
    """One word per model id, so the Engram compressed vocabulary is the whole
    vocabulary; the special tokens keep the released model's ids."""
    tokenizer = reference.tokenizer
    assert tokenizer.get_vocab_size(with_added_tokens=True) == reference.config.vocab_size
    assert reference.config.engram_compressed_vocab_size == reference.config.vocab_size
    assert [tokenizer.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)] == [
        reference.config.bos_token_id, reference.config.eos_token_id, reference.config.pad_token_id,
    ]


@pytest.fixture(scope="module", params=("bf16", "fp4"))
def written(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, flash: V41Config
) -> tuple[SliceModel, Path]:
    """TEST_SLICE as a checkpoint on disk, written from the generator (seed 3)."""
    model = SliceModel.build(TEST_SLICE, flash, expert_format=request.param)
    make = SliceWeights(seed=3, expert_format=model.expert_format, device="cpu")
    stored: dict[str, torch.Tensor] = {}
    for spec in checkpoint_tensors(model.config).values():
        values, scale = make(spec, None)
        stored[spec.name] = values
        if scale is not None:
            stored[spec.scale_name] = scale
    out = tmp_path_factory.mktemp(f"slice-{request.param}")
    save_file(stored, str(out / SINGLE_FILE))
    (out / TOKENIZER_FILE).write_text(model.tokenizer.to_str())
    (out / "config.json").write_text(json.dumps(model.raw_config))
    return model, out


def _assert_same_checkpoint(made: LoadedCheckpoint, read: LoadedCheckpoint) -> None:
    assert made.config == read.config
    assert made.expert_ids == read.expert_ids and made.has_dspark == read.has_dspark
    assert made.tensors.keys() == read.tensors.keys()
    for name, tensor in read.tensors.items():
        assert made.tensors[name].dtype == tensor.dtype, name
        assert torch.equal(made.tensors[name], tensor), name
    assert made.engram_tables.keys() == read.engram_tables.keys()
    for layer, table in read.engram_tables.items():
        assert torch.equal(made.engram_tables[layer].values, table.values), layer
        assert (made.engram_tables[layer].scales is None) == (table.scales is None)
    assert torch.equal(made.token_map, read.token_map) and made.num_compressed == read.num_compressed


@pytest.mark.parametrize("shard", SHARDS, ids=lambda s: "all" if s is None else f"{s.mode}{s.rank}of{s.world}")
def test_generated_equals_the_written_checkpoint(written: tuple[SliceModel, Path], shard: ExpertShard | None) -> None:
    """For each expert format and each rank shard (all experts; EP halves; TP halves of
    every expert), generating in memory gives exactly the tensors, Engram tables and
    token map that loading the written checkpoint gives: the generator makes a rank's
    experts or slices without the rest, identical to that part of the whole."""
    model, checkpoint_dir = written
    made = load_slice(model, seed=3, dtype=torch.bfloat16, shard=shard)
    read = load_checkpoint(checkpoint_dir, dtype=torch.bfloat16, shard=shard)
    _assert_same_checkpoint(made, read)
    assert made.post_load_runs == 1


def test_seed_changes_every_random_tensor(flash: V41Config) -> None:
    """Another seed draws other values for every tensor that is not constant."""
    model = SliceModel.build(TEST_SLICE, flash)
    first, second = load_slice(model, seed=0), load_slice(model, seed=1)
    assert all(not torch.equal(first.tensors[n], second.tensors[n]) for n in first.tensors)


def test_load_generated_refuses_a_tensor_that_does_not_match_its_declaration(flash: V41Config) -> None:
    """A maker's answer is checked like a shard file's header entry: a wrong shape is
    refused naming the tensor."""
    model = SliceModel.build(TEST_SLICE, flash)
    make = SliceWeights(seed=0, expert_format="bf16", device="cpu")

    def transposed_wq_a(spec, part):
        values, scale = make(spec, part)
        return (values.t().contiguous(), scale) if spec.name == "layers.3.attn.wq_a.weight" else (values, scale)

    with pytest.raises(CheckpointError, match=r"layers\.3\.attn\.wq_a\.weight: shape"):
        load_generated(model.config, model.tokenizer, transposed_wq_a, source="test")


def test_slice_spec_refuses_unknown_or_repeated_widths() -> None:
    """widths may only replace known size fields, each once, with positive ints."""
    with pytest.raises(ValueError, match="widths: 'n_layers'"):
        dataclasses.replace(REFERENCE_SLICE, widths=(("n_layers", 4),))
    with pytest.raises(ValueError, match="given twice"):
        dataclasses.replace(REFERENCE_SLICE, widths=(("hidden_size", 64), ("hidden_size", 128)))
    with pytest.raises(ValueError, match=r"widths\['hidden_size'\]: 0"):
        dataclasses.replace(REFERENCE_SLICE, widths=(("hidden_size", 0),))
    with pytest.raises(ValueError, match="expert_format"):
        SliceWeights(seed=0, expert_format="fp8", device="cpu")


def test_generated_slice_serves_through_the_engine(flash: V41Config) -> None:
    """The generated TEST_SLICE runs the paged engine path the benchmarks drive: a
    prompt past the window, the top-k and the candidate budget prefills and decodes."""
    model = SliceModel.build(TEST_SLICE, flash, expert_format="fp4")
    checkpoint = load_slice(model, seed=0, dtype=torch.float32)
    engine = Engine.from_params(ModelParams.from_checkpoint(checkpoint), checkpoint.tokenizer, EngineOptions(block_size=32))
    prompt = torch.randint(16, model.config.vocab_size, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(output.token_ids) == 3 and output.finished
