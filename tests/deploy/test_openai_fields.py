"""The OpenAI and vLLM fields real clients send, over HTTP to a live Serve app on the
tiny model, through the official ``openai`` client (``extra_body`` for vLLM's extras)
and plain HTTP where the client has no call: echo and prompt logprobs, max_tokens 0,
max_completion_tokens, skip_special_tokens, spaces_between_special_tokens, logprob
bytes, streamed text, the tokenizer endpoints, /version, models.retrieve and the error
shape of what is refused. Expected values come from an in-process Engine on the same
checkpoint and options (a seeded or greedy run is the same token stream there) and
from the tokenizer itself."""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path
from typing import Any, Callable, Mapping

import openai
import pytest
import requests
from tokenizers import Tokenizer

from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.deploy.chat_parser import OUTPUT_MARKERS
from dsv41.deploy.chat_protocol import PromptEncoder, render_pieces

PROMPT = "hello world, the quick brown fox"
# A sampled run long enough to hold special tokens and byte tokens that split a character.
SAMPLED = {"temperature": 1.0, "seed": 5, "max_tokens": 96}


@pytest.fixture(scope="module")
def base_url(tiny_app: str) -> str:
    return tiny_app


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path, tiny_app_engine: Mapping[str, Any]) -> Engine:
    return Engine.from_pretrained(tiny_dir, **tiny_app_engine)


@pytest.fixture(scope="module")
def tokenizer(engine: Engine) -> Tokenizer:
    return engine.tokenizer


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def _specials(tokenizer: Tokenizer) -> dict[int, str]:
    return {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


def _error(response: requests.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    return error


def test_echo_with_max_tokens_0_answers_the_prompt_and_its_logprobs(
    client: openai.OpenAI, engine: Engine, tokenizer: Tokenizer
) -> None:
    """echo with max_tokens 0 (lm_eval's and vLLM's scoring request): the text is the
    prompt, one logprob entry per prompt token, None for the first and the engine's
    prompt logprob (with the top alternatives) for each other; nothing is generated."""
    answer = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0, logprobs=2)
    [choice] = answer.choices
    prompt = _ids(tokenizer, PROMPT)
    [reference] = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [entry[t] for t, entry in zip(prompt[1:], reference.prompt_logprobs[1:])]
    for top, entry in zip(lp.top_logprobs[1:], reference.prompt_logprobs[1:]):
        assert max(top.values()) == max(entry.values())
    assert lp.text_offset == [sum(map(len, lp.tokens[:k])) for k in range(len(prompt))]


def test_echo_puts_the_prompt_before_the_completion_streamed_or_not(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    """echo with max_tokens > 0 answers prompt + the completion a request without echo
    gets, logprobs the prompt's then the completion's; streamed, the chunks join to the
    same text and the same logprob tokens (the prompt on the first chunk). A token-id
    prompt echoes its decode."""
    kwargs = {"model": "tiny", "max_tokens": 5, "temperature": 0, "logprobs": 1, "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(prompt=PROMPT, **kwargs).choices[0]
    echoed = client.completions.create(prompt=PROMPT, echo=True, **kwargs).choices[0]
    assert echoed.text == PROMPT + plain.text
    prompt_len = len(_ids(tokenizer, PROMPT))
    assert echoed.logprobs.tokens[prompt_len:] == plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[prompt_len:] == plain.logprobs.token_logprobs
    chunks = list(client.completions.create(prompt=PROMPT, echo=True, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == echoed.text
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == echoed.logprobs.tokens
    ids = [3, *_ids(tokenizer, " fox")]
    by_ids = client.completions.create(model="tiny", prompt=ids, echo=True, max_tokens=0)
    assert by_ids.choices[0].text == tokenizer.decode(ids, skip_special_tokens=False)
    assert by_ids.choices[0].logprobs is None


def test_prompt_logprobs_are_vllms(base_url: str, client: openai.OpenAI, engine: Engine, tokenizer: Tokenizer) -> None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id:
    {logprob, rank, decoded_token}} holding the top-k with ranks 1..k and the prompt's
    own token (rank None when outside the top-k), its logprob the engine's."""
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1})
    field = answer.choices[0].model_extra["prompt_logprobs"]
    prompt = _ids(tokenizer, PROMPT)
    [reference] = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert field[0] is None and len(field) == len(prompt)
    for token, entry, expected in zip(prompt[1:], field[1:], reference.prompt_logprobs[1:]):
        assert {int(k): v["logprob"] for k, v in entry.items()} == expected
        ranks = {int(k): v["rank"] for k, v in entry.items()}
        assert sorted(r for r in ranks.values() if r is not None) == [1]
        assert ranks[token] == (1 if len(expected) == 1 else None)
        assert all(v["decoded_token"] == tokenizer.decode([int(k)], skip_special_tokens=False) for k, v in entry.items())
    streamed = requests.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "stream": True, "prompt_logprobs": 1},
        timeout=120,
    )
    _error(streamed, 400, "prompt_logprobs")
    without_echo = requests.post(f"{base_url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 0}, timeout=120)
    assert "echo" in _error(without_echo, 400, "max_tokens")["message"]


def test_max_completion_tokens_on_completions(base_url: str, client: openai.OpenAI) -> None:
    """max_completion_tokens bounds a completion as max_tokens does; giving both is refused."""
    answer = client.completions.create(
        model="tiny", prompt=PROMPT, temperature=0, extra_body={"max_completion_tokens": 3, "ignore_eos": True}
    )
    assert answer.usage.completion_tokens == 3 and answer.choices[0].finish_reason == "length"
    both = requests.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "max_completion_tokens": 3},
        timeout=120,
    )
    _error(both, 400, "max_tokens")


def _sampled_ids(engine: Engine, prompt: list[int]) -> list[int]:
    [output] = engine.generate([prompt], SamplingParams(**SAMPLED, ignore_eos=True))
    return list(output.token_ids)



def test_skip_special_tokens_on_completions(
    client: openai.OpenAI, engine: Engine, tokenizer: Tokenizer, concurrently: Callable[[list[Callable[[], Any]]], list[Any]]
) -> None:
    """A completion's text is the tokenizer's decode of its tokens with special tokens
    skipped by default (vLLM's), kept with skip_special_tokens false; streamed, the
    chunks join to it, no chunk holding part of a character (the run splits some);
    spaces_between_special_tokens either way gives the same text (ByteLevel decoding)."""
    kwargs = {"model": "tiny", "prompt": PROMPT, **SAMPLED}
    flags = [(skip, spaces) for skip in (True, False) for spaces in (True, False)]

    def text(skip: bool, spaces: bool) -> str:
        body = {"ignore_eos": True, "skip_special_tokens": skip, "spaces_between_special_tokens": spaces}
        return client.completions.create(**kwargs, extra_body=body).choices[0].text

    def default() -> str:
        return client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text

    def chunks() -> str:
        stream = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in stream)

    calls: list[Callable[[], Any]] = [lambda skip=skip, spaces=spaces: text(skip, spaces) for skip, spaces in flags]
    reference = functools.partial(_sampled_ids, engine, _ids(tokenizer, PROMPT))
    *answers, default_text, streamed, ids = concurrently([*calls, default, chunks, reference])
    texts = dict(zip(flags, answers))
    assert set(ids) & set(_specials(tokenizer)), "the sampled run holds no special token"
    assert any(tokenizer.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids))), "no token splits a character"
    assert texts[True, True] == texts[True, False] == tokenizer.decode(ids, skip_special_tokens=True)
    assert texts[False, True] == texts[False, False] == tokenizer.decode(ids, skip_special_tokens=False)
    assert default_text == streamed == texts[True, True]


def test_chat_skips_special_tokens_but_the_parsers_markers(
    client: openai.OpenAI, engine: Engine, tokenizer: Tokenizer, concurrently: Callable[[list[Callable[[], Any]]], list[Any]]
) -> None:
    """A chat answer's content holds no special token by default but the markers its
    parser reads (they are not special text to it: </think> ends reasoning); with
    skip_special_tokens false the sampled special tokens are in it, the same with
    spaces_between_special_tokens false (ByteLevel decoding). Logprob bytes are
    each token's own bytes: joined they decode to the tokenizer's decode of the ids."""
    messages = [{"role": "user", "content": "hi"}]
    prompt = PromptEncoder(tokenizer).encode_pieces(render_pieces(messages))
    kwargs = {"model": "tiny", "messages": messages, **SAMPLED, "logprobs": True, "top_logprobs": 1}
    bodies = [
        {"ignore_eos": True},
        {"ignore_eos": True, "skip_special_tokens": False},
        {"ignore_eos": True, "skip_special_tokens": False, "spaces_between_special_tokens": False},
    ]
    calls: list[Callable[[], Any]] = [
        lambda body=body: client.chat.completions.create(**kwargs, extra_body=body).choices[0] for body in bodies
    ]
    default, kept, unspaced, ids = concurrently([*calls, functools.partial(_sampled_ids, engine, prompt)])
    specials = _specials(tokenizer)
    dropped = {specials[t] for t in ids if t in specials} - set(OUTPUT_MARKERS)
    assert dropped, "the sampled run holds no special token the chat answer drops"
    assert not any(s in (default.message.content or "") for s in dropped)
    assert any(s in (kept.message.content or "") for s in dropped)
    assert unspaced.message.content == kept.message.content
    items = default.logprobs.content
    assert [item.token for item in items] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    joined = bytes(b for item in items for b in item.bytes)
    assert joined.decode("utf-8", errors="replace") == tokenizer.decode(ids, skip_special_tokens=False)
    assert any("\ufffd" in item.token and b"\xef\xbf\xbd" not in bytes(item.bytes) for item in items)


def test_tokenize_and_detokenize_answer_as_vllm(base_url: str, tokenizer: Tokenizer, tiny_app_engine: Mapping[str, Any]) -> None:
    """/tokenize of a prompt is the tokenizer's encoding (add_special_tokens as asked,
    token strings when asked), of messages the chat prompt's ids; /detokenize inverts
    it; both refuse what they cannot read with the OpenAI error shape."""
    answer = requests.post(f"{base_url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}, timeout=60).json()
    ids = tokenizer.encode(PROMPT).ids
    assert answer == {
        "count": len(ids),
        "max_model_len": tiny_app_engine["max_model_len"],
        "tokens": ids,
        "token_strs": [tokenizer.id_to_token(t) for t in ids],
    }
    plain = requests.post(f"{base_url}/tokenize", json={"model": "tiny", "prompt": "<｜User｜>x", "add_special_tokens": False}, timeout=60)
    assert plain.json()["tokens"] == tokenizer.encode("<｜User｜>x", add_special_tokens=False).ids
    messages = [{"role": "user", "content": "hi"}]
    chat = requests.post(f"{base_url}/tokenize", json={"messages": messages}, timeout=60).json()
    assert chat["tokens"] == PromptEncoder(tokenizer).encode_pieces(render_pieces(messages)) and chat["token_strs"] is None
    back = requests.post(f"{base_url}/detokenize", json={"tokens": ids}, timeout=60).json()
    assert back == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    _error(requests.post(f"{base_url}/tokenize", json={"prompt": 5}, timeout=60), 400, "prompt")
    _error(requests.post(f"{base_url}/tokenize", json={"prompt": "x", "bogus": 1}, timeout=60), 400, "bogus")
    _error(requests.post(f"{base_url}/detokenize", json={"tokens": [10**6]}, timeout=60), 400, "tokens")
    assert _error(requests.post(f"{base_url}/detokenize", json={"model": "nope", "tokens": [1]}, timeout=60), 404, "model")[
        "code"
    ] == "model_not_found"
    _error(requests.get(f"{base_url}/tokenize", timeout=60), 405, None)


def test_tokenizer_info_version_and_models_retrieve(base_url: str, client: openai.OpenAI, engine: Engine) -> None:
    """/tokenizer_info names the class and the BOS/EOS/pad strings and every added
    token; /version is the installed dsv41's; models.retrieve finds the served model
    and answers another with a 404 in the OpenAI shape, as unknown paths are."""
    info = requests.get(f"{base_url}/tokenizer_info", timeout=60).json()
    tokenizer = engine.tokenizer
    config = engine.config
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == tuple(
        tokenizer.id_to_token(i) for i in (config.bos_token_id, config.eos_token_id, config.pad_token_id)
    )
    assert {int(k): v["content"] for k, v in info["added_tokens_decoder"].items()} == {
        i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()
    }
    assert requests.get(f"{base_url}/version", timeout=60).json() == {"version": importlib.metadata.version("dsv41")}
    model = client.models.retrieve("tiny")
    assert (model.id, model.object) == ("tiny", "model")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert missing.value.body["code"] == "model_not_found"
    _error(requests.get(f"{base_url}/nope", timeout=60), 404, None)
