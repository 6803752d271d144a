"""lm_eval's own ``local-completions`` client (lm_eval.models.openai_completions.
LocalCompletionsAPI, lm-eval 0.4.13) against a live Serve app on the tiny model: its
``loglikelihood`` and ``loglikelihood_rolling`` equal the engine's own prompt logprobs
(an in-process Engine on the same checkpoint and options, and the log-softmax of
``Engine.prompt_logits``), and its ``generate_until`` equals the engine's greedy text,
with the server's tokenizer (``/tokenizer_info``, ``/tokenize``, ``/detokenize``) and
with a local one (the checkpoint's tokenizer.json through transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams

PAIRS = [("The quick brown", " fox jumps"), ("hello", " world, hello again"), ("a b c ", "d e f")]
ROLLING = ["the lazy dog sleeps under the old tree while the fox runs"]
CONTEXTS = ["Once upon a time", "hello world"]
MAX_GEN_TOKS = 8


@pytest.fixture(scope="module")
def base_url(tiny_app: str) -> str:
    return tiny_app


@pytest.fixture(scope="module")
def engine(tiny_dir: Path, tiny_app_engine: Mapping[str, Any]) -> Engine:
    return Engine.from_pretrained(tiny_dir, **tiny_app_engine)


def _client(base_url: str, **kwargs: Any) -> LocalCompletionsAPI:
    return LocalCompletionsAPI(
        base_url=f"{base_url}/v1/completions", model="tiny", num_concurrent=1, max_retries=1, timeout=120, **kwargs
    )


@pytest.fixture(scope="module", params=["remote", "local"])
def lm(request: pytest.FixtureRequest, base_url: str, tiny_dir: Path, engine: Engine) -> LocalCompletionsAPI:
    """lm_eval's client with the server's tokenizer, or with the checkpoint's
    tokenizer.json loaded by transformers (it has no BOS of its own there: the prefix
    of a rolling window is given as the model's BOS id)."""
    if request.param == "remote":
        return _client(base_url, tokenizer_backend="remote")
    return _client(
        base_url,
        tokenizer_backend="huggingface",
        tokenizer=str(tiny_dir),
        custom_prefix_token_id=engine.config.bos_token_id,
    )


def _engine_logprobs(engine: Engine, prompt: list[int]) -> list[dict[int, float]]:
    """The engine's prompt logprob entries of every prompt token after the first."""
    [output] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    return list(output.prompt_logprobs[1:])


def _score(engine: Engine, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """lm_eval's (loglikelihood, is_greedy) of ``continuation`` after ``context`` from
    the engine's own prompt logprobs, each equal to Engine.prompt_logits' log-softmax
    (the arithmetic is batch-invariant: bit for bit)."""
    prompt = context + continuation
    entries = _engine_logprobs(engine, prompt)[len(context) - 1 :]
    logprobs = [entry[t] for t, entry in zip(continuation, entries)]
    reference = torch.log_softmax(engine.prompt_logits(prompt).logits.float(), dim=-1)
    for position, (token, logprob) in enumerate(zip(continuation, logprobs), start=len(context) - 1):
        assert logprob == float(reference[position, token])
    greedy = all(entry[t] == max(entry.values()) for t, entry in zip(continuation, entries))
    return sum(logprobs), greedy


def test_loglikelihood_equals_the_engines_prompt_logprobs(lm: LocalCompletionsAPI, engine: Engine) -> None:
    """Each (context, continuation) scores, through lm_eval's echo request, the sum of
    the engine's prompt logprobs of the continuation's tokens, and is greedy exactly
    when every one of them is the engine's top token."""
    requests = [Instance("loglikelihood", {}, pair, k) for k, pair in enumerate(PAIRS)]
    scores = lm.loglikelihood(requests, disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(PAIRS, scores):
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        expected, expected_greedy = _score(engine, list(context_ids), list(continuation_ids))
        assert logprob == expected and greedy == expected_greedy


def test_loglikelihood_rolling_equals_the_engines_prompt_logprobs(lm: LocalCompletionsAPI, engine: Engine) -> None:
    """A text's rolling loglikelihood is the engine's prompt logprobs of all its tokens
    after lm_eval's prefix token (one window: the text fits the context)."""
    requests = [Instance("loglikelihood_rolling", {}, (text,), k) for k, text in enumerate(ROLLING)]
    scores = lm.loglikelihood_rolling(requests, disable_tqdm=True)
    for text, logprob in zip(ROLLING, scores):
        expected, _ = _score(engine, [lm.prefix_token_id], list(lm.tok_encode(text)))
        assert logprob == expected


def test_generate_until_equals_the_engines_greedy_text(lm: LocalCompletionsAPI, engine: Engine) -> None:
    """generate_until answers the engine's greedy text of each context, cut at the
    first stop string."""
    until = ["\n\n", " the"]
    requests = [
        Instance("generate_until", {}, (context, {"until": until, "max_gen_toks": MAX_GEN_TOKS}), k)
        for k, context in enumerate(CONTEXTS)
    ]
    texts = lm.generate_until(requests, disable_tqdm=True)
    for context, text in zip(CONTEXTS, texts):
        stops = [*until, *([lm.eos_string] if lm.eos_string else [])]
        params = SamplingParams(max_tokens=MAX_GEN_TOKS, temperature=0, stop=stops)
        [output] = engine.generate([list(lm.tok_encode(context))], params)
        assert text == output.text
