"""The fused Triton mHC kernels (model/kernels/triton/mhc.py) compute model/mhc.py's
site steps: compiled on a GPU when one is present, else under TRITON_INTERPRET=1 on
the CPU (tests/conftest.py sets it). The torch reference runs in the batch-invariant
mode, on the CPU (the CPU path's arithmetic) or, for the mix, on the kernels' device.

The kernels round every product, quotient and sum of hc terms where torch's ops do, so
where no exp and no long reduction is involved they are the torch path bit for bit:
the expand always; the collapse + RMSNorm and the Sinkhorn on inputs whose exps and
mean of squares every implementation computes exactly. Elsewhere they differ only
through exp (numpy's in the interpreter, torch's own on the CPU) and the order of the
long row reductions (the mix's projection among them), and are held to a few float32
ulps, and the mix to as few from a float64 evaluation as the torch path. A row's result
does not depend on the other rows of the call, nor on how many rows a program takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv41.cluster.engine import Engine
from dsv41.cluster.options import RankLayout, engine_options
from dsv41.cluster.ranks import DPRank, LocalRank
from dsv41.model.config import V41Config
from dsv41.model.kernels.torch_backend import TorchKernels
from dsv41.model.linalg import batch_invariant
from dsv41.model.mhc import TORCH_HC, HcMix, HcSite
from dsv41.model.params import load_model_params

pytest.importorskip("triton")

from dsv41.model.kernels.triton import TritonKernels  # noqa: E402  (needs triton)
from dsv41.model.kernels.triton.mhc import fused_collapse_norm, fused_expand, fused_hc_mix  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROW_COUNTS = (1, 3, 64, 200)
# Bounds in float32 ulps of the larger magnitude: about twice the worst measured over
# these tests' inputs, 12 seeds of 200 rows each on TINY and TINY_ALT, fp32 and bf16
# streams (CPU, interpreter, 2026-12-07): pre 11.2, post 16.2 (an exp's ulps grow with
# the logit's magnitude, and the projection sums its columns in its own order), comb
# 16.8 (carried through 20 Sinkhorn rounds); the collapse + RMSNorm in fp32 3.3 (the
# mean of squares' order, 2026-12-02). Compiled on an H200 against torch's CUDA path,
# before the projection was fused (devrun of 2026-12-02): pre 4.9, post 7.9, comb
# 15.9, norm 2.7.
MIX_ULPS = {"pre": 24.0, "post": 32.0, "comb": 34.0}
# Each path's distance from the mix evaluated in float64, on the same inputs: the torch
# path's worst pre 26.2, post 30.0, comb 39.3 and the fused one's 25.6, 26.7, 41.0 ulps
# (CPU, interpreter, 2026-12-07). Both are held to one bound, about 1.5 times the
# larger: the fused projection's order costs no accuracy.
MIX_FP64_ULPS = {"pre": 40.0, "post": 45.0, "comb": 60.0}
NORM_ULPS = 7.0


@pytest.fixture(scope="module", params=["tiny", "tiny_alt"])
def config(request: pytest.FixtureRequest) -> V41Config:
    """TINY (hc 4, hidden 64) and TINY_ALT (hc 3: a padded stream axis, hidden 96)."""
    return V41Config.from_pretrained(request.getfixturevalue(f"{request.param}_dir"), text_only=True)


def _ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """The largest difference in units of ``dtype``'s epsilon times the larger magnitude."""
    got, want = got.double().cpu(), want.double().cpu()
    scale = torch.finfo(dtype).eps * torch.maximum(got.abs(), want.abs()).clamp_min(1e-300)
    return ((got - want).abs() / scale).max().item()


def _site(config: V41Config, g: torch.Generator) -> HcSite:
    hc, width = config.hc_mult, config.hc_mult * config.hidden_size
    return HcSite(
        fn=torch.randn((2 + hc) * hc, width, generator=g) / width**0.5,
        base=torch.randn((2 + hc) * hc, generator=g),
        scale=torch.rand(3, generator=g) + 0.5,
    )


def _streams(config: V41Config, rows: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random streams, each row at its own magnitude."""
    scale = torch.rand(rows, 1, 1, generator=g) * 4 + 0.01
    return (torch.randn(rows, config.hc_mult, config.hidden_size, generator=g) * scale).to(dtype)


def _mix(config: V41Config, rows: int, g: torch.Generator) -> HcMix:
    hc = config.hc_mult
    return HcMix(
        pre=torch.rand(rows, hc, generator=g) + 0.1,
        post=2 * torch.rand(rows, hc, generator=g),
        comb=torch.rand(rows, hc, hc, generator=g),
    )


def _on(device: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in tensors)


def _site_on(site: HcSite, device: str) -> HcSite:
    return HcSite(*_on(device, site.fn, site.base, site.scale))


def _mix_on(mix: HcMix, device: str) -> HcMix:
    return HcMix(*_on(device, mix.pre, mix.post, mix.comb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_the_fused_expand_is_the_torch_expand(config: V41Config, rows: int, dtype: torch.dtype) -> None:
    """post * y + the comb-weighted streams, summed first to last: bit for bit."""
    g = torch.Generator().manual_seed(rows)
    streams, mix = _streams(config, rows, dtype, g), _mix(config, rows, g)
    y = torch.randn(rows, config.hidden_size, generator=g).to(dtype)
    with batch_invariant(True):
        want = TORCH_HC.hc_expand(streams, y, mix)
    got = fused_expand(*_on(DEVICE, streams, y), _mix_on(mix, DEVICE))
    assert got.dtype == dtype and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_fused_collapse_norm_is_the_torch_one_where_sums_are_exact(
    config: V41Config, dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    """Streams and pre on coarse dyadic grids, so the collapse and the mean of squares
    are exact in any order: then the fused collapse + RMSNorm equals the torch path on
    the same device bit for bit (the rsqrt, the scaling by the norm weight and the
    rounding to the output dtype are torch's there: on a GPU CUDA's rsqrtf, on the CPU
    one over the correctly rounded square root, which differ in the last bits)."""
    g = torch.Generator().manual_seed(7)
    rows, hc = 64, config.hc_mult
    streams = (torch.randint(-8, 9, (rows, hc, config.hidden_size), generator=g) / 4).to(dtype)
    pre = torch.randint(0, 5, (rows, hc), generator=g) / 4
    norm = torch.randn(config.hidden_size, generator=g)
    inputs = _on(DEVICE, streams, pre, norm)
    with batch_invariant(True):
        want = TORCH_HC.hc_collapse_norm(*inputs, config.rms_norm_eps, out_dtype)
    got = fused_collapse_norm(*inputs, config.rms_norm_eps, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_the_fused_collapse_norm_matches_the_torch_one(config: V41Config, rows: int, dtype: torch.dtype) -> None:
    """Random streams: the sublayer input (streams' dtype) within one bf16 step or
    NORM_ULPS float32 ulps, the final hidden (fp32) within NORM_ULPS."""
    g = torch.Generator().manual_seed(rows)
    streams = _streams(config, rows, dtype, g)
    pre = torch.rand(rows, config.hc_mult, generator=g) + 0.1
    norm = torch.randn(config.hidden_size, generator=g)
    for out_dtype in {dtype, torch.float32}:
        with batch_invariant(True):
            want = TORCH_HC.hc_collapse_norm(streams, pre, norm, config.rms_norm_eps, out_dtype)
        got = fused_collapse_norm(*_on(DEVICE, streams, pre, norm), config.rms_norm_eps, out_dtype)
        bound = 1.0 if out_dtype == torch.bfloat16 else NORM_ULPS
        assert got.dtype == out_dtype and _ulps(got, want, out_dtype) <= bound


def test_the_fused_sinkhorn_is_the_torch_one_where_exps_are_exact(config: V41Config) -> None:
    """A zero projection and logits of 0 and -inf only (each comb row keeps at least one
    0), whose exps every implementation computes exactly: the pre and post sigmoids,
    the softmax and all 20 Sinkhorn rounds of row and column sums and divisions equal
    the torch path bit for bit."""
    g = torch.Generator().manual_seed(3)
    rows, hc = 64, config.hc_mult
    streams = _streams(config, rows, torch.float32, g)
    keep = torch.rand(hc, hc, generator=g) < 0.6
    keep[torch.arange(hc), torch.randint(0, hc, (hc,), generator=g)] = True
    comb_base = torch.where(keep, 0.0, float("-inf")).flatten()
    gate_base = torch.where(torch.rand(2 * hc, generator=g) < 0.5, 0.0, float("-inf"))
    site = HcSite(
        fn=torch.zeros((2 + hc) * hc, hc * config.hidden_size),
        base=torch.cat((gate_base, comb_base)),
        scale=torch.rand(3, generator=g) + 0.5,
    )
    with batch_invariant(True):
        want = TORCH_HC.hc_mix(streams, site, config)
        got = fused_hc_mix(streams.to(DEVICE), _site_on(site, DEVICE), config)
    for name in ("pre", "post", "comb"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_the_fused_mix_matches_the_torch_mix(config: V41Config, rows: int, dtype: torch.dtype) -> None:
    """Random streams and site weights: pre, post and the doubly stochastic comb within
    MIX_ULPS of the torch path's on the same device (against the CPU's path a GPU's
    differs by that device's exp too: 24 / 32 / 44 ulps on the H200)."""
    g = torch.Generator().manual_seed(rows)
    streams, site = _streams(config, rows, dtype, g), _site(config, g)
    with batch_invariant(True):
        want = TORCH_HC.hc_mix(streams.to(DEVICE), _site_on(site, DEVICE), config)
        got = fused_hc_mix(streams.to(DEVICE), _site_on(site, DEVICE), config)
    for name, bound in MIX_ULPS.items():
        assert _ulps(getattr(got, name), getattr(want, name)) <= bound, name


def _mix_in_float64(streams: torch.Tensor, site: HcSite, config: V41Config) -> HcMix:
    """model/mhc.hc_mix's arithmetic in float64 (torch's own reductions)."""
    tokens, hc, _ = streams.shape
    flat = streams.reshape(tokens, -1).double()
    m = flat @ site.fn.double().T * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    s = site.scale.double()
    logits = site.base.double() + m * torch.cat((s[0].expand(hc), s[1].expand(hc), s[2].expand(hc * hc)))
    comb = torch.softmax(logits[:, 2 * hc :].reshape(tokens, hc, hc), -1) + config.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + config.hc_eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + config.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + config.hc_eps)
    return HcMix(
        pre=torch.sigmoid(logits[:, :hc]) + config.hc_eps,
        post=2 * torch.sigmoid(logits[:, hc : 2 * hc]),
        comb=comb,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_mix_is_as_close_to_float64_as_the_torch_mix(config: V41Config, dtype: torch.dtype) -> None:
    """200 random rows: the fused mix and the torch path each within MIX_FP64_ULPS of
    the mix evaluated in float64, so the fused projection's summation order (column
    splits, each a tile at a time) is no less accurate than the torch path's GEMM."""
    g = torch.Generator().manual_seed(7)
    streams, site = _streams(config, 200, dtype, g), _site(config, g)
    want = _mix_in_float64(streams, site, config)
    with batch_invariant(True):
        paths = {
            "torch": TORCH_HC.hc_mix(streams.to(DEVICE), _site_on(site, DEVICE), config),
            "fused": fused_hc_mix(streams.to(DEVICE), _site_on(site, DEVICE), config),
        }
    for path, got in paths.items():
        for name, bound in MIX_FP64_ULPS.items():
            assert _ulps(getattr(got, name), getattr(want, name)) <= bound, (path, name)


def test_a_rows_fused_result_does_not_depend_on_the_call(config: V41Config) -> None:
    """Every fused step gives a row the same bits in a call of 200 rows, of 3 rows and
    of that row alone, with one row per program and with the default rows per program
    (each against a call of every row with the same rows per program: on a GPU the
    reduction order may change with the program's rows, never with the call's)."""
    g = torch.Generator().manual_seed(11)
    rows = 200
    streams = _streams(config, rows, torch.bfloat16, g).to(DEVICE)
    site, mix = _site_on(_site(config, g), DEVICE), _mix_on(_mix(config, rows, g), DEVICE)
    y = torch.randn(rows, config.hidden_size, generator=g).to(torch.bfloat16).to(DEVICE)
    norm = torch.randn(config.hidden_size, generator=g).to(DEVICE)

    def steps(pick: torch.Tensor, block_t: int | None) -> list[torch.Tensor]:
        sub = HcMix(mix.pre[pick], mix.post[pick], mix.comb[pick])
        with batch_invariant(True):
            mixed = fused_hc_mix(streams[pick], site, config, block_t=block_t)
        return [
            mixed.pre,
            mixed.post,
            mixed.comb,
            fused_collapse_norm(streams[pick], sub.pre, norm, config.rms_norm_eps, torch.bfloat16, block_t=block_t),
            fused_expand(streams[pick], y[pick], sub, block_t=block_t),
        ]

    for block_t in (None, 1):
        everything = steps(torch.arange(rows, device=DEVICE), block_t)
        for pick in (torch.tensor([5, 100, 199]), torch.tensor([17])):
            for whole, part in zip(everything, steps(pick.to(DEVICE), block_t)):
                assert torch.equal(whole[pick.to(DEVICE)], part)


class TritonMhc(TorchKernels):
    """The torch backend with the fused mHC site steps: the whole runtime with only
    these kernels changed."""

    name = "torch+triton-mhc"

    def __init__(self) -> None:
        super().__init__()
        self.triton = TritonKernels()

    def hc_mix(self, *args: object) -> HcMix:
        return self.triton.hc_mix(*args)

    def hc_collapse_norm(self, *args: object) -> torch.Tensor:
        return self.triton.hc_collapse_norm(*args)

    def hc_expand(self, *args: object) -> torch.Tensor:
        return self.triton.hc_expand(*args)


def test_the_runtime_on_the_fused_mhc_gives_the_torch_logits(tiny_dir: Path) -> None:
    """A prompt fed in chunks of 3, 1, 6, 5, 2 through the paged runtime: with the fused
    mHC it selects the same entries at every layer and position, and its greedy tokens
    and logits are the torch backend's (fp32; logits within 1e-5)."""
    options = engine_options(dict(block_size=32, enable_prefix_caching=False, max_num_seqs=2, num_pages=4,
                                  device=DEVICE))
    params, checkpoint = load_model_params(tiny_dir, dtype=options.dtype, text_only=True)
    params = params.to(DEVICE)
    layout = RankLayout.build(params.config, options)
    prompt = torch.randint(3, 500, (17,), generator=torch.Generator().manual_seed(5)).tolist()
    scores = {}
    for name, kernels in (("torch", TorchKernels()), ("fused", TritonMhc())):
        rank = DPRank(
            params, layout, 0, None, device=DEVICE, kernels=kernels, batch_invariant=bool(options.batch_invariant)
        )
        engine = Engine(params.config, checkpoint.tokenizer, options, 1, LocalRank(rank))
        scores[name] = engine.prompt_logits(prompt, chunk_sizes=(3, 1, 6, 5, 2))
    for layer, selected in scores["torch"].selections.items():
        assert torch.equal(scores["fused"].selections[layer], selected), f"layer {layer}"
    assert torch.equal(scores["fused"].logits.argmax(-1), scores["torch"].logits.argmax(-1))
    torch.testing.assert_close(scores["fused"].logits, scores["torch"].logits, rtol=1e-5, atol=1e-5)
