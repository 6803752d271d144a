"""A DP replica over a generated slice: each rank makes only its own expert shard.

Property: DP2 over ``generated:small-slice`` with whole-expert EP and with TP experts
gives exactly the greedy tokens of the one-rank engine over the same source. Each rank
draws its experts (or its TP slice of every expert) alone, so this proves a rank's
generated shard is that part of the whole model, the path a Flash-width DP group takes
(no checkpoint is written).
"""

from __future__ import annotations

import random

import pytest

from dsv41.cluster.engine import Engine
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.sampling_params import SamplingParams

SOURCE = "generated:small-slice,experts=bf16,seed=7"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
OPTIONS = dict(block_size=32, state_transfer="copy", max_num_seqs=4, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def prompts_and_tokens() -> tuple[list[list[int]], list[tuple[int, ...]]]:
    engine = Engine.from_pretrained(SOURCE, **OPTIONS)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, engine.config.vocab_size) for _ in range(n)] for n in (45, 9, 70)]
    return prompts, [out.token_ids for out in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize("expert_mode", ["ep", "tp"])
def test_dp2_over_a_generated_slice_gives_the_one_rank_tokens(prompts_and_tokens, expert_mode: str) -> None:
    prompts, want = prompts_and_tokens
    engine = Engine.in_process(SOURCE, DPLayout(2, expert_mode), **OPTIONS)
    try:
        assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == want
    finally:
        engine.executor.close()
