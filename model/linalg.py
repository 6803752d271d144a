"""The model's matrix products and row reductions, and the batch-invariant mode.

Owns every operation of the arithmetic whose result for one row could depend on the
other rows of the call: the dense projections (``linear``, ``grouped_linear``), the
per-row reductions (``row_sum``, ``row_mean``, ``softmax``), each row's products with
its own keys (``batched_matmul``: the attention's two products) and the index
scorer's dot products (``tiled_dots``). Outside the mode they are the plain torch calls. In the
batch-invariant mode (``batch_invariant(True)``, entered by a forward for its whole
duration) each computes a row in an order fixed by the row alone:

- a projection runs every row through a GEMM of one shape, ``ROW_TILE`` rows: the
  rows are padded to whole tiles and the tiles go through one batched GEMM of at
  least two tiles, so the BLAS never sees the call's row count (MKL picks another
  kernel, with another reduction order, for 1-3 rows, and its thread split follows
  the shape; ATen hands a batch of one to the plain GEMM, whose one-column kernel
  differs from the batched one's);
- dot products against a varying set of keys go through GEMMs of one shape,
  ``KEY_TILE`` keys each, so a key's dot product does not depend on how many keys
  share the call;
- a batch of per-row products (a row's attention heads against its own keys, then its
  probabilities against them) goes through one batched GEMM of at least two items, so
  ATen never hands it to the plain GEMM;
- on a CUDA device the projections and the per-row products run a fixed-tile Triton
  GEMM (no split over K, no autotuning, each batch item its own programs:
  model/kernels/triton/gemm.py; an fp32 projection through a wide weight the split
  GEMM below, at one row block) and the row reductions a one-program-per-row Triton
  reduction, because cuBLAS and torch's CUDA reductions choose their algorithm and
  splits from the problem size (a batched GEMM's from its batch count too). The Triton
  backend registers both here when it is imported (``register_gpu_kernels``; an
  engine in the mode on a GPU imports it whatever its kernels backend): the kernels
  sit above this module, never below it.

Elementwise arithmetic is batch-invariant but for one thing: on the CPU, ATen runs
an elementwise op over whole vector steps and the last few elements of the tensor
through the scalar function (``std::exp`` where the body runs Sleef's vector exp), and
the two may differ in the last bit, so where a row lands depends on the tensor's size.
``pointwise`` runs a transcendental function (exp, sigmoid, silu, softplus, cos, sin)
over a copy padded to whole vector steps. With several intra-op threads each thread's
range has such an end too, so the CPU mode runs on one thread (``cpu_threads``).
Reductions over a handful of elements (the hc streams, a row's top-k slots) are
explicit sums in a fixed order (``ordered_sum``).

On a CUDA device an fp32 projection through a weight of at least
``SPLIT_FP32_MIN_WEIGHT_ROWS`` rows (the LM head, DSpark's heads) with at most
``SPLIT_FP32_ROWS`` rows of input (a decode step; any row count in the batch-invariant
mode) runs the registered split GEMM (``GpuKernels.fp32_matmul``,
model/kernels/triton/fp32_gemm.py): both operands split exactly into bf16 parts on
tensor cores, at fp32 accuracy, where cuBLAS's fp32 GEMM is bound by the FP32 FMA
units (the head of a 128-row decode step, 3.4 ms against its 0.9 ms of weight bytes on
an H100, BENCHMARKS.md). A narrower weight (the router's gate, the compressor) would
give that GEMM, which walks all of K in each program, too few programs to fill a GPU.

The FP8-activation mode (``fp8_activations(True)``, entered by a forward whose
engine asks for it) changes the arithmetic of every projection through an FP8 weight:
its input is quantised to FP8 E4M3 per row and 32 channels with E8M0 (power-of-two)
scales, formats.quantize_fp8's grid (the one the model's FP8 caches use), and
multiplied as those values: the fake-quantised rows (formats.round_fp8, exact in the
compute dtype; bf16 rows on a GPU in one launch, ``GpuKernels.round_fp8``) times the
weight as its plain input would be, so a row's activations are the same values
whichever GEMM runs it (not an FP8 x FP8 GEMM: kernels/triton/fp8_rows.py says why).
The reference model keeps its inputs unquantised: MODEL_FACTS has a quantised GEMM's
difference from it measured, never assumed (bench/stored_parity.py --fp8-activations).

Must not import: cache, cluster, actors, deploy, ray, triton, model.kernels (they
import this module).
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from dsv41.model.formats import FP8_BLOCK, round_fp8
from dsv41.model.stored_weights import Fp4Weight, Fp8Weight, Weight

logger = logging.getLogger(__name__)

# Rows per GEMM in the batch-invariant mode. Any fixed size works; 16 keeps the padding
# of a decode step small and stays clear of MKL's 1-3-row kernels.
ROW_TILE = 16
# Keys per dot-product GEMM in the batch-invariant mode.
KEY_TILE = 32
# Rows from which a projection through an FP8 weight on a GPU, outside the
# batch-invariant mode, decodes the weight into a transient bf16 copy and runs cuBLAS
# (the H200 measurement in BENCHMARKS.md: at 128 rows the fixed-tile GEMM over the
# FP8 bytes is faster on most shapes; from 256 rows the decode and cuBLAS are, about
# 2x at 4096 rows).
DECODED_GEMM_ROWS = 256
# Rows up to which an fp32 projection on a GPU, outside the batch-invariant mode, runs
# the split GEMM rather than cuBLAS (BENCHMARKS.md, "The fp32 head and the rotated
# epilogues"), and the weight rows from which it does: 128 programs of the split
# GEMM's 128 weight rows, about one per SM.
SPLIT_FP32_ROWS = 256
SPLIT_FP32_MIN_WEIGHT_ROWS = 16384

# Elements per pointwise call: a multiple of every CPU vector loop's step (two 512-bit
# vectors of bf16 is 64 elements; of fp32, 32; of fp64, 16).
POINTWISE_QUANTUM = 64

_mode = threading.local()


@dataclass(frozen=True)
class GpuKernels:
    """The batch-invariant mode's GPU implementations: ``matmul(a [M, K], b [N, K])`` ->
    a @ b.T, or ``matmul(a [B, M, K], b [B, N, K])`` -> each item's a[i] @ b[i].T, with
    one tile walk per output tile (``row_invariant=False``: a row's sum order may depend
    on M, for FP8 weights outside the mode); ``fp32_matmul(a [M, K], b [N, K])`` -> a @ b.T
    for fp32 operands at fp32 accuracy on tensor cores (``row_invariant=False``: the
    row block follows M); ``row_sum(x [..., C])`` -> [...] fp32 with
    one order per row; ``decode_fp8(w)`` -> an FP8 weight's exact decode in its compute
    dtype, in one pass; ``round_fp8(x [M, K])`` -> bf16 rows on that FP8 grid
    (formats.round_fp8's bits, K a multiple of 32) in one launch."""

    matmul: Callable[..., torch.Tensor]
    fp32_matmul: Callable[..., torch.Tensor]
    row_sum: Callable[[torch.Tensor], torch.Tensor]
    decode_fp8: Callable[[Fp8Weight], torch.Tensor]
    round_fp8: Callable[[torch.Tensor], torch.Tensor]


_gpu_kernels: GpuKernels | None = None


def register_gpu_kernels(kernels: GpuKernels) -> None:
    """Installs the GPU implementations (model/kernels/triton does, on import)."""
    global _gpu_kernels
    _gpu_kernels = kernels


def _gpu() -> GpuKernels:
    if _gpu_kernels is None:
        raise RuntimeError(
            "the batch-invariant mode on a GPU, and a projection through an FP8 weight as stored, run the Triton "
            "backend's GEMM and row reduction, and none is registered: call "
            "model.kernels.register_gpu_linalg_kernels(device) first (an engine on a GPU does)"
        )
    return _gpu_kernels


def batch_invariant_enabled() -> bool:
    """Whether this thread's arithmetic runs in the batch-invariant mode."""
    return getattr(_mode, "enabled", False)


@contextmanager
def batch_invariant(enabled: bool) -> Iterator[None]:
    """Runs the block in (or out of) the batch-invariant mode on this thread; the
    previous setting is restored afterwards. Each DP rank thread sets its own."""
    previous = batch_invariant_enabled()
    _mode.enabled = bool(enabled)
    try:
        yield
    finally:
        _mode.enabled = previous


def fp8_activations_enabled() -> bool:
    """Whether this thread's projections through FP8 weights quantise their inputs to
    FP8 (the module docstring)."""
    return getattr(_mode, "fp8_activations", False)


@contextmanager
def fp8_activations(enabled: bool) -> Iterator[None]:
    """Runs the block with (or without) FP8 activations in the projections through FP8
    weights; the previous setting is restored afterwards."""
    previous = fp8_activations_enabled()
    _mode.fp8_activations = bool(enabled)
    try:
        yield
    finally:
        _mode.fp8_activations = previous


def default_batch_invariant(device: torch.device | str) -> bool:
    """The mode's default: on for the CPU (what tests and ``dsv41 validate`` run on),
    off elsewhere unless asked for (it costs GEMM throughput on a GPU)."""
    return torch.device(device).type == "cpu"


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``; in the batch-invariant mode on the CPU,
    every element goes through the vectorised body of ATen's loop (the input padded
    with zeros to whole vector steps), so its value does not depend on the tensor's
    size or its position in it."""
    if not batch_invariant_enabled() or x.is_cuda:
        return fn(x)
    flat = x.reshape(-1)
    pad = (-flat.numel()) % POINTWISE_QUANTUM
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return fn(flat)[: x.numel()].view(x.shape)


def cpu_threads(batch_invariant: bool, device: torch.device | str) -> None:
    """Puts torch on one intra-op thread when the batch-invariant mode runs on the CPU
    (a multi-threaded elementwise op splits the tensor into ranges whose ends take the
    scalar path: see the module docstring); logs it, since it is process-wide."""
    if batch_invariant and torch.device(device).type == "cpu" and torch.get_num_threads() != 1:
        logger.info("batch-invariant mode on the CPU: torch intra-op threads %d -> 1", torch.get_num_threads())
        torch.set_num_threads(1)


def _tiled_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a, b) with at least two batch items (a zero item appended to a batch of
    one, then dropped), so every call takes ATen's batched path."""
    if a.shape[0] != 1:
        return torch.bmm(a, b)
    return torch.bmm(torch.cat((a, torch.zeros_like(a))), b.expand(2, -1, -1))[:1]


def _plain(x: torch.Tensor, weight: Weight) -> torch.Tensor | Fp8Weight:
    """The weight as a projection of ``x`` reads it: an FP8 weight stays as stored on
    a GPU (the registered GEMM decodes its tiles in registers); elsewhere, and for an
    FP4 weight, its exact decode in x's dtype."""
    if isinstance(weight, Fp8Weight) and x.is_cuda:
        return weight
    if isinstance(weight, (Fp8Weight, Fp4Weight)):
        return weight.decoded(x.dtype)
    return weight


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """``x @ weight.T``: x [..., K], weight [N, K] -> [..., N] in x's dtype (the
    operands must share a dtype; a stored weight decodes to x's). In the FP8-activation
    mode an FP8 weight's input is quantised first (the module docstring)."""
    if isinstance(weight, Fp8Weight) and fp8_activations_enabled():
        k = x.shape[-1]
        if x.is_cuda and x.dtype == torch.bfloat16 and k % FP8_BLOCK == 0:
            x = _gpu().round_fp8(x.reshape(-1, k)).reshape(x.shape)
        else:
            x = round_fp8(x)
    weight = _plain(x, weight)
    if isinstance(weight, Fp8Weight):
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)
        if batch_invariant_enabled() or rows.shape[0] < DECODED_GEMM_ROWS:
            out = _gpu().matmul(rows, weight, row_invariant=batch_invariant_enabled())
        else:
            # A prefill's rows: cuBLAS's bf16 rate beats the in-register decode by
            # more than the transient decode costs (BENCHMARKS.md, "FP8 projections").
            out = rows @ _gpu().decode_fp8(weight).t()
        return out.reshape(*lead, weight.shape[0])
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    invariant = batch_invariant_enabled()
    wide = weight.shape[0] >= SPLIT_FP32_MIN_WEIGHT_ROWS
    if x.is_cuda and x.dtype == torch.float32 and wide and (invariant or rows.shape[0] <= SPLIT_FP32_ROWS):
        return _gpu().fp32_matmul(rows, weight, row_invariant=invariant).reshape(*lead, weight.shape[0])
    if not invariant:
        return x @ weight.t()
    if x.is_cuda:
        out = _gpu().matmul(rows, weight)
    else:
        count = -(-rows.shape[0] // ROW_TILE)
        tiles = rows.new_zeros(count * ROW_TILE, k)
        tiles[: rows.shape[0]] = rows
        out = _tiled_bmm(tiles.view(count, ROW_TILE, k), weight.t().unsqueeze(0).expand(count, -1, -1))
        out = out.reshape(-1, weight.shape[0])[: rows.shape[0]]
    return out.reshape(*lead, weight.shape[0])


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each batch item's own product ``a[i] @ b[i].T``: a [B, M, K], b [B, N, K] (any
    strides: ``values.transpose(1, 2)`` multiplies by the values) -> [B, M, N] in a's
    dtype. In the batch-invariant mode an item's product does not depend on B or on
    the item's place in the batch."""
    if not batch_invariant_enabled():
        return torch.bmm(a, b.transpose(1, 2))
    if a.is_cuda:
        return _gpu().matmul(a, b)
    return _tiled_bmm(a, b.transpose(1, 2))


def grouped_linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """Group g of every row through its own projection, the g-th of G equal row blocks
    of ``weight``: x [T, G, I], weight [G * O, I] -> [T, G, O]."""
    groups = x.shape[1]
    if isinstance(weight, Fp8Weight) and fp8_activations_enabled() and not x.is_cuda:
        # On a GPU each group's ``linear`` quantises its own rows.
        x = round_fp8(x)
    weight = _plain(x, weight)
    if isinstance(weight, Fp8Weight):
        return torch.stack([linear(x[:, g], w) for g, w in enumerate(weight.row_groups(groups))], dim=1)
    per_group = weight.reshape(groups, -1, weight.shape[-1])
    if not batch_invariant_enabled():
        return torch.einsum("tgi,goi->tgo", x, per_group)
    return torch.stack([linear(x[:, g], per_group[g]) for g in range(groups)], dim=1)


def tiled_dots(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row's heads against its own keys: q [T, H, D], keys [T, C, D] (an expanded
    [C, D] where every row scores the same keys) -> [T, H, C] in q's dtype. In the
    batch-invariant mode the keys go through GEMMs of ``KEY_TILE`` keys, one per (row,
    tile), whatever C is; rows are taken in blocks that bound the padded copy."""
    if not batch_invariant_enabled():
        if keys.stride(0) == 0:
            return (q @ keys[0].t()) if keys.shape[0] else q.new_zeros(0, q.shape[1], keys.shape[1])
        return torch.einsum("thd,tcd->thc", q, keys)
    rows, heads, dim = q.shape
    count = keys.shape[1]
    if rows == 0 or count == 0:
        return q.new_zeros(rows, heads, count)
    tiles = -(-count // KEY_TILE)
    block = max(1, _DOTS_BLOCK_BYTES // (tiles * KEY_TILE * dim * keys.element_size()))
    return torch.cat([_tile_dots(q[i : i + block], keys[i : i + block], tiles) for i in range(0, rows, block)])


_DOTS_BLOCK_BYTES = 64 << 20


def _tile_dots(q: torch.Tensor, keys: torch.Tensor, tiles: int) -> torch.Tensor:
    rows, heads, dim = q.shape
    count = keys.shape[1]
    padded = keys.new_zeros(rows, tiles * KEY_TILE, dim)
    padded[:, :count] = keys
    per_tile_q = q.unsqueeze(1).expand(rows, tiles, heads, dim).reshape(rows * tiles, heads, dim)
    per_tile_keys = padded.view(rows * tiles, KEY_TILE, dim)
    dots = batched_matmul(per_tile_q, per_tile_keys).view(rows, tiles, heads, KEY_TILE)
    return dots.permute(0, 2, 1, 3).reshape(rows, heads, tiles * KEY_TILE)[:, :, :count]


def ordered_sum(terms: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of a few tensors, added first to last: where a reduction runs over a
    handful of elements (the hc streams), the model fixes its order instead of a
    reduction kernel."""
    iterator = iter(terms)
    total = next(iterator)
    for term in iterator:
        total = total + term
    return total


def small_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over ``dim`` of ``x`` where that dim holds a handful of elements (kept as
    a size-1 dim). On the CPU, torch's sum: a loop over so few elements in their
    order, whatever the other dims (the parity tests check it on each instruction set);
    on a GPU in the batch-invariant mode, ``ordered_sum``, since a CUDA reduction's
    order is the kernel configuration's."""
    if batch_invariant_enabled() and x.is_cuda:
        return ordered_sum(x.unbind(dim)).unsqueeze(dim)
    return x.sum(dim, keepdim=True)


def row_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """The sum over the last dim of fp32 ``x``."""
    if batch_invariant_enabled() and x.is_cuda:
        out = _gpu().row_sum(x)
        return out.unsqueeze(-1) if keepdim else out
    return x.sum(-1, keepdim=keepdim)


def row_mean(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """The mean over the last dim of fp32 ``x``."""
    if batch_invariant_enabled() and x.is_cuda:
        return row_sum(x, keepdim) / x.shape[-1]
    return x.mean(-1, keepdim=keepdim)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of fp32 ``x`` (-inf entries get 0)."""
    if batch_invariant_enabled() and x.is_cuda:
        shifted = torch.exp(x - x.amax(-1, keepdim=True))
        return shifted / row_sum(shifted, keepdim=True)
    return torch.softmax(x, dim=-1)
