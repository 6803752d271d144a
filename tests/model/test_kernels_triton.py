"""The Triton kernels compute the torch backend's function on the paged planes, read
in place: compiled on a GPU when one is present, else under TRITON_INTERPRET=1 on the
CPU (tests/conftest.py sets it).

Inputs are fresh random rows written through the pools' own write path, so the planes
hold real packed formats (bf16 / FP8 rings, bf16 / NVFP4 main rows, FP8 / MXFP4 index
keys) at their real strided offsets inside one pool buffer. Every launch shape is
covered: one program per row and head group, and the key axis split over programs
with a merge pass; the scorer's rows cut into spans of several entry blocks.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.cache.plane_io import PlaneIO
from dsv41.cache.pools import PoolSize, V41Pools
from dsv41.cluster.engine import Engine
from dsv41.cluster.pool_layout import pool_geometry
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.formats import dequantize_fp8, dequantize_mxfp4, dequantize_nvfp4, round_fp8, round_mxfp4
from dsv41.model.kernels.torch_backend import TorchKernels

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from dsv41.model.kernels.interface import SCALE_GROUPS  # noqa: E402
from dsv41.model.kernels.triton import FORMAT_CODES, TritonKernels, default_attention_tiling  # noqa: E402
from dsv41.model.kernels.triton.attention import (  # noqa: E402
    DEFAULT_ATTENTION_TILING,
    AttentionTiling,
    MlaTiling,
    plan_key_split,
)
from dsv41.model.kernels.triton.decode import load_rows  # noqa: E402
from dsv41.model.kernels.triton.index_scorer import ScorerTiling, plan_entry_span  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLASH = FLASH_CONFIG_DIR
NUM_PAGES, NUM_SLOTS = 6, 3
# One program per row and head group (a one-program wave never splits, on any device);
# the key axis split into 16-key spans (a merge pass); spans of two 16-key tiles (a loop
# inside each split).
ATTENTION_TILINGS = {
    "unsplit": AttentionTiling(programs_per_wave=1),
    "split-per-tile": AttentionTiling(block_n=16, programs_per_wave=10_000),
    "split-two-tiles": AttentionTiling(block_n=16, programs_per_wave=40),
}
# The all-heads kernel's cuts, at TINY_ALT's head dim 64 (20 heads): one program for all
# heads, the latent whole (the logits' tile is the values'); two head groups, logits
# summed over 32-channel spans of q re-read every tile, a split per tile; the output
# latent over two programs, a split per two tiles; both spans, one program per row.
MLA_TILINGS = {
    "all-heads": MlaTiling(block_h=32, block_n=16, qk_chunk=None, dim_split=1, programs_per_wave=1),
    "groups-qk-spans-split": MlaTiling(block_h=16, block_n=16, qk_chunk=32, q_reload=True, dim_split=1,
                                       programs_per_wave=10_000),
    "dim-split-two-tiles": MlaTiling(block_h=32, block_n=16, qk_chunk=None, dim_split=2, programs_per_wave=24),
    "qk-spans-dim-split": MlaTiling(block_h=32, block_n=16, qk_chunk=32, dim_split=2, programs_per_wave=1),
}


def _store(config: V41Config, kv: str, index: str, seed: int, block_size: int = 32) -> PlaneIO:
    """Pools of the config's geometry with every ring, main and index row written."""
    geometry = pool_geometry(config, block_size=block_size, kv_cache_dtype=kv, index_cache_dtype=index)
    store = PlaneIO(V41Pools(geometry, PoolSize(num_pages=NUM_PAGES, num_slots=NUM_SLOTS), device=DEVICE))
    g = torch.Generator().manual_seed(seed)
    ring_rows = torch.arange(NUM_SLOTS * geometry.ring_rows)
    window_kv = round_fp8(torch.randn(ring_rows.numel(), config.head_dim, generator=g))
    writer = TorchKernels()
    writer.write_rows(store.window_plane(0), ring_rows.to(DEVICE), window_kv.to(DEVICE))
    for owner in geometry.full_owners:
        entry_rows = torch.arange(NUM_PAGES * geometry.rows_per_page(owner))
        main_kv = torch.randn(entry_rows.numel(), config.head_dim, generator=g) * 3
        writer.write_rows(store.main_plane(owner), entry_rows.to(DEVICE), main_kv.to(DEVICE), round_to="nvfp4")
        keys = round_mxfp4(torch.randn(entry_rows.numel(), config.index_head_dim, generator=g))
        writer.write_rows(store.index_plane(owner), entry_rows.to(DEVICE), keys.to(DEVICE))
    return store


def _attention_case(config: V41Config, ring_store: PlaneIO, main_store: PlaneIO, rows: int, heads: int, topk: int,
                    dtype: torch.dtype, seed: int) -> tuple:
    """A ragged batch: window keys from this step's rows and from the ring (some
    invalid), main entries with NO_ROW slots, one row with no valid key at all."""
    g = torch.Generator().manual_seed(seed)
    dim, window = config.head_dim, config.sliding_window
    owner = main_store.geometry.full_owners[-1]
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    chunk_kv = round_fp8(torch.randn(rows, dim, generator=g)).to(dtype)
    chunk_rows = torch.randint(-1, rows, (rows, window), generator=g)
    ring_total = NUM_SLOTS * ring_store.geometry.ring_rows
    ring_rows = torch.where(chunk_rows < 0, torch.randint(0, ring_total, (rows, window), generator=g), -1)
    valid = torch.rand(rows, window, generator=g) < 0.8
    main_total = NUM_PAGES * main_store.geometry.rows_per_page(owner)
    entry_rows = torch.randint(0, main_total, (rows, topk), generator=g)
    entry_rows[torch.rand(rows, topk, generator=g) < 0.3] = -1
    valid[-1] = False
    entry_rows[-1] = -1
    sink = torch.randn(heads, generator=g)
    q, chunk_kv, chunk_rows, ring_rows, valid, entry_rows, sink = (
        t.to(DEVICE) for t in (q, chunk_kv, chunk_rows, ring_rows, valid, entry_rows, sink)
    )
    return (q, chunk_kv, chunk_rows, ring_rows, valid, ring_store.window_plane(0), entry_rows,
            main_store.main_plane(owner), sink, dim**-0.5)


def _assert_attention_matches(args: tuple, tiling: AttentionTiling) -> None:
    q = args[0]
    want = TorchKernels().attend(*args).float()
    got = TritonKernels(attention_tiling=tiling).attend(*args)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    assert (got.float() - want).norm() / want.norm() < tol
    # A row with no valid key attends to the zero-value sink alone.
    assert torch.count_nonzero(got[-1]) == 0


@pytest.mark.parametrize(
    ("ring_kv", "main_kv", "dtype"),
    [
        ("bf16", "bf16", torch.float32),
        ("fp4", "fp4", torch.float32),
        ("bf16", "fp4", torch.bfloat16),
        ("fp4", "bf16", torch.bfloat16),
    ],
)
def test_attention_matches_torch_on_a_ragged_batch(tiny_dir: Path, ring_kv: str, main_kv: str, dtype: torch.dtype) -> None:
    """bf16 or FP8 rings (kv "bf16" / "fp4" pools) with bf16 or NVFP4 main rows, 20
    heads (two head groups, the second partly masked), one program per row and head
    group: the torch backend's output (fp32: 1e-5; bf16 dots with bf16 probabilities:
    2e-2 relative)."""
    config = V41Config.from_pretrained(tiny_dir)
    ring_store, main_store = _store(config, ring_kv, "fp8", seed=1), _store(config, main_kv, "fp8", seed=2)
    args = _attention_case(config, ring_store, main_store, rows=4, heads=20, topk=24, dtype=dtype, seed=3)
    _assert_attention_matches(args, ATTENTION_TILINGS["unsplit"])


@pytest.mark.parametrize("tiling", ["split-per-tile", "split-two-tiles"])
@pytest.mark.parametrize(("kv", "dtype"), [("fp4", torch.float32), ("bf16", torch.bfloat16), ("fp4", torch.bfloat16)])
def test_attention_split_over_keys_matches_torch(tiny_dir: Path, kv: str, dtype: torch.dtype, tiling: str) -> None:
    """The key axis split over programs (spans of one or two 16-key tiles, window and
    main spans apart) and merged with the sink afterwards: the torch backend's output.
    With bf16 queries on a GPU the NVFP4 main tiles meet bf16 dots of K 16 (p . v over
    16 keys), the dots decode.NIBBLE_DOT_MIN_K is about."""
    config = V41Config.from_pretrained(tiny_dir)
    store = _store(config, kv, "fp8", seed=4)
    args = _attention_case(config, store, store, rows=3, heads=20, topk=24, dtype=dtype, seed=5)
    _assert_attention_matches(args, ATTENTION_TILINGS[tiling])


def test_attention_without_main_keys(tiny_dir: Path) -> None:
    """A window-only layer (no entry rows, no main plane), unsplit and split: the torch
    backend's output."""
    config = V41Config.from_pretrained(tiny_dir)
    store = _store(config, "fp4", "fp8", seed=6)
    args = _attention_case(config, store, store, rows=3, heads=4, topk=8, dtype=torch.float32, seed=7)
    window_only = args[:6] + (None, None) + args[8:]
    for tiling in ATTENTION_TILINGS.values():
        _assert_attention_matches(window_only, tiling)


@pytest.mark.parametrize("tiling", list(MLA_TILINGS))
@pytest.mark.parametrize(
    ("ring_kv", "main_kv", "dtype"),
    [
        ("bf16", "bf16", torch.float32),
        ("fp4", "fp4", torch.float32),
        ("bf16", "fp4", torch.bfloat16),
        ("fp4", "bf16", torch.bfloat16),
        ("fp4", "fp4", torch.bfloat16),
    ],
)
def test_mla_attention_matches_torch(tiny_alt_dir: Path, ring_kv: str, main_kv: str, dtype: torch.dtype,
                                     tiling: str) -> None:
    """The all-heads kernel, every cut of MLA_TILINGS, on bf16 or FP8 rings with bf16 or
    NVFP4 main rows (NO_ROW entries, invalid window keys, a row with no valid key):
    the torch backend's output at the unfused kernel's tolerances. Every cut's tiles
    are 16 keys, so with bf16 queries on a GPU the NVFP4 tiles meet bf16 dots of K 16
    (decode.NIBBLE_DOT_MIN_K), and with 32-channel spans dots of K 32."""
    config = V41Config.from_pretrained(tiny_alt_dir)
    ring_store = _store(config, ring_kv, "fp8", seed=13, block_size=64)
    main_store = _store(config, main_kv, "fp8", seed=14, block_size=64)
    args = _attention_case(config, ring_store, main_store, rows=4, heads=20, topk=24, dtype=dtype, seed=15)
    _assert_attention_matches(args, MLA_TILINGS[tiling])


@pytest.mark.parametrize("tiling", ["unsplit", "split-per-tile", "all-heads", "groups-qk-spans-split"])
def test_absent_entry_tiles_change_no_bit(tiny_dir: Path, tiny_alt_dir: Path, tiling: str) -> None:
    """A prefill row's selection holds fewer than K entries, padded with absent ones: the
    output of each row is bit for bit the one of its selection cut to its first 16
    entries, whatever whole tiles of absent entries follow (the kernels skip them) or
    how the rows' counts differ (one row has none at all)."""
    mla = tiling in MLA_TILINGS
    config = V41Config.from_pretrained(tiny_alt_dir if mla else tiny_dir)
    store = _store(config, "fp4", "fp8", seed=18, block_size=64 if mla else 32)
    args = _attention_case(config, store, store, rows=4, heads=20, topk=16, dtype=torch.float32, seed=19)
    kernels = TritonKernels(attention_tiling=MLA_TILINGS[tiling] if mla else ATTENTION_TILINGS[tiling])
    cut = kernels.attend(*args)
    entry_rows = args[6]
    padded = torch.cat((entry_rows, entry_rows.new_full((entry_rows.shape[0], 48), -1)), dim=1)
    assert torch.equal(kernels.attend(*args[:6], padded, *args[7:]), cut)


def test_mla_attention_without_main_keys(tiny_alt_dir: Path) -> None:
    """A window-only layer through every cut of the all-heads kernel: the torch
    backend's output."""
    config = V41Config.from_pretrained(tiny_alt_dir)
    store = _store(config, "fp4", "fp8", seed=16, block_size=64)
    args = _attention_case(config, store, store, rows=3, heads=4, topk=8, dtype=torch.float32, seed=17)
    window_only = args[:6] + (None, None) + args[8:]
    for tiling in MLA_TILINGS.values():
        _assert_attention_matches(window_only, tiling)


def test_mla_tiling_rejects_spans_the_planes_cannot_read() -> None:
    """Tile sizes below a dot's minimum and q re-reads without spans are refused when the
    tiling is made; spans that do not divide the head dim or would cut a scale group,
    and re-reads of a single span, when a launch meets them."""
    with pytest.raises(ValueError, match="MlaTiling.block_h"):
        MlaTiling(block_h=8)
    with pytest.raises(ValueError, match="MlaTiling.qk_chunk"):
        MlaTiling(qk_chunk=48)
    with pytest.raises(ValueError, match="MlaTiling.dim_split"):
        MlaTiling(dim_split=3)
    with pytest.raises(ValueError, match="MlaTiling.q_reload"):
        MlaTiling(qk_chunk=None, q_reload=True)
    with pytest.raises(ValueError, match="MlaTiling.q_reload"):
        MlaTiling(qk_chunk=64, q_reload=True).spans(64, (1, 1))  # one span: nothing to re-read
    assert MlaTiling(qk_chunk=128, dim_split=2).spans(512, (32, 16)) == (128, 256)
    with pytest.raises(ValueError, match="qk_chunk = 16"):
        MlaTiling(qk_chunk=16).spans(512, (32, 16))  # an FP8 ring's scale groups are 32 channels
    with pytest.raises(ValueError, match="dim_split = 8"):
        MlaTiling(dim_split=8).spans(64, (1, 1))


def test_the_engines_cut_fits_any_models_dims() -> None:
    """The default cut is kept as chosen at V4.1-Flash's dims and planes; on a narrower
    model its head block shrinks to the heads (never below a dot's 16) and, where its
    q . k spans cannot cut the latent in whole scale groups, one span takes the whole
    latent with q held: every fitted cut is one a launch accepts."""
    flash_groups = (32, 16)  # an FP8 ring, an NVFP4 main plane
    assert DEFAULT_ATTENTION_TILING.fitted(64, 512, flash_groups) == DEFAULT_ATTENTION_TILING
    assert default_attention_tiling(64, 512, (1, 1)) == DEFAULT_ATTENTION_TILING
    for heads, head_dim, groups in ((4, 32, (32, 16)), (4, 32, (1, 1)), (16, 64, (32, 16)), (128, 128, (1, 1))):
        fitted = DEFAULT_ATTENTION_TILING.fitted(heads, head_dim, groups)
        assert fitted.block_h == max(16, min(64, triton.next_power_of_2(heads)))
        qk_chunk, value_dim = fitted.spans(head_dim, groups)
        assert value_dim == head_dim
        if qk_chunk < head_dim:
            assert fitted == replace(DEFAULT_ATTENTION_TILING, block_h=fitted.block_h)
        else:
            assert fitted.qk_chunk is None and not fitted.q_reload


@pytest.mark.parametrize(("kv", "index"), [("bf16", "fp8"), ("fp4", "fp4")])
def test_attention_and_scores_at_flash_dims(kv: str, index: str) -> None:
    """V4.1-Flash dims on the Flash geometry (block 128): 64 heads x 512 in four head
    groups and in one all-heads program (MlaTiling's default cut, and the engine's:
    one program a row, q re-read for each span), window 128, 32 index
    heads x 128, split and unsplit launches: the torch backend's results (bf16 q on a
    GPU: bf16 dots)."""
    config = V41Config.from_pretrained(FLASH, text_only=True)
    store = _store(config, kv, index, seed=8, block_size=128)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    args = _attention_case(config, store, store, rows=2, heads=config.num_attention_heads, topk=32, dtype=dtype, seed=9)
    for tiling in (ATTENTION_TILINGS["unsplit"], AttentionTiling(programs_per_wave=24), MlaTiling(programs_per_wave=1),
                   MlaTiling(programs_per_wave=8), replace(DEFAULT_ATTENTION_TILING, programs_per_wave=1),
                   replace(DEFAULT_ATTENTION_TILING, programs_per_wave=8)):
        _assert_attention_matches(args, tiling)
    _assert_scores_match(config, store, rows=2, segments=2, width=200, seed=10,
                         kernels=(TritonKernels(), TritonKernels(scorer_tiling=ScorerTiling(programs_per_wave=4))))


def _assert_scores_match(config: V41Config, store: PlaneIO, rows: int, segments: int, width: int, seed: int,
                         kernels: tuple[TritonKernels, ...]) -> None:
    g = torch.Generator().manual_seed(seed)
    owner = store.geometry.full_owners[0]
    main_total = NUM_PAGES * store.geometry.rows_per_page(owner)
    tile = torch.randint(0, main_total, (segments, width), generator=g)
    tile[0, width // 2 :] = -1
    tile[-1, 3:] = -1
    row_segments = torch.randint(0, segments, (rows,), generator=g)
    q = round_mxfp4(torch.randn(rows, config.index_n_heads, config.index_head_dim, generator=g))
    w = torch.randn(rows, config.index_n_heads, generator=g)
    q, w, tile, row_segments = (t.to(DEVICE) for t in (q, w, tile, row_segments))
    plane = store.index_plane(owner)
    want = TorchKernels().score(q, w, tile, row_segments, plane)
    for k in kernels:
        got = k.score(q, w, tile, row_segments, plane)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index", ["fp8", "fp4"])
def test_index_scorer_matches_torch_per_row_tile(tiny_dir: Path, index: str) -> None:
    """Each row scores its own segment's tile (rows of different lengths, NO_ROW
    padding -> -inf), with one span per row, spans of one 16-entry block and spans of
    several; a logits budget of one row per launch changes nothing."""
    config = V41Config.from_pretrained(tiny_dir)
    store = _store(config, "bf16", index, seed=11)
    width = 40
    kernels = (
        TritonKernels(),
        TritonKernels(scorer_tiling=ScorerTiling(block_c=16, programs_per_wave=10_000)),
        TritonKernels(scorer_tiling=ScorerTiling(block_c=16, programs_per_wave=10)),
        TritonKernels(logits_budget_bytes=4 * width),
    )
    _assert_scores_match(config, store, rows=5, segments=3, width=width, seed=12, kernels=kernels)


@triton.jit
def _load_rows_kernel(values, scales, flat_ptr, out_ptr, vsu, vsr, ssu, ssr, N: tl.constexpr, ROWS: tl.constexpr,
                      WIDTH: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr):
    flat = tl.load(flat_ptr + tl.arange(0, N))
    rows = load_rows(values, scales, flat, flat >= 0, ROWS, vsu, vsr, ssu, ssr, WIDTH, FMT, GROUP, tl.float32)
    tl.store(out_ptr + tl.arange(0, N)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :], rows)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4", "bf16"])
def test_row_decoding_is_the_formats_dequantizer(fmt: str) -> None:
    """Every byte value a plane can hold (E4M3 bar NaN, both nibbles of E2M1 pairs,
    E8M0 and E4M3 scales), in rows at strided flat addresses of a [units, rows, width]
    view: the kernel's decode equals model/formats.py's dequantizer exactly (as numbers:
    an FP8 -0 may read as +0), and NO_ROW reads as zeros."""
    code, group = FORMAT_CODES[fmt], SCALE_GROUPS.get(fmt, 1)
    units, rows, width = 3, 4, 64
    g = torch.Generator().manual_seed(11)
    page = torch.zeros(units, 8192, dtype=torch.uint8)
    values_width = {"fp8": width, "bf16": width * 2}.get(fmt, width // 2)
    values = page[:, 256 : 256 + rows * values_width].view(units, rows, values_width)
    every_byte = torch.arange(units * rows * values_width) % 256
    if fmt == "fp8":
        every_byte = torch.where(every_byte & 0x7F == 0x7F, 0, every_byte)  # no NaN in a plane
    values.copy_(every_byte.view(values.shape).to(torch.uint8))
    if fmt == "bf16":
        values = values.view(torch.bfloat16)
        values.copy_(torch.randn(values.shape, generator=g))
        scales = None
    else:
        scales = page[:, 4096 : 4096 + rows * (width // group)].view(units, rows, width // group)
        low, high = (0, 0x7F) if fmt == "nvfp4" else (90, 160)  # E4M3 bar NaN; E8M0 around 2^0
        scales.copy_(torch.randint(low, high, scales.shape, generator=g).to(torch.uint8))
    flat = torch.tensor([0, 5, -1, 11, 8, 3, 2, -1])
    out = torch.empty(flat.numel(), width)
    plane_scales = scales if scales is not None else values
    # The planes are strided views into the page: move the page and view it the same way
    # there (a moved view would be a contiguous copy with other strides).
    page_d = page.to(DEVICE)

    def on_device(view: torch.Tensor) -> torch.Tensor:
        return page_d.view(view.dtype).as_strided(view.shape, view.stride(), view.storage_offset())

    values_d, scales_d = on_device(values), on_device(plane_scales)
    flat_d, out_d = flat.to(DEVICE), out.to(DEVICE)
    _load_rows_kernel[(1,)](values_d, scales_d, flat_d, out_d, values.stride(0), values.stride(1),
                            plane_scales.stride(0), plane_scales.stride(1), N=flat.numel(), ROWS=rows, WIDTH=width,
                            FMT=code, GROUP=group)
    unit, row = flat.clamp_min(0) // rows, flat.clamp_min(0) % rows
    if fmt == "bf16":
        want = values[unit, row].float()
    else:
        dequantize = {"fp8": dequantize_fp8, "nvfp4": dequantize_nvfp4, "mxfp4": dequantize_mxfp4}[fmt]
        want = dequantize(values[unit, row], scales[unit, row])
    want[flat < 0] = 0
    assert torch.equal(out_d.cpu(), want)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 300),
    head_groups=st.integers(1, 8),
    window=st.integers(1, 300),
    topk=st.integers(0, 1100),
    block_n=st.sampled_from([16, 32, 64]),
    programs_per_wave=st.integers(1, 600),
)
def test_key_splits_cover_each_key_once_within_a_wave(
    rows: int, head_groups: int, window: int, topk: int, block_n: int, programs_per_wave: int
) -> None:
    """The key axis is split exactly when a wave has room for two programs per row
    and head group and the keys fill two tiles; then, under the kernel's span
    arithmetic, every window key and every main key falls in exactly one split, splits
    are whole tiles, and the launch never has more programs than one wave."""
    plan = plan_key_split(rows, head_groups, window, topk, block_n, programs_per_wave)
    room = programs_per_wave // (rows * head_groups) >= 2
    if plan.splits == 1:
        assert not room or triton.cdiv(window, block_n) + triton.cdiv(topk, block_n) == 1
        return
    assert room
    assert plan.keys_per_split % block_n == 0
    assert rows * head_groups * plan.splits <= programs_per_wave
    window_seen, main_seen = [0] * window, [0] * topk
    for split in range(plan.splits):
        lo = min(split * plan.keys_per_split, window)
        hi = min(lo + plan.keys_per_split, window) if split < plan.window_splits else lo
        for key in range(lo, hi):
            window_seen[key] += 1
        lo = min(max(split - plan.window_splits, 0) * plan.keys_per_split, topk)
        hi = min(lo + plan.keys_per_split, topk) if split >= plan.window_splits else lo
        for key in range(lo, hi):
            main_seen[key] += 1
    assert window_seen == [1] * window and main_seen == [1] * topk


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 300),
    entries=st.integers(1, 40_000),
    block_c=st.sampled_from([16, 128]),
    programs_per_wave=st.integers(1, 1000),
)
def test_entry_spans_are_whole_blocks_in_one_wave(rows: int, entries: int, block_c: int, programs_per_wave: int) -> None:
    """A scorer span is whole blocks and covers a row's entries with no empty span;
    the launch fits one wave whenever the rows do, and each row gets at least half
    the spans the wave has room for (whole blocks cannot always split evenly)."""
    span = plan_entry_span(rows, entries, block_c, programs_per_wave)
    spans = triton.cdiv(entries, span)
    blocks = triton.cdiv(entries, block_c)
    assert span % block_c == 0 and (spans - 1) * span < entries <= spans * span
    assert rows * spans <= max(programs_per_wave, rows)
    assert 2 * spans >= min(blocks, max(1, programs_per_wave // rows))


def test_the_paged_runtime_on_triton_reproduces_the_torch_tokens(tiny_dir: Path) -> None:
    """The whole engine with kernel_backend="triton" gives the torch backend's greedy
    tokens (fp32), through a chunked prefill and decode steps."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    tokens = {}
    for backend in ("torch", "triton"):
        engine = Engine.from_pretrained(
            tiny_dir, block_size=32, max_num_batched_tokens=24, kernel_backend=backend, enable_prefix_caching=False,
            device=DEVICE,
        )
        tokens[backend] = engine.generate([prompt], params)[0].token_ids
    assert tokens["triton"] == tokens["torch"]
