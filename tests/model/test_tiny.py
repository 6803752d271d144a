"""The tiny checkpoints, random and shipped trained: determinism, layer-mode pattern,
tokenizer, weights, and the trained one's text."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tokenizers import Tokenizer

from dsv41.model.config import ConfigError, LayerMode, V41Config
from dsv41.model.loader import ExpertShard, load_checkpoint
from dsv41.model.params import ModelParams
from dsv41.model.reference import ReferenceModel
from dsv41.model.tiny import SHARD_FILES, TINY, make_tiny, tiny_config
from dsv41.model.weights import checkpoint_tensors, quantize

# PROTOCOL.md's strings, spelled with escapes so the fullwidth U+FF5C and U+2581 are explicit.
PROTOCOL_SPECIAL_TOKENS = {
    "<\uff5cbegin\u2581of\u2581sentence\uff5c>": "bos",
    "<\uff5cend\u2581of\u2581sentence\uff5c>": "eos",
    "<\uff5c\u2581pad\u2581\uff5c>": "pad",
    "<\uff5cSystem\uff5c>": "system",
    "<\uff5cUser\uff5c>": "user",
    "<\uff5cAssistant\uff5c>": "assistant",
    "<think>": "think",
    "</think>": "end_think",
    "\uff5cDSML\uff5c": "dsml",
    "<\uff5clatest_reminder\uff5c>": "latest_reminder",
    "<\uff5cdeepseek_image\uff5c>": "image",
}
PRESET_FIXTURES = ["tiny_dir", "tiny_alt_dir"]
# The shipped trained checkpoint is TINY's architecture with a tokenizer of its own.
CHECKPOINT_FIXTURES = PRESET_FIXTURES + ["trained_tiny_dir"]
PROMPT_TOKENS = 300


def _file_bytes(model_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


# -- determinism ---------------------------------------------------------------------------


def test_same_seed_gives_byte_identical_files(tiny_dir: Path, tiny_quantized_dir: Path, tmp_path: Path) -> None:
    """make_tiny with the same arguments writes byte-identical files (tokenizer
    training included), plain and quantised."""
    assert _file_bytes(make_tiny(tmp_path / "plain")) == _file_bytes(tiny_dir)
    assert _file_bytes(make_tiny(tmp_path / "quantized", quantized=True)) == _file_bytes(tiny_quantized_dir)


def test_another_seed_changes_the_weights_only(tiny_dir: Path, tmp_path: Path) -> None:
    """Another seed gives other weights in every shard, with the same config, tokenizer
    and tensor layout."""
    reseeded = _file_bytes(make_tiny(tmp_path / "seed1", seed=1))
    original = _file_bytes(tiny_dir)
    assert reseeded.keys() == original.keys()
    for name in reseeded:
        assert (reseeded[name] == original[name]) == (name not in SHARD_FILES), name


def test_quantized_stores_the_plain_weights_quantized(tiny_dir: Path, tiny_quantized_dir: Path) -> None:
    """The quantised checkpoint holds exactly model/weights.quantize of the plain one's
    weights (E8M0 scales as float8_e8m0fnu), and every other tensor bit for bit."""
    specs = checkpoint_tensors(V41Config.from_pretrained(tiny_dir))
    plain: dict[str, torch.Tensor] = {}
    quantized: dict[str, torch.Tensor] = {}
    for file_name in SHARD_FILES:
        plain.update(load_file(tiny_dir / file_name))
        quantized.update(load_file(tiny_quantized_dir / file_name))
    assert plain.keys() == specs.keys()
    assert quantized.keys() == set(specs) | {s.scale_name for s in specs.values() if s.kind.quantizable}
    for name, spec in specs.items():
        if not spec.kind.quantizable:
            assert torch.equal(plain[name], quantized[name]), name
            continue
        values, scale = quantize(spec, plain[name].float())
        assert scale.dtype == quantized[spec.scale_name].dtype == torch.float8_e8m0fnu
        assert torch.equal(quantized[name].view(torch.uint8), values.view(torch.uint8)), name
        assert torch.equal(quantized[spec.scale_name].view(torch.uint8), scale.view(torch.uint8)), name


# -- config and pattern --------------------------------------------------------------------


@pytest.mark.parametrize("fixture", CHECKPOINT_FIXTURES)
def test_presets_keep_the_flash_layer_mode_pattern(fixture: str, request: pytest.FixtureRequest) -> None:
    """The presets (and the trained checkpoint) parse and have Flash's pattern: window layers first; ratio-2 Full
    owners with a Reuse between two of them; a ratio-1 Full owner that is the candidate
    source and the decoder start; a Reindex after it followed by a Reuse; Engram on a
    window layer and on a compressed one; three window-only DSpark stages."""
    model_dir: Path = request.getfixturevalue(fixture)
    config = V41Config.from_pretrained(model_dir)
    layers = config.topology.target_layers
    modes = [(t.mode, t.ratio) for t in layers]
    assert modes[0] == modes[1] == (LayerMode.WINDOW, 0)
    full_ratio2 = [t.layer_id for t in layers if (t.mode, t.ratio) == (LayerMode.FULL, 2)]
    assert len(full_ratio2) >= 2
    assert any(modes[i] == (LayerMode.REUSE, 2) for i in range(full_ratio2[0] + 1, full_ratio2[1]))
    candidate = config.topology.layer(config.topology.candidate_source)
    assert (candidate.mode, candidate.ratio) == (LayerMode.FULL, 1)
    assert candidate.layer_id == config.topology.decoder_start
    reindex = [t.layer_id for t in layers if t.mode is LayerMode.REINDEX]
    assert reindex and reindex[0] > candidate.layer_id
    assert modes[reindex[0] + 1] == (LayerMode.REUSE, 1)
    engram_modes = {config.topology.layer(i).mode for i in config.engram_layer_ids}
    assert LayerMode.WINDOW in engram_modes and engram_modes & {LayerMode.FULL, LayerMode.REUSE}
    dspark = [config.topology.layer(i) for i in config.topology.dspark_layers]
    assert len(dspark) == 3 and all(t.mode is LayerMode.WINDOW for t in dspark)


@pytest.mark.parametrize("fixture", CHECKPOINT_FIXTURES)
def test_sizes_exercise_the_paged_features_at_300_tokens(fixture: str, request: pytest.FixtureRequest) -> None:
    """A 300-token prompt passes the window, index_topk of the ratio-2 entries and the
    candidate budget of the ratio-1 entries; index heads >= 16 keep selection ties away;
    the experts split over EP-2 and TP-2."""
    config = V41Config.from_pretrained(request.getfixturevalue(fixture))
    assert config.sliding_window < PROMPT_TOKENS
    assert config.index_topk < PROMPT_TOKENS // 2
    assert config.candidate_topk_blocks * config.candidate_block_size < PROMPT_TOKENS
    assert config.index_n_heads >= 16
    ExpertShard("ep", 1, 2).expert_ids(config.n_routed_experts)
    ExpertShard("ep", 1, 2).expert_ids(config.dspark_n_routed_experts)
    ExpertShard("tp", 1, 2).check_intermediate(config.moe_intermediate_size)


def test_config_is_the_released_nested_layout(tiny_dir: Path, tiny_quantized_dir: Path) -> None:
    """config.json nests text_config / vision_config (no vision layers); only the
    quantised checkpoint has a quantization_config, with fp4 experts."""
    plain = json.loads((tiny_dir / "config.json").read_text())
    quantized = json.loads((tiny_quantized_dir / "config.json").read_text())
    assert plain["architectures"] == ["DeepseekV41ForCausalLM"] and plain["model_type"] == "deepseek_v41"
    assert plain["vision_config"]["num_hidden_layers"] == 0
    assert "quantization_config" not in plain
    assert quantized["quantization_config"]["expert_dtype"] == "fp4"
    assert {k: v for k, v in quantized.items() if k != "quantization_config"} == plain


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_size": 48}, "hidden_size"),
        ({"moe_intermediate_size": 96}, "moe_intermediate_size"),
        ({"n_routed_experts": 7}, "n_routed_experts"),
        ({"tokenizer_vocab_size": 100}, "tokenizer_vocab_size"),
        ({"compress_ratios": (0, 0, 2)}, "compress_ratios"),
    ],
)
def test_tiny_spec_refuses_unusable_sizes(change: dict, field: str, tmp_path: Path) -> None:
    """A spec the formats, the TP-2/EP-2 split or V41Config cannot take is refused,
    naming the field, before anything is written."""
    with pytest.raises((ValueError, ConfigError), match=field):
        make_tiny(tmp_path, spec=dataclasses.replace(TINY, **change))
    assert not (tmp_path / "config.json").exists()


# -- tokenizer -----------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", CHECKPOINT_FIXTURES)
def test_tokenizer_has_the_protocol_special_tokens(fixture: str, request: pytest.FixtureRequest) -> None:
    """PROTOCOL.md's special tokens exist with the same strings, each one token; BOS,
    EOS and pad are ids 0, 1, 2 as in config.json; `<｜System｜>` is the DSpark noise
    token; vocab_size is the tokenizer's size."""
    model_dir: Path = request.getfixturevalue(fixture)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = V41Config.from_pretrained(model_dir)
    for token in PROTOCOL_SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        assert token_id is not None, token
        assert tokenizer.encode(token).ids == [token_id]
    ids = {name: tokenizer.token_to_id(token) for token, name in PROTOCOL_SPECIAL_TOKENS.items()}
    assert (ids["bos"], ids["eos"], ids["pad"]) == (0, 1, 2)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)
    assert config.dspark_noise_token_id == ids["system"]
    assert config.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)
    assert 256 < config.vocab_size < 1000


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=80))
def test_tokenizer_round_trips_any_text(tiny_tokenizer: Tokenizer, text: str) -> None:
    """Byte-level BPE: decoding the encoding of any text gives the text back."""
    ids = tiny_tokenizer.encode(text).ids
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_round_trips_a_chat_prompt(tiny_tokenizer: Tokenizer) -> None:
    """A rendered chat turn keeps its special tokens as single ids and decodes back."""
    prompt = (
        "<｜begin▁of▁sentence｜><｜User｜>What is a page?<｜Assistant｜></think>"
        "A block of tokens.<｜end▁of▁sentence｜>"
    )
    ids = tiny_tokenizer.encode(prompt).ids
    assert ids[0] == 0 and ids[-1] == 1
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == prompt
    assert len(ids) < len(prompt.encode()) // 2  # the merges learned real words


# -- weights -------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", PRESET_FIXTURES)
def test_random_weights_keep_logits_order_one(fixture: str, request: pytest.FixtureRequest) -> None:
    """Weights at 1/sqrt(fan_in) (norms ~1, small mHC scales, sinks and biases ~0)
    keep a 300-token reference forward's logits finite and O(1) through every layer."""
    checkpoint = load_checkpoint(request.getfixturevalue(fixture))
    params = ModelParams.from_checkpoint(checkpoint)
    ids = torch.randint(0, checkpoint.config.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    logits = ReferenceModel(params).forward(ids).logits
    assert torch.isfinite(logits).all()
    assert 0.3 < float(logits.std()) < 3.0


# -- the shipped trained checkpoint --------------------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"


def test_trained_checkpoint_is_tiny_in_the_official_format(trained_tiny_dir: Path) -> None:
    """The shipped checkpoint's config.json is TINY's (tiny_config with its own
    tokenizer); it stores every declared tensor plain (BF16/FP32, no .scale), DSpark
    stages included, and loads through the same loader; it is a few MB."""
    tokenizer = Tokenizer.from_file(str(trained_tiny_dir / "tokenizer.json"))
    assert json.loads((trained_tiny_dir / "config.json").read_text()) == tiny_config(TINY, tokenizer, quantized=False)
    checkpoint = load_checkpoint(trained_tiny_dir)
    assert checkpoint.has_dspark
    stored: dict[str, torch.Tensor] = {}
    for file_name in SHARD_FILES:
        stored.update(load_file(trained_tiny_dir / file_name))
    assert stored.keys() == checkpoint_tensors(checkpoint.config).keys()
    assert {t.dtype for t in stored.values()} == {torch.bfloat16, torch.float32}
    assert sum(path.stat().st_size for path in trained_tiny_dir.iterdir()) < 8 * 2**20


def test_trained_checkpoint_continues_the_readme_prompt_with_text(trained_tiny_dir: Path) -> None:
    """The README's client example (prompt "hello", 8 tokens, greedy) returns text on the
    shipped model: no end of sentence among the tokens, and the text README.md shows."""
    checkpoint = load_checkpoint(trained_tiny_dir)
    model = ReferenceModel(ModelParams.from_checkpoint(checkpoint))
    ids = checkpoint.tokenizer.encode("hello").ids
    out: list[int] = []
    for _ in range(8):
        out.append(int(model.forward(ids + out).logits[-1].argmax()))
    assert checkpoint.config.eos_token_id not in out
    text = checkpoint.tokenizer.decode(out, skip_special_tokens=False)
    assert text.strip()
    assert repr(text) in README.read_text(), f"README.md does not show the example's output {text!r}"
