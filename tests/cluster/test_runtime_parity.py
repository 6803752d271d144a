"""Paged runtime == dense reference, bit for bit: the same arithmetic over PAGE/STATE
storage, in the batch-invariant mode (the CPU default; model/linalg.py).

Prompts are fed in chunks of 1, 2, 3, 5, 16, (3, 1, 29, 7) and (3, 1, 129, 7, 128)
cycling, and whole: chunks straddle PAGE boundaries, chunks are wider than the ring
(window 32 < 129) and ratio-2 groups split across chunks (odd chunk ends leave a
compressor tail); a 120-token prompt passes the window, index_topk (16 of 60 ratio-2
entries) and the candidate budget (32 of 120 ratio-1 entries). Every row's logits and
every top-k selection equal the dense forward's exactly, on whatever CPU runs the
suite (tests/cluster/test_isa_parity.py reruns the first test under each instruction
set the CPU has). Every cache format stores the model's rounded values exactly, so the
fp4 main pool and the fp4 index plane are compared with the same reference; the other
formats, dtypes and checkpoints run the two ragged chunkings. At V4.1-Flash's attention
widths (512-dim heads, window 128, the Flash indexer) the equality is just as exact.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dsv41.cluster.engine import Engine
from dsv41.cluster.options import EngineOptions
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.linalg import KEY_TILE, fp8_activations
from dsv41.model.params import ModelParams
from dsv41.model.reference import ReferenceModel
from dsv41.model.reference_slice import SliceModel, SliceSpec, load_slice
from dsv41.model.tiny import TINY, make_tiny

EVERY_CHUNKING = ((1,), (2,), (3,), (5,), (16,), (3, 1, 29, 7), (3, 1, 129, 7, 128), None)
RAGGED = ((3, 1, 29, 7), (3, 1, 129, 7, 128))
# V4.1-Flash's attention at its own widths (64 heads of 512 dims with 64 RoPE channels,
# q/o LoRA ranks 1280/1024 in 8 output groups, window 128, 32 index heads of 128 dims)
# on a ratio-2 owner and a ratio-1 owner; the rest small enough for CI: hidden 1024, 4
# experts of 64 channels, a 512-token vocabulary, index_topk 32 (so a selection chooses).
FLASH_ATTENTION = SliceSpec(
    name="flash-attention-two-layers",
    num_hidden_layers=2,
    compress_ratios=(2, 1),
    kv_source_layer_ids=(0, 1),
    index_source_layer_ids=(0, 1),
    candidate_source_layer_id=1,
    engram_layer_ids=(0,),
    engram_vocab_size=1009,
    n_routed_experts=4,
    widths=(
        ("vocab_size", 512),
        ("hidden_size", 1024),
        ("moe_intermediate_size", 64),
        ("num_experts_per_tok", 2),
        ("index_topk", 32),
    ),
)


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_parity(engine: Engine, prompt: list[int], chunkings: tuple[tuple[int, ...] | None, ...]) -> None:
    want = ReferenceModel(engine.params).forward(prompt)
    for chunking in chunkings:
        paged = engine.prompt_logits(prompt, chunk_sizes=chunking)
        assert torch.equal(paged.logits, want.logits), f"chunks {chunking}: max {float((paged.logits - want.logits).abs().max())}"
        assert paged.selections.keys() == want.selections.keys()
        for layer, selected in want.selections.items():
            assert torch.equal(paged.selections[layer], selected), f"chunks {chunking}, layer {layer}"


def test_paged_logits_and_selections_equal_the_reference_at_every_chunking(tiny_dir: Path) -> None:
    """Every row's logits and every selecting layer's top-k entries equal the dense
    forward's bit for bit, whatever the chunking."""
    engine = Engine.from_pretrained(tiny_dir, block_size=32, enable_prefix_caching=False, max_num_seqs=4)
    assert engine.options.batch_invariant, "the CPU default"
    _assert_parity(engine, _prompt(engine.config.vocab_size, 120, 7), EVERY_CHUNKING)


def test_prompt_logits_after_served_requests_equal_the_reference(tiny_dir: Path) -> None:
    """Once requests have been served and finished, the rank still holds their slots
    until a batch releases them: prompt logits taken then release them first and equal
    the dense forward's bit for bit (the stored-weights parity bench runs them after
    generating)."""
    engine = Engine.from_pretrained(tiny_dir, block_size=32, enable_prefix_caching=False, max_num_seqs=2)
    vocab = engine.config.vocab_size
    engine.generate([_prompt(vocab, 40, 1), _prompt(vocab, 33, 2)], SamplingParams(max_tokens=3, temperature=0.0))
    _assert_parity(engine, _prompt(vocab, 50, 3), (None,))
    _assert_parity(engine, _prompt(vocab, 50, 4), (None,))


@pytest.mark.parametrize(("kv_cache_dtype", "index_cache_dtype"), [("fp4", "fp4"), ("fp4", "fp8"), ("bf16", "fp4")])
def test_parity_holds_in_every_cache_format(tiny_dir: Path, kv_cache_dtype: str, index_cache_dtype: str) -> None:
    """The same bit-exact equality with the fp4 main pool and either index plane."""
    engine = Engine.from_pretrained(
        tiny_dir,
        block_size=32,
        kv_cache_dtype=kv_cache_dtype,
        index_cache_dtype=index_cache_dtype,
        enable_prefix_caching=False,
        max_num_seqs=4,
    )
    _assert_parity(engine, _prompt(engine.config.vocab_size, 300, 7), RAGGED)


def test_parity_holds_on_the_quantised_and_the_second_checkpoint(tiny_quantized_dir: Path, tiny_alt_dir: Path) -> None:
    """The same equivalence with FP8/FP4 stored weights, and on other sizes and weights
    (nothing tuned to one model)."""
    quantized = Engine.from_pretrained(tiny_quantized_dir, block_size=32, enable_prefix_caching=False, max_num_seqs=4)
    _assert_parity(quantized, _prompt(quantized.config.vocab_size, 200, 9), RAGGED)
    alt = Engine.from_pretrained(tiny_alt_dir, block_size=64, enable_prefix_caching=False, max_num_seqs=4)
    _assert_parity(alt, _prompt(alt.config.vocab_size, 260, 8), RAGGED)


def test_parity_holds_with_fp8_activations(tiny_quantized_dir: Path) -> None:
    """An engine with fp8_activations gives, bit for bit, the dense forward run in
    linalg's FP8-activation mode over the same stored weights (the same arithmetic:
    each FP8-weight projection's input quantised per row and 32 channels), whatever
    the chunking; and its logits are not the unquantised engine's."""
    engine = Engine.from_pretrained(
        tiny_quantized_dir, block_size=32, enable_prefix_caching=False, max_num_seqs=4, fp8_activations=True
    )
    prompt = _prompt(engine.config.vocab_size, 200, 9)
    with fp8_activations(True):
        want = ReferenceModel(engine.params).forward(prompt)
    for chunking in RAGGED:
        paged = engine.prompt_logits(prompt, chunk_sizes=chunking)
        assert torch.equal(paged.logits, want.logits), f"chunks {chunking}"
        for layer, selected in want.selections.items():
            assert torch.equal(paged.selections[layer], selected), f"chunks {chunking}, layer {layer}"
    plain = Engine.from_pretrained(tiny_quantized_dir, block_size=32, enable_prefix_caching=False, max_num_seqs=4)
    assert not torch.equal(plain.prompt_logits(prompt).logits, want.logits)


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("engram_head_dim", [16, 48, 256])
def test_parity_holds_at_any_engram_width(tmp_path: Path, engram_head_dim: int, quantized: bool) -> None:
    """A checkpoint whose Engram rows are 16, 48 or 256 wide (FP8 tables with a partial
    last scale group at 16 and 48) loads, and the paged runtime gives the reference's
    logits and selections bit for bit."""
    model_dir = make_tiny(tmp_path, quantized=quantized, spec=dataclasses.replace(TINY, engram_head_dim=engram_head_dim))
    engine = Engine.from_pretrained(model_dir, block_size=32, enable_prefix_caching=False, max_num_seqs=4)
    assert engine.config.engram_head_dim == engram_head_dim
    _assert_parity(engine, _prompt(engine.config.vocab_size, 120, 7), RAGGED)


def test_parity_holds_in_bfloat16(tiny_dir: Path) -> None:
    """bf16 compute: the paged rows equal the bf16 reference's bit for bit too."""
    engine = Engine.from_pretrained(
        tiny_dir, dtype=torch.bfloat16, block_size=32, enable_prefix_caching=False, max_num_seqs=4
    )
    _assert_parity(engine, _prompt(engine.config.vocab_size, 150, 10), RAGGED)


def test_parity_holds_at_flash_attention_widths() -> None:
    """At V4.1-Flash's attention widths a 160-token prompt fed in chunks 3, 1, 129, 7,
    128 (odd ends split ratio-2 pairs across chunks, the 129-row chunk is wider than the
    128-row ring, the scored entries pass KEY_TILE within a chunk) gives the dense
    forward's logits and selections bit for bit, in fp32."""
    model = SliceModel.build(FLASH_ATTENTION, V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True))
    params = ModelParams.from_checkpoint(load_slice(model, dtype=torch.float32))
    config = params.config
    assert (config.head_dim, config.num_attention_heads, config.sliding_window) == (512, 64, 128)
    options = EngineOptions(block_size=32, state_transfer="copy", enable_prefix_caching=False, max_num_seqs=2, num_pages=16)
    engine = Engine.from_params(params, model.tokenizer, options)
    prompt = _prompt(config.vocab_size, 160, 13)
    assert len(prompt) // 2 > 2 * KEY_TILE and len(prompt) > config.sliding_window
    _assert_parity(engine, prompt, ((3, 1, 129, 7, 128),))


def _logprob_trace(engine: Engine, prompts: dict[str, list[int]], want: str) -> list[dict[int, float]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    trace: list[dict[int, float]] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == want:
                trace.extend(out.logprobs)
    return trace


def test_a_requests_logprobs_do_not_depend_on_its_batch(tiny_dir: Path) -> None:
    """Scheduled among other requests (its prefill chunked by a small token budget,
    decoded beside prefills of others) a request gets exactly the logprobs it gets
    alone: batch composition changes no bit of its arithmetic."""
    vocab = Engine.from_pretrained(tiny_dir, enable_prefix_caching=False).config.vocab_size
    target = _prompt(vocab, 70, 11)
    alone = _logprob_trace(Engine.from_pretrained(tiny_dir, enable_prefix_caching=False), {"t": target}, "t")
    crowded_engine = Engine.from_pretrained(tiny_dir, enable_prefix_caching=False, max_num_batched_tokens=37, max_num_seqs=4)
    others = {f"o{i}": _prompt(vocab, 20 + 17 * i, 12 + i) for i in range(3)}
    crowded = _logprob_trace(crowded_engine, {**others, "t": target}, "t")
    assert len(alone) == 6
    assert crowded == alone
