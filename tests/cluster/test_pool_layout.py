"""pool_geometry: the cache geometry's plain inputs derived from a V41Config."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dsv41.cache.geometry import GeometryError, PlaneKind
from dsv41.cluster.pool_layout import pool_geometry
from dsv41.model.config import FLASH_CONFIG_DIR, LayerMode, V41Config

FLASH = FLASH_CONFIG_DIR


@pytest.fixture(scope="module")
def flash_config() -> V41Config:
    return V41Config.from_pretrained(FLASH, text_only=True)


def test_flash_geometry_follows_the_topology(flash_config: V41Config) -> None:
    """Only the topology's FULL layers own PAGE planes, each at its compress ratio;
    every target layer has a ring; ratio-2 owners have tails; the cursor keeps
    engram_max_ngram_size - 1 ids; dims and window come from the config."""
    g = pool_geometry(flash_config)
    full = [t for t in flash_config.topology.target_layers if t.mode is LayerMode.FULL]
    assert g.full_owners == tuple(t.layer_id for t in full) == (2, 8, 14, 20)
    assert g.owner_ratios == tuple(t.ratio for t in full) == (2, 2, 2, 1)
    assert {p.key for p in g.page_planes} == set(g.full_owners)
    for t in full:
        assert g.plane(PlaneKind.MAIN_KV, t.layer_id).shape == (128 // t.ratio, flash_config.head_dim)
        assert g.plane(PlaneKind.INDEX_VALUES, t.layer_id).shape == (128 // t.ratio, flash_config.index_head_dim)
    assert g.ring_layers == tuple(range(flash_config.num_hidden_layers))
    assert g.tail_owners == (2, 8, 14)
    assert g.plane(PlaneKind.CURSOR).shape == (flash_config.engram_max_ngram_size,)
    assert (g.window, g.block_size, g.kv_cache_dtype, g.index_cache_dtype) == (128, 128, "bf16", "fp8")
    assert g.encoder_replay and g.num_speculative_tokens == 0


def test_dspark_speculation_gives_the_draft_stages_rings(flash_config: V41Config) -> None:
    """With DSpark's 5 speculative tokens the three draft stages get rings too, and
    every ring has window + 5 rows."""
    g = pool_geometry(flash_config, num_speculative_tokens=5)
    assert g.ring_layers == tuple(range(40)) + (40, 41, 42)
    assert g.ring_rows == 133
    with pytest.raises(GeometryError, match=r"num_speculative_tokens: 3 \(allowed: 0, 5"):
        pool_geometry(flash_config, num_speculative_tokens=3)


def test_a_model_without_dspark_refuses_speculation() -> None:
    """A config with no DSpark stages admits only 0 speculative tokens."""
    raw: dict[str, Any] = json.loads((FLASH / "config.json").read_text())
    text = raw["text_config"]
    text["num_nextn_predict_layers"] = 0
    text["compress_ratios"] = text["compress_ratios"][: text["num_hidden_layers"]]
    config = V41Config.from_dict(raw, text_only=True)
    assert pool_geometry(config).ring_layers == tuple(range(40))
    with pytest.raises(GeometryError, match=r"num_speculative_tokens: 5 \(allowed: 0;"):
        pool_geometry(config, num_speculative_tokens=5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 64}, "shorter than window - 1 = 127"),
        ({"block_size": 130}, None),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype: 'fp8'"),
        ({"index_cache_dtype": "bf16"}, "index_cache_dtype: 'bf16'"),
    ],
)
def test_options_reach_the_geometry(flash_config: V41Config, options: dict[str, Any], message: str | None) -> None:
    """The runtime options are the geometry's: accepted ones shape it, refused ones
    fail with the geometry's message."""
    if message is None:
        assert pool_geometry(flash_config, **options).block_size == options["block_size"]
    else:
        with pytest.raises(GeometryError, match=message):
            pool_geometry(flash_config, **options)
