"""The native checkpoint loader against tiny checkpoints written by model/tiny.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import dsv41.model.loader as loader
from dsv41.model.config import FLASH_CONFIG_DIR, ConfigError, LayerMode, V41Config
from dsv41.model.loader import (
    CheckpointError,
    ExpertShard,
    LoadedCheckpoint,
    LoadProgress,
    load_checkpoint,
    read_safetensors_header,
)
from dsv41.model.tiny import TINY, make_tiny
from dsv41.model.weights import TensorKind, TensorSpec, checkpoint_tensors, routed_expert

Tensors = dict[str, torch.Tensor]


# -- helpers -------------------------------------------------------------------------------


def _stored_tensors(model_dir: Path) -> Tensors:
    """Every stored tensor of a checkpoint, by stored name, read with safetensors itself."""
    index = json.loads((model_dir / loader.INDEX_FILE).read_text())
    tensors: Tensors = {}
    for file_name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(model_dir / file_name))
    return tensors


def _write_single_file(source_dir: Path, target_dir: Path, tensors: Tensors) -> Path:
    """A checkpoint with source_dir's config and tokenizer and ``tensors`` in one file."""
    target_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", loader.TOKENIZER_FILE):
        shutil.copy(source_dir / name, target_dir / name)
    save_file(tensors, str(target_dir / loader.SINGLE_FILE))
    return target_dir


def _specs(model_dir: Path) -> dict[str, TensorSpec]:
    return checkpoint_tensors(V41Config.from_pretrained(model_dir))


def _load_error(model_dir: Path, **kwargs: object) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model_dir, **kwargs)
    return str(info.value)


@pytest.fixture(scope="module")
def plain_tensors(tiny_dir: Path) -> Tensors:
    return _stored_tensors(tiny_dir)


@pytest.fixture(scope="module")
def quantized_tensors(tiny_quantized_dir: Path) -> Tensors:
    return _stored_tensors(tiny_quantized_dir)


@pytest.fixture(scope="module")
def full_plain(tiny_dir: Path) -> LoadedCheckpoint:
    return load_checkpoint(tiny_dir)


@pytest.fixture(scope="module")
def full_quantized(tiny_quantized_dir: Path) -> LoadedCheckpoint:
    return load_checkpoint(tiny_quantized_dir)


# -- declarations --------------------------------------------------------------------------

FLASH_DIR = FLASH_CONFIG_DIR


def test_flash_declarations_follow_the_layer_roles() -> None:
    """On Flash's config each layer declares the tensors of its role (MODEL_FACTS
    sections 2, 8, 9): compressor and index keys on Full owners only (wgate at ratio 2
    only), index queries on Full and Reindex layers, Engram on its layers with
    engram_num_embeddings rows, every routed expert, and DSpark stages with their own
    expert count, main_proj on stage 0 and the heads on the last stage."""
    config = V41Config.from_pretrained(FLASH_DIR, text_only=True)
    specs = checkpoint_tensors(config)
    for layer in config.topology.target_layers:
        prefix = f"layers.{layer.layer_id}."
        names = {n.removeprefix(prefix) for n in specs if n.startswith(prefix)}
        full, reindex = layer.mode is LayerMode.FULL, layer.mode is LayerMode.REINDEX
        assert ("attn.compressor.wkv.weight" in names) == full
        assert ("attn.compressor.wgate.weight" in names) == (full and layer.ratio == 2)
        assert ("attn.indexer.wk.weight" in names) == full
        assert ("attn.indexer.wq_b.weight" in names) == (full or reindex)
        assert ("engram.embed.weight" in names) == layer.is_engram
        experts = {routed_expert(prefix + n) for n in names if routed_expert(prefix + n) is not None}
        assert experts == {(e, w) for e in range(config.n_routed_experts) for w in ("w1", "w2", "w3")}
    for k, layer_id in enumerate(config.engram_layer_ids):
        assert specs[f"layers.{layer_id}.engram.embed.weight"].shape == (config.engram_num_embeddings[k], 256)
    mtp = [n for n, s in specs.items() if s.group == "mtp"]
    assert all(n.startswith("mtp.") for n in mtp) and {n.split(".")[1] for n in mtp} == {"0", "1", "2"}
    assert {routed_expert(n)[0] for n in mtp if routed_expert(n)} == set(range(config.dspark_n_routed_experts))
    assert specs["mtp.0.main_proj.weight"].shape == (5120, 3 * 5120)
    assert specs["mtp.2.confidence_head.proj.weight"].shape == (1, 5120 + 256)
    assert "mtp.1.markov_head.head.weight" not in specs and "mtp.2.main_proj.weight" not in specs


@pytest.mark.parametrize("width", [1, 16, 32, 48, 256, 257])
def test_row_scaled_kinds_declare_one_scale_per_started_group(width: int) -> None:
    """An Engram table of any width declares ceil(width / 32) E8M0 scales per row; an
    FP4 expert must hold whole groups of 32 (TP slices split at group boundaries)."""
    table = TensorSpec("layers.1.engram.embed.weight", (7, width), TensorKind.ENGRAM_TABLE, "core")
    assert table.quantized_shape == (7, width) and table.scale_shape == (7, -(-width // 32))
    if width % 32:
        with pytest.raises(ValueError, match=f"last dim {width} must be a multiple of 32"):
            TensorSpec("layers.0.ffn.experts.0.w1.weight", (7, width), TensorKind.FP4_EXPERT, "core")
    else:
        expert = TensorSpec("layers.0.ffn.experts.0.w1.weight", (7, width), TensorKind.FP4_EXPERT, "core")
        assert expert.scale_shape == (7, width // 32)


def test_only_router_gates_are_held_in_fp32_and_only_bf16_tensors_may_be() -> None:
    """The Flash declarations hold exactly the router gates (every layer's and DSpark
    stage's ``ffn.gate.weight``) in float32; held_fp32 on any other kind is refused."""
    specs = checkpoint_tensors(V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True))
    held = {name for name, spec in specs.items() if spec.held_fp32}
    assert held == {name for name in specs if name.endswith(".ffn.gate.weight")} and held
    with pytest.raises(ValueError, match="held_fp32 .* kind FP32"):
        TensorSpec("layers.0.attn.attn_sink", (4,), TensorKind.FP32, "core", held_fp32=True)


# -- round trip ----------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_quantized_dir", "tiny_alt_dir"])
def test_every_declared_tensor_is_loaded_with_its_shape(fixture: str, request: pytest.FixtureRequest) -> None:
    """make_tiny then load: every declared tensor is present with its declared shape
    (Engram tables as memory-mapped tables of the declared rows x head_dim), nothing
    else is, FP32 kinds are float32 and the rest the compute dtype."""
    model_dir: Path = request.getfixturevalue(fixture)
    checkpoint = load_checkpoint(model_dir)
    specs = _specs(model_dir)
    tables = {n: s for n, s in specs.items() if s.kind is TensorKind.ENGRAM_TABLE}
    assert set(checkpoint.tensors) == set(specs) - set(tables)
    for name, tensor in checkpoint.tensors.items():
        assert tuple(tensor.shape) == specs[name].shape, name
        assert tensor.dtype == torch.float32, name
    for name, spec in tables.items():
        table = checkpoint.engram_tables[int(name.split(".")[1])]
        assert (table.num_rows, table.head_dim) == spec.shape
    assert sorted(checkpoint.engram_tables) == list(checkpoint.config.engram_layer_ids)
    assert checkpoint.has_dspark
    assert checkpoint.expert_ids == tuple(range(checkpoint.config.n_routed_experts))
    assert checkpoint.dspark_expert_ids == tuple(range(checkpoint.config.dspark_n_routed_experts))
    assert checkpoint.token_map is not None and checkpoint.token_map.shape == (checkpoint.config.vocab_size,)
    assert checkpoint.num_compressed == checkpoint.config.engram_compressed_vocab_size


def test_compute_dtype_casts_all_but_fp32_kinds(tiny_dir: Path, full_plain: LoadedCheckpoint) -> None:
    """dtype=bfloat16 gives the float32 load cast to bf16, except FP32 kinds, which stay
    float32 and unchanged, and the held_fp32 tensors (the router gates), which hold
    the bf16 cast's values in float32."""
    half = load_checkpoint(tiny_dir, dtype=torch.bfloat16)
    specs = _specs(tiny_dir)
    assert any(spec.held_fp32 for spec in specs.values())
    for name, tensor in half.tensors.items():
        if specs[name].kind is TensorKind.FP32:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, full_plain.tensors[name]), name
        elif specs[name].held_fp32:
            want = full_plain.tensors[name].to(torch.bfloat16).float()
            assert tensor.dtype == torch.float32 and torch.equal(tensor, want), name
        else:
            assert torch.equal(tensor, full_plain.tensors[name].to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(tiny_dir, dtype=torch.int8)


def _fp8_error_bound(reference: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
    # E4M3 keeps 3 mantissa bits (half an ulp <= |x| / 16); below its normal range the
    # spacing is 2^-9 of a block scale <= 2 * amax / 448.
    return reference.abs() / 16 + block_amax * 2.0**-17


def _fp8_tile_amax(weight: torch.Tensor, block: int = 32) -> torch.Tensor:
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight.abs(), (0, (-cols) % block, 0, (-rows) % block))
    tiles = padded.reshape(padded.shape[0] // block, block, padded.shape[1] // block, block).amax(dim=(1, 3))
    return tiles.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]


def _group_amax(weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    rows, cols = weight.shape
    amax = weight.abs().reshape(rows, cols // group, group).amax(-1, keepdim=True)
    return amax.expand(rows, cols // group, group).reshape(rows, cols)


def test_quantized_decodes_within_the_format_error_of_the_plain(
    tiny_dir: Path, full_plain: LoadedCheckpoint, full_quantized: LoadedCheckpoint
) -> None:
    """The quantised checkpoint stores the plain one's weights quantised: each decoded
    value is within its format's rounding error of the plain value (FP8 E4M3 with 32x32
    power-of-two tiles; E2M1 with power-of-two groups of 32, half-gap <= max(s/4, |x|/4));
    the other kinds are bit-identical."""
    specs = _specs(tiny_dir)
    for name, spec in specs.items():
        if spec.kind is TensorKind.ENGRAM_TABLE:
            continue
        plain, decoded = full_plain.tensors[name], full_quantized.tensors[name]
        if spec.kind is TensorKind.FP8_WEIGHT:
            bound = _fp8_error_bound(plain, _fp8_tile_amax(plain))
        elif spec.kind is TensorKind.FP4_EXPERT:
            bound = plain.abs() / 4 + _group_amax(plain) / 12
        else:
            assert torch.equal(plain, decoded), name
            continue
        assert not torch.equal(plain, decoded), f"{name} was not quantised"
        assert torch.all((decoded - plain).abs() <= bound), name
    for layer_id, table in full_plain.engram_tables.items():
        rows = torch.arange(table.num_rows).unsqueeze(1)
        plain = table.lookup(rows)
        decoded = full_quantized.engram_tables[layer_id].lookup(rows)
        assert full_quantized.engram_tables[layer_id].scales is not None
        assert torch.all((decoded - plain).abs() <= _fp8_error_bound(plain, _group_amax(plain))), layer_id


def test_single_file_checkpoint_loads_like_the_sharded_one(
    tiny_dir: Path, plain_tensors: Tensors, full_plain: LoadedCheckpoint, tmp_path: Path
) -> None:
    """The same tensors in one model.safetensors load to the same checkpoint."""
    single = load_checkpoint(_write_single_file(tiny_dir, tmp_path / "single", plain_tensors))
    assert single.tensors.keys() == full_plain.tensors.keys()
    assert all(torch.equal(t, full_plain.tensors[n]) for n, t in single.tensors.items())


def test_bare_mhc_spelling_is_an_alias_of_the_canonical_one(
    tiny_dir: Path, plain_tensors: Tensors, full_plain: LoadedCheckpoint, tmp_path: Path
) -> None:
    """`layers.N.hc_attn_fn` (bare, as public re-implementations store it) loads as
    `layers.N.hc_attn_fn.weight`; storing both spellings is an error naming both."""
    renamed = {
        (name.removesuffix(".weight") if ".hc_" in name else name): tensor for name, tensor in plain_tensors.items()
    }
    assert "layers.0.hc_attn_fn" in renamed and "mtp.0.hc_ffn_scale" in renamed
    bare = load_checkpoint(_write_single_file(tiny_dir, tmp_path / "bare", renamed))
    assert bare.tensors.keys() == full_plain.tensors.keys()
    assert all(torch.equal(t, full_plain.tensors[n]) for n, t in bare.tensors.items())
    both = dict(plain_tensors, **{"layers.3.hc_ffn_base": plain_tensors["layers.3.hc_ffn_base.weight"].clone()})
    message = _load_error(_write_single_file(tiny_dir, tmp_path / "both", both))
    assert "layers.3.hc_ffn_base" in message and "stored twice" in message


# -- refusals ------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_every_declared_tensor_is_required(tiny_dir: Path, plain_tensors: Tensors, data: st.DataObject) -> None:
    """Removing any declared tensor (a DSpark one while the others stay, too) is an
    error naming it and its expected shape."""
    name = data.draw(st.sampled_from(sorted(plain_tensors)))
    spec = _specs(tiny_dir)[name]
    with tempfile.TemporaryDirectory() as tmp:
        damaged = {n: t for n, t in plain_tensors.items() if n != name}
        message = _load_error(_write_single_file(tiny_dir, Path(tmp), damaged))
    assert f"{name}: missing" in message and str(list(spec.shape)) in message


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_every_misshaped_tensor_is_refused(tiny_dir: Path, plain_tensors: Tensors, data: st.DataObject) -> None:
    """A declared tensor stored with one dim one larger is an error naming it with the
    found and expected shapes."""
    name = data.draw(st.sampled_from(sorted(plain_tensors)))
    tensor = plain_tensors[name]
    dim = data.draw(st.integers(0, tensor.dim() - 1))
    shape = list(tensor.shape)
    shape[dim] += 1
    with tempfile.TemporaryDirectory() as tmp:
        damaged = dict(plain_tensors, **{name: torch.zeros(shape, dtype=tensor.dtype)})
        message = _load_error(_write_single_file(tiny_dir, Path(tmp), damaged))
    assert name in message and str(shape) in message and str(list(tensor.shape)) in message


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("layers.3.attn.compressor.wkv.weight", "unexpected tensor"),  # a compressor on a Reuse layer
        ("layers.2.attn.wq_a.weight.bias", "unexpected tensor"),
        ("layers.0.attn_norm.scale", "takes none"),  # a scale on a BF16 norm
        ("mtp.3.attn_norm.weight", "unexpected tensor"),  # a fourth DSpark stage
        ("vision.blocks.0.attn.qkv.weight", "text_only=True"),
    ],
)
def test_unexpected_tensors_are_refused(
    tiny_dir: Path, plain_tensors: Tensors, tmp_path: Path, extra: str, expected: str
) -> None:
    """A tensor the config does not declare is an error naming it."""
    damaged = dict(plain_tensors, **{extra: torch.zeros(4, 4, dtype=torch.bfloat16)})
    message = _load_error(_write_single_file(tiny_dir, tmp_path, damaged))
    assert extra in message and expected in message


def test_vision_tensors_are_ignored_when_text_only(
    tiny_dir: Path, plain_tensors: Tensors, full_plain: LoadedCheckpoint, tmp_path: Path
) -> None:
    """With text_only=True a vision tower's tensors are skipped, not loaded."""
    with_vision = dict(plain_tensors, **{"vision.patch_embed.weight": torch.ones(8, 8), "aligner.proj": torch.ones(3)})
    checkpoint = load_checkpoint(_write_single_file(tiny_dir, tmp_path, with_vision), text_only=True)
    assert checkpoint.tensors.keys() == full_plain.tensors.keys()


def test_quantized_forms_are_checked(tiny_quantized_dir: Path, quantized_tensors: Tensors, tmp_path: Path) -> None:
    """A .scale of the wrong shape, quantised values without their .scale, and a .scale
    without its tensor are errors naming the tensor and what was expected."""
    wrong_scale = dict(quantized_tensors, **{"layers.0.attn.wq_a.scale": torch.zeros(3, 3, dtype=torch.uint8)})
    message = _load_error(_write_single_file(tiny_quantized_dir, tmp_path / "a", wrong_scale))
    spec = _specs(tiny_quantized_dir)["layers.0.attn.wq_a.weight"]
    assert "layers.0.attn.wq_a.scale: shape [3, 3]" in message and str(list(spec.scale_shape)) in message

    no_scale = {n: t for n, t in quantized_tensors.items() if n != "layers.1.ffn.experts.2.w2.scale"}
    message = _load_error(_write_single_file(tiny_quantized_dir, tmp_path / "b", no_scale))
    assert "layers.1.ffn.experts.2.w2.weight: dtype I8" in message and "need their .scale" in message

    orphan = dict(quantized_tensors, **{"layers.0.ffn.experts.99.w1.scale": torch.zeros(2, 2, dtype=torch.uint8)})
    message = _load_error(_write_single_file(tiny_quantized_dir, tmp_path / "c", orphan))
    assert "layers.0.ffn.experts.99.w1.scale" in message


def test_without_dspark_tensors_the_checkpoint_says_so(
    tiny_dir: Path, plain_tensors: Tensors, full_plain: LoadedCheckpoint, tmp_path: Path
) -> None:
    """mtp.* tensors are optional as a whole: absent, the target model loads the same,
    has_dspark is False and require_dspark() raises; present, require_dspark() passes."""
    target_only = {n: t for n, t in plain_tensors.items() if not n.startswith("mtp.")}
    checkpoint = load_checkpoint(_write_single_file(tiny_dir, tmp_path, target_only))
    assert not checkpoint.has_dspark and checkpoint.dspark_expert_ids == ()
    assert checkpoint.tensors.keys() == {n for n in full_plain.tensors if not n.startswith("mtp.")}
    with pytest.raises(CheckpointError, match="DSpark"):
        checkpoint.require_dspark()
    full_plain.require_dspark()


def test_index_must_agree_with_the_shards(tiny_dir: Path, tmp_path: Path) -> None:
    """A tensor the index does not list, or lists in a shard that lacks it, is an error."""
    damaged = Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))
    index_path = damaged / loader.INDEX_FILE
    index = json.loads(index_path.read_text())
    file_of_norm = index["weight_map"].pop("norm.weight")
    index["weight_map"]["layers.0.ffn.gate.bias_vl.extra"] = file_of_norm
    index_path.write_text(json.dumps(index))
    message = _load_error(damaged)
    assert "norm.weight: stored in" in message and "does not list it" in message
    assert "layers.0.ffn.gate.bias_vl.extra" in message and "does not hold it" in message


def test_missing_tokenizer_is_an_error(tiny_dir: Path, tmp_path: Path) -> None:
    """A checkpoint without tokenizer.json is refused, naming the file."""
    damaged = Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))
    (damaged / loader.TOKENIZER_FILE).unlink()
    assert "tokenizer.json: not found" in _load_error(damaged)


def _edit_config(path: str, value: object) -> Callable[[dict], None]:
    """An edit of config.json at a dotted path; a callable value maps the old value."""

    def edit(raw: dict) -> None:
        *sections, key = path.split(".")
        target = raw
        for section in sections:
            target = target[section]
        target[key] = value(target[key]) if callable(value) else value

    return edit


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_edit_config("text_config.scoring_func", "softmax"), "scoring_func"),
        (_edit_config("vision_config.num_hidden_layers", 24), "vision_config.num_hidden_layers"),
        (
            _edit_config("text_config.engram_num_embeddings", lambda rows: [rows[0] + 1, *rows[1:]]),
            r"engram_num_embeddings\[0\]",
        ),
        (
            _edit_config("quantization_config", {"quant_method": "fp8", "expert_dtype": "fp8"}),
            "quantization_config.expert_dtype",
        ),
    ],
)
def test_a_bad_config_fails_before_any_shard_is_opened(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: Callable[[dict], None], field: str
) -> None:
    """A bad config value is a ConfigError naming the field, raised before any shard or
    the index is opened: no such open happens, and the shards are garbage anyway."""
    _assert_refused_before_any_shard_is_opened(tiny_dir, tmp_path, monkeypatch, edit, field)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_edit_config("is_encoder_decoder", True), "^is_encoder_decoder: true is not supported"),
        (_edit_config("text_config.add_cross_attention", True), "^text_config.add_cross_attention: true"),
        (_edit_config("text_config.tie_word_embeddings", True), "^tie_word_embeddings: true"),
        (_edit_config("pad_token_id", 5), "^pad_token_id: the top level says 5"),
        (_edit_config("quantization_config.activation_scheme", "static"), "quantization_config.activation_scheme"),
    ],
)
def test_a_transformers_written_config_with_an_unsupported_value_fails_before_any_shard_is_opened(
    hf_written_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: Callable[[dict], None], field: str
) -> None:
    """A config written by transformers whose known field (generic or V4.1's, at the top
    level or in a section) has a value V4.1 cannot mean is refused naming the field,
    before any shard or the index is opened."""
    _assert_refused_before_any_shard_is_opened(hf_written_dir, tmp_path, monkeypatch, edit, field)


def _assert_refused_before_any_shard_is_opened(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: Callable[[dict], None], field: str
) -> None:
    damaged = Path(shutil.copytree(source, tmp_path / "ckpt"))
    raw = json.loads((damaged / "config.json").read_text())
    edit(raw)
    (damaged / "config.json").write_text(json.dumps(raw))
    for shard in damaged.glob("*.safetensors"):
        shard.write_bytes(b"not a safetensors file")
    opened = _spy_on_opens(monkeypatch)
    with pytest.raises(ConfigError, match=field):
        load_checkpoint(damaged)
    assert not [name for name in opened if name.endswith((".safetensors", loader.INDEX_FILE))]


def test_a_transformers_written_checkpoint_loads_like_the_released_one(
    hf_written_dir: Path, full_quantized: LoadedCheckpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The quantised tiny checkpoint with its config.json as transformers writes it
    loads the same config and tensors; with a field no one knows added, it still loads,
    and the one warning the load logs names that field exactly once."""
    checkpoint = load_checkpoint(hf_written_dir)
    assert checkpoint.config == full_quantized.config
    assert checkpoint.tensors.keys() == full_quantized.tensors.keys()
    assert all(torch.equal(checkpoint.tensors[name], t) for name, t in full_quantized.tensors.items())
    extended = Path(shutil.copytree(hf_written_dir, tmp_path / "ckpt"))
    raw = json.loads((extended / "config.json").read_text())
    raw["text_config"]["frobnicate_layers"] = 3
    (extended / "config.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="dsv41.model.config"):
        assert load_checkpoint(extended).config == full_quantized.config
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(messages) == 1 and messages[0].count("frobnicate_layers") == 1
    assert "text_config.frobnicate_layers" in messages[0]


@pytest.mark.parametrize(
    ("shard", "field"),
    [(ExpertShard("ep", 0, 3), "n_routed_experts 8"), (ExpertShard("tp", 1, 4), "moe_intermediate_size 64")],
)
def test_an_unsplittable_expert_shard_fails_before_any_shard_is_opened(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, shard: ExpertShard, field: str
) -> None:
    """EP needs the world to divide the expert count; TP needs slices of whole FP4 scale
    groups (multiples of 32). Both are checked before any shard is opened."""
    opened = _spy_on_opens(monkeypatch)
    with pytest.raises(ValueError, match=field):
        load_checkpoint(tiny_dir, shard=shard)
    assert not [name for name in opened if name.endswith((".safetensors", loader.INDEX_FILE))]


def _spy_on_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    opened: list[str] = []
    real_open, real_safe_open = Path.open, loader.safe_open

    def spy_open(self: Path, *args: object, **kwargs: object):  # noqa: ANN202 - mirrors Path.open
        opened.append(self.name)
        return real_open(self, *args, **kwargs)

    def spy_safe_open(path: str, *args: object, **kwargs: object):  # noqa: ANN202 - mirrors safe_open
        opened.append(Path(path).name)
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(Path, "open", spy_open)
    monkeypatch.setattr(loader, "safe_open", spy_safe_open)
    return opened


# -- post-load, sharding, memory maps, progress -----------------------------------------------


def test_post_load_runs_exactly_once(tiny_quantized_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader runs post-load once (one compressed-token map built, every quantised
    weight decoded once); a second call raises and changes nothing."""
    calls = {"token_map": 0, "dequantize": 0}
    real_map, real_dequantize = loader.build_compressed_token_map, loader.dequantize

    def counting_map(*args: object, **kwargs: object) -> tuple[torch.Tensor, int]:
        calls["token_map"] += 1
        return real_map(*args, **kwargs)

    def counting_dequantize(*args: object, **kwargs: object) -> torch.Tensor:
        calls["dequantize"] += 1
        return real_dequantize(*args, **kwargs)

    monkeypatch.setattr(loader, "build_compressed_token_map", counting_map)
    monkeypatch.setattr(loader, "dequantize", counting_dequantize)
    checkpoint = load_checkpoint(tiny_quantized_dir)
    decoded_kinds = (TensorKind.FP8_WEIGHT, TensorKind.FP4_EXPERT)
    quantised = [n for n, s in _specs(tiny_quantized_dir).items() if s.kind in decoded_kinds]
    assert checkpoint.post_load_runs == 1
    assert calls == {"token_map": 1, "dequantize": len(quantised)}
    before = {n: t.clone() for n, t in checkpoint.tensors.items()}
    with pytest.raises(RuntimeError, match="exactly once"):
        checkpoint.post_load()
    assert checkpoint.post_load_runs == 1
    assert all(torch.equal(t, before[n]) for n, t in checkpoint.tensors.items())


def _expert_tensors(checkpoint: LoadedCheckpoint) -> dict[str, torch.Tensor]:
    return {n: t for n, t in checkpoint.tensors.items() if routed_expert(n) is not None}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ep_ranks_partition_the_experts(tiny_dir: Path, full_plain: LoadedCheckpoint, world: int) -> None:
    """EP rank r of w holds exactly experts [r E/w, (r+1) E/w) (target and DSpark
    stages alike): the ranks partition the experts, every held expert equals the full
    load's, and everything else is whole on every rank."""
    config = full_plain.config
    held: list[int] = []
    held_dspark: list[int] = []
    for rank in range(world):
        part = load_checkpoint(tiny_dir, shard=ExpertShard("ep", rank, world))
        per_rank = config.n_routed_experts // world
        assert part.expert_ids == tuple(range(rank * per_rank, (rank + 1) * per_rank))
        held += part.expert_ids
        held_dspark += part.dspark_expert_ids
        experts = _expert_tensors(part)
        for name, tensor in experts.items():
            expert_id, _ = routed_expert(name)  # type: ignore[misc]
            assert expert_id in (part.dspark_expert_ids if name.startswith("mtp.") else part.expert_ids)
            assert torch.equal(tensor, full_plain.tensors[name])
        per_projection = config.num_hidden_layers * len(part.expert_ids)
        per_projection += config.num_nextn_predict_layers * len(part.dspark_expert_ids)
        assert len(experts) == 3 * per_projection
        others = {n: t for n, t in part.tensors.items() if n not in experts}
        assert others.keys() == full_plain.tensors.keys() - _expert_tensors(full_plain).keys()
        assert all(torch.equal(t, full_plain.tensors[n]) for n, t in others.items())
    assert sorted(held) == list(range(config.n_routed_experts))
    assert sorted(held_dspark) == list(range(config.dspark_n_routed_experts))


@pytest.mark.parametrize(("fixture", "world"), [("tiny_quantized_dir", 2), ("tiny_dir", 2), ("tiny_alt_dir", 4)])
def test_tp_slices_concatenate_to_the_whole(fixture: str, world: int, request: pytest.FixtureRequest) -> None:
    """TP ranks hold every expert; concatenating their w1/w3 rows and w2 columns over
    the ranks gives the full load's tensor (the quantised form is sliced packed, with
    its scales); everything else is whole on every rank."""
    model_dir: Path = request.getfixturevalue(fixture)
    full = load_checkpoint(model_dir)
    parts = [load_checkpoint(model_dir, shard=ExpertShard("tp", rank, world)) for rank in range(world)]
    inter = full.config.moe_intermediate_size
    for name, whole in full.tensors.items():
        expert = routed_expert(name)
        if expert is None:
            assert all(torch.equal(part.tensors[name], whole) for part in parts), name
            continue
        axis = 1 if expert[1] == "w2" else 0
        assert all(part.tensors[name].shape[axis] == inter // world for part in parts), name
        assert torch.equal(torch.cat([part.tensors[name] for part in parts], dim=axis), whole), name


def _mapping_of(address: int) -> str | None:
    """The file a process address is mapped from (None: anonymous or unmapped)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) == 6 else None
    return None


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_quantized_dir"])
def test_engram_tables_are_memory_mapped_from_the_shard(fixture: str, request: pytest.FixtureRequest) -> None:
    """Every Engram table's rows (and scales) live in a memory map of the shard file
    that holds them: first and last byte are addresses mapped from that file."""
    model_dir: Path = request.getfixturevalue(fixture)
    checkpoint = load_checkpoint(model_dir)
    weight_map = json.loads((model_dir / loader.INDEX_FILE).read_text())["weight_map"]
    for layer_id, table in checkpoint.engram_tables.items():
        parts = [("weight", table.values)] + ([("scale", table.scales)] if table.scales is not None else [])
        assert len(parts) == (2 if fixture == "tiny_quantized_dir" else 1)
        for suffix, tensor in parts:
            shard = str((model_dir / weight_map[f"layers.{layer_id}.engram.embed.{suffix}"]).resolve())
            first = tensor.data_ptr()
            last = first + tensor.numel() * tensor.element_size() - 1
            assert _mapping_of(first) == shard and _mapping_of(last) == shard, (layer_id, suffix)


ENGRAM_WIDTHS = (16, 48, 256)


@pytest.fixture(scope="module")
def engram_width_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, bool], Path]:
    """TINY with Engram rows of 16 (half a scale group), 48 (one and a half) and 256
    values, plain and quantised (the same underlying weights per width)."""
    return {
        (width, quantized): make_tiny(
            tmp_path_factory.mktemp(f"engram-{width}-{'fp8' if quantized else 'plain'}"),
            quantized=quantized,
            spec=dataclasses.replace(TINY, engram_head_dim=width),
        )
        for width in ENGRAM_WIDTHS
        for quantized in (False, True)
    }


def _fp8_rounding_by_definition(rows: torch.Tensor) -> torch.Tensor:
    """Each group of 32 consecutive values of a row (the last one partial) divided by
    the power of two 2^ceil(log2(max(amax, 1e-4) / 448)), cast to E4M3 and multiplied
    back: MODEL_FACTS' FP8 with E8M0 scales, written out here without model/formats.py."""
    out = torch.empty_like(rows)
    for start in range(0, rows.shape[1], 32):
        group = rows[:, start : start + 32]
        scale = torch.exp2(torch.ceil(torch.log2(group.abs().amax(1, keepdim=True).clamp_min(1e-4) / 448)))
        out[:, start : start + 32] = (group / scale).to(torch.float8_e4m3fn).float() * scale
    return out


@pytest.mark.parametrize("width", ENGRAM_WIDTHS)
def test_engram_tables_of_any_width_load_their_rows(width: int, engram_width_dirs: dict[tuple[int, bool], Path]) -> None:
    """An Engram table of any head_dim loads: its scale sibling holds ceil(head_dim / 32)
    E8M0 bytes per row, the plain table's rows are the stored values, and the quantised
    table's rows are those same values' FP8 rounding with one scale per group of 32,
    the last group partial."""
    plain_dir, quantized_dir = engram_width_dirs[(width, False)], engram_width_dirs[(width, True)]
    written = _stored_tensors(plain_dir)
    stored_quantized = _stored_tensors(quantized_dir)
    plain, quantized = load_checkpoint(plain_dir), load_checkpoint(quantized_dir)
    for layer_id in plain.config.engram_layer_ids:
        name = f"layers.{layer_id}.engram.embed"
        rows = written[f"{name}.weight"].float()
        assert tuple(stored_quantized[f"{name}.scale"].shape) == (rows.shape[0], -(-width // 32))
        all_rows = torch.arange(rows.shape[0]).unsqueeze(1)
        assert plain.engram_tables[layer_id].scales is None
        assert torch.equal(plain.engram_tables[layer_id].lookup(all_rows), rows)
        assert quantized.engram_tables[layer_id].scales is not None
        assert torch.equal(quantized.engram_tables[layer_id].lookup(all_rows), _fp8_rounding_by_definition(rows))


def test_progress_reaches_every_shards_total(tiny_dir: Path) -> None:
    """Progress is reported per shard file, monotonically, and ends each shard with all
    its tensors and all its data bytes (the file minus its header) dealt with, other
    ranks' experts included; the checkpoint-wide count ends at the sum."""
    reports: list[LoadProgress] = []
    load_checkpoint(tiny_dir, shard=ExpertShard("ep", 1, 2), progress=reports.append)
    files = sorted({r.shard_file for r in reports})
    assert len(files) == 2 and all(r.num_shards == 2 for r in reports)
    data_bytes = 0
    for file_name in files:
        mine = [r for r in reports if r.shard_file == file_name]
        assert [r.bytes_done for r in mine] == sorted(r.bytes_done for r in mine)
        header = read_safetensors_header(tiny_dir / file_name)
        size = (tiny_dir / file_name).stat().st_size
        header_bytes = 8 + int.from_bytes((tiny_dir / file_name).read_bytes()[:8], "little")
        assert mine[-1].tensors_done == mine[-1].tensors_total == len(header)
        assert mine[-1].bytes_done == mine[-1].bytes_total == size - header_bytes
        data_bytes += size - header_bytes
    assert reports[-1].checkpoint_bytes_done == reports[-1].checkpoint_bytes_total == data_bytes
    assert [r.checkpoint_bytes_done for r in reports] == sorted(r.checkpoint_bytes_done for r in reports)


@settings(max_examples=50, deadline=None)
@given(mode=st.sampled_from(["ep", "tp", "dp", ""]), rank=st.integers(-2, 9), world=st.integers(-1, 9))
def test_expert_shard_accepts_exactly_the_valid_declarations(mode: str, rank: int, world: int) -> None:
    """ExpertShard(mode, rank, world) is accepted iff mode is ep/tp, world >= 1 and
    0 <= rank < world; a refusal names the field."""
    if mode not in ("ep", "tp"):
        refused = "mode"
    elif world < 1:
        refused = "world"
    elif not 0 <= rank < world:
        refused = "rank"
    else:
        ExpertShard(mode, rank, world)
        return
    with pytest.raises(ValueError, match=f"ExpertShard.{refused}"):
        ExpertShard(mode, rank, world)


def test_quantized_weights_decode_exactly(
    tiny_quantized_dir: Path, quantized_tensors: Tensors, full_quantized: LoadedCheckpoint
) -> None:
    """Decoding is exact: an FP8 weight is its E4M3 value times its tile's power-of-two
    scale, an FP4 weight its E2M1 value (code & 7 on the grid, bit 3 the sign) times its
    group's scale, computed here from the stored bytes by the facts' definition."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    fp8 = "layers.2.attn.wq_b.weight"
    values, scale = quantized_tensors[fp8], quantized_tensors[fp8.replace(".weight", ".scale")]
    scales = torch.exp2(scale.view(torch.uint8).float() - 127).repeat_interleave(32, 0).repeat_interleave(32, 1)
    expected = values.float() * scales[: values.shape[0], : values.shape[1]]
    assert torch.equal(full_quantized.tensors[fp8], expected)
    fp4 = "layers.5.ffn.experts.3.w2.weight"
    packed, scale = quantized_tensors[fp4].view(torch.uint8), quantized_tensors[fp4.replace(".weight", ".scale")]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    magnitudes = grid[codes & 7]
    signed = torch.where(codes & 8 != 0, -magnitudes, magnitudes)
    expected = signed * torch.exp2(scale.view(torch.uint8).float() - 127).repeat_interleave(32, 1)
    assert torch.equal(full_quantized.tensors[fp4], expected)
    assert math.prod(expected.shape) == math.prod(_specs(tiny_quantized_dir)[fp4].shape)
