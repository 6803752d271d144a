"""Weights held as the checkpoint stores them (model/stored_weights.py) compute exactly
what their decoded copies compute.

Properties: a quantised checkpoint loaded with ``weight_storage="stored"`` holds each
FP8 and FP4 weight as the file's own bytes, and each one's decode is bit for bit the
decoded load's tensor (every other tensor is the same either way); a projection, a
grouped projection (in and out of the batch-invariant mode) and the whole dense
reference forward give the same bits through stored weights as through decoded ones;
the Triton fixed-tile GEMM (interpreted here) reading an FP8 weight's bytes and scales
gives its decoded weight's product bit for bit, over edge tiles, scale extremes and
split counts; the paged engine's tokens and logprobs are the same over stored and
decoded weights on a random workload. Bad stored forms and option values are refused
naming the field.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv41.cluster.engine import Engine
from dsv41.cluster.options import EngineError
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model import formats
from dsv41.model.linalg import batch_invariant, grouped_linear, linear
from dsv41.model.loader import load_checkpoint
from dsv41.model.params import load_model_params
from dsv41.model.reference import ReferenceModel
from dsv41.model.stored_weights import Fp4Weight, Fp8Weight
from dsv41.model.weights import TensorKind, checkpoint_tensors


def _fp8(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[:32, :32] *= 1e-4  # a tile whose scale is far below the others
    values, scale = formats.quantize_fp8_weight(w)
    return Fp8Weight(values.view(torch.float8_e4m3fn), scale, dtype)


def _fp4(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> Fp4Weight:
    g = torch.Generator().manual_seed(seed)
    packed, scale = formats.quantize_fp4_weight(torch.randn(rows, cols, generator=g))
    return Fp4Weight(packed.view(torch.uint8), scale, dtype)


def _stored_file_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stored_load_holds_the_files_bytes_and_decodes_to_the_decoded_load(
    tiny_quantized_dir: Path, dtype: torch.dtype
) -> None:
    stored = load_checkpoint(tiny_quantized_dir, dtype=dtype, weight_storage="stored")
    decoded = load_checkpoint(tiny_quantized_dir, dtype=dtype, weight_storage="decoded")
    on_disk = _stored_file_tensors(tiny_quantized_dir)
    specs = checkpoint_tensors(stored.config)
    kinds = {TensorKind.FP8_WEIGHT: Fp8Weight, TensorKind.FP4_EXPERT: Fp4Weight}
    resident = 0
    assert stored.tensors.keys() == decoded.tensors.keys()
    for name, held in stored.tensors.items():
        spec = specs[name]
        expected_type = kinds.get(spec.kind) if spec.kind in kinds and spec.scale_name in on_disk else None
        if expected_type is None:
            assert isinstance(held, torch.Tensor) and torch.equal(held, decoded.tensors[name]), name
            continue
        assert isinstance(held, expected_type), name
        file_values, file_scale = on_disk[name], on_disk[spec.scale_name]
        assert torch.equal(held.values.view(torch.uint8), file_values.view(torch.uint8)), name
        assert torch.equal(held.scale, file_scale.view(torch.uint8)), name
        assert torch.equal(held.decoded(), decoded.tensors[name]), name
        resident += 1
    assert resident > 0 and any(isinstance(t, Fp4Weight) for t in stored.tensors.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("invariant", [False, True])
def test_projections_through_stored_weights_equal_the_decoded(dtype: torch.dtype, invariant: bool) -> None:
    x = torch.randn(7, 96).to(dtype)
    grouped_x = torch.randn(5, 2, 96).to(dtype)
    with batch_invariant(invariant):
        for weight in (_fp8(70, 96, dtype), _fp4(64, 96, dtype)):
            assert torch.equal(linear(x, weight), linear(x, weight.decoded())), type(weight).__name__
        fp8 = _fp8(128, 96, dtype)
        assert torch.equal(grouped_linear(grouped_x, fp8), grouped_linear(grouped_x, fp8.decoded()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_forward_is_the_same_over_stored_and_decoded_weights(
    tiny_quantized_dir: Path, dtype: torch.dtype
) -> None:
    stored, _ = load_model_params(tiny_quantized_dir, dtype=dtype, weight_storage="stored")
    decoded, _ = load_model_params(tiny_quantized_dir, dtype=dtype, weight_storage="decoded")
    ids = torch.tensor([random.Random(3).randrange(3, 500) for _ in range(40)])
    assert torch.equal(ReferenceModel(stored).forward(ids).logits, ReferenceModel(decoded).forward(ids).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_gemm_reads_an_fp8_weight_as_its_decode(dtype: torch.dtype) -> None:
    """On a GPU when present, else interpreted (tests/conftest.py): the FP8 bytes'
    product equals the decoded weight's bit for bit, over edge tiles and K splits, in
    the row-invariant split plan and the one outside the batch-invariant mode."""
    from dsv41.model.kernels.triton.gemm import fixed_tile_matmul

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for rows, cols, count in ((70, 100, 5), (128, 64, 17), (33, 200, 1)):
        host = _fp8(rows, cols, dtype, seed=rows)
        weight = Fp8Weight(host.values.to(device), host.scale.to(device), dtype)
        a = torch.randn(count, cols).to(dtype).to(device)
        for programs in (1, 3, 8):
            for invariant in (True, False):
                got = fixed_tile_matmul(a, weight, programs=programs, row_invariant=invariant)
                want = fixed_tile_matmul(a, weight.decoded(), programs=programs, row_invariant=invariant)
                assert torch.equal(got, want), (rows, cols, count, programs, invariant)
    with pytest.raises(ValueError, match="one compute dtype"):
        fixed_tile_matmul(torch.zeros(2, 64, dtype=torch.float32), _fp8(32, 64, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_decode_is_the_fp8_weights_exact_decode(dtype: torch.dtype) -> None:
    """The Triton decode of an FP8 weight (on a GPU when present, else interpreted)
    gives ``Fp8Weight.decoded``'s values bit for bit, over partial edge tiles, tiny
    tile scales and a column-strided view."""
    from dsv41.model.kernels.triton.gemm import decode_fp8_weight

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for rows, cols in ((70, 100), (33, 200), (128, 64)):
        host = _fp8(rows, cols, dtype, seed=cols)
        weight = Fp8Weight(host.values.to(device), host.scale.to(device), dtype)
        assert torch.equal(decode_fp8_weight(weight), weight.decoded())
    strided = Fp8Weight(weight.values.t(), weight.scale.t(), dtype)
    assert torch.equal(decode_fp8_weight(strided), strided.decoded())


@pytest.mark.parametrize("rows", [3, 300])
def test_a_projection_through_a_stored_fp8_weight_is_its_decodes(rows: int) -> None:
    """Outside the batch-invariant mode, on the device present: a decode step's few rows
    (the FP8 GEMM) and a prefill's many (the transient decode, then the dense GEMM) both
    give what the decoded weight gives through the same path."""
    from dsv41.model.kernels import register_gpu_linalg_kernels
    from dsv41.model.linalg import batch_invariant, linear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    register_gpu_linalg_kernels(device)
    host = _fp8(96, 160, torch.bfloat16, seed=rows)
    weight = Fp8Weight(host.values.to(device), host.scale.to(device), torch.bfloat16)
    x = torch.randn(rows, 160).to(torch.bfloat16).to(device)
    with batch_invariant(False):
        got = linear(x, weight)
    if device == "cuda" and rows < 256:
        from dsv41.model.kernels.triton.gemm import fixed_tile_matmul

        want = fixed_tile_matmul(x, weight.decoded(), row_invariant=False)
    else:
        want = x @ weight.decoded().t()
    assert torch.equal(got, want)


def test_the_engine_gives_the_same_tokens_over_stored_and_decoded_weights(tiny_quantized_dir: Path) -> None:
    rng = random.Random(18)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 70))] for _ in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=4, logprobs=2)
    runs = {}
    for storage in ("stored", "decoded"):
        engine = Engine.from_pretrained(
            tiny_quantized_dir, weight_storage=storage, block_size=32, num_pages=12, max_num_batched_tokens=48
        )
        outputs = engine.generate(prompts, params)
        runs[storage] = [(o.token_ids, o.logprobs) for o in outputs]
    assert runs["stored"] == runs["decoded"]


def test_bad_stored_forms_and_options_are_refused(tiny_quantized_dir: Path) -> None:
    values, scale = formats.quantize_fp8_weight(torch.randn(40, 64))
    with pytest.raises(ValueError, match="Fp8Weight.scale"):
        Fp8Weight(values.view(torch.float8_e4m3fn), scale[:1], torch.float32)
    with pytest.raises(ValueError, match="Fp8Weight.values"):
        Fp8Weight(torch.zeros(40, 64), scale, torch.float32)
    with pytest.raises(ValueError, match="Fp8Weight.dtype"):
        Fp8Weight(values.view(torch.float8_e4m3fn), scale, torch.float16)
    with pytest.raises(ValueError, match="row_groups"):
        _fp8(96, 64, torch.float32).row_groups(2)
    packed, fp4_scale = formats.quantize_fp4_weight(torch.randn(8, 64))
    with pytest.raises(ValueError, match="Fp4Weight.scale"):
        Fp4Weight(packed.view(torch.uint8), fp4_scale[:, :1], torch.float32)
    with pytest.raises(EngineError, match="weight_storage"):
        Engine.from_pretrained(tiny_quantized_dir, weight_storage="fp8")
    with pytest.raises(EngineError, match="fp8_activations: True with weight_storage 'decoded'"):
        Engine.from_pretrained(tiny_quantized_dir, weight_storage="decoded", fp8_activations=True)
    with pytest.raises(EngineError, match="fp8_activations: 'yes'"):
        Engine.from_pretrained(tiny_quantized_dir, fp8_activations="yes")


def test_a_stored_load_refuses_a_dtype_that_cannot_hold_the_values(tiny_quantized_dir: Path) -> None:
    with pytest.raises(ValueError, match="weight_storage 'stored'"):
        load_checkpoint(tiny_quantized_dir, dtype=torch.float16, weight_storage="stored")
    with pytest.raises(ValueError, match="weight_storage"):
        load_checkpoint(tiny_quantized_dir, weight_storage="packed")


def test_a_generated_slice_with_fp8_dense_weights_holds_them_stored() -> None:
    """``dense=fp8``: the slice's FP8_WEIGHT kinds are made as FP8 with 32x32 scales,
    held stored under weight_storage "stored", and decode to the decoded load's."""
    from dsv41.model.source import ModelSource

    source = ModelSource.parse("generated:small-slice,experts=fp4,dense=fp8")
    stored, _ = source.load_params(dtype=torch.bfloat16, weight_storage="stored")
    decoded, _ = source.load_params(dtype=torch.bfloat16, weight_storage="decoded")
    for s_layer, d_layer in zip(stored.layers, decoded.layers):
        assert isinstance(s_layer.attn.wq_a, Fp8Weight) and isinstance(s_layer.moe.shared.w2, Fp8Weight)
        assert torch.equal(s_layer.attn.wo_a.decoded(), d_layer.attn.wo_a)
        expert = min(s_layer.moe.experts)
        assert isinstance(s_layer.moe.experts[expert].w1, Fp4Weight)
        assert torch.equal(s_layer.moe.experts[expert].w1.decoded(), d_layer.moe.experts[expert].w1)
