"""Engram rows read by the Triton backend (model/kernels/triton/engram.py) are the host
lookup's (model/engram.EngramTable.lookup) bit for bit: compiled on a GPU, reading the
host table mapped for it (EngramTable.map_for), else under TRITON_INTERPRET=1 on the
CPU (tests/conftest.py sets it), reading host memory. Both decodes are exact (FP8 E4M3
times a power-of-two scale, or float rows widened), so nothing but equality is
accepted. The runtime reads Engram through the kernels backend: with the Triton
backend every n-gram is hashed and read on the weights' device, giving the torch
backend's host rows.

The fused gated add (``engram_gated_add``) is model/engram.gated_add in one launch: bit
for bit where its reductions cannot matter (a zero query weight: the gate is exactly
one half), elsewhere within a few units of the terms' magnitude of the torch path and
of a float64 evaluation, and a row's result does not depend on the call.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from dsv41.model.config import V41Config
from dsv41.model.engram import GATE_DOT_FLOOR, EngramTable, gated_add
from dsv41.model.formats import quantize_fp8
from dsv41.model.linalg import batch_invariant
from dsv41.model.kernels.torch_backend import TorchKernels
from dsv41.model.params import load_model_params
from dsv41.model.runtime import PagedRuntime

pytest.importorskip("triton")

from dsv41.model.kernels.triton import TritonKernels  # noqa: E402  (needs triton)
from dsv41.model.kernels.triton.engram import engram_gated_add, engram_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="mapped host memory needs a CUDA device")


def _fp8_table(num_rows: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows over six decades of magnitude (scales from 2^-17 up), as quantize_fp8
    leaves them: a head_dim 32 does not divide is a strided view of padded rows."""
    g = torch.Generator().manual_seed(seed)
    source = torch.randn(num_rows, head_dim, generator=g) * torch.logspace(-4, 2, num_rows).unsqueeze(1)
    return quantize_fp8(source)


def _tables(num_rows: int, head_dim: int, seed: int) -> list[EngramTable]:
    values, scales = _fp8_table(num_rows, head_dim, seed)
    rows = torch.randn(num_rows, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    return [
        EngramTable(values, scales),
        EngramTable(values.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)),
        *(EngramTable(rows.to(dtype), None) for dtype in (torch.float32, torch.bfloat16, torch.float16)),
    ]


@pytest.mark.parametrize("head_dim", [16, 48, 64, 256])
def test_device_rows_equal_host_lookup(head_dim: int) -> None:
    """For FP8 tables (both byte dtypes, partial last scale groups at 16 and 48, rows
    strided over padding) and float tables, the kernel's rows of random ids [..., k]
    equal ``lookup``'s bit for bit, the ids' shape kept (rows concatenated)."""
    for i, table in enumerate(_tables(300, head_dim, seed=head_dim)):
        table.map_for(DEVICE)
        ids = torch.randint(0, table.num_rows, (4, 3, 6), generator=torch.Generator().manual_seed(i))
        ids[0, 0] = torch.tensor([0, table.num_rows - 1, 0, 7, 7, table.num_rows - 1])
        got = engram_rows(table, ids.to(DEVICE))
        assert got.dtype == torch.float32 and tuple(got.shape) == (4, 3, 6 * head_dim)
        assert torch.equal(got.cpu(), table.lookup(ids)), f"table {i}"


def test_no_ids_and_bad_ids() -> None:
    """No row ids give no rows; ids that are not int64 [..., k] are refused by name."""
    table = _tables(10, 32, seed=3)[0]
    table.map_for(DEVICE)
    assert engram_rows(table, torch.zeros(0, 5, dtype=torch.long, device=DEVICE)).shape == (0, 5 * 32)
    for bad in (torch.zeros(3, dtype=torch.int32), torch.tensor(1)):
        with pytest.raises(ValueError, match="row_ids"):
            engram_rows(table, bad.to(DEVICE))


def test_runtime_reads_engram_where_its_kernels_do(tiny_quantized_dir: Path) -> None:
    """A runtime on the Triton backend hashes n-grams and reads the (FP8, memory-mapped)
    tables on the weights' device, the torch backend's on the host; both give the same
    rows for every Engram layer, for n-grams of any compressed ids, pad ids included."""
    params = load_model_params(tiny_quantized_dir, text_only=True)[0].to(DEVICE)
    on_device = PagedRuntime(params, kernels=TritonKernels())
    on_host = PagedRuntime(params, kernels=TorchKernels())
    assert on_device.engram_device == params.embed.device and on_host.engram_device == torch.device("cpu")
    hashing = params.engram_hashing
    assert hashing is not None
    ngrams = torch.randint(0, params.config.engram_compressed_vocab_size, (37, hashing.max_ngram_size))
    ngrams[:5, 2:] = hashing.pad_compressed_id
    layers = [layer for layer in params.layers if layer.engram is not None]
    assert layers
    for layer in layers:
        device_rows = on_device.engram_rows(layer, ngrams.to(DEVICE))
        assert device_rows.device.type == torch.device(DEVICE).type
        assert torch.equal(device_rows.cpu(), on_host.engram_rows(layer, ngrams))


def test_runtime_refuses_a_table_its_hashing_overruns(tiny_dir: Path) -> None:
    """The device reads row ids unchecked, so a runtime that reads Engram there refuses
    a table with other than its layer's rows (the sum of its primes), naming the layer."""
    params = load_model_params(tiny_dir, text_only=True)[0].to(DEVICE)
    at, layer = next((i, layer) for i, layer in enumerate(params.layers) if layer.engram is not None)
    table = layer.engram.table
    short = EngramTable(table.values[:-1], None if table.scales is None else table.scales[:-1])
    layers = list(params.layers)
    layers[at] = dataclasses.replace(layer, engram=dataclasses.replace(layer.engram, table=short))
    with pytest.raises(ValueError, match=rf"layer {layer.layer_id} Engram table: {table.num_rows - 1} rows"):
        PagedRuntime(dataclasses.replace(params, layers=tuple(layers)), kernels=TritonKernels())


@needs_cuda
def test_unmapped_table_is_refused_on_the_gpu() -> None:
    """A CUDA device reads only a table mapped for it."""
    table = _tables(10, 32, seed=4)[0]
    with pytest.raises(RuntimeError, match="not mapped for the device"):
        engram_rows(table, torch.zeros(1, 1, dtype=torch.long, device="cuda"))


@needs_cuda
def test_tables_are_page_locked_in_place_or_copied_once(
    file_mapped_table: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """``map_for`` a GPU registers a file-mapped table where it lies when the device
    registers read-only memory (the map's own pages, same addresses), else copies it
    once into page-locked memory and says so; an in-memory table is copied once. Either
    way the rows are page-locked, read on the device as on the host, and mapping again
    changes nothing."""
    values, scales = _fp8_table(500, 96, seed=5)
    mapped, arrays = file_mapped_table(values, scales, file_mapped=True)
    in_memory = EngramTable(values, scales)
    ids = torch.randint(0, 500, (64, 24), generator=torch.Generator().manual_seed(6))
    for table in (mapped, in_memory):
        with caplog.at_level(logging.WARNING, logger="dsv41.model.engram"):
            table.map_for("cuda")
            table.map_for("cuda")
        assert table.device_readable
        assert table.values.is_pinned() and table.scales is not None and table.scales.is_pinned()
        assert torch.equal(engram_rows(table, ids.cuda()).cpu(), table.lookup(ids))
    copied = [r.getMessage() for r in caplog.records if "copied once into page-locked memory" in r.getMessage()]
    in_place = mapped.values.data_ptr() == arrays["values"].ctypes.data
    assert in_place != bool(copied) and len(copied) <= 1, copied
    assert in_memory.values.data_ptr() != values.data_ptr()


# Bounds on the gated add's difference in units of the streams' dtype epsilon times the
# terms' magnitude (|h| + |value|: the result may cancel to near zero), about twice the
# worst measured over 40 seeds of 200 rows on TINY and TINY_ALT (CPU, interpreter,
# 2026-12-07): fp32 streams, fused against torch 27.5, torch against float64 17.2,
# fused against float64 27.2 (the gate's square root amplifies a dot's rounding near
# zero, so the worst case is a single row whose fp32 dot is a few ulps from zero, and
# the two paths sum the dot in their own orders); bf16 streams 0.72, 0.49, 0.49 (one
# rounding of the result).
GATED_ADD_UNITS = {torch.float32: 55.0, torch.bfloat16: 1.0}
GATED_ADD_FP64_UNITS = {torch.float32: 55.0, torch.bfloat16: 1.0}


@pytest.fixture(scope="module", params=["tiny", "tiny_alt"])
def config(request: pytest.FixtureRequest) -> V41Config:
    """TINY (hc 4, hidden 64) and TINY_ALT (hc 3, hidden 96)."""
    return V41Config.from_pretrained(request.getfixturevalue(f"{request.param}_dir"), text_only=True)


def _gated_add_inputs(
    config: V41Config, rows: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams (each row at its own magnitude), the projected keys and value, and the
    q and k weights."""
    g = torch.Generator().manual_seed(seed)
    hc, hidden = config.hc_mult, config.hidden_size
    scale = torch.rand(rows, 1, 1, generator=g) * 4 + 0.01
    streams = (torch.randn(rows, hc, hidden, generator=g) * scale).to(dtype)
    projected = torch.randn(rows, (hc + 1) * hidden, generator=g).to(dtype)
    return streams, projected, torch.randn(hc, hidden, generator=g), torch.randn(hc, hidden, generator=g)


def _terms_units(got: torch.Tensor, want: torch.Tensor, streams: torch.Tensor, projected: torch.Tensor) -> float:
    """The largest difference in the streams' dtype epsilon times |h| + |value|."""
    hc, hidden = streams.shape[1:]
    terms = streams.double().abs() + projected[:, hc * hidden :].double().abs().unsqueeze(1)
    scale = torch.finfo(streams.dtype).eps * terms
    return ((got.double().cpu() - want.double().cpu()).abs() / scale).max().item()


def _gated_add_in_float64(
    streams: torch.Tensor, projected: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """model/engram.gated_add's arithmetic in float64."""
    tokens, hc, hidden = streams.shape
    projected = projected.double()
    keys = projected[:, : hc * hidden].reshape(tokens, hc, hidden)
    h = streams.double()
    dot = (h * q_weight.double() * k_weight.double() * keys).sum(-1)
    dot = dot * torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(keys.square().mean(-1) + eps) / math.sqrt(hidden)
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(GATE_DOT_FLOOR)))
    return h + gate.unsqueeze(-1) * projected[:, hc * hidden :].unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_gated_add_is_the_torch_one_where_the_gate_is_exact(config: V41Config, dtype: torch.dtype) -> None:
    """A zero query weight: every dot is zero whatever the order of its sums, the gate
    is exactly sigmoid(0) = 1/2, and the fused result equals the torch path's bit for
    bit (the add, its rounding to the streams' dtype and the masking of a hidden size
    the column block does not divide)."""
    streams, projected, q_weight, k_weight = _gated_add_inputs(config, 64, dtype, seed=1)
    q_weight = torch.zeros_like(q_weight)
    with batch_invariant(True):
        want = gated_add(streams, projected, q_weight, k_weight, config.rms_norm_eps)
    got = engram_gated_add(*(t.to(DEVICE) for t in (streams, projected, q_weight, k_weight)), config.rms_norm_eps)
    assert got.dtype == dtype and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_the_fused_gated_add_matches_the_torch_one_and_float64(
    config: V41Config, rows: int, dtype: torch.dtype
) -> None:
    """Random streams, projections and weights: the fused gated add within
    GATED_ADD_UNITS of the torch path on the same device, and both within
    GATED_ADD_FP64_UNITS of a float64 evaluation."""
    streams, projected, q_weight, k_weight = _gated_add_inputs(config, rows, dtype, seed=rows)
    on_device = [t.to(DEVICE) for t in (streams, projected, q_weight, k_weight)]
    with batch_invariant(True):
        want = gated_add(*on_device, config.rms_norm_eps)
        got = engram_gated_add(*on_device, config.rms_norm_eps)
    exact = _gated_add_in_float64(streams, projected, q_weight, k_weight, config.rms_norm_eps)
    assert got.dtype == dtype
    assert _terms_units(got, want, streams, projected) <= GATED_ADD_UNITS[dtype]
    for path in (got, want):
        assert _terms_units(path, exact, streams, projected) <= GATED_ADD_FP64_UNITS[dtype]


def test_a_rows_fused_gated_add_does_not_depend_on_the_call(config: V41Config) -> None:
    """A row gets the same bits in a call of 200 rows, of 3 rows and alone."""
    inputs = [t.to(DEVICE) for t in _gated_add_inputs(config, 200, torch.bfloat16, seed=9)]
    streams, projected, q_weight, k_weight = inputs
    whole = engram_gated_add(streams, projected, q_weight, k_weight, config.rms_norm_eps)
    for pick in (torch.tensor([5, 100, 199]), torch.tensor([17])):
        pick = pick.to(DEVICE)
        part = engram_gated_add(streams[pick], projected[pick], q_weight, k_weight, config.rms_norm_eps)
        assert torch.equal(whole[pick], part)
