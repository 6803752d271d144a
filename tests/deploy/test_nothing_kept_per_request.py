"""After requests end, an LLM server keeps nothing of them: a random mix of completions
and chats (whole, streamed, streams the client leaves after the first event, ``n`` > 1,
token streams, refusals) run concurrently through the LLMServer class on a real tiny
engine (no Ray), and afterwards no per-request object is alive anywhere in the process,
no string of a request's id is reachable from the server, no task is left on the loop,
the engine holds no request, PAGE or slot, and the heap trimmer sees the server idle."""

from __future__ import annotations

import asyncio
import gc
import random
import re
import time
import types
from contextlib import aclosing
from pathlib import Path
from typing import Any, Iterator

import pytest

from dsv41.cluster.request import Request, RequestOutput
from dsv41.deploy.app_args import AppArgs
from dsv41.deploy.async_engine import _SampleTiming, _Stream
from dsv41.deploy.llm_server import LLMServer
from dsv41.deploy.openai_errors import OpenAIError
from dsv41.deploy.openai_responses import ChatStreamWriter, CompletionWriter

MODEL = "tiny"
REQUESTS = 48
CONCURRENCY = 12
IDLE_S = 0.3
# The engine's request ids (LLMServer._run): uuid4 hex, the prompt's index, a sample's.
REQUEST_ID = re.compile(r"^[0-9a-f]{32}-\d+(#\d+)?$")
PER_REQUEST_TYPES = (Request, RequestOutput, _Stream, _SampleTiming, CompletionWriter, ChatStreamWriter)
# Not walked: what leads from an object to every module's globals rather than to its state.
NOT_STATE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.FrameType)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def server(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[Any]:
    args = AppArgs(
        model=str(tiny_dir),
        served_model_name=MODEL,
        engine={"block_size": 32, "max_model_len": 256, "max_num_seqs": 8, "async_scheduling": request.param},
        ray_metrics=False,
        heap_trim_idle_s=IDLE_S,
    )
    instance = LLMServer.func_or_class(args)
    yield instance
    instance.__del__()


def _body(rng: random.Random, vocab: int, *, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": [rng.randrange(vocab) for _ in range(rng.randint(1, 40))],
        "max_tokens": rng.randint(1, 12),
        "n": rng.choice([1, 1, 2]),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": stream,
    }


def _chat(rng: random.Random, *, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(rng.choice(["hi", "tell", "me", "more"]) for _ in range(5))}],
        "max_tokens": rng.randint(1, 10),
        "stream": stream,
    }


async def _one(server: Any, rng: random.Random, index: int) -> str:
    """One request of a random kind, consumed the way its client would; its kind."""
    vocab = server.vocab_size
    kind = rng.choice(["completion", "stream", "leave", "chat", "chat_stream", "tokens", "refused"])
    if kind == "completion":
        assert not isinstance(await server.completions(_body(rng, vocab, stream=False), f"c{index}"), OpenAIError)
    elif kind == "stream":
        events = [e async for e in server.completions_stream(_body(rng, vocab, stream=True), f"s{index}")]
        assert events[-1] == "data: [DONE]\n\n"
    elif kind == "leave":
        body = {**_body(rng, vocab, stream=True), "max_tokens": 200, "ignore_eos": True}
        async with aclosing(server.completions_stream(body, f"l{index}")) as events:
            await anext(events)
    elif kind == "chat":
        assert not isinstance(await server.chat(_chat(rng, stream=False), f"h{index}"), OpenAIError)
    elif kind == "chat_stream":
        events = [e async for e in server.chat_stream(_chat(rng, stream=True), f"t{index}")]
        assert events[-1] == "data: [DONE]\n\n"
    elif kind == "tokens":
        body = {"prompt": [rng.randrange(vocab) for _ in range(5)], "max_tokens": 4}
        items = [item async for item in server.generate_stream(body, f"g{index}")]
        assert items[-1]["finish_reason"] is not None
    else:
        body = {**_body(rng, vocab, stream=False), "prompt": [vocab + 1]}
        assert isinstance(await server.completions(body, f"r{index}"), OpenAIError)
    return kind


async def _workload(server: Any) -> set[str]:
    rng = random.Random(14)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def bounded(index: int) -> str:
        async with gate:
            return await _one(server, rng, index)

    kinds = set(await asyncio.gather(*(bounded(i) for i in range(REQUESTS))))
    # The aborts of the streams left early travel to the engine thread; wait for them.
    deadline = time.monotonic() + 30
    while server.engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert asyncio.all_tasks() == {asyncio.current_task()}, "a task outlived its request"
    return kinds


def _reachable_request_ids(root: object) -> set[str]:
    """Every string shaped like an engine request id reachable from ``root`` through
    its state (containers and instances, not modules, classes or functions)."""
    seen, found, stack = {id(root)}, set(), [root]
    while stack:
        node = stack.pop()
        # The collector does not visit a dict's string keys (they make no cycles).
        keys = list(node) if isinstance(node, dict) else []
        for child in [*keys, *gc.get_referents(node)]:
            if isinstance(child, str):
                if REQUEST_ID.match(child):
                    found.add(child)
            elif id(child) not in seen and not isinstance(child, NOT_STATE):
                seen.add(id(child))
                stack.append(child)
    return found


def test_nothing_of_a_request_outlives_it(server: Any) -> None:
    """See the module docstring: every kind of request ran, then nothing of any remains."""
    kinds = asyncio.run(_workload(server))
    assert kinds == {"completion", "stream", "leave", "chat", "chat_stream", "tokens", "refused"}
    gc.collect()
    alive = [type(o).__name__ for o in gc.get_objects() if isinstance(o, PER_REQUEST_TYPES)]
    assert alive == []
    assert _reachable_request_ids(server) == set()
    stats = server.engine.engine.stats()
    assert (stats.requests_running, stats.requests_waiting) == (0, 0)
    assert all(rank.pages_used == 0 and rank.slots_used == 0 for rank in stats.ranks)
    heap_trim = server._heap_trim
    assert heap_trim.in_flight == 0
    deadline = time.monotonic() + 10
    while heap_trim.trims == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert heap_trim.trims >= 1, "the trimmer never saw the server idle"
