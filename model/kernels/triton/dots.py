"""The fp32 dots of the kernels: IEEE products, and exact bf16 splits for tensor cores.

Owns ``split3(v)``, an fp32 tile as three bf16 parts that sum to it exactly (the mHC
mix's weight, both operands of the split fp32 GEMM: a bf16 x bf16 product is exact in
fp32, so tensor-core dots of the parts keep fp32 accuracy), ``parts_dot``, the bf16
tensor-core dot of such parts (under the interpreter, whose dot multiplies bf16
operands as bit patterns, the parts widened to fp32 through ``ieee_dot``), and
``ieee_dot(a [M, K], b [K, N], acc)``: compiled, ``tl.dot`` with IEEE fp32
products (FMA units, K in one fixed order per output); under Triton's interpreter, the
products and a sum over K, because the interpreter's ``tl.dot`` calls numpy's matmul,
whose BLAS gives a row other bits at another place in the operand (numpy 2.4.6's
OpenBLAS 0.3.31 on the AVX512 dev box, 2026-12-07: a row alone against the same row
at offset 32 of a [256, 256] x [256, 32] product), so a row's result would depend on
the other rows of the call. numpy's sum over a non-last axis adds the products in K
order for every output alike; its [M, K, N] products must fit INTERPRETED_DOT_ELEMENTS.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv41.model.kernels.triton.decode import INTERPRETED

_INTERPRETED = tl.constexpr(INTERPRETED)
# The most elements of a tensor the interpreter holds (triton's TRITON_MAX_TENSOR_NUMEL):
# an interpreted ieee_dot's [M, K, N] products must fit.
INTERPRETED_DOT_ELEMENTS = 1 << 20


@triton.jit
def split3(v):
    """v (fp32) as three bf16 parts, hi + mid + lo == v exactly (bf16 keeps fp32's
    exponent range): each part rounds what the parts before it leave."""
    hi = v.to(tl.bfloat16)
    rest = v - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def ieee_dot(a, b, acc):
    """acc + a @ b in fp32 (a [M, K], b [K, N] fp32)."""
    if _INTERPRETED:
        return acc + tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def parts_dot(a, b, acc):
    """acc + a @ b in fp32 for bf16 parts a [M, K], b [K, N]: their products are exact
    in fp32, so the interpreter's widened IEEE dot multiplies the same values."""
    if _INTERPRETED:
        return ieee_dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)
