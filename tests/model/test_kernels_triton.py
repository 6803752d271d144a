"""The Triton kernels compute the torch backend's function on the paged planes, read
in place: compiled on a GPU when one is present, else under TRITON_INTERPRET=1 on the
CPU (tests/conftest.py sets it).

Inputs are fresh random rows written through the pools' own write path, so the planes
hold real packed formats (bf16 / FP8 rings, bf16 / NVFP4 main rows, FP8 / MXFP4 index
keys) at their real strided offsets inside one pool buffer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cache.plane_io import PlaneIO
from cache.pools import PoolSize, V41Pools
from cluster.engine import Engine
from cluster.pool_layout import pool_geometry
from cluster.request import SamplingParams
from model.config import V41Config
from model.formats import round_fp8, round_mxfp4
from model.kernels.torch_backend import TorchKernels
from model.kernels.triton import TritonKernels

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _store(config: V41Config, kv: str, index: str, seed: int) -> tuple[PlaneIO, int, int]:
    geometry = pool_geometry(config, block_size=32, kv_cache_dtype=kv, index_cache_dtype=index)
    store = PlaneIO(V41Pools(geometry, PoolSize(num_pages=12, num_slots=5), device=DEVICE))
    g = torch.Generator().manual_seed(seed)
    layer, owner = 0, geometry.full_owners[0]
    ring_rows = torch.arange(5 * geometry.ring_rows)
    window_kv = round_fp8(torch.randn(ring_rows.numel(), config.head_dim, generator=g))
    store.write_window(layer, ring_rows.to(DEVICE), window_kv.to(DEVICE))
    entry_rows = torch.arange(12 * geometry.rows_per_page(owner))
    main_kv = torch.randn(entry_rows.numel(), config.head_dim, generator=g) * 3
    store.write_main(owner, entry_rows.to(DEVICE), main_kv.to(DEVICE))
    keys = round_mxfp4(torch.randn(entry_rows.numel(), config.index_head_dim, generator=g))
    store.write_index(owner, entry_rows.to(DEVICE), keys.to(DEVICE))
    return store, layer, owner


@pytest.mark.parametrize(("kv", "index"), [("bf16", "fp8"), ("fp4", "fp4")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_torch_on_a_ragged_batch(tiny_dir: Path, kv: str, index: str, dtype: torch.dtype) -> None:
    """Window keys from this step's rows and from the ring, selected main rows (with
    empty slots), the sink: the same output as the torch backend (fp32: 1e-5; bf16
    dots with bf16 probabilities: 2e-2 relative)."""
    config = V41Config.from_pretrained(tiny_dir)
    store, layer, owner = _store(config, kv, index, seed=1)
    g = torch.Generator().manual_seed(2)
    rows, heads, dim, window, topk = 7, config.num_attention_heads, config.head_dim, 6, 5
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    chunk_kv = round_fp8(torch.randn(rows, dim, generator=g)).to(dtype)
    chunk_rows = torch.randint(-1, rows, (rows, window), generator=g)
    ring_total = store.pools.swa_ring(layer).shape[0] * store.pools.swa_ring(layer).shape[1]
    ring_rows = torch.where(chunk_rows < 0, torch.randint(0, ring_total, (rows, window), generator=g), -1)
    valid = torch.rand(rows, window, generator=g) < 0.8
    main_total = 12 * store.geometry.rows_per_page(owner)
    entry_rows = torch.randint(0, main_total, (rows, topk), generator=g)
    entry_rows[torch.rand(rows, topk, generator=g) < 0.3] = -1
    sink = torch.randn(heads, generator=g)
    q, chunk_kv, chunk_rows, ring_rows, valid, entry_rows, sink = (
        t.to(DEVICE) for t in (q, chunk_kv, chunk_rows, ring_rows, valid, entry_rows, sink)
    )
    args = (q, chunk_kv, chunk_rows, ring_rows, valid, store.window_plane(layer), entry_rows, store.main_plane(owner), sink, dim**-0.5)
    want = TorchKernels().attend(*args).float()
    got = TritonKernels().attend(*args).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - want).norm() / want.norm() < tol


@pytest.mark.parametrize("index", ["fp8", "fp4"])
def test_index_scorer_matches_torch_per_row_tile(tiny_dir: Path, index: str) -> None:
    """Each row scores its own segment's tile (rows of different lengths, NO_ROW
    padding -> -inf); a logits budget of one row per launch changes nothing."""
    config = V41Config.from_pretrained(tiny_dir)
    store, _, owner = _store(config, "bf16", index, seed=3)
    g = torch.Generator().manual_seed(4)
    segments, width, rows = 3, 40, 9
    main_total = 12 * store.geometry.rows_per_page(owner)
    tile = torch.randint(0, main_total, (segments, width), generator=g)
    tile[0, 25:] = -1
    tile[2, 3:] = -1
    row_segments = torch.randint(0, segments, (rows,), generator=g)
    q = round_mxfp4(torch.randn(rows, config.index_n_heads, config.index_head_dim, generator=g))
    w = torch.randn(rows, config.index_n_heads, generator=g)
    q, w, tile, row_segments = (t.to(DEVICE) for t in (q, w, tile, row_segments))
    plane = store.index_plane(owner)
    want = TorchKernels().score(q, w, tile, row_segments, plane)
    for kernels in (TritonKernels(), TritonKernels(logits_budget_bytes=4 * width)):
        got = kernels.score(q, w, tile, row_segments, plane)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)


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
