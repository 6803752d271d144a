"""On a GPU: the whole paged runtime with the Triton kernels reproduces the torch
backend's greedy tokens and the dense reference's logits (fp32, tiny checkpoint).
Skipped where no GPU is present (CI); run on the device machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.reference import ReferenceModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (300, 45, 130)]


def test_triton_on_gpu_reproduces_torch_tokens(tiny_dir: Path) -> None:
    """Chunked prefill (64-token budget) and decode of three prompts at once: the
    Triton backend on the GPU, the torch backend on the GPU and the torch backend on
    the CPU give the same greedy tokens."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for device, backend in (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton")):
        engine = Engine.from_pretrained(
            tiny_dir, block_size=32, max_num_batched_tokens=64, device=device, kernel_backend=backend,
            enable_prefix_caching=False,
        )
        tokens[(device, backend)] = [o.token_ids for o in engine.generate(_prompts(), params)]
    assert tokens[("cuda", "triton")] == tokens[("cuda", "torch")] == tokens[("cpu", "torch")]


@pytest.mark.parametrize(("kv", "index"), [("bf16", "fp8"), ("fp4", "fp4")])
def test_triton_on_gpu_matches_torch_and_the_reference(tiny_dir: Path, kv: str, index: str) -> None:
    """Paged logits and selections on the GPU (chunks 3/1/129/7/128): the Triton
    kernels equal the torch backend on the same GPU and the CPU dense reference within
    2e-3 (fp32 sums in another order — the kernels' dots, cuBLAS, the CPU BLAS — differ
    by ~1e-6 at first, which ten random-weight layers amplify to ~1e-3, measured on an
    H200 on 2026-11-30); every top-k selection must still be equal."""
    prompt = _prompts()[0]
    scores = {}
    for backend in ("torch", "triton"):
        engine = Engine.from_pretrained(
            tiny_dir, block_size=32, device="cuda", kernel_backend=backend, kv_cache_dtype=kv,
            index_cache_dtype=index, enable_prefix_caching=False,
        )
        scores[backend] = engine.prompt_logits(prompt, chunk_sizes=(3, 1, 129, 7, 128))
    reference = ReferenceModel(engine.params.to("cpu")).forward(prompt)
    torch.testing.assert_close(scores["triton"].logits, scores["torch"].logits, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(scores["triton"].logits, reference.logits, rtol=2e-3, atol=2e-3)
    for layer, selected in reference.selections.items():
        assert torch.equal(scores["triton"].selections[layer], selected), f"layer {layer}"
        assert torch.equal(scores["torch"].selections[layer], selected), f"layer {layer}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fixed_tile_gemm_rows_do_not_depend_on_the_call(dtype: torch.dtype) -> None:
    """The batch-invariant GEMM on the GPU (K cut into splits, rows beyond one launch's
    SPLIT_ROWS): a row of a call of any size, at any position, equals that row
    projected alone; the product is the matmul's to the
    dtype's rounding (bf16 inputs; fp32: rounding of a sum of K = 4096 products, about
    sqrt(K) * 2**-24 = 4e-6 relative; 1.15e-6 measured on an H200, 2026-12-02)."""
    from dsv41.model.kernels.triton.gemm import fixed_tile_matmul, plan_k_splits

    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(1000, 4096, generator=g, device="cuda").to(dtype)
    rows = torch.randn(1100, 4096, generator=g, device="cuda").to(dtype)
    assert plan_k_splits(1000, 4096, dtype, 264) > 1, "K is cut into splits here"
    alone = torch.cat([fixed_tile_matmul(rows[i : i + 1], weight) for i in range(40)])
    # 1,100 rows: more than one launch's SPLIT_ROWS.
    for count, start in ((1, 0), (3, 0), (40, 0), (299, 1), (1100, 0)):
        got = fixed_tile_matmul(rows[start : start + count], weight)
        keep = min(count, 40 - start)
        assert torch.equal(got[:keep], alone[start : start + keep]), (count, start)
    want = rows.double() @ weight.double().t()
    error = float((fixed_tile_matmul(rows, weight).double() - want).norm() / want.norm())
    assert error < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_split_fp32_gemm_rows_do_not_depend_on_the_call_and_keep_fp32_accuracy() -> None:
    """The split fp32 GEMM on tensor cores (the head's shape cut to 3,000 vocabulary
    rows): in the batch-invariant mode a row of a call of any size, at any position,
    equals that row alone; every element is within the fp32 bound of a K-term sum of
    the float64 product, and the whole is no further from it in norm than cuBLAS's
    FP32 GEMM, times 1.5."""
    from dsv41.model.kernels.triton.fp32_gemm import split_fp32_matmul

    g = torch.Generator(device="cuda").manual_seed(3)
    k = 5120
    weight = torch.randn(3000, k, generator=g, device="cuda") * k**-0.5
    rows = torch.randn(300, k, generator=g, device="cuda")
    alone = torch.cat([split_fp32_matmul(rows[i : i + 1], weight) for i in range(40)])
    for count, start in ((1, 0), (3, 0), (40, 0), (129, 1), (300, 0)):
        got = split_fp32_matmul(rows[start : start + count], weight)
        keep = min(count, 40 - start)
        assert torch.equal(got[:keep], alone[start : start + keep]), (count, start)
    exact = rows.double() @ weight.double().t()
    bound = (k + 2) * 2.0**-24 * (rows.double().abs() @ weight.double().abs().t())
    for row_invariant in (True, False):
        got = split_fp32_matmul(rows, weight, row_invariant=row_invariant).double()
        assert bool(((got - exact).abs() <= bound).all())
        ratio = float((got - exact).norm()) / float(((rows @ weight.t()).double() - exact).norm())
        assert ratio <= 1.5, f"the split GEMM's error is {ratio:.2f}x cuBLAS FP32's"


def test_an_fp32_projection_runs_the_split_gemm_through_a_wide_weight_up_to_its_rows() -> None:
    """linear() on the GPU: an fp32 projection through a weight of
    SPLIT_FP32_MIN_WEIGHT_ROWS rows is the split GEMM's up to SPLIT_FP32_ROWS rows (row
    block by the rows) and cuBLAS's beyond, and in the batch-invariant mode the split
    GEMM's at its fixed row block whatever the rows; through a narrower weight it is
    cuBLAS's, and in the mode the fixed-tile GEMM's."""
    from dsv41.model.kernels.triton.fp32_gemm import split_fp32_matmul
    from dsv41.model.kernels.triton.gemm import fixed_tile_matmul
    from dsv41.model.linalg import SPLIT_FP32_MIN_WEIGHT_ROWS, SPLIT_FP32_ROWS, batch_invariant, linear

    g = torch.Generator(device="cuda").manual_seed(4)
    wide = torch.randn(SPLIT_FP32_MIN_WEIGHT_ROWS, 256, generator=g, device="cuda")
    narrow = wide[: SPLIT_FP32_MIN_WEIGHT_ROWS - 1]
    rows = torch.randn(SPLIT_FP32_ROWS + 1, 256, generator=g, device="cuda")
    few = rows[:SPLIT_FP32_ROWS]
    assert torch.equal(linear(few, wide), split_fp32_matmul(few, wide, row_invariant=False))
    assert torch.equal(linear(rows, wide), rows @ wide.t())
    assert torch.equal(linear(few, narrow), few @ narrow.t())
    with batch_invariant(True):
        assert torch.equal(linear(rows, wide), split_fp32_matmul(rows, wide, row_invariant=True))
        assert torch.equal(linear(few, narrow), fixed_tile_matmul(few, narrow))


def test_batched_fixed_tile_gemm_items_do_not_depend_on_the_batch() -> None:
    """The per-row products of the mode on the GPU (attention at Flash widths: 64 heads
    x 512 dims against 640 keys, then the probabilities against the values as a
    transposed view): an item's product is the same alone or among 300, at any place."""
    from dsv41.model.kernels.triton.gemm import fixed_tile_matmul

    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(300, 64, 512, generator=g, device="cuda")
    keys = torch.randn(300, 640, 512, generator=g, device="cuda")
    for a, b in ((q, keys), (torch.softmax(fixed_tile_matmul(q, keys), -1), keys.transpose(1, 2))):
        whole = fixed_tile_matmul(a, b)
        for start, count in ((0, 1), (7, 1), (5, 3), (1, 299)):
            assert torch.equal(fixed_tile_matmul(a[start : start + count], b[start : start + count]), whole[start : start + count])
        want = torch.bmm(a.double(), b.double().transpose(1, 2))
        assert float((whole.double() - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_in_the_mode_equals_the_reference_on_the_gpu(tiny_dir: Path, dtype: torch.dtype) -> None:
    """The torch kernels in the batch-invariant mode on the GPU: paged logits and
    selections of a prompt fed in chunks 3/1/129/7/128 equal the GPU dense reference's
    (in the mode) bit for bit: every product, attention's included, is the fixed-tile
    GEMM on both sides."""
    engine = Engine.from_pretrained(
        tiny_dir, dtype=dtype, block_size=32, device="cuda", kernel_backend="torch", batch_invariant=True,
        enable_prefix_caching=False,
    )
    prompt = _prompts()[0]
    paged = engine.prompt_logits(prompt, chunk_sizes=(3, 1, 129, 7, 128))
    reference = ReferenceModel(engine.params, batch_invariant=True).forward(prompt)
    assert torch.equal(paged.logits, reference.logits.cpu())
    for layer, selected in reference.selections.items():
        assert torch.equal(paged.selections[layer].cpu(), selected.cpu()), f"layer {layer}"


def test_row_sum_rows_do_not_depend_on_the_call() -> None:
    """The batch-invariant row reduction on the GPU: a row's sum is the same in a call
    of 1 row or 4096, and is the sum to fp32 rounding."""
    from dsv41.model.kernels.triton.reduce import row_sum

    x = torch.randn(4096, 16384, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
    whole = row_sum(x)
    for count in (1, 2, 33, 4096):
        assert torch.equal(row_sum(x[:count]), whole[:count])
    torch.testing.assert_close(whole, x.double().sum(-1).float(), rtol=1e-5, atol=1e-3)


def test_batch_invariant_triton_logprobs_do_not_depend_on_the_batch(tiny_dir: Path) -> None:
    """bf16 on the GPU with the Triton kernels in the batch-invariant mode: a request
    scheduled among others (chunked prefill, decoded beside prefills) gets exactly the
    logprobs it gets alone."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    options = dict(
        dtype=torch.bfloat16, device="cuda", kernel_backend="triton", batch_invariant=True, enable_prefix_caching=False
    )
    target = _prompts()[1]
    alone = Engine.from_pretrained(tiny_dir, **options).generate([target], params)[0]
    crowded_engine = Engine.from_pretrained(tiny_dir, max_num_batched_tokens=37, **options)
    crowded = crowded_engine.generate([_prompts()[0], target, _prompts()[2]], params)[1]
    assert crowded.token_ids == alone.token_ids
    assert crowded.logprobs == alone.logprobs
