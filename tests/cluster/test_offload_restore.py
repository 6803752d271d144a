"""Prefix restore from the offload store: what a local hit would have done, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv41.cache.offload import OffloadKey, TieredStore, UnitKind
from dsv41.cluster.engine import Engine
from dsv41.cluster.offload_connector import LocalOffload
from dsv41.cluster.options import EngineError
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.cluster.scheduler import SchedulerError

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
BLOCK = 32
OPTIONS = dict(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64)


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def _evict_everything(engine: Engine) -> None:
    bm = engine.block_manager
    bm.evict(bm.config.num_pages)
    assert bm.stats().pages_cached == 0


@pytest.mark.parametrize("state_transfer", ["replay", "copy"])
def test_offloaded_prefix_restores_what_a_local_hit_would(tiny_dir: Path, state_transfer: str) -> None:
    """A prompt whose prefix was evicted from the pools but kept by the offload store
    resumes from fetched PAGEs (and, under copy, a fetched image) and generates
    exactly the tokens of the same prompt resuming from a local hit; under copy that
    is also the cold run's. The fetched PAGEs hold the bytes that were published."""
    local = Engine.from_pretrained(tiny_dir, state_transfer=state_transfer, **OPTIONS)
    offloaded = Engine.from_pretrained(tiny_dir, state_transfer=state_transfer, offload_host_bytes=64 << 20, **OPTIONS)
    prompt = _prompt(local.config.vocab_size, 3 * BLOCK + 7, seed=11)

    cold = local.generate([prompt], GREEDY)[0].token_ids
    local_hit = local.generate([prompt], GREEDY)[0].token_ids
    assert local.block_manager.stats().hits >= 1

    assert offloaded.generate([prompt], GREEDY)[0].token_ids == cold
    store = offloaded.offload.store
    published = store.stats().puts
    assert published >= 3  # the prompt's three full PAGEs (+ images under copy)
    _evict_everything(offloaded)
    hits_before = offloaded.block_manager.stats().hits
    restored = offloaded.generate([prompt], GREEDY)[0].token_ids
    stats = offloaded.block_manager.stats()

    assert restored == local_hit
    if state_transfer == "copy":
        assert restored == cold
        assert stats.fetched_images == 1
    assert stats.hits == hits_before  # nothing came from the pools themselves
    assert stats.fetched_pages == 3
    # The PAGEs now cached under the prompt's hashes hold the published bytes.
    hit = offloaded.block_manager.lookup(prompt)
    assert len(hit.pages) == 3
    for i, (page, h) in enumerate(zip(hit.pages, hit.prompt_hashes)):
        rows = store.get(OffloadKey(offloaded.geometry.layout_id, h, UnitKind.PAGE))
        assert rows is not None, f"PAGE {i} was not published"
        assert torch.equal(offloaded.runner.pools.read_pages([page]), rows)


def test_offload_survives_preemption_pressure_with_unchanged_tokens(tiny_dir: Path) -> None:
    """With PAGEs so scarce that prompts evict each other's prefixes, a mix of shared
    prefixes run with the offload store gives every request the tokens it gets
    without offload (replay hits resume from the same boundaries either way)."""
    vocab = Engine.from_pretrained(tiny_dir, **OPTIONS).config.vocab_size
    shared = _prompt(vocab, 2 * BLOCK, seed=3)
    # Suffixes longer than the window: decoder bounded replay resumes no image above a
    # prompt's tail, so an image at the shared prefix's end is usable.
    prompts = [shared + _prompt(vocab, 33 + i, seed=20 + i) for i in range(4)] + [_prompt(vocab, 70, seed=9)]

    def run(**extra: object) -> tuple[list[list[int]], Engine]:
        # Eight PAGEs: one prompt's four beside one image's four, so prompts evict
        # each other's prefixes (with more, reclaiming images alone makes room).
        engine = Engine.from_pretrained(tiny_dir, state_transfer="copy", num_pages=8, **OPTIONS, **extra)
        outs = []
        for p in prompts + prompts[::-1]:
            outs.append(engine.generate([p], GREEDY)[0].token_ids)
        return outs, engine

    plain, _ = run()
    with_offload, engine = run(offload_host_bytes=64 << 20)
    assert with_offload == plain
    stats = engine.block_manager.stats()
    assert stats.fetched_pages > 0 and stats.fetched_images > 0


def test_dp_ranks_share_the_store(tiny_dir: Path) -> None:
    """Threaded DP ranks publish to one store: after every rank's pools are emptied, a
    prompt computed on one rank restores from the store on whichever rank it lands,
    with the tokens of a local hit."""
    engine = Engine.in_process(tiny_dir, DPLayout(2), state_transfer="copy", offload_host_bytes=64 << 20, **OPTIONS)
    try:
        prompt = _prompt(engine.config.vocab_size, 2 * BLOCK + 3, seed=5)
        cold = engine.generate([prompt], GREEDY)[0].token_ids
        for scheduler in engine.schedulers:
            scheduler.block_manager.evict(scheduler.block_manager.config.num_pages)
        assert engine.generate([prompt], GREEDY)[0].token_ids == cold
        assert sum(s.block_manager.stats().fetched_pages for s in engine.schedulers) == 2
    finally:
        engine.executor.close()


def test_refusals(tiny_dir: Path) -> None:
    """A store of another layout, offload without prefix caching, a disk tier without
    a host tier, and half a disk tier are refused with the field named."""
    engine = Engine.from_pretrained(tiny_dir, **OPTIONS)
    other = LocalOffload(TieredStore("another-layout", engine.geometry.page_bytes, 1 << 20))
    with pytest.raises(SchedulerError, match="layout"):
        engine.scheduler.__class__(
            engine.scheduler.config,
            engine.block_manager,
            layout_id=engine.geometry.layout_id,
            image_pages=engine.geometry.image_pages,
            image_bytes=engine.geometry.image_bytes,
            offload=other,
        )
    with pytest.raises(EngineError, match="enable_prefix_caching"):
        Engine.from_pretrained(tiny_dir, offload_host_bytes=1 << 20, enable_prefix_caching=False, **OPTIONS)
    with pytest.raises(EngineError, match="offload_disk"):
        Engine.from_pretrained(tiny_dir, offload_disk_bytes=1 << 20, **OPTIONS)
    with pytest.raises(EngineError, match="both set, or neither"):
        Engine.from_pretrained(tiny_dir, offload_host_bytes=1 << 20, offload_disk_dir="/tmp/x", **OPTIONS)
