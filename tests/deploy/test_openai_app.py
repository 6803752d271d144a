"""The Ray Serve app end to end: a live local Serve app on the tiny model, driven by the
official ``openai`` client and plain HTTP (started once for the module)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
import ray
from ray import serve

from deploy.app import build_app

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url(tiny_dir: Path) -> Iterator[str]:
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": str(tiny_dir),
        "served_model_name": "tiny",
        "engine": {"block_size": 32, "max_model_len": MAX_MODEL_LEN, "cache_memory_bytes": 64 << 20},
        "ray_actor_options": {"num_cpus": 1},
    }
    serve.run(build_app(args), route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)


def _post(url: str, data: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _metric(base_url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=30).read().decode()
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_completion_stream_and_batch_agree_and_count_usage(client: openai.OpenAI) -> None:
    """A greedy completion streamed concatenates to the non-streamed text; usage counts
    the prompt and generated tokens; token-id prompts give the same answer as text."""
    kwargs = {"model": "tiny", "prompt": "hello world", "max_tokens": 6, "temperature": 0}
    whole = client.completions.create(**kwargs)
    streamed = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == whole.choices[0].text
    assert streamed[-1].usage.completion_tokens == whole.usage.completion_tokens == 6
    assert whole.choices[0].finish_reason == "length"
    ids = client.completions.create(**{**kwargs, "prompt": [267, 316, 89, 280, 276, 295]})
    assert whole.usage.prompt_tokens == 6 and ids.choices[0].text == whole.choices[0].text


def test_n_seed_logprobs_and_stop(client: openai.OpenAI) -> None:
    """n gives n choices; a seed reproduces a sampled run; logprobs carry one entry per
    token with the chosen token's logprob; a stop string ends the text before it."""
    kwargs = {"model": "tiny", "prompt": "abc", "max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 2, "logprobs": 2}
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    lp = first.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    greedy = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    text = greedy.choices[0].text
    stop = text[3:5]
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.find(stop)]


def test_chat_stream_and_batch_agree_with_reasoning(client: openai.OpenAI) -> None:
    """Chat in thinking mode: the streamed reasoning and content deltas join to the
    non-streamed message (the same greedy tokens, parsed whole or delta by delta)."""
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"chat_template_kwargs": {"thinking": True}},
    }
    whole = client.chat.completions.create(**kwargs).choices[0].message
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == (getattr(whole, "reasoning_content", None) or "")
    assert content == (whole.content or "")
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_bad_requests_get_openai_errors(base_url: str, client: openai.OpenAI) -> None:
    """Negative max_tokens, a prompt beyond the context limit and malformed JSON get 400
    with an OpenAI error body naming the field; an unknown model gets 404."""
    with pytest.raises(openai.BadRequestError) as negative:
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert negative.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt=[5] * MAX_MODEL_LEN, max_tokens=4)
    assert "max_model_len" in long.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=4, stream=True, top_p=2.0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    status, body = _post(f"{base_url}/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_64_concurrent_requests_all_complete(client: openai.OpenAI, base_url: str) -> None:
    """64 concurrent completions all finish with their tokens, and the counters move."""
    before = _metric(base_url, "dsv41_generation_tokens_total")

    def one(i: int) -> int:
        r = client.completions.create(model="tiny", prompt=[5 + i, 6, 7], max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        assert list(pool.map(one, range(64))) == [3] * 64
    assert _metric(base_url, "dsv41_generation_tokens_total") >= before + 192
    assert _metric(base_url, "dsv41_time_to_first_token_seconds_count") >= 64


def test_disconnect_mid_stream_aborts_and_frees_pages(client: openai.OpenAI, base_url: str) -> None:
    """A client that leaves a stream early aborts its request: /metrics shows the abort
    and no PAGE held once the engine is idle."""
    aborted = _metric(base_url, "dsv41_requests_aborted_total")
    stream = client.completions.create(
        model="tiny", prompt=[9] * 100, max_tokens=120, temperature=0, extra_body={"ignore_eos": True}, stream=True
    )
    for _ in zip(range(3), stream):
        pass
    stream.close()
    deadline = __import__("time").monotonic() + 30
    while _metric(base_url, "dsv41_requests_aborted_total") < aborted + 1:
        assert __import__("time").monotonic() < deadline, "the disconnect did not abort the request"
        __import__("time").sleep(0.2)
    client.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert _metric(base_url, "dsv41_cache_pages_used") == 0
    assert _metric(base_url, "dsv41_num_requests_running") == 0


def test_models_and_health(base_url: str, client: openai.OpenAI) -> None:
    """/v1/models lists the served name; /health answers 200 while the engine lives."""
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert urllib.request.urlopen(f"{base_url}/health", timeout=30).status == 200
