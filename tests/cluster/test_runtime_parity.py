"""Paged runtime == dense reference: the same arithmetic over PAGE/STATE storage.

Prompts are fed in chunks 3/1/129/7/128 (cycling), so chunks straddle PAGE boundaries,
chunks are wider than the ring (window 32 < 129) and ratio-2 groups split across
chunks (odd chunk ends leave a compressor tail). Tolerance: fp32, 1e-4 absolute and
relative on logits (measured max difference ~2e-6 on 2026-11-30), and every top-k
selection equal. Every cache format stores the model's rounded values exactly, so the
fp4 main pool and the fp4 index plane are compared with the same reference.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from cluster.engine import Engine
from model.reference import ReferenceModel
from model.tiny import TINY, make_tiny

CHUNKS = (3, 1, 129, 7, 128)


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_paged_matches_reference(engine: Engine, length: int, seed: int) -> None:
    """A random prompt of ``length`` fed in CHUNKS: the paged logits equal the dense
    forward's within the tolerance above, and every selecting layer's top-k entries
    are the same."""
    reference = ReferenceModel(engine.params)
    prompt = _prompt(engine.config.vocab_size, length, seed)
    paged = engine.prompt_logits(prompt, chunk_sizes=CHUNKS)
    want = reference.forward(prompt)
    torch.testing.assert_close(paged.logits, want.logits, rtol=1e-4, atol=1e-4)
    assert paged.selections.keys() == want.selections.keys()
    for layer, selected in want.selections.items():
        assert torch.equal(paged.selections[layer], selected), f"layer {layer}"


@pytest.mark.parametrize(("kv_cache_dtype", "index_cache_dtype"), [("bf16", "fp8"), ("fp4", "fp4"), ("fp4", "fp8")])
def test_paged_logits_and_selections_match_the_reference(tiny_dir: Path, kv_cache_dtype: str, index_cache_dtype: str) -> None:
    """Every row's logits and every selecting layer's top-k entries equal the dense
    forward's, whatever the chunking and the cache formats."""
    engine = Engine.from_pretrained(
        tiny_dir,
        block_size=32,
        kv_cache_dtype=kv_cache_dtype,
        index_cache_dtype=index_cache_dtype,
        enable_prefix_caching=False,
        max_num_seqs=4,
    )
    _assert_paged_matches_reference(engine, 300, 7)


def test_parity_holds_on_the_second_tiny_checkpoint(tiny_alt_dir: Path) -> None:
    """The same equivalence on other sizes and weights (nothing tuned to one model)."""
    engine = Engine.from_pretrained(tiny_alt_dir, block_size=64, enable_prefix_caching=False, max_num_seqs=4)
    _assert_paged_matches_reference(engine, 260, 8)


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("engram_head_dim", [16, 48, 256])
def test_parity_holds_at_any_engram_width(tmp_path: Path, engram_head_dim: int, quantized: bool) -> None:
    """A checkpoint whose Engram rows are 16, 48 or 256 wide (FP8 tables with a partial
    last scale group at 16 and 48) loads, and the paged runtime gives the reference's
    logits and selections."""
    model_dir = make_tiny(tmp_path, quantized=quantized, spec=dataclasses.replace(TINY, engram_head_dim=engram_head_dim))
    engine = Engine.from_pretrained(model_dir, block_size=32, enable_prefix_caching=False, max_num_seqs=4)
    assert engine.config.engram_head_dim == engram_head_dim
    _assert_paged_matches_reference(engine, 300, 7)
