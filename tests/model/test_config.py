"""V41Config parsing and the derived attention topology."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any, Callable

import pytest

from dsv41.model.config import FLASH_CONFIG_DIR, PRETRAINED_CONFIG_FIELDS, ConfigError, LayerMode, V41Config

FLASH = FLASH_CONFIG_DIR


def _raw() -> dict:
    return json.loads((FLASH / "config.json").read_text())


def test_flash_topology_has_the_published_roles() -> None:
    """Full owners 2, 8, 14, 20 (ratios 2, 2, 2, 1); Reindex 24, 28, 32, 36; every other
    compressed layer Reuse; layers 0, 1 and the DSpark stages window-only; the decoder
    starts at the last owner, 20, which is the candidate source."""
    topo = V41Config.from_pretrained(FLASH, text_only=True).topology
    assert topo.full_owners == (2, 8, 14, 20) and topo.owner_ratios == (2, 2, 2, 1)
    assert [t.layer_id for t in topo.layers if t.mode is LayerMode.REINDEX] == [24, 28, 32, 36]
    for t in topo.layers:
        if t.ratio and t.layer_id not in (2, 8, 14, 20, 24, 28, 32, 36):
            assert t.mode is LayerMode.REUSE
    assert [t.layer_id for t in topo.layers if t.mode is LayerMode.WINDOW] == [0, 1, 40, 41, 42]
    assert topo.decoder_start == 20 and topo.candidate_source == 20
    assert topo.layer(25).topk_owner == 24 and topo.layer(25).kv_owner == 20
    assert topo.layer(13).kv_owner == 8 and topo.layer(14).is_engram


def test_flat_layout_and_rope_parameters_parse_to_the_same_config() -> None:
    """The nested released layout, a flat text-only layout and the newer
    rope_parameters spelling describe the same model."""
    raw = _raw()
    raw.pop("vision_config")
    nested = V41Config.from_dict(raw)
    flat = dict(raw["text_config"], quantization_config=raw["quantization_config"])
    assert V41Config.from_dict(flat) == nested
    params = copy.deepcopy(flat)
    scaling = params.pop("rope_scaling")
    params["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": params.pop("rope_theta"),
        **{k: v for k, v in scaling.items() if k != "type"},
    }
    assert V41Config.from_dict(params) == nested


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda t: t.update(scoring_func="softmax"), "scoring_func"),
        (lambda t: t.update(compress_ratios=t["compress_ratios"][:-1]), "compress_ratios"),
        (lambda t: t.update(kv_source_layer_ids=[2, 8, 14]), "candidate_source_layer_id"),
        (lambda t: t.update(kv_source_layer_ids=[8, 14, 20]), "compress_ratios"),
        (lambda t: t.update(index_source_layer_ids=[8, 14, 20]), "index_source_layer_ids"),
        (lambda t: t.update(candidate_source_layer_id=24), "candidate_source_layer_id"),
        (lambda t: t.update(num_key_value_heads=8), "num_key_value_heads"),
        (lambda t: t.update(o_groups=7), "o_groups"),
        (lambda t: t.update(head_dim=500), "head_dim"),
        (lambda t: t.pop("index_topk"), "index_topk"),
        (lambda t: t["rope_scaling"].update(type="linear"), "rope_type"),
        (lambda t: t.update(eos_token_id=999999), "eos_token_id"),
        (lambda t: t.update(eos_token_id=[1, 2]), "eos_token_id"),
        (lambda t: t.update(bos_token_id=None), "bos_token_id"),
        (lambda t: t.update(tie_word_embeddings=True), "tie_word_embeddings"),
        (lambda t: t.update(is_encoder_decoder=True), r"text_config\.is_encoder_decoder: true .*allowed: false"),
        (lambda t: t.update(add_cross_attention=True), r"text_config\.add_cross_attention: true .*allowed: false"),
        (lambda t: t.update(cross_attention_hidden_size=64), r"text_config\.cross_attention_hidden_size: 64 .*allowed: null"),
        (lambda t: t.update(tie_encoder_decoder=1), r"text_config\.tie_encoder_decoder: 1 .*allowed: false"),
        (lambda t: t.update(pruned_heads={"3": [0]}), r"text_config\.pruned_heads: .*allowed: \{\}, null"),
    ],
)
def test_inconsistent_or_unsupported_configs_are_refused_naming_the_field(change, field: str) -> None:
    """Each refusal raises ConfigError whose message names the offending field."""
    raw = _raw()
    change(raw["text_config"])
    with pytest.raises(ConfigError, match=field):
        V41Config.from_dict(raw, text_only=True)


def test_a_vision_tower_is_refused_unless_serving_text_only() -> None:
    """Images are not supported: a config with vision layers needs text_only=True."""
    with pytest.raises(ConfigError, match="vision_config.num_hidden_layers"):
        V41Config.from_dict(_raw())
    assert V41Config.from_dict(_raw(), text_only=True).vision_num_layers == 24


def test_wrong_architecture_is_refused() -> None:
    raw = _raw()
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    with pytest.raises(ConfigError, match="architectures"):
        V41Config.from_dict(raw, text_only=True)


# -- configs as transformers writes them ------------------------------------------------------

TRANSFORMERS_RECORD = json.loads((Path(__file__).parent / "data" / "transformers_pretrained_config.json").read_text())
# PretrainedConfig fields V4.1 reads as its own (validated as such, not declared generic).
V41_MEANINGFUL = {"architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"}


def _released_quantized() -> dict:
    """Flash's released layout with its quantization_config, vision tower removed."""
    raw = _raw()
    raw["vision_config"] = {"model_type": "deepseek_v41_vision", "num_hidden_layers": 0}
    return raw


def _config_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dsv41.model.config" and r.levelno == logging.WARNING]


def test_the_declared_generic_fields_are_exactly_what_transformers_writes() -> None:
    """Every key PretrainedConfig().to_dict() gives in each recorded transformers version
    (and every generation parameter transformers 5 pops from a config) is declared, or is
    one V4.1 validates as its own; nothing is declared that no version writes."""
    recorded = set(TRANSFORMERS_RECORD["generation_params"]["5.24.0"])
    for defaults in TRANSFORMERS_RECORD["to_dict"].values():
        recorded |= set(defaults)
    assert recorded - V41_MEANINGFUL == set(PRETRAINED_CONFIG_FIELDS)
    assert not V41_MEANINGFUL & set(PRETRAINED_CONFIG_FIELDS)


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_a_transformers_written_config_is_the_released_one(
    layout: str, transformers_version: str, transformers_written: Callable[..., dict], caplog: pytest.LogCaptureFixture
) -> None:
    """The released layout with quantization_config, written by transformers with every
    PretrainedConfig field at the top level and in text_config and vision_config (the
    nested layout) or as one flat text config, parses to the same config as the file
    without them, and logs no warning: none of those fields is unknown."""
    raw = _released_quantized()
    want = V41Config.from_dict(raw)
    written = transformers_written(raw, transformers_version, layout)
    assert set(PRETRAINED_CONFIG_FIELDS) & set(written["text_config"] if layout == "nested" else written)
    with caplog.at_level(logging.WARNING, logger="dsv41.model.config"):
        assert V41Config.from_dict(written) == want
    assert _config_warnings(caplog) == []
    assert want.quantization is not None and want.quantization.activation_scheme == "dynamic"


@pytest.mark.parametrize(
    ("where", "name", "value", "match"),
    [
        ((), "is_encoder_decoder", True, r"^is_encoder_decoder: true is not supported \(allowed: false\)"),
        ((), "pruned_heads", {"1": [0, 2]}, r"^pruned_heads: .*allowed: \{\}, null"),
        (("vision_config",), "num_hidden_layers", 24, r"^vision_config\.num_hidden_layers"),
        ((), "eos_token_id", 7, r"^eos_token_id: the top level says 7, text_config 1 \(allowed: null"),
        ((), "vocab_size", 12, r"^vocab_size: the top level says 12"),
        (("quantization_config",), "activation_scheme", "static", r"quantization_config\.activation_scheme: 'static'"),
        (("quantization_config",), "weight_block_size", [128, 128], r"quantization_config\.weight_block_size"),
    ],
)
def test_a_known_field_with_an_unsupported_value_is_refused_wherever_it_appears(
    where: tuple[str, ...], name: str, value: Any, match: str, transformers_written: Callable[..., dict]
) -> None:
    """A transformers-written config with one known field changed to a value V4.1
    cannot mean is refused naming the field and what is allowed: PretrainedConfig's
    structure fields at the top level, a top-level token id or size disagreeing with
    text_config, the quantisation scheme."""
    written = transformers_written(_released_quantized(), "4.57.6")
    target = written
    for key in where:
        target = target[key]
    target[name] = value
    with pytest.raises(ConfigError, match=match):
        V41Config.from_dict(written)


def test_the_top_level_tie_word_embeddings_is_the_wrappers(transformers_written: Callable[..., dict]) -> None:
    """transformers 4.x writes PretrainedConfig's default tie_word_embeddings (true) at
    the top of a composite config whose class does not set it, and ties by the text
    config's value: the top-level value is accepted, text_config's must be false."""
    written = transformers_written(_released_quantized(), "4.57.6")
    assert written["tie_word_embeddings"] is True and written["text_config"]["tie_word_embeddings"] is False
    assert V41Config.from_dict(written).tie_word_embeddings is False
    written["text_config"]["tie_word_embeddings"] = True
    with pytest.raises(ConfigError, match="^tie_word_embeddings: true"):
        V41Config.from_dict(written)


def test_unknown_fields_are_warned_about_once_by_name(
    tmp_path: Path, transformers_written: Callable[..., dict], caplog: pytest.LogCaptureFixture
) -> None:
    """Fields the runtime does not know (at the top level, in text_config, in
    quantization_config) are not refused: one warning names each of them exactly once,
    with the file it came from, and reading the same file again warns no more."""
    written = transformers_written(_released_quantized(), "4.57.6")
    written["frobnicate"] = 1
    written["text_config"]["frobnicate_layers"] = [3]
    written["quantization_config"]["frobnicate_scale"] = "x"
    (tmp_path / "config.json").write_text(json.dumps(written))
    with caplog.at_level(logging.WARNING, logger="dsv41.model.config"):
        config = V41Config.from_pretrained(tmp_path)
        assert V41Config.from_pretrained(tmp_path) == config
    assert config == V41Config.from_dict(_released_quantized())
    (warning,) = _config_warnings(caplog)
    assert str((tmp_path / "config.json").resolve()) in warning
    names = ("frobnicate", "text_config.frobnicate_layers", "quantization_config.frobnicate_scale")
    assert sorted(warning.split(": ", 2)[2].split(" (")[0].split(", ")) == sorted(names)
