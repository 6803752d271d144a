"""model/linalg.py's batch-invariant mode: a row's (or an element's) result does not
depend on the other rows of the call, their number or its position among them.

Each property is checked on the default kernels of whatever CPU runs the suite;
tests/cluster/test_isa_parity.py reruns the end-to-end parity under each instruction
set the CPU has. Outside the mode every function is the plain torch call, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv41.model.linalg import (
    KEY_TILE,
    ROW_TILE,
    batch_invariant,
    batched_matmul,
    batch_invariant_enabled,
    grouped_linear,
    linear,
    ordered_sum,
    pointwise,
    tiled_dots,
)

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 15, 16, 17, 31, 33, 64, 100)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(64, 32), (96, 200), (512, 64), (96, 1), (64, 3)])
def test_a_projected_row_is_the_same_in_every_call(dtype: torch.dtype, k: int, n: int) -> None:
    """linear: every row of a call of any size, at any position, equals that row
    projected alone."""
    weight = torch.randn(n, k, generator=_generator(0)).to(dtype)
    rows = torch.randn(max(ROW_COUNTS) + 9, k, generator=_generator(1)).to(dtype)
    with batch_invariant(True):
        alone = torch.cat([linear(rows[i : i + 1], weight) for i in range(rows.shape[0])])
        for count in ROW_COUNTS:
            for start in (0, 9):
                assert torch.equal(linear(rows[start : start + count], weight), alone[start : start + count]), count


def test_outside_the_mode_every_function_is_the_plain_call() -> None:
    """With the mode off, linear / grouped_linear / tiled_dots / pointwise are the torch
    expressions they replace."""
    x = torch.randn(5, 3, 16, generator=_generator(2))
    w = torch.randn(3, 8, 16, generator=_generator(3))
    keys = torch.randn(5, 11, 16, generator=_generator(4))
    assert not batch_invariant_enabled()
    assert torch.equal(linear(x[:, 0], w[0]), x[:, 0] @ w[0].t())
    assert torch.equal(grouped_linear(x, w), torch.einsum("tgi,goi->tgo", x, w))
    assert torch.equal(tiled_dots(x, keys), torch.einsum("thd,tcd->thc", x, keys))
    assert torch.equal(batched_matmul(x, keys), torch.bmm(x, keys.transpose(1, 2)))
    assert torch.equal(pointwise(torch.exp, x), torch.exp(x))


def test_grouped_projection_is_each_group_alone() -> None:
    """grouped_linear in the mode: group g of a row is linear(row's group g, w[g])."""
    x = torch.randn(23, 4, 32, generator=_generator(5))
    w = torch.randn(4, 16, 32, generator=_generator(6))
    with batch_invariant(True):
        got = grouped_linear(x, w)
        for g in range(4):
            assert torch.equal(got[:, g], linear(x[:, g], w[g]))
        assert torch.equal(grouped_linear(x[7:8], w), got[7:8])


@pytest.mark.parametrize("count", [1, 2, KEY_TILE - 1, KEY_TILE, KEY_TILE + 1, 150])
def test_a_keys_dot_product_does_not_depend_on_the_other_keys(count: int) -> None:
    """tiled_dots: the dots of a row's heads with key c are the same whether the call
    scores c keys or more, per-row keys or one shared set."""
    q = torch.randn(6, 16, 32, generator=_generator(7))
    keys = torch.randn(6, 160, 32, generator=_generator(8))
    with batch_invariant(True):
        everything = tiled_dots(q, keys)
        assert torch.equal(tiled_dots(q, keys[:, :count]), everything[:, :, :count])
        assert torch.equal(tiled_dots(q[2:3], keys[2:3, :count]), everything[2:3, :, :count])
        shared = keys[0, :count]
        assert torch.equal(tiled_dots(q, shared.unsqueeze(0).expand(6, -1, -1)), tiled_dots(q, keys[:1, :count].expand(6, -1, -1)))


@pytest.mark.parametrize(("m", "n", "k"), [(64, 160, 512), (64, 512, 160), (4, 3, 16)])
def test_a_rows_own_product_does_not_depend_on_the_batch(m: int, n: int, k: int) -> None:
    """batched_matmul (the attention's per-row products, at Flash widths among others):
    an item's a[i] @ b[i].T is the same in a batch of one or of many, at any place in
    it, with b a transposed view as the values product passes; it is the product."""
    a = torch.randn(12, m, k, generator=_generator(13))
    values = torch.randn(12, k, n, generator=_generator(14))
    for b in (torch.randn(12, n, k, generator=_generator(15)), values.transpose(1, 2)):
        with batch_invariant(True):
            alone = torch.cat([batched_matmul(a[i : i + 1], b[i : i + 1]) for i in range(12)])
            for count, start in ((2, 0), (3, 5), (12, 0)):
                assert torch.equal(batched_matmul(a[start : start + count], b[start : start + count]), alone[start : start + count])
        torch.testing.assert_close(alone, a @ b.transpose(1, 2), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "fn", [torch.exp, torch.sigmoid, F.silu, F.softplus, torch.cos, torch.sin], ids=lambda f: f.__name__
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_elements_transcendental_does_not_depend_on_the_tensor_size(fn, dtype: torch.dtype) -> None:
    """pointwise: an element's fn value is the same in a tensor of any size and at any
    offset (ATen computes a tensor's last few elements with the scalar function)."""
    values = torch.randn(300, generator=_generator(9), dtype=torch.float64).to(dtype) * 4
    with batch_invariant(True):
        whole = pointwise(fn, values)
        for size in (1, 3, 7, 16, 17, 33, 63, 65, 129):
            for start in (0, 5):
                assert torch.equal(pointwise(fn, values[start : start + size]), whole[start : start + size]), size
        assert torch.equal(pointwise(fn, values.view(30, 10)[:, :3]), whole.view(30, 10)[:, :3])


def test_ordered_sum_adds_first_to_last() -> None:
    """ordered_sum is ((a + b) + c) + d, not any other association."""
    a, b, c, d = (torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0))
    assert ordered_sum([a, b, c, d]).item() == ((a + b) + c + d).item() == 1.0
    assert ordered_sum([a, c, b, d]).item() == 2.0


def test_the_mode_is_per_thread_and_restored() -> None:
    """batch_invariant sets this thread's mode for the block and restores the previous
    one after it, also on an error."""
    with batch_invariant(True):
        assert batch_invariant_enabled()
        with pytest.raises(RuntimeError):
            with batch_invariant(False):
                assert not batch_invariant_enabled()
                raise RuntimeError("inside")
        assert batch_invariant_enabled()
    assert not batch_invariant_enabled()
    assert ROW_TILE > 3, "MKL's 1-3-row kernels must never see a tile"


def test_triton_fixed_tile_gemm_is_the_matmul_and_a_rows_bits_are_its_own() -> None:
    """The GPU mode's GEMM, run here by Triton's interpreter, is the matmul to fp32
    rounding at edge shapes, in one walk over K or cut into splits; and a row's bits are
    the same alone as at any place in a call of up to 70 rows (the interpreted dots sum
    each output in K order, dots.ieee_dot, so this holds whatever BLAS numpy has; on a
    GPU tests/model/test_gpu_runtime.py checks it of the tensor-core dots), for fp32
    and bf16 operands."""
    pytest.importorskip("triton")
    from dsv41.model.kernels.triton.gemm import fixed_tile_matmul, plan_k_splits

    weight = torch.randn(70, 200, generator=_generator(10))
    rows = torch.randn(70, 200, generator=_generator(11))
    # programs 1: K in one walk; 4 and 16: cut into 2 and 7 splits (plan_k_splits),
    # summed in split order.
    for programs, splits in ((1, 1), (4, 2), (16, 7)):
        assert plan_k_splits(70, 200, torch.float32, programs) == splits
        alone = torch.cat([fixed_tile_matmul(rows[i : i + 1], weight, programs=programs) for i in range(70)])
        for count in (1, 33, 70):
            got = fixed_tile_matmul(rows[:count], weight, programs=programs)
            torch.testing.assert_close(got, rows[:count] @ weight.t(), rtol=1e-5, atol=1e-5)
            assert torch.equal(got, alone[:count])
        assert torch.equal(fixed_tile_matmul(rows[37:70], weight, programs=programs), alone[37:70])
    half_rows, half_weight = rows.bfloat16(), weight.bfloat16()
    alone = torch.cat([fixed_tile_matmul(half_rows[i : i + 1], half_weight) for i in range(70)])
    assert torch.equal(fixed_tile_matmul(half_rows, half_weight), alone)
    assert fixed_tile_matmul(rows[:0], weight).shape == (0, 70)


def test_triton_batched_fixed_tile_gemm_is_each_items_matmul() -> None:
    """The GPU mode's per-row products (interpreted here): each item of a batch gets its
    own a[i] @ b[i].T, the same bits whatever the batch's size or the item's place, for
    a contiguous b, a transposed view (the attention's values) and one b shared by every
    item (an expanded view)."""
    pytest.importorskip("triton")
    from dsv41.model.kernels.triton.gemm import fixed_tile_matmul

    a = torch.randn(5, 40, 48, generator=_generator(16))
    values = torch.randn(5, 48, 70, generator=_generator(17))
    shared = torch.randn(70, 48, generator=_generator(18))
    for b in (values.transpose(1, 2).contiguous(), values.transpose(1, 2), shared.expand(5, -1, -1)):
        whole = fixed_tile_matmul(a, b)
        torch.testing.assert_close(whole, a @ b.transpose(1, 2), rtol=1e-5, atol=1e-5)
        for start, count in ((0, 1), (3, 2)):
            assert torch.equal(fixed_tile_matmul(a[start : start + count], b[start : start + count]), whole[start : start + count])
    assert fixed_tile_matmul(a[:0], values[:0].transpose(1, 2)).shape == (0, 40, 70)


def test_triton_row_sum_rows_do_not_depend_on_the_call() -> None:
    """The GPU mode's row reduction (interpreted here): a row's sum is the same in a
    call of any size, and is the sum to fp32 rounding."""
    pytest.importorskip("triton")
    from dsv41.model.kernels.triton.reduce import row_sum

    x = torch.randn(9, 2500, generator=_generator(12))
    whole = row_sum(x)
    for count in (1, 2, 9):
        assert torch.equal(row_sum(x[:count]), whole[:count])
    torch.testing.assert_close(whole, x.sum(-1), rtol=1e-5, atol=1e-4)
