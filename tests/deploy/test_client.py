"""The client helpers end to end: the package's tiny application (tests/deploy/conftest.py,
deployed once for the modules on the package's shared cluster; every call here goes
through a DeploymentHandle, none through the HTTP proxy), driven by ``deploy.client``'s
``generate``, ``stream`` and the Ray Data ``complete_dataset``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

import pytest
import ray
import ray.data
from ray.serve.handle import DeploymentHandle
from tokenizers import Tokenizer

from dsv41.deploy.client import complete_dataset, generate, llm_handle, stream
from dsv41.deploy.openai_errors import OpenAIError

ROOT = Path(__file__).resolve().parents[2]
# The name the tiny_app fixture runs the tiny application under.
APP_NAME = "tiny"


@pytest.fixture(scope="module")
def handle(tiny_app: str) -> DeploymentHandle:
    ray.data.DataContext.get_current().enable_progress_bars = False
    return llm_handle(APP_NAME)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


async def _deltas(handle: DeploymentHandle, prompt: Any, **sampling: Any) -> list[dict[str, Any]]:
    return [delta async for delta in stream(handle, prompt, **sampling)]


def test_generate_is_the_joined_stream(handle: DeploymentHandle, tokenizer: Tokenizer) -> None:
    """``generate``'s completion is ``stream``'s deltas joined (text, token ids), with the
    last delta's finish reason and usage; usage counts the prompt and the tokens; a
    token-id prompt gives the same completion as its text."""
    sampling = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = generate(handle, "hello world", **sampling)
    deltas = asyncio.run(_deltas(handle, "hello world", **sampling))
    assert whole["text"] == "".join(d["text"] for d in deltas)
    assert whole["token_ids"] == [t for d in deltas for t in d["token_ids"]]
    assert (whole["finish_reason"], whole["usage"]) == (deltas[-1]["finish_reason"], deltas[-1]["usage"]) != (None, None)
    assert all(d["finish_reason"] is None and d["usage"] is None for d in deltas[:-1])
    ids = tokenizer.encode("hello world").ids
    assert whole["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": len(ids) + 6}
    assert len(whole["token_ids"]) == 6 and whole["finish_reason"] == "length"
    assert generate(handle, ids, **sampling) == whole


def test_refusals_raise_the_server_error(handle: DeploymentHandle) -> None:
    """A request the server refuses raises its OpenAIError (status and the field named)
    from both helpers; an unknown sampling argument is refused before anything is sent;
    ``complete_dataset`` wants exactly one of app_name and handle."""
    with pytest.raises(OpenAIError) as negative:
        generate(handle, "x", max_tokens=-1)
    assert (negative.value.status, negative.value.param) == (400, "max_tokens")
    with pytest.raises(OpenAIError) as top_p:
        asyncio.run(_deltas(handle, "x", max_tokens=2, top_p=2.0))
    assert (top_p.value.status, top_p.value.param) == (400, "top_p")
    with pytest.raises(OpenAIError) as unknown_model:
        generate(handle, "x", model="nope")
    assert unknown_model.value.status == 404
    with pytest.raises(TypeError, match="stream"):
        generate(handle, "x", stream=True)
    ds = ray.data.from_items([{"prompt": "x"}])
    with pytest.raises(ValueError, match="app_name, handle"):
        complete_dataset(ds, app_name=APP_NAME, handle=handle)
    with pytest.raises(ValueError, match="prompt_column"):
        complete_dataset(ds, handle=handle, prompt_column="text")


def test_leaving_a_stream_early_aborts_the_request(handle: DeploymentHandle, metric_value: Callable[[str, str], float]) -> None:
    """A consumer that stops iterating ``stream`` early aborts its request on the server."""

    def aborted() -> float:
        return metric_value(handle.metrics_text.remote().result().decode(), "dsv41:requests_aborted_total")

    before = aborted()

    async def first_delta() -> None:
        async for _ in stream(handle, [9] * 40, max_tokens=200, temperature=0, ignore_eos=True):
            break

    asyncio.run(first_delta())
    for _ in range(100):
        if aborted() >= before + 1:
            return
        asyncio.run(asyncio.sleep(0.1))
    pytest.fail("leaving the stream did not abort the request")


def test_dataset_of_100_prompts_completes_like_single_requests(handle: DeploymentHandle, tokenizer: Tokenizer) -> None:
    """100 prompts through ``complete_dataset`` (two actors, batches of 25): every row
    keeps its columns and gains its completion's text, token ids, finish reason and
    usage; greedy rows equal the same prompt's ``generate`` completion."""
    sampling = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    rows = [{"id": i, "prompt": f"prompt number {i}"} for i in range(100)]
    ds = complete_dataset(
        ray.data.from_items(rows), app_name=APP_NAME, concurrency=2, batch_size=25, **sampling
    )
    done = sorted(ds.take_all(), key=lambda row: row["id"])
    assert [row["id"] for row in done] == list(range(100))
    for row in done:
        prompt_tokens = len(tokenizer.encode(row["prompt"]).ids)
        assert isinstance(row["text"], str) and len(row["token_ids"]) == 4 and row["finish_reason"] == "length"
        assert row["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 4, "total_tokens": prompt_tokens + 4}
    for row in done[::11]:
        single = generate(handle, row["prompt"], **sampling)
        assert (row["text"], list(row["token_ids"])) == (single["text"], single["token_ids"])
