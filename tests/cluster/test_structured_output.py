"""Tests of cluster.structured_output through the engine: with the random tiny model
and the trained default one, every output of a grammar request matches it (JSON parsed
and validated against its schema, a regex, a choice, an EBNF grammar), also seeded
and sampled, also preempted (same tokens as alone); each spec compiles once; refusals
name the field; penalties run through the engine with a row's guide."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputs
from dsv41.cluster.structured_output import (
    OUTPUT_MARKERS,
    GrammarCache,
    StructuredOutputError,
    check_structured_outputs,
    grammar_tokenizer_info,
)
from dsv41.deploy.chat_protocol import DSML, THINK_END

# A schema whose language is finite, so even random weights end it well inside the
# budget: bounded strings, integers in a range, an enum, a boolean, a bounded array.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "unit": {"enum": ["c", "f"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-c]{2}( [xyz])?"
CHOICES = ("alpha", "beta gamma", 'quote " and é')
EBNF = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [0-9] | "x"'


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(11, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_dir, block_size=32, max_num_seqs=8, max_num_batched_tokens=256)


def _check(spec: StructuredOutputs, text: str) -> None:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(spec.json))
    elif spec.kind == "regex":
        assert re.fullmatch(spec.regex, text), text
    elif spec.kind == "choice":
        assert text in spec.choice
    else:
        assert re.fullmatch(r"\(([0-9x])(,[0-9x]){0,3}\)", text), text


SPECS = [
    StructuredOutputs(json=json.dumps(SCHEMA)),
    StructuredOutputs(regex=REGEX),
    StructuredOutputs(choice=CHOICES),
    StructuredOutputs(grammar=EBNF),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.kind for s in SPECS])
def test_every_sample_of_the_random_model_matches_its_grammar(engine: Engine, spec: StructuredOutputs) -> None:
    """Random weights, temperature 1, four seeded samples of three prompts: every
    output ends with EOS ("stop") and its text matches the grammar."""
    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=7, n=4, structured_outputs=spec)
    outputs = engine.generate([_prompt(vocab, 9 + i, i) for i in range(3)], params)
    assert len(outputs) == 12
    for output in outputs:
        assert output.finish_reason.value == "stop", output.text
        _check(spec, output.text)


def test_json_object_is_an_object(engine: Engine) -> None:
    """json_object: the output parses as a JSON object (greedy and sampled)."""
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=200, temperature=temperature, seed=1, structured_outputs=StructuredOutputs(json_object=True))
        output = engine.generate([_prompt(engine.config.vocab_size, 12, 3)], params)[0]
        if output.finish_reason.value == "stop":
            assert isinstance(json.loads(output.text), dict)
        else:  # an object may nest past any budget; what came is still its prefix
            assert output.text.startswith("{")


def test_a_preempted_grammar_request_keeps_its_tokens(tiny_dir: Path) -> None:
    """PAGEs for one request's growth only: the newer request is preempted and
    recomputes; its matcher is where its tokens left it, so both finish with the
    tokens of their runs alone (seeded sampling)."""
    options = dict(block_size=32, enable_prefix_caching=False, max_num_seqs=4, max_num_batched_tokens=512)
    vocab = Engine.from_pretrained(tiny_dir, **options).config.vocab_size
    spec = StructuredOutputs(grammar='root ::= [a-z ]{40,60} "."')
    params = SamplingParams(max_tokens=70, temperature=1.0, seed=5, structured_outputs=spec)
    prompts = [_prompt(vocab, 60, 30), _prompt(vocab, 58, 31)]
    alone = [Engine.from_pretrained(tiny_dir, **options).generate([p], params)[0] for p in prompts]
    tight = Engine.from_pretrained(tiny_dir, **{**options, "num_pages": 5})
    together = tight.generate(prompts, params)
    assert tight.stats().preemptions[0] > 0
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for output in together:
        assert re.fullmatch(r"[a-z ]{40,60}\.", output.text)


def test_the_trained_model_answers_inside_the_grammar(trained_tiny_dir: Path) -> None:
    """The shipped trained model (the CLI's default) under each grammar, greedy."""
    engine = Engine.from_pretrained(trained_tiny_dir, block_size=32, max_num_seqs=4)
    prompt = engine.tokenizer.encode("def main():\n    ", add_special_tokens=False).ids
    for spec in SPECS:
        output = engine.generate([prompt], SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=spec))[0]
        assert output.finish_reason.value == "stop"
        _check(spec, output.text)


def test_each_spec_compiles_once_and_the_cache_is_an_lru(tiny_dir: Path) -> None:
    """Requests with equal specs share one compilation; past capacity the least
    recently used spec is evicted and compiles again when asked."""
    engine = Engine.from_pretrained(tiny_dir, block_size=32, max_num_seqs=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputs(regex="[a-z]{3}"))
    for i in range(3):
        engine.add_request(f"r{i}", [5, 6, 7], params)
    assert engine.structured.cache.compilations == 1
    while engine.has_unfinished_requests():
        engine.step()
    cache = GrammarCache(grammar_tokenizer_info(engine.tokenizer, engine.config.vocab_size, [1]), capacity=2)
    a, b, c = (StructuredOutputs(regex=r) for r in ("a+", "b+", "c+"))
    for spec in (a, b, a, c, a, b):
        cache.get(spec)
    assert (cache.compilations, len(cache)) == (4, 2)  # a, b, c, then b again (a stayed recent)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (StructuredOutputs(json='{"type": 3}'), "the json does not compile"),
        (StructuredOutputs(json="not json"), "Failed to parse JSON"),
        (StructuredOutputs(regex="[a-"), "Unclosed '\\['"),
        (StructuredOutputs(grammar="root ::= undefined_rule"), 'Rule "undefined_rule" is not defined'),
    ],
)
def test_specs_the_grammar_engine_refuses_name_the_field(engine: Engine, spec: StructuredOutputs, reason: str) -> None:
    """An invalid spec is refused before anything is queued, by the tokenizer-free
    check and by the engine, naming structured_outputs and the engine's reason (not
    its C++ source location)."""
    with pytest.raises(StructuredOutputError, match=reason) as raised:
        check_structured_outputs(spec)
    assert str(raised.value).startswith("structured_outputs: ") and ".cc:" not in str(raised.value)
    with pytest.raises(SamplingParamsError, match="^structured_outputs: "):
        engine.add_request("bad", [5, 6], SamplingParams(structured_outputs=spec))
    assert engine.request("bad") is None


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({}, "give exactly one"),
        ({"regex": "a", "grammar": "root ::= \"a\""}, "give exactly one"),
        ({"choice": ()}, "^structured_outputs.choice"),
        ({"regex": ""}, "^structured_outputs.regex"),
    ],
)
def test_spec_shapes_are_checked_on_construction(fields: dict, match: str) -> None:
    """Exactly one kind, non-empty, bounded; ignore_eos with a grammar is refused."""
    with pytest.raises(SamplingParamsError, match=match):
        StructuredOutputs(**fields)
    with pytest.raises(SamplingParamsError, match="^ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputs(regex="a"))


def test_penalties_run_through_the_engine_and_change_the_greedy_text(engine: Engine) -> None:
    """A strong repetition / frequency penalty makes a greedy answer repeat fewer
    tokens than without, and min_tokens keeps EOS out of the first tokens."""
    prompt = _prompt(engine.config.vocab_size, 10, 11)
    plain = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    penalised = engine.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=3.0, frequency_penalty=2.0)
    )[0]
    assert len(set(penalised.token_ids)) >= len(set(plain.token_ids))
    assert penalised.token_ids != plain.token_ids
    bias = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, logit_bias={77: 100.0}))[0]
    assert bias.token_ids == (77,) * 5
    early = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6, logit_bias={1: 100.0}))[0]
    assert 1 not in early.token_ids and len(early.token_ids) == 6


def test_output_markers_are_the_protocols() -> None:
    """The markers a grammar may spell are chat_protocol's."""
    assert OUTPUT_MARKERS == (THINK_END, DSML)


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"structured_outputs": StructuredOutputs(regex="[a-z]+")}, "structured_outputs"), ({"frequency_penalty": 1.0}, "frequency_penalty")],
)
def test_grammars_and_penalties_are_refused_under_speculation(trained_tiny_dir: Path, fields: dict, field: str) -> None:
    """A verify's draft rows would be sampled without the matcher or token counts the
    tokens before them leave, so a speculating engine refuses such requests, naming
    the field and why, with nothing queued."""
    engine = Engine.from_pretrained(trained_tiny_dir, block_size=32, speculative_method="dspark")
    with pytest.raises(SamplingParamsError, match=f"^{field}: .*speculative decoding"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, **fields))
    assert engine.request("r") is None
