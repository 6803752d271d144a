"""The FP8-activation mode (model/linalg.py; model/kernels/triton/fp8_rows.py on a
GPU): bf16 rows rounded to the FP8 grid in one launch are formats.round_fp8's bits, and
in the mode every path of ``linear`` / ``grouped_linear`` through an FP8 weight
multiplies the same quantised activations, while plain weights and the mode's absence
keep the compute dtype's. The kernel cases run where the Triton kernels run: on the
CPU interpreter here.
"""

from __future__ import annotations

import pytest
import torch

from dsv41.model import formats
from dsv41.model.linalg import batch_invariant, fp8_activations, fp8_activations_enabled, grouped_linear, linear
from dsv41.model.stored_weights import Fp8Weight

pytest.importorskip("triton")

from dsv41.model.kernels.triton.fp8_rows import round_fp8_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp8_weight(rows: int, cols: int, dtype: torch.dtype, seed: int) -> Fp8Weight:
    generator = torch.Generator().manual_seed(seed)
    values, scale = formats.quantize_fp8_weight(torch.randn(rows, cols, generator=generator) * 0.05)
    return Fp8Weight(values.view(torch.float8_e4m3fn), scale, dtype)


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Rows whose 32-channel groups span many magnitudes, so the groups' scales differ.
    return torch.randn(m, k, generator=generator) * torch.logspace(-3, 2, k // 32).repeat_interleave(32)


@pytest.mark.parametrize(("m", "k"), [(1, 32), (37, 96), (130, 256), (0, 64)])
def test_rounded_rows_are_formats_bits(m: int, k: int) -> None:
    """bf16 rows rounded to the FP8 grid in one launch equal formats.round_fp8's bit for
    bit (the values the GPU's bf16 GEMMs multiply in the FP8-activation mode); on a GPU
    against the CPU's formats.round_fp8."""
    x = _rows(m, k, seed=m * k + 1).to(torch.bfloat16)
    got = round_fp8_rows(x.to(DEVICE)).cpu()
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), formats.round_fp8(x).view(torch.int16))


def test_rounding_refuses_partial_scale_groups_and_other_dtypes() -> None:
    """A width that is not whole 32-channel groups, and fp32 rows, are named in the
    error."""
    with pytest.raises(ValueError, match="width 40"):
        round_fp8_rows(torch.zeros(2, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="torch.float32"):
        round_fp8_rows(torch.zeros(2, 64))


@pytest.mark.parametrize("invariant", [False, True])
def test_the_mode_quantises_an_fp8_weights_input_and_nothing_else(invariant: bool) -> None:
    """In the mode (either batch-invariance), linear through an FP8 weight equals
    linear of the fake-quantised input outside it, bit for bit; grouped_linear too;
    a plain weight's product is unchanged; leaving the mode restores the plain
    arithmetic."""
    x = _rows(5, 64, seed=1).to(torch.bfloat16)
    weight = _fp8_weight(96, 64, torch.bfloat16, seed=2)
    plain = weight.decoded()
    grouped_x = _rows(5, 64, seed=3).to(torch.bfloat16).view(5, 2, 32)
    grouped_weight = _fp8_weight(128, 32, torch.bfloat16, seed=4)
    with batch_invariant(invariant):
        want = linear(formats.round_fp8(x), weight)
        want_grouped = grouped_linear(formats.round_fp8(grouped_x), grouped_weight)
        want_plain = linear(x, plain)
        unquantised = linear(x, weight)
        with fp8_activations(True):
            assert fp8_activations_enabled()
            assert torch.equal(linear(x, weight), want)
            assert torch.equal(grouped_linear(grouped_x, grouped_weight), want_grouped)
            assert torch.equal(linear(x, plain), want_plain)
        assert not fp8_activations_enabled()
        assert torch.equal(linear(x, weight), unquantised)
    assert not torch.equal(want, unquantised), "the quantisation changed something"
