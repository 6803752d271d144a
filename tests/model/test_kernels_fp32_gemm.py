"""model/kernels/triton/fp32_gemm.py under the interpreter: the split fp32 GEMM.

Properties: the three-way bf16 split is exact (a product with one-hot rows returns the
other operand's fp32 values bit for bit, through both accumulators); the product is the
float64 one within fp32's rounding bound for a K-term sum, at edge shapes and strided
operands; a row's bits do not depend on the call at the mode's fixed row block (the
interpreted dot sums each output's products in K order: dots.ieee_dot); the row block
follows the batch-invariant mode. On the GPU (tensor-core dots)
tests/model/test_gpu_runtime.py checks the same independence and the accuracy against
cuBLAS's fp32 GEMM.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsv41.model.kernels.triton.fp32_gemm import INVARIANT_ROWS, ROW_BLOCKS, row_block, split_fp32_matmul  # noqa: E402

UNIT = 2.0**-24


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _wide_range(rows: int, cols: int, seed: int) -> torch.Tensor:
    """fp32 values over many binades (2^-40 to 2^40), with every mantissa bit used."""
    g = _generator(seed)
    return torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-40, 41, (rows, cols), generator=g).float())


def test_the_split_is_exact_through_both_accumulators() -> None:
    """x @ I and I @ w: each output is one product with 1.0, split into hi (main
    accumulator) and mid + lo (the small one); their sum is the fp32 value exactly."""
    w = _wide_range(70, 130, 1)
    x = _wide_range(33, 130, 2)
    eye = torch.eye(130)
    assert torch.equal(split_fp32_matmul(eye, w), w.t())
    assert torch.equal(split_fp32_matmul(x, eye), x)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (1, 130, 200), (17, 129, 63), (70, 200, 130), (33, 5, 257)])
def test_the_product_is_float64s_within_fp32_rounding(m: int, n: int, k: int) -> None:
    """|got - exact| <= (k + 2) * 2^-24 * sum_k |x||w|: the deterministic bound of an
    fp32 sum of k products, with the dropped products' 2^-25 and the accumulators'
    final add inside it; and no further from float64 in norm than torch's fp32 matmul
    is, times two."""
    x = torch.randn(m, k, generator=_generator(m + k))
    w = torch.randn(n, k, generator=_generator(n * k))
    got = split_fp32_matmul(x, w)
    exact = x.double() @ w.double().t()
    bound = (k + 2) * UNIT * (x.double().abs() @ w.double().abs().t())
    assert bool(((got.double() - exact).abs() <= bound).all())
    torch_error = float(((x @ w.t()).double() - exact).norm())
    assert float((got.double() - exact).norm()) <= 2 * torch_error + 1e-30


def test_a_rows_product_does_not_depend_on_the_call() -> None:
    """At the mode's row block a row's bits are the same alone, among 3 rows and among
    100 (two row blocks), at any position."""
    w = torch.randn(150, 96, generator=_generator(7))
    x = torch.randn(100, 96, generator=_generator(8))
    whole = split_fp32_matmul(x, w)
    for pick in (torch.tensor([5]), torch.tensor([99, 0, 64]), torch.arange(37, 100)):
        assert torch.equal(split_fp32_matmul(x[pick], w), whole[pick])


def test_strided_operands_are_read_as_their_values() -> None:
    """A transposed weight view and a row-strided block give the contiguous copies'
    bits."""
    w_t = torch.randn(96, 150, generator=_generator(5)).t()
    x = torch.randn(40, 192, generator=_generator(6))[:, ::2]
    assert torch.equal(split_fp32_matmul(x, w_t), split_fp32_matmul(x.contiguous(), w_t.contiguous()))


def test_empty_calls_and_bad_operands() -> None:
    """No rows or no weight rows: an empty [M, N]; K of zero: zeros. Mixed dtypes and
    mismatched shapes are refused with the allowed forms named."""
    w = torch.randn(10, 8)
    assert split_fp32_matmul(torch.randn(0, 8), w).shape == (0, 10)
    assert split_fp32_matmul(torch.randn(3, 8), w[:0]).shape == (3, 0)
    assert torch.equal(split_fp32_matmul(torch.randn(3, 0), torch.randn(10, 0)), torch.zeros(3, 10))
    with pytest.raises(ValueError, match="allowed: both torch.float32"):
        split_fp32_matmul(torch.randn(3, 8).bfloat16(), w)
    with pytest.raises(ValueError, match=r"allowed: \[M, K\] and \[N, K\]"):
        split_fp32_matmul(torch.randn(3, 9), w)


def test_the_row_block_is_fixed_in_the_mode_and_follows_the_rows_outside_it() -> None:
    """In the batch-invariant mode every call runs INVARIANT_ROWS-row blocks; outside
    it, the narrowest block holding the rows (the widest beyond)."""
    assert {row_block(m, True) for m in (1, 16, 17, 128, 4096)} == {INVARIANT_ROWS}
    assert [row_block(m, False) for m in (1, 16, 17, 32, 33, 64, 65, 128, 4096)] == [16, 16, 32, 32, 64, 64, 64, 64, 64]
    assert ROW_BLOCKS == tuple(sorted(ROW_BLOCKS)) and ROW_BLOCKS[0] >= 16
