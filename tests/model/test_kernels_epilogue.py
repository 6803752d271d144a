"""The fused Triton epilogue (model/kernels/triton/epilogue.py) computes
model/epilogue.py's function at every site that uses it: compiled on a GPU when one is
present, else under TRITON_INTERPRET=1 on the CPU (tests/conftest.py sets it). The
torch reference runs in the batch-invariant mode on the kernels' device (model/formats.py's
roundings, which are bit arithmetic, on the CPU).

The RoPE rotation and the FP8 / MXFP4 roundings are the torch path's bits (compared as
bit patterns, so -0 is not +0): the rope at both of V4.1's rope kinds (no YaRN, and
YaRN at theta 160000), forward and inverse, at positions up to 2^20; the roundings on
values at every grid's ties, below the amax floors, past saturation, signed zeros and
huge values. The RMSNorm's mean of squares is a row reduction in the kernel's own order:
where every order sums exactly, each site's whole chain is the torch path's bits; on
random rows the normed values are held to the bound measured below, and a norm followed
by a rounding is the kernel's own rounding of its own normed rows, bit for bit. A row's
result does not depend on the other rows of the call, nor on how many rows a program
takes.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.epilogue import Epilogue, apply_epilogue
from dsv41.model.formats import round_fp8, round_mxfp4
from dsv41.model.linalg import batch_invariant
from dsv41.model.rope import Rope

pytest.importorskip("triton")

from dsv41.model.kernels.triton.epilogue import MIN_PROGRAMS, ROW_BLOCK_CHOICES, fused_epilogue, row_blocks  # noqa: E402  (needs triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLASH = V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True)
EPS = FLASH.rms_norm_eps
# The normed rows' bound in float32 ulps of the larger magnitude: about twice the worst
# measured, 3.35, over 6 seeds of 200 rows at widths 32 to 1280, fp32 and bf16 inputs,
# each row at its own magnitude (CPU, interpreter, 2026-12-02); a bf16 output is then
# within one bf16 step.
NORM_ULPS = 7.0
ROWS = 7

# Each site as x's shape after its projection (heads, width) and its epilogue: V4.1-Flash
# widths, and TINY's 32-channel head whose 16 rope channels share a scale block with the
# unrotated half.
Site = tuple[tuple[int, ...], Callable[[Rope, torch.Tensor], Epilogue]]
SITES: dict[str, Site] = {
    "q_latent": ((FLASH.q_lora_rank,), lambda rope, w: Epilogue(torch.bfloat16, norm=w, eps=EPS)),
    "query": ((8, FLASH.head_dim), lambda rope, w: Epilogue(torch.bfloat16, rope=rope)),
    "window_kv": (
        (FLASH.head_dim,),
        lambda rope, w: Epilogue(torch.bfloat16, norm=w, eps=EPS, rope=rope, round_to="fp8"),
    ),
    "output": ((8, FLASH.head_dim), lambda rope, w: Epilogue(torch.bfloat16, rope=rope, inverse=True)),
    "index_query": ((8, FLASH.index_head_dim), lambda rope, w: Epilogue(torch.float32, rope=rope, round_to="mxfp4")),
    "compressed_kv": ((FLASH.head_dim,), lambda rope, w: Epilogue(torch.float32, norm=w, eps=EPS, rope=rope)),
    "index_keys": (
        (FLASH.index_head_dim,),
        lambda rope, w: Epilogue(torch.bfloat16, norm=w, eps=EPS, rope=rope, round_to="mxfp4"),
    ),
    "tiny_window_kv": ((32,), lambda rope, w: Epilogue(torch.float32, norm=w, eps=1e-6, rope=rope, round_to="fp8")),
}
NORM_SITES = ("q_latent", "window_kv", "compressed_kv", "index_keys", "tiny_window_kv")
PLAIN_SITES = tuple(name for name in SITES if name not in NORM_SITES)
ROPE_KINDS = ("window", "compressed")


def _rope(kind: str, width: int) -> Rope:
    """A window layer's rope (no YaRN) or a compressed layer's (YaRN), on the last 64
    channels (16 of a 32-channel head)."""
    theta, yarn = FLASH.layer_rope(0 if kind == "window" else 3)
    return Rope.build(min(FLASH.qk_rope_head_dim, width // 2), theta, yarn)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    differ = _bits(got) != _bits(want)
    assert not differ.any(), f"{differ.sum().item()} of {differ.numel()} values differ"


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in float32 ulps of the larger magnitude."""
    got, want = got.double().cpu(), want.double().cpu()
    scale = torch.finfo(torch.float32).eps * torch.maximum(got.abs(), want.abs()).clamp_min(1e-300)
    return ((got - want).abs() / scale).max().item()


def _positions(rows: int, g: torch.Generator) -> torch.Tensor:
    """Random positions up to 2^20, the first one 0."""
    positions = torch.randint(0, 1 << 20, (rows,), generator=g)
    positions[0] = 0
    return positions


def _random_rows(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Normal rows, each row at its own magnitude (2^-12 to 2^12)."""
    scale = torch.exp2(torch.randint(-12, 13, (shape[0],) + (1,) * (len(shape) - 1), generator=g).float())
    return torch.randn(shape, generator=g) * scale


def _edge_rows(rows: int, width: int, g: torch.Generator) -> torch.Tensor:
    """[rows, width] fp32 rows whose 32-channel blocks each take one case where a
    rounding can go one code astray: normals at a power-of-two magnitude; E4M3
    midpoints (normal and subnormal) under the exact scale of an amax of 448 * 2^k; E2M1
    midpoints under an amax of 6 * 2^k; an amax a few float32 steps above those (where
    the scale's float32 log2 rounds down); an amax below both floors (1e-30); values
    saturating any grid (1e30); signed zeros among small values; an all-zero block; and
    values halfway between two bf16 numbers."""
    shape = (rows, width // 32, 32)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    power = torch.exp2(torch.randint(-12, 12, (rows, width // 32, 1), generator=g).float())
    base = torch.randn(shape, generator=g)
    e4m3_ties = (1 + (2 * torch.randint(0, 8, shape, generator=g) + 1) / 16) * torch.exp2(
        torch.randint(-6, 8, shape, generator=g).float()
    )
    subnormal_ties = (2 * torch.randint(0, 8, shape, generator=g) + 1) * 2.0**-10
    e4m3_ties = torch.where(torch.rand(shape, generator=g) < 0.3, subnormal_ties, e4m3_ties) * sign
    e4m3_ties[..., 0] = 448.0
    e2m1_ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])[torch.randint(0, 7, shape, generator=g)] * sign
    e2m1_ties[..., 0] = 6.0
    above = base.clone()
    above[..., 0] = torch.where(torch.rand(shape[:2], generator=g) < 0.5, 448.0, 6.0) * (
        1 + torch.randint(1, 6, shape[:2], generator=g) * 2.0**-23
    )
    signed_zeros = torch.where(torch.rand(shape, generator=g) < 0.5, base * 1e-3, -0.0 * sign)
    as_bf16 = base.to(torch.bfloat16).float()
    bf16_ties = as_bf16 + sign * torch.exp2(torch.floor(torch.log2(as_bf16.abs())) - 8)
    cases = torch.stack(
        (
            base * power,
            e4m3_ties * power,
            e2m1_ties * power,
            above * power,
            base * 1e-30,
            base * 1e30,
            signed_zeros,
            torch.zeros(shape).copysign(sign),
            bf16_ties,
        )
    )
    pick = torch.randint(0, cases.shape[0], (1, rows, width // 32, 1), generator=g).expand(1, *shape)
    return torch.gather(cases, 0, pick)[0].reshape(rows, width)


def _spec_on(spec: Epilogue, device: str) -> Epilogue:
    norm = None if spec.norm is None else spec.norm.to(device)
    rope = None if spec.rope is None else Rope(spec.rope.rope_dim, spec.rope.inv_freq.to(device))
    return Epilogue(spec.out_dtype, norm=norm, eps=spec.eps, rope=rope, inverse=spec.inverse, round_to=spec.round_to)


def _on(positions: torch.Tensor | None) -> torch.Tensor | None:
    return None if positions is None else positions.to(DEVICE)


def _torch(x: torch.Tensor, spec: Epilogue, positions: torch.Tensor | None) -> torch.Tensor:
    """The torch path on the kernels' device: a GPU's cos, sin, rsqrt and mean round as
    CUDA's do, not as the CPU's."""
    with batch_invariant(True):
        return apply_epilogue(x.to(DEVICE), _spec_on(spec, DEVICE), _on(positions))


def _fused(x: torch.Tensor, spec: Epilogue, positions: torch.Tensor | None, block_r: int | None = None) -> torch.Tensor:
    return fused_epilogue(x.to(DEVICE), _spec_on(spec, DEVICE), _on(positions), block_r=block_r)


@pytest.mark.parametrize("rope_kind", ROPE_KINDS)
@pytest.mark.parametrize("site", PLAIN_SITES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_rope_and_rounding_are_the_torch_bits(site: str, rope_kind: str, dtype: torch.dtype) -> None:
    """The sites without a norm (the query, the output's inverse rotation, the index
    query): random rows and edge rows, fp32 and bf16 projections, bit for bit."""
    g = torch.Generator().manual_seed(len(site) * 7 + len(rope_kind))
    shape, make = SITES[site]
    spec = make(_rope(rope_kind, shape[-1]), torch.ones(shape[-1]))
    edges = _edge_rows(ROWS * shape[0] if len(shape) == 2 else ROWS, shape[-1], g).reshape(ROWS, *shape)
    for x in (_random_rows((ROWS, *shape), g), edges):
        positions = _positions(ROWS, g)
        _assert_same_bits(_fused(x.to(dtype), spec, positions), _torch(x.to(dtype), spec, positions))


@pytest.mark.parametrize("round_to", ["fp8", "mxfp4"])
@pytest.mark.parametrize(("dtype", "out_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.bfloat16)])
def test_the_fused_roundings_are_the_formats_bits_on_edge_values(
    round_to: str, dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    """A rounding alone, [T, D] and [T, H, D], at widths 512, 128 and 96 (padded to a
    power of two in the kernel): model/formats.round_fp8 / round_mxfp4 of the fp32
    values, then the output dtype, bit for bit."""
    g = torch.Generator().manual_seed(11 if round_to == "fp8" else 12)
    rounding = {"fp8": round_fp8, "mxfp4": round_mxfp4}[round_to]
    spec = Epilogue(out_dtype, round_to=round_to)
    for shape in ((40, 512), (40, 128), (40, 96), (10, 4, 128)):
        x = _edge_rows(shape[0], shape[-1] * (shape[1] if len(shape) == 3 else 1), g).reshape(shape).to(dtype)
        _assert_same_bits(_fused(x, spec, None), rounding(x.float()).to(out_dtype))


@pytest.mark.parametrize("rope_kind", ROPE_KINDS)
@pytest.mark.parametrize("site", NORM_SITES)
def test_the_fused_norm_sites_are_the_torch_bits_where_the_mean_of_squares_is_exact(site: str, rope_kind: str) -> None:
    """Rows of quarters in [-2, 2] (squares on a grid of 1/16 whose every partial sum
    over 1280 channels is a float32 exactly) with some all-zero rows: the mean of
    squares is the same in any order, and then every site with a norm (the q latent,
    the window KV, the compressor's latent and index keys) is the torch path's bits,
    from bf16 and fp32 projections."""
    g = torch.Generator().manual_seed(len(site) * 5 + len(rope_kind))
    shape, make = SITES[site]
    spec = make(_rope(rope_kind, shape[-1]), torch.randn(shape[-1], generator=g))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randint(-8, 9, (ROWS, *shape), generator=g) / 4
        x[1] = 0.0
        positions = _positions(ROWS, g)
        _assert_same_bits(_fused(x.to(dtype), spec, positions), _torch(x.to(dtype), spec, positions))


@pytest.mark.parametrize("site", NORM_SITES)
def test_the_fused_norm_is_within_its_bound_and_the_rest_is_exact_on_its_rows(site: str) -> None:
    """Random rows at their own magnitudes: the normed rows (fp32) within NORM_ULPS of
    the torch path's; every site's whole chain is, bit for bit, the fused rest of it
    (rope, rounding, output dtype: the torch path's bits, the tests above) on the fused
    normed rows. (The ulps are not measured after the rope: a rotation that cancels
    makes a small value of two ulp-close ones.)"""
    g = torch.Generator().manual_seed(len(site))
    shape, make = SITES[site]
    spec = make(_rope("compressed", shape[-1]), torch.randn(shape[-1], generator=g))
    rest = Epilogue(spec.out_dtype, rope=spec.rope, inverse=spec.inverse, round_to=spec.round_to)
    for dtype in (torch.float32, torch.bfloat16):
        x = _random_rows((ROWS * 4, *shape), g).to(dtype)
        positions = _positions(ROWS * 4, g)
        norm_only = Epilogue(torch.float32, norm=spec.norm, eps=spec.eps)
        normed = _fused(x, norm_only, positions)
        assert _ulps(normed, _torch(x, norm_only, positions)) <= NORM_ULPS
        _assert_same_bits(_fused(x, spec, positions), _fused(normed, rest, positions))


def test_a_rows_fused_epilogue_does_not_depend_on_the_call() -> None:
    """Each site's epilogue gives a row (and its heads) the same bits in a call of 40
    rows, of 3 rows and of that row alone, with one row per program and with the
    default rows per program."""
    g = torch.Generator().manual_seed(3)
    rows = 40
    for site, (shape, make) in SITES.items():
        spec = make(_rope("compressed", shape[-1]), torch.randn(shape[-1], generator=g))
        x = _random_rows((rows, *shape), g).to(torch.bfloat16)
        positions = _positions(rows, g)
        whole = _fused(x, spec, positions)
        for pick in (torch.tensor([5, 17, 39]), torch.tensor([17])):
            for block_r in (None, 1):
                part = _fused(x[pick], spec, positions[pick], block_r=block_r)
                _assert_same_bits(part, whole[pick.to(whole.device)])


def test_a_program_taking_several_heads_of_a_token_gives_each_row_its_bits() -> None:
    """The sites with heads (8 here): programs of 2, 4 and 8 one-row blocks of one
    token, whose cos and sin are computed once, give every row the bits of one row a
    program; blocks that would cross a token are refused. ``row_blocks`` takes them
    only with a rope, within a token's heads, and while the launch keeps MIN_PROGRAMS."""
    g = torch.Generator().manual_seed(4)
    for site in ("query", "output", "index_query"):
        shape, make = SITES[site]
        spec = make(_rope("compressed", shape[-1]), torch.ones(shape[-1]))
        x = _random_rows((ROWS, *shape), g).to(torch.bfloat16)
        positions = _positions(ROWS, g)
        one = fused_epilogue(x.to(DEVICE), _spec_on(spec, DEVICE), _on(positions), block_r=1, blocks=1)
        for blocks in (2, 4, 8):
            got = fused_epilogue(x.to(DEVICE), _spec_on(spec, DEVICE), _on(positions), block_r=1, blocks=blocks)
            _assert_same_bits(got, one)
        with pytest.raises(ValueError, match="a divisor of the 8 heads"):
            fused_epilogue(x.to(DEVICE), _spec_on(spec, DEVICE), _on(positions), block_r=1, blocks=3)
    assert row_blocks(4096 * 64, 64, 1, rope=True) == ROW_BLOCK_CHOICES[0]
    assert row_blocks(128 * 64, 64, 1, rope=True) == 8
    assert row_blocks(64, 64, 1, rope=True) == 1
    assert row_blocks(4096 * 64, 64, 1, rope=False) == 1
    assert row_blocks(4096 * 6, 6, 1, rope=True) == 2
    assert row_blocks(MIN_PROGRAMS * 16, 1, 1, rope=True) == 1


def test_an_epilogue_refuses_what_no_backend_computes_alike() -> None:
    """Each refusal names the field or argument and what is allowed."""
    rope = Rope.build(16, 1e4, None)
    with pytest.raises(ValueError, match="Epilogue.round_to: 'nvfp4'"):
        Epilogue(torch.float32, round_to="nvfp4")
    with pytest.raises(ValueError, match="Epilogue.inverse"):
        Epilogue(torch.float32, inverse=True)
    with pytest.raises(ValueError, match="Epilogue.out_dtype"):
        Epilogue(torch.float16)
    with pytest.raises(ValueError, match="Epilogue.norm"):
        Epilogue(torch.float32, norm=torch.ones(32), eps=0.0)
    x = torch.zeros(3, 48)
    for spec, positions, match in (
        (Epilogue(torch.float32, round_to="fp8"), None, "not a multiple of fp8's block 32"),
        (Epilogue(torch.float32, rope=rope), None, "positions: None"),
        (Epilogue(torch.float32, rope=rope), torch.zeros(2, dtype=torch.long), r"positions: \(2,\)"),
        (Epilogue(torch.float32, norm=torch.ones(32), eps=1e-6), None, "spec.norm: 32 channels"),
    ):
        for run in (apply_epilogue, fused_epilogue):
            with pytest.raises(ValueError, match=match):
                run(x, spec, positions)
