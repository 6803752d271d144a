"""Grammar and penalty requests on a Ray engine group (DP2, the sockets transport):
each sampling segment's guide travels to its RankActor and is applied there, so the
group samples exactly the tokens of the in-process one-rank Engine, and every grammar
output matches its grammar."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from dsv41.actors.engine_group import EngineGroup
from dsv41.actors.group import GroupOptions
from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams, StructuredOutputs

OPTIONS = dict(block_size=32, max_num_seqs=4, max_num_batched_tokens=128)
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
PARAMS = [
    SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA))),
    SamplingParams(max_tokens=30, temperature=1.0, seed=4, structured_outputs=StructuredOutputs(regex="[a-f]{4,9}")),
    SamplingParams(max_tokens=12, temperature=0.8, seed=5, repetition_penalty=1.4, presence_penalty=0.5, min_p=0.05, logit_bias={9: 3.0}),
]


def test_a_ray_group_samples_the_engines_tokens_under_grammars_and_penalties(ray_cluster: None, tiny_dir: Path) -> None:
    """Three requests (a JSON schema, a regex, penalties) on a DP2 group give the
    one-rank engine's tokens; the grammar outputs parse."""
    prompts = [[5, 9, 14, 20], [7, 7, 30], [11, 40, 41, 42, 43]]
    engine = Engine.from_pretrained(tiny_dir, **OPTIONS)
    expected = [engine.generate([p], params)[0] for p, params in zip(prompts, PARAMS)]
    with EngineGroup(str(tiny_dir), dp=2, expert_mode="ep", group_options=GroupOptions(rank_num_cpus=0.5, step_timeout_s=30.0), name="grammar2", **OPTIONS) as group:
        got = [group.generate([p], params)[0] for p, params in zip(prompts, PARAMS)]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    jsonschema.validate(json.loads(got[0].text), SCHEMA)
    assert got[1].finish_reason.value == "stop"
