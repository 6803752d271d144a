"""Runtime validation: scheduled runs finish with the tokens of uninterrupted ones.

Owns the scenarios of the spec's "Scheduler acceptance" on the real engine: chunked
and reordered batches, prefix forks, replay from a missing image, preemption,
cancellation at every point, slot recycling, and the parity of paged logits with the
dense reference. There is no second oracle of the scheduler: each request's expected
tokens are its own uninterrupted run (alone, one prefill chunk, nothing cached).

Exact token equality holds under ``state_transfer="copy"`` (every resume is from an
exact state); ``replay`` changes logits after a hit by design, so its scenario
compares two runs that take the same hits.

Must not import: actors, deploy, ray.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cluster.engine import Engine, EngineOptions
from cluster.request import RequestOutput, SamplingParams
from model.params import ModelParams, load_model_params
from model.reference import ReferenceModel
from tokenizers import Tokenizer

PARITY_CHUNKS = (3, 1, 129, 7, 128)
PARITY_TOLERANCE = 1e-4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Workload:
    """Prompts for the scenarios: some share prefixes so forks and hits occur."""

    prompts: dict[str, list[int]]
    block_size: int

    @classmethod
    def build(cls, vocab_size: int, block_size: int, seed: int = 0) -> "Workload":
        rng = random.Random(seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, vocab_size) for _ in range(n)]

        base = tokens(3 * block_size + 11)
        prompts = {
            "a": base,
            "fork-b": base[: 2 * block_size + 5] + tokens(9),
            "fork-c": base[: block_size + 3] + tokens(block_size),
            "short": tokens(7),
            "mid": tokens(block_size + 1),
            "long": tokens(4 * block_size - 3),
            # One PAGE each at admission, two once they decode: they outgrow a pool
            # that admitted them all.
            "edge-1": tokens(block_size - 3),
            "edge-2": tokens(block_size - 2),
            "edge-3": tokens(block_size - 1),
        }
        return cls(prompts=prompts, block_size=block_size)


class _Harness:
    def __init__(self, params: ModelParams, tokenizer: Tokenizer, block_size: int) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.block_size = block_size

    def engine(self, **options: object) -> Engine:
        settings: dict[str, object] = {"block_size": self.block_size, "state_transfer": "copy", "max_num_seqs": 8}
        settings.update(options)
        return Engine(self.params, self.tokenizer, EngineOptions(**settings))  # type: ignore[arg-type]

    def solo(self, prompts: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
        """Each prompt alone in a fresh engine: one prefill chunk, nothing cached."""
        out = {}
        for name, prompt in prompts.items():
            engine = self.engine(enable_prefix_caching=False, max_num_batched_tokens=max(len(prompt), 64))
            out[name] = engine.generate([prompt], GREEDY)[0].token_ids
        return out


def _run(engine: Engine, arrivals: list[tuple[int, str, list[int]]]) -> dict[str, RequestOutput]:
    """Adds each (step, name, prompt) when the step loop reaches its step; runs all
    to completion."""
    pending = sorted(arrivals, key=lambda a: a[0])
    finished: dict[str, RequestOutput] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, name, prompt = pending.pop(0)
            engine.add_request(name, prompt, GREEDY)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
    return finished


def _compare(expected: dict[str, tuple[int, ...]], got: dict[str, RequestOutput], names) -> dict[str, bool]:
    return {name: got[name].token_ids == expected[name] for name in names}


def _pages_released(engine: Engine) -> bool:
    stats = engine.block_manager.stats()
    return stats.requests == 0 and stats.slots_used == 0 and stats.pages_used == stats.image_pages


def run_validation(model_dir: str | Path, *, progress: Progress = lambda _: None, block_size: int = 32) -> dict:
    """Runs every scenario on ``model_dir`` in fp32; returns the JSON report."""
    params, checkpoint = load_model_params(model_dir)
    harness = _Harness(params, checkpoint.tokenizer, block_size)
    workload = Workload.build(params.config.vocab_size, block_size)
    prompts = workload.prompts
    progress(f"uninterrupted runs of {len(prompts)} prompts")
    expected = harness.solo(prompts)
    scenarios = []

    def record(name: str, checks: dict[str, bool], **facts: object) -> None:
        passed = all(checks.values())
        scenarios.append({"name": name, "passed": passed, "checks": checks, **facts})
        progress(f"{name}: {'pass' if passed else 'FAIL'} {facts}")

    # Chunked and reordered: a 32-token budget, arrival order shuffled and staggered.
    engine = harness.engine(max_num_batched_tokens=32, enable_prefix_caching=False)
    order = list(prompts)
    random.Random(1).shuffle(order)
    got = _run(engine, [(i * 3, name, prompts[name]) for i, name in enumerate(order)])
    record("chunked_reordered", _compare(expected, got, prompts), order=order)

    # Prefix forks: "a" first, then prompts sharing its prefix restore its images.
    engine = harness.engine(max_num_batched_tokens=64)
    got = _run(engine, [(0, "a", prompts["a"]), (40, "fork-b", prompts["fork-b"]), (40, "fork-c", prompts["fork-c"])])
    stats = engine.block_manager.stats()
    checks = _compare(expected, got, ["a", "fork-b", "fork-c"])
    checks["took_prefix_hits"] = stats.hits >= 2
    record("prefix_forks", checks, hits=stats.hits, hit_tokens=stats.hit_tokens, images=stats.images)

    # Replay from a missing image: "a" prefilled in one chunk keeps an image only at
    # its last full PAGE; "fork-c" hits one PAGE below any image and recomputes from 0.
    engine = harness.engine(max_num_batched_tokens=512)
    got = _run(engine, [(0, "a", prompts["a"]), (30, "fork-c", prompts["fork-c"])])
    stats = engine.block_manager.stats()
    checks = _compare(expected, got, ["a", "fork-c"])
    checks["hit_without_image"] = stats.hit_tokens > 0
    record("replay_from_missing_image", checks, hit_tokens=stats.hit_tokens)

    # Preemption: PAGEs just above one request's need, a 32-token budget; the edge
    # prompts are admitted together and outgrow the pool as they decode.
    edges = [name for name in prompts if name.startswith("edge-")]
    pages = -(-(len(prompts["edge-3"]) + GREEDY.max_tokens) // block_size) + 1
    engine = harness.engine(max_num_batched_tokens=32, num_pages=pages, enable_prefix_caching=False)
    got = _run(engine, [(0, name, prompts[name]) for name in edges])
    checks = _compare(expected, got, edges)
    checks["preempted"] = engine.scheduler.num_preemptions > 0
    checks["pages_released"] = _pages_released(engine)
    record("preemption", checks, num_pages=pages, preemptions=engine.scheduler.num_preemptions)

    # Tight and mixed: every prompt at once under a 32-token budget with PAGEs just above
    # the largest request's need, one request aborted mid-run.
    largest = max(len(p) for p in prompts.values()) + GREEDY.max_tokens
    pages = -(-largest // block_size) + 1
    engine = harness.engine(max_num_batched_tokens=32, num_pages=pages, enable_prefix_caching=False)
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, GREEDY)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out
        if "mid" not in got and engine.request("mid") is not None and engine.request("mid").num_output_tokens:
            engine.abort("mid")
    kept = [name for name in prompts if name != "mid"]
    checks = _compare(expected, got, kept)
    checks["aborted_mid"] = "mid" not in got
    checks["pages_released"] = _pages_released(engine)
    record("tight_mixed", checks, num_pages=pages, preemptions=engine.scheduler.num_preemptions)

    record(*_cancellation(harness, prompts, expected))

    # Slot recycling: two STATE slots serve every request in turn.
    engine = harness.engine(max_num_seqs=2, num_state_slots=2, max_num_batched_tokens=64)
    got = _run(engine, [(0, name, prompt) for name, prompt in prompts.items()])
    checks = _compare(expected, got, prompts)
    checks["pages_released"] = _pages_released(engine)
    record("slot_recycle", checks)

    # Replay (the default): hits replay a hash block below; two runs taking the same
    # hits agree, and the hit really replayed.
    runs = []
    for _ in range(2):
        engine = harness.engine(state_transfer="replay", max_num_batched_tokens=64)
        runs.append(_run(engine, [(0, "a", prompts["a"]), (40, "fork-b", prompts["fork-b"])]))
    checks = {name: runs[0][name].token_ids == runs[1][name].token_ids for name in ("a", "fork-b")}
    checks["a_equals_uninterrupted"] = runs[0]["a"].token_ids == expected["a"]
    checks["took_prefix_hit"] = engine.block_manager.stats().hits >= 1
    record("replay_same_hits", checks, fork_b_equals_cold=runs[0]["fork-b"].token_ids == expected["fork-b"])

    scenarios.extend(_parity(harness, prompts["long"], progress))
    return {"model": str(model_dir), "block_size": block_size, "passed": all(s["passed"] for s in scenarios), "scenarios": scenarios}


def _cancellation(
    harness: _Harness, prompts: dict[str, list[int]], expected: dict[str, tuple[int, ...]]
) -> tuple[str, dict[str, bool]]:
    """Aborts one request at each point of its life while the others run on."""
    engine = harness.engine(max_num_batched_tokens=32, max_num_seqs=3)
    victims = {"waiting": prompts["long"], "mid-prefill": prompts["a"], "first-step": prompts["short"], "decoding": prompts["mid"]}
    survivors = ["fork-b", "fork-c"]
    for name in survivors:
        engine.add_request(name, prompts[name], GREEDY)
    for name, prompt in victims.items():
        engine.add_request(f"x-{name}", prompt, GREEDY)
    engine.abort("x-waiting")
    aborted_at: dict[str, bool] = {}
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out
        mid = engine.request("x-mid-prefill")
        if mid is not None and 0 < mid.num_computed_tokens < mid.num_prompt_tokens and "mid-prefill" not in aborted_at:
            aborted_at["mid-prefill"] = engine.abort("x-mid-prefill")
        first = engine.request("x-first-step")
        if first is not None and first.num_output_tokens == 1 and "first-step" not in aborted_at:
            aborted_at["first-step"] = engine.abort("x-first-step")
        decoding = engine.request("x-decoding")
        if decoding is not None and decoding.num_output_tokens == 3 and "decoding" not in aborted_at:
            aborted_at["decoding"] = engine.abort("x-decoding")
    checks = _compare(expected, finished, survivors)
    for point in ("mid-prefill", "first-step", "decoding"):
        checks[f"aborted_{point}"] = aborted_at.get(point, False)
    checks["no_aborted_output"] = not any(name.startswith("x-") for name in finished)
    checks["pages_released"] = _pages_released(engine)
    return "cancellation", checks


def _parity(harness: _Harness, prompt: list[int], progress: Progress) -> list[dict]:
    reference = ReferenceModel(harness.params).forward(prompt)
    out = []
    for kv, index in (("bf16", "fp8"), ("fp4", "fp4")):
        engine = harness.engine(kv_cache_dtype=kv, index_cache_dtype=index, enable_prefix_caching=False)
        paged = engine.prompt_logits(prompt, chunk_sizes=PARITY_CHUNKS)
        max_diff = float((paged.logits - reference.logits).abs().max())
        checks = {"logits_within_tolerance": torch.allclose(paged.logits, reference.logits, rtol=PARITY_TOLERANCE, atol=PARITY_TOLERANCE)}
        for layer, selected in reference.selections.items():
            checks[f"selections_layer_{layer}"] = bool(torch.equal(paged.selections[layer], selected))
        passed = all(checks.values())
        name = f"parity_{kv}_{index}"
        progress(f"{name}: {'pass' if passed else 'FAIL'} max |diff| {max_diff:.2e}")
        out.append({"name": name, "passed": passed, "checks": checks, "max_abs_diff": max_diff, "chunks": list(PARITY_CHUNKS)})
    return out
