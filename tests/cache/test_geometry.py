"""V41PoolGeometry: byte sizes, plane layout, refusals, layout_id and describe()."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cache.geometry import (
    DEAD_ENGRAM_ID,
    PLANE_ALIGNMENT,
    GeometryError,
    PlaneKind,
    Region,
    V41PoolGeometry,
)
from dsv41.cluster.pool_layout import pool_geometry
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config

REPO = Path(__file__).resolve().parents[2]
FLASH = FLASH_CONFIG_DIR

MakeGeometry = Callable[..., V41PoolGeometry]


@pytest.fixture(scope="module")
def flash_config() -> V41Config:
    return V41Config.from_pretrained(FLASH, text_only=True)


def test_flash_bf16_fp8_sizes_derived_by_hand(flash_config: V41Config) -> None:
    """The Flash fixture at block 128, kv bf16 / index fp8, has the PAGE and STATE
    sizes derived by hand below."""
    g = pool_geometry(flash_config, block_size=128, kv_cache_dtype="bf16", index_cache_dtype="fp8")
    # PAGE, per Full owner (2, 8, 14 at ratio 2: 64 rows; 20 at ratio 1: 128 rows):
    #   main KV bf16     rows * 512 * 2   = 65536  | 131072
    #   index values e4m3 rows * 128      =  8192  |  16384
    #   index scales e8m0 rows * 128 / 32 =   256  |    512
    #   every plane is a multiple of 16 bytes, so alignment adds nothing:
    #   3 * (65536 + 8192 + 256) + (131072 + 16384 + 512) = 221952 + 147968 = 369920
    assert g.page_bytes == 369_920
    # STATE: 40 bf16 rings of 128 rows * 512 * 2 = 131072 each -> 5242880;
    #   cursor: (1 + 3) int64 = 32 -> image 5242912 (a multiple of 16);
    #   tails of owners 2, 8, 14: 1 row * (v, g) * 512 * 4 = 4096 each -> 12288;
    #   entry = 5242912 + 12288 = 5255200. DSpark rings: none without speculation.
    assert g.image_bytes == 5_242_912
    assert g.state_bytes == 5_255_200
    assert g.image_pages == 15  # ceil(5242912 / 369920)


def test_flash_fp4_fp4_sizes_derived_by_hand(flash_config: V41Config) -> None:
    """The Flash fixture at block 128, kv fp4 / index fp4, has the PAGE and STATE
    sizes derived by hand below."""
    g = pool_geometry(flash_config, block_size=128, kv_cache_dtype="fp4", index_cache_dtype="fp4")
    # PAGE, per Full owner (64 rows for ratio 2 | 128 rows for ratio 1):
    #   main NVFP4 e2m1 x2  rows * 512 / 2  = 16384 | 32768
    #   main e4m3 scales    rows * 512 / 16 =  2048 |  4096
    #   index e2m1 x2       rows * 128 / 2  =  4096 |  8192
    #   index e8m0 scales   rows * 128 / 32 =   256 |   512
    #   all multiples of 16: 3 * 22784 + 45568 = 113920
    assert g.page_bytes == 113_920
    # STATE (SWA in FP8 under a packed main pool): per layer 128 * 512 e4m3 = 65536
    #   + 128 * 512 / 32 e8m0 = 2048 -> 67584; * 40 = 2703360; cursor 32 -> image
    #   2703392; tails 3 * 4096 = 12288 -> entry 2715680.
    assert g.image_bytes == 2_703_392
    assert g.state_bytes == 2_715_680
    assert g.image_pages == 24  # ceil(2703392 / 113920)


def test_plane_alignment_pads_to_16_bytes(make_geometry: MakeGeometry) -> None:
    """A plane whose size is not a multiple of 16 is followed by padding: at block 34
    a ratio-2 owner's index scales are 17 rows * 1 byte = 17 bytes, padded to 32."""
    g = make_geometry(block_size=34, encoder_replay=False)
    # owner 1 (ratio 2, 17 rows): main 17*64*2 = 2176; index 17*32 = 544; scales 17 -> 32
    # owner 3 (ratio 1, 34 rows): main 34*128 = 4352; index 1088; scales 34 -> 48
    # PAGE = 2176 + 544 + 32 + 4352 + 1088 + 48 = 8240
    assert g.plane(PlaneKind.INDEX_SCALES, 1).nbytes == 17
    assert g.plane(PlaneKind.MAIN_KV, 3).offset == 2176 + 544 + 32
    assert g.page_bytes == 8240


geometry_options = st.fixed_dictionaries(
    {
        "num_layers": st.integers(2, 6),
        "window": st.integers(1, 40),
        "head_dim": st.sampled_from([32, 64, 96]),
        "index_head_dim": st.sampled_from([32, 64]),
        "engram_history": st.integers(0, 4),
        "block_size": st.integers(16, 40).map(lambda b: 2 * b),
        "dtypes": st.sampled_from([("bf16", "fp8"), ("bf16", "fp4"), ("fp4", "fp8"), ("fp4", "fp4")]),
        "ratios": st.lists(st.sampled_from([1, 2]), min_size=1, max_size=2),
    }
)


def _geometry_from(options: dict[str, Any]) -> V41PoolGeometry:
    ratios = tuple(options["ratios"])
    return V41PoolGeometry(
        num_layers=options["num_layers"],
        full_owners=tuple(range(len(ratios))),
        owner_ratios=ratios,
        window=options["window"],
        head_dim=options["head_dim"],
        index_head_dim=options["index_head_dim"],
        dspark_layers=(),
        engram_history=options["engram_history"],
        block_size=options["block_size"],
        kv_cache_dtype=options["dtypes"][0],
        index_cache_dtype=options["dtypes"][1],
        num_speculative_tokens=0,
        encoder_replay=False,
    )


@settings(max_examples=60, deadline=None)
@given(geometry_options)
def test_planes_tile_their_units(options: dict[str, Any]) -> None:
    """For any geometry, planes are 16-byte aligned, disjoint, inside their unit and
    cover it up to alignment padding; the image is every ring plus the cursor, and
    the compressor tails lie after it."""
    g = _geometry_from(options)
    for planes, unit_bytes in ((g.page_planes, g.page_bytes), (g.state_planes, g.state_bytes)):
        assert unit_bytes % PLANE_ALIGNMENT == 0
        ordered = sorted(planes, key=lambda p: p.offset)
        for p in ordered:
            assert p.offset % PLANE_ALIGNMENT == 0
        for a, b in zip(ordered, ordered[1:]):
            assert a.end <= b.offset < a.end + PLANE_ALIGNMENT
        assert ordered[0].offset == 0 and unit_bytes - PLANE_ALIGNMENT < ordered[-1].end <= unit_bytes
    image_kinds = {PlaneKind.SWA_RING, PlaneKind.SWA_SCALES, PlaneKind.CURSOR}
    for p in g.state_planes:
        assert (p.end <= g.image_bytes) == (p.kind in image_kinds)
    assert {p.key for p in g.state_planes if p.kind is PlaneKind.SWA_RING} == set(range(g.num_layers))
    ratio_two = {o for o, r in zip(g.full_owners, g.owner_ratios) if r == 2}
    assert {p.key for p in g.state_planes if p.kind is PlaneKind.COMPRESSOR_TAIL} == ratio_two
    for owner in g.full_owners:
        rows = g.block_size // g.ratio_of(owner)
        assert all(p.shape[0] == rows for p in g.page_planes if p.key == owner)
    assert all(p.region is Region.PAGE for p in g.page_planes)


def test_speculation_adds_slack_rows_and_dspark_rings(make_geometry: MakeGeometry) -> None:
    """With k speculative tokens every ring has window + k rows, every tail 1 + k, and
    the DSpark stages get rings; without speculation they have none."""
    plain = make_geometry()
    spec = make_geometry(num_speculative_tokens=5)
    assert plain.ring_layers == (0, 1, 2, 3)
    assert spec.ring_layers == (0, 1, 2, 3, 4)
    assert spec.plane(PlaneKind.SWA_RING, 4).shape == (16 + 5, 64)
    assert spec.plane(PlaneKind.COMPRESSOR_TAIL, 1).shape == (6, 2, 64)
    assert plain.plane(PlaneKind.COMPRESSOR_TAIL, 1).shape == (1, 2, 64)


@pytest.mark.parametrize(
    ("overrides", "field", "allowed"),
    [
        ({"block_size": 129, "encoder_replay": False}, "block_size: 129 is odd", "even"),
        ({"block_size": 30}, "block_size: 30 is under 32", ">= 32"),
        ({"block_size": 33, "full_owners": (3,), "owner_ratios": (1,)}, "block_size: 33 is odd", "even"),
        ({"block_size": 35}, "not a multiple of compress ratio(s) [2]", "multiple of every owner ratio"),
        ({"window": 40}, "block_size: 32 is shorter than window - 1 = 39", "encoder_replay=False"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype: 'fp8'", "bf16, fp4"),
        ({"index_cache_dtype": "bf16"}, "index_cache_dtype: 'bf16'", "fp8, fp4"),
        ({"owner_ratios": (2, 4)}, "owner 3 has ratio 4", "1, 2"),
        ({"full_owners": (1, 4)}, "full_owners: [1, 4]", "[0, 4)"),
        ({"owner_ratios": (2,)}, "owner_ratios: 1 entries for 2 full_owners", "one per owner"),
        ({"head_dim": 48}, "head_dim: 48", "multiple of 32"),
        ({"index_head_dim": 16}, "index_head_dim: 16", "multiple of 32"),
        ({"dspark_layers": (2,)}, "dspark_layers: [2]", ">= num_layers"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens: -1", ">= 0"),
        ({"num_speculative_tokens": 5, "dspark_layers": ()}, "no DSpark layers", "allowed: 0"),
        (
            {"num_speculative_tokens": 5, "kv_cache_dtype": "fp4"},
            "packed speculative caches are refused",
            "kv_cache_dtype='bf16' and index_cache_dtype='fp8'",
        ),
        ({"engram_history": -1}, "engram_history: -1", ">= 0"),
    ],
)
def test_refusals_name_the_field_and_what_is_allowed(
    make_geometry: MakeGeometry, overrides: dict[str, Any], field: str, allowed: str
) -> None:
    """Every unsupported geometry is refused with a message naming the field, the
    value and what is allowed."""
    with pytest.raises(GeometryError) as info:
        make_geometry(**overrides)
    message = str(info.value)
    assert field in message and allowed in message, message


def test_encoder_replay_floor_is_window_minus_one(make_geometry: MakeGeometry) -> None:
    """Under encoder replay a PAGE of window - 1 rows is enough and one row fewer is
    refused; without encoder replay the window does not bound the PAGE."""
    assert make_geometry(block_size=32, window=33).block_size == 32
    with pytest.raises(GeometryError, match="window - 1"):
        make_geometry(block_size=32, window=34)
    assert make_geometry(block_size=32, window=34, encoder_replay=False).block_size == 32


def test_layout_id_names_every_layout_input(make_geometry: MakeGeometry) -> None:
    """layout_id changes with every input a stored PAGE or image depends on, and not
    with encoder_replay, which changes no stored byte."""
    base = make_geometry()
    assert base.layout_id.startswith("v41-") and len(base.layout_id) == 4 + 16
    assert make_geometry().layout_id == base.layout_id
    changes: list[dict[str, Any]] = [
        {"block_size": 64},
        {"window": 8},
        {"num_speculative_tokens": 5},
        {"head_dim": 32},
        {"index_head_dim": 64},
        {"num_layers": 5, "dspark_layers": (5,)},
        {"full_owners": (0, 3)},
        {"owner_ratios": (2, 2)},
        {"engram_history": 2},
        {"kv_cache_dtype": "fp4"},
        {"index_cache_dtype": "fp4"},
    ]
    ids = {make_geometry(**change).layout_id for change in changes}
    assert len(ids) == len(changes) and base.layout_id not in ids
    assert make_geometry(encoder_replay=False).layout_id == base.layout_id


def test_layout_id_is_stable_across_processes(make_geometry: MakeGeometry) -> None:
    """layout_id does not depend on the process (Python's hash seed): a fresh
    interpreter with another seed derives the same id."""
    code = (
        "import sys; sys.path.insert(0, 'tests/cache'); from conftest import SMALL_GEOMETRY; "
        "from cache.geometry import V41PoolGeometry; print(V41PoolGeometry(**SMALL_GEOMETRY).layout_id)"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == make_geometry().layout_id


def test_describe_lists_every_plane_and_the_totals(flash_config: V41Config) -> None:
    """describe() has one table row per plane (kind, owner/layer, shape, bytes) and the
    PAGE, image and entry totals."""
    g = pool_geometry(flash_config, kv_cache_dtype="fp4", index_cache_dtype="fp4")
    text = g.describe()
    lines = text.splitlines()
    for p in g.page_planes + g.state_planes:
        shape = "x".join(map(str, p.shape))
        key = "-" if p.key is None else str(p.key)
        assert any(
            line.split()[:3] == [p.kind.value, key, shape] and line.split()[-1] == str(p.nbytes) for line in lines
        ), p
    assert g.layout_id in text
    for total in (g.page_bytes, g.image_bytes, g.state_bytes):
        assert f"{total:,}" in text


def test_cursor_is_last_in_the_image_with_dead_history(make_geometry: MakeGeometry) -> None:
    """The cursor is int64 [position, engram_history ids], ending the image region,
    and DEAD is -1."""
    g = make_geometry()
    cursor = g.plane(PlaneKind.CURSOR)
    assert cursor.shape == (1 + g.engram_history,) and cursor.end == g.image_bytes
    assert DEAD_ENGRAM_ID == -1


def test_plane_lookup_names_the_allowed_keys(make_geometry: MakeGeometry) -> None:
    """Asking for a plane that does not exist says which keys exist, or that the
    plane kind does not exist under these dtypes."""
    g = make_geometry()
    with pytest.raises(GeometryError, match=r"compressor_tail: no plane for 3 \(allowed: \[1\]\)"):
        g.plane(PlaneKind.COMPRESSOR_TAIL, 3)
    with pytest.raises(GeometryError, match="swa_scales: no such plane under kv_cache_dtype='bf16'"):
        g.plane(PlaneKind.SWA_SCALES, 0)
