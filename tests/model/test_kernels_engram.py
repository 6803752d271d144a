"""Engram rows read by the Triton backend (model/kernels/triton/engram.py) are the host
lookup's (model/engram.EngramTable.lookup) bit for bit: compiled on a GPU, reading the
host table mapped for it (EngramTable.map_for), else under TRITON_INTERPRET=1 on the
CPU (tests/conftest.py sets it), reading host memory. Both decodes are exact (FP8 E4M3
times a power-of-two scale, or float rows widened), so nothing but equality is
accepted. The runtime reads Engram through the kernels backend: with the Triton
backend every n-gram is hashed and read on the weights' device, giving the torch
backend's host rows.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from dsv41.model.engram import EngramTable
from dsv41.model.formats import quantize_fp8
from dsv41.model.kernels.torch_backend import TorchKernels
from dsv41.model.params import load_model_params
from dsv41.model.runtime import PagedRuntime

pytest.importorskip("triton")

from dsv41.model.kernels.triton import TritonKernels  # noqa: E402  (needs triton)
from dsv41.model.kernels.triton.engram import engram_rows  # noqa: E402

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
