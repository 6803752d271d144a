"""The Triton compression-path kernels (ratio-2 pair pooling with STATE tails, quantised
row stores) compute the torch backend's function: compiled on a GPU when one is present,
else under TRITON_INTERPRET=1 on the CPU (tests/conftest.py sets it).

The kernel tests take their torch reference on the CPU, where model/formats.py and
model/compressor.py define the arithmetic (on a GPU, torch divides by a Python scalar
through its reciprocal). Stored bytes must be equal bit for bit. The pooled entries may
differ in their last bits only through the pair softmax's exp (a libm function: numpy's
in the interpreter, libdevice's expf on a GPU, torch's own on the CPU), so they are held
to a few float32 ulps of the terms they sum.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import pytest
import torch

from dsv41.cache.addressing import NO_ROW, CompressionPlan, PoolShape, SegmentSpec, build_step_addresses
from dsv41.cache.plane_io import PlaneIO, PlaneView
from dsv41.cache.pools import PoolSize, V41Pools
from dsv41.cluster.engine import Engine
from dsv41.cluster.options import RankLayout, engine_options
from dsv41.cluster.pool_layout import pool_geometry
from dsv41.cluster.ranks import DPRank, LocalRank
from dsv41.model.config import V41Config
from dsv41.model.device import move_tensors
from dsv41.model.kernels.interface import SCALE_GROUPS
from dsv41.model.kernels.torch_backend import TorchKernels
from dsv41.model.params import load_model_params

pytest.importorskip("triton")

from dsv41.model.kernels.triton import TritonKernels  # noqa: E402  (needs triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The pooled rows' bound, in float32 ulps of |v1| p1 + |v2| p2: numpy's float32 exp is
# off by up to 2.4 ulps (measured over 4M arguments in [-40, 0]), which reaches a pooled
# row as up to 2.7 ulps (measured on 2,000 x 512 random pairs, CPU, 2026-11-30).
POOL_ULPS = 8


def _hard_rows(count: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """[count, width] fp32 rows whose 32-channel groups each take a case where an encoder
    can be one code off: plain normals; E2M1 midpoints under an exact power-of-two scale;
    E4M3 midpoints (normal and subnormal) under an exact scale; an amax just above 448 or
    6 times a power of two (where formats.py's float32 log2 rounds the scale down);
    everything below every amax floor; values past every saturation; signed zeros and
    values that round to zero; values halfway between two bf16 numbers. Never all zero."""
    g = generator
    shape = (count, width // 32, 32)
    base = torch.randn(shape, generator=g)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    power = torch.exp2(torch.randint(-12, 12, (count, width // 32, 1), generator=g).float())
    e2m1_ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])[torch.randint(0, 7, shape, generator=g)] * sign
    e2m1_ties[..., 0] = 6.0
    e4m3_ties = (1 + (2 * torch.randint(0, 8, shape, generator=g) + 1) / 16) * torch.exp2(
        torch.randint(-6, 8, shape, generator=g).float()
    )
    subnormal_ties = (2 * torch.randint(0, 8, shape, generator=g) + 1) * 2.0**-10
    e4m3_ties = torch.where(torch.rand(shape, generator=g) < 0.3, subnormal_ties, e4m3_ties)
    e4m3_ties = e4m3_ties * sign
    e4m3_ties[..., 0] = 448.0
    band = base.clone()
    band[..., 0] = torch.where(torch.rand(shape[:2], generator=g) < 0.5, 448.0, 6.0) * (
        1 + torch.randint(1, 6, shape[:2], generator=g) * 2.0**-23
    )
    zeros = torch.where(torch.rand(shape, generator=g) < 0.5, base, torch.tensor(-0.0))
    zeros = torch.where(torch.rand(shape, generator=g) < 0.2, 1e-30 * sign, zeros)
    zeros[..., 0] = 1.0
    as_bf16 = base.to(torch.bfloat16).float()
    half_ulp = torch.exp2(torch.floor(torch.log2(as_bf16.abs())) - 8)
    bf16_ties = as_bf16 + sign * half_ulp
    cases = torch.stack(
        (base, e2m1_ties * power, e4m3_ties * power, band * power, base * 1e-7, base * 3e4, zeros, bf16_ties)
    )
    pick = torch.randint(0, cases.shape[0], (1, count, width // 32, 1), generator=g).expand(1, *shape)
    return torch.gather(cases, 0, pick)[0].reshape(count, width)


def _random_plane(fmt: str, units: int, rows: int, width: int, generator: torch.Generator) -> PlaneView:
    """A plane of random bytes (the rows a write leaves alone must stay so)."""
    stored = width // 2 if fmt in ("nvfp4", "mxfp4") else width
    if fmt == "bf16":
        values = torch.randint(-(2**15), 2**15, (units, rows, stored), dtype=torch.int16, generator=generator)
        return PlaneView(values.view(torch.bfloat16), None, fmt)
    values = torch.randint(0, 256, (units, rows, stored), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 256, (units, rows, width // SCALE_GROUPS[fmt]), dtype=torch.uint8, generator=generator)
    return PlaneView(values, scales, fmt)


def _on(plane: PlaneView, device: str) -> PlaneView:
    return PlaneView(
        plane.values.clone().to(device), None if plane.scales is None else plane.scales.clone().to(device), plane.fmt
    )


def _bytes(plane: PlaneView) -> tuple[torch.Tensor, ...]:
    values = plane.values.cpu().view(torch.uint8)
    return (values,) if plane.scales is None else (values, plane.scales.cpu())


def _destinations(count: int, total_rows: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct flat rows in random order, every fifth one NO_ROW (padding)."""
    rows = torch.randperm(total_rows, generator=generator)[:count]
    rows[::5] = NO_ROW
    return rows


@pytest.mark.parametrize(
    ("fmt", "round_to"),
    [
        ("bf16", None),
        ("bf16", "fp8"),
        ("bf16", "nvfp4"),
        ("bf16", "mxfp4"),
        ("fp8", None),
        ("nvfp4", "nvfp4"),
        ("mxfp4", None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_rows_stores_the_torch_bytes(fmt: str, round_to: str | None, dtype: torch.dtype) -> None:
    """At V4.1-Flash widths (512 main / window rows, 128 index rows), every plane format
    and rounding grid, fp32 and bf16 sources: the Triton store leaves exactly the bytes of
    the torch backend's (model/formats.py), in the rows written and in every other row;
    NO_ROW rows write nothing."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{fmt}/{round_to}/{dtype}".encode()))
    for width in (512, 128):
        plane = _random_plane(fmt, units=3, rows=8, width=width, generator=g)
        rows = _destinations(20, 24, g)
        values = _hard_rows(20, width, g).to(dtype)
        want = _on(plane, "cpu")
        TorchKernels().write_rows(want, rows, values, round_to)
        got = _on(plane, DEVICE)
        TritonKernels().write_rows(got, rows.to(DEVICE), values.to(DEVICE), round_to)
        for w, o in zip(_bytes(want), _bytes(got)):
            assert torch.equal(o, w), f"width {width}: {(o != w).sum().item()} bytes differ"


@pytest.mark.parametrize(("kv", "index"), [("bf16", "fp8"), ("fp4", "fp4")])
def test_write_rows_into_the_pools_agree_across_backends(tiny_dir: Path, kv: str, index: str) -> None:
    """The runtime's three writes (window ring, main KV rounded to NVFP4, index keys) into
    real pools (planes at their strided offsets in one buffer, the buffer random): the
    Triton store and the torch store leave the same buffer."""
    config = V41Config.from_pretrained(tiny_dir)
    geometry = pool_geometry(config, block_size=32, kv_cache_dtype=kv, index_cache_dtype=index)
    size = PoolSize(num_pages=4, num_slots=3)
    g = torch.Generator().manual_seed(7)
    start = torch.randint(0, 256, (size.nbytes(geometry),), dtype=torch.uint8, generator=g)
    owner, layer = geometry.full_owners[0], 1
    ring_total = size.num_slots * geometry.ring_rows
    entry_total = size.num_pages * geometry.rows_per_page(owner)
    writes = []
    for plane, total, width, round_to in (
        ("window", ring_total, config.head_dim, None),
        ("main", entry_total, config.head_dim, "nvfp4"),
        ("index", entry_total, config.index_head_dim, None),
    ):
        writes.append((plane, _destinations(9, total, g), _hard_rows(9, width, g), round_to))
    buffers = {}
    for name, kernels, device in (("torch", TorchKernels(), "cpu"), ("triton", TritonKernels(), DEVICE)):
        pools = V41Pools(geometry, size, device=device)
        pools.buffer.copy_(start)
        store = PlaneIO(pools)
        planes = {
            "window": store.window_plane(layer),
            "main": store.main_plane(owner),
            "index": store.index_plane(owner),
        }
        for plane, rows, values, round_to in writes:
            kernels.write_rows(planes[plane], rows.to(device), values.to(device), round_to)
        buffers[name] = pools.buffer.cpu()
    assert not torch.equal(buffers["torch"], start)
    assert torch.equal(buffers["triton"], buffers["torch"])


def test_write_rows_refuses_what_no_backend_stores_alike() -> None:
    """A rounding grid that is not the plane's own packed format, or rows whose width
    does not fit the plane, are refused by both backends with the argument named."""
    g = torch.Generator().manual_seed(3)
    nvfp4 = _random_plane("nvfp4", 1, 4, 32, g)
    for kernels in (TorchKernels(), TritonKernels()):
        with pytest.raises(ValueError, match="round_to"):
            kernels.write_rows(nvfp4, torch.arange(2), torch.randn(2, 32), round_to="mxfp4")
        with pytest.raises(ValueError, match="values"):
            kernels.write_rows(nvfp4, torch.arange(2), torch.randn(2, 64))


def _assert_pooled_close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    bound = POOL_ULPS * torch.finfo(torch.float32).eps * magnitude
    excess = (got.cpu() - want).abs() - bound
    assert excess.max() <= 0, f"pooled rows off by {excess.max().item():.3g} past {POOL_ULPS} ulps"


def _pair_magnitude(v: torch.Tensor, g: torch.Tensor, plan: CompressionPlan, tails: torch.Tensor) -> torch.Tensor:
    """|v1| p1 + |v2| p2 of every group: the scale of a pooled row's rounding."""
    return TorchKernels().pool_ratio2(v.abs(), g, plan, torch.stack((tails[:, 0].abs(), tails[:, 1]), dim=1))


def test_pool_ratio2_matches_torch_across_calls_and_chunkings() -> None:
    """Three requests fed in chunks of odd and even lengths, then decoded, on slots with
    pending tails carried from call to call: after every call the STATE tails hold the
    torch backend's bytes and the pooled rows are torch's within the exp's ulps; each
    entry is bit for bit the one a single whole-sequence call gives (a pair pooled from
    a tail is the same arithmetic as a pair of this step's rows); a padding group gives
    a zero row and a NO_ROW tail write leaves the tails alone."""
    dim, shape = 64, PoolShape(block_size=32, window=8, ring_rows=8, ratios=(2,))
    slots, page_tables = (0, 2, 3), torch.tensor(((0, 1), (2, 3), (4, 5)))
    length = 40
    g = torch.Generator().manual_seed(11)
    v_seq = torch.randn(3, length, dim, generator=g)
    g_seq = torch.randn(3, length, dim, generator=g) * 3
    chunks = ((3, 4, 1), (5, 2, 6), (1, 7, 3), (6, 1, 2), (1, 1, 1), (1, 1, 1))
    tails = {"torch": torch.randn(4, 2, dim, generator=g)}
    tails["triton"] = tails["torch"].clone().to(DEVICE)
    chunked: dict[tuple[int, int], torch.Tensor] = {}
    done = [0, 0, 0]
    for lengths in chunks:
        segments = [SegmentSpec(slots[r], done[r], n) for r, n in enumerate(lengths)]
        plan = build_step_addresses(segments, page_tables, shape).compression[2]
        v = torch.cat([v_seq[r, done[r] : done[r] + n] for r, n in enumerate(lengths)])
        gate = torch.cat([g_seq[r, done[r] : done[r] + n] for r, n in enumerate(lengths)])
        magnitude = _pair_magnitude(v, gate, plan, tails["torch"])
        want = TorchKernels().pool_ratio2(v, gate, plan, tails["torch"])
        got = TritonKernels().pool_ratio2(v.to(DEVICE), gate.to(DEVICE), move_tensors(plan, DEVICE), tails["triton"])
        assert torch.equal(tails["triton"].cpu(), tails["torch"])
        _assert_pooled_close(got, want, magnitude)
        groups = iter(got.cpu())
        for r, n in enumerate(lengths):
            for j in range(done[r] // 2, (done[r] + n) // 2):
                chunked[(r, j)] = next(groups)
            done[r] += n
    whole = [SegmentSpec(slots[r], 0, done[r]) for r in range(3)]
    plan = build_step_addresses(whole, page_tables, shape).compression[2]
    v = torch.cat([v_seq[r, : done[r]] for r in range(3)]).to(DEVICE)
    gate = torch.cat([g_seq[r, : done[r]] for r in range(3)]).to(DEVICE)
    fresh_tails = torch.zeros(4, 2, dim, device=DEVICE)
    one_call = TritonKernels().pool_ratio2(v, gate, move_tensors(plan, DEVICE), fresh_tails).cpu()
    assert torch.equal(torch.stack([chunked[(r, j)] for r in range(3) for j in range(done[r] // 2)]), one_call)

    padded = dataclasses.replace(
        plan,
        first_rows=torch.cat((plan.first_rows, torch.tensor([NO_ROW]))),
        first_tail_slots=torch.cat((plan.first_tail_slots, torch.tensor([1]))),
        second_rows=torch.cat((plan.second_rows, torch.tensor([NO_ROW]))),
        tail_write_rows=torch.tensor([0]),
        tail_write_slots=torch.tensor([NO_ROW]),
    )
    before = tails["triton"].clone()
    got = TritonKernels().pool_ratio2(v, gate, move_tensors(padded, DEVICE), tails["triton"]).cpu()
    assert torch.equal(got[:-1], one_call) and torch.equal(got[-1], torch.zeros(dim))
    assert torch.equal(tails["triton"], before)


class TritonCompressionPath(TorchKernels):
    """The torch backend with the Triton pair pooling and row stores: the whole runtime
    with only these kernels changed."""

    name = "torch+triton-compression"

    def __init__(self) -> None:
        super().__init__()
        self.triton = TritonKernels()

    def pool_ratio2(self, *args: object) -> torch.Tensor:
        return self.triton.pool_ratio2(*args)

    def write_rows(self, *args: object, **kwargs: object) -> None:
        self.triton.write_rows(*args, **kwargs)


@pytest.mark.parametrize(("kv", "index"), [("bf16", "fp8"), ("fp4", "fp4")])
def test_the_runtime_on_the_triton_compression_path_gives_the_torch_tokens(tiny_dir: Path, kv: str, index: str) -> None:
    """A prompt fed in chunks of 3, 1, 6, 5, 2 (pairs split across steps, tails carried)
    through the paged runtime: with the Triton pooling and stores it selects the same
    entries at every layer and position, and its greedy tokens and logits are the torch
    backend's (fp32; logits within 1e-5)."""
    options = engine_options(
        dict(block_size=32, kv_cache_dtype=kv, index_cache_dtype=index, enable_prefix_caching=False, max_num_seqs=2,
             num_pages=4, device=DEVICE)
    )
    params, checkpoint = load_model_params(tiny_dir, dtype=options.dtype, text_only=True)
    params = params.to(DEVICE)
    layout = RankLayout.build(params.config, options)
    prompt = torch.randint(3, 500, (17,), generator=torch.Generator().manual_seed(5)).tolist()
    scores = {}
    for name, kernels in (("torch", TorchKernels()), ("triton", TritonCompressionPath())):
        rank = DPRank(params, layout, 0, None, device=DEVICE, kernels=kernels, batch_invariant=bool(options.batch_invariant))
        engine = Engine(params.config, checkpoint.tokenizer, options, 1, LocalRank(rank))
        scores[name] = engine.prompt_logits(prompt, chunk_sizes=(3, 1, 6, 5, 2))
    for layer, selected in scores["torch"].selections.items():
        assert torch.equal(scores["triton"].selections[layer], selected), f"layer {layer}"
    assert torch.equal(scores["triton"].logits.argmax(-1), scores["torch"].logits.argmax(-1))
    torch.testing.assert_close(scores["triton"].logits, scores["torch"].logits, rtol=1e-5, atol=1e-5)
