"""V41Config parsing and the derived attention topology."""

from __future__ import annotations

import copy
import json

import pytest

from model.config import FLASH_CONFIG_DIR, ConfigError, LayerMode, V41Config

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
        (lambda t: t.update(unknown_feature=True), "unknown_feature"),
        (lambda t: t.pop("index_topk"), "index_topk"),
        (lambda t: t["rope_scaling"].update(type="linear"), "rope_type"),
        (lambda t: t.update(eos_token_id=999999), "eos_token_id"),
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
