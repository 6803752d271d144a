"""Deltas that queue up while a stream's consumer is busy reach it joined
(``deploy.async_engine.coalesced``): a stream then carries exactly what an uncoalesced
one does (the same tokens, text, finish reason and usage, in order) in fewer chunks; and
the engine thread, which no longer records its load on every step, still records it
while a request decodes and once it is idle. Real tiny engines, no Ray."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import pytest

from dsv41.cluster.engine import Engine
from dsv41.cluster.request import CumulativeOutputs, FinishReason, PhaseTimes, RequestOutput
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.deploy.app_args import AppArgs
from dsv41.deploy.async_engine import LOAD_REFRESH_S, AsyncEngine, _End, coalesced
from dsv41.deploy.llm_server import LLMServer
from dsv41.deploy.metrics import ServingMetrics
from dsv41.deploy.openai_errors import OpenAIError

MODEL = "tiny"
ENGINE = {"block_size": 32, "max_model_len": 256}
PROMPT = [5, 9, 200, 17, 3]


def _delta(sample: str, tokens: tuple[int, ...], text: str, count: int, *, finished: bool = False, **fields: Any) -> RequestOutput:
    return RequestOutput(
        sample, tokens, finished, FinishReason.LENGTH if finished else None, count, text=text, **fields
    )


def test_coalesced_joins_each_run_of_one_sample_and_moves_nothing() -> None:
    """A run of consecutive deltas of one sample becomes one delta: tokens and text in
    order, the run's last finish fields and count, the first token's phase times;
    another sample's delta, a delta with logprobs, an error and the end marker stay
    where they were."""
    phases = PhaseTimes(0.1, 0.2)
    a1 = _delta("r#0", (1,), "a", 1, phase_times=phases)
    a2 = _delta("r#0", (2, 3), "bc", 3)
    b1 = _delta("r#1", (7,), "x", 1)
    a3 = _delta("r#0", (4,), "", 4, finished=True, stop_reason=None)
    lp1 = _delta("s", (5,), "p", 1, logprobs=({5: -0.1},))
    lp2 = _delta("s", (6,), "q", 2, logprobs=({6: -0.2},))
    error, end = RuntimeError("lost"), _End()
    joined = coalesced([a1, a2, b1, a3, lp1, lp2, error, end])
    assert joined[1:] == [b1, a3, lp1, lp2, error, end]
    assert joined[0] == _delta("r#0", (1, 2, 3), "abc", 3, phase_times=phases)
    # A finished delta is the last of its sample: nothing is joined after it.
    assert coalesced([a2, a3]) == [_delta("r#0", (2, 3, 4), "bc", 4, finished=True)]
    assert coalesced([a3, a1]) == [a3, a1]


def test_coalesced_batches_add_up_to_the_uncoalesced_whole_outputs() -> None:
    """However a stream of interleaved deltas of two samples is cut into the batches a
    consumer finds queued, coalescing each batch keeps every sample's whole output (its
    tokens, text, finish and count) and never grows the number of items."""
    rng = random.Random(0)
    for _ in range(200):
        deltas, counts = [], {"r#0": 0, "r#1": 0}
        for _ in range(rng.randint(1, 30)):
            sample = rng.choice(sorted(counts))
            tokens = tuple(rng.randrange(100) for _ in range(rng.randint(0, 2)))
            counts[sample] += len(tokens)
            deltas.append(_delta(sample, tokens, "".join(rng.choice("ab ") for _ in range(rng.randint(0, 3))), counts[sample]))
        for sample, count in counts.items():
            deltas.append(_delta(sample, (9,), "z", count + 1, finished=True))
        cuts = sorted(rng.sample(range(1, len(deltas)), rng.randint(0, len(deltas) - 1)))
        batches = [deltas[i:j] for i, j in zip([0, *cuts], [*cuts, len(deltas)])]
        joined = [item for batch in batches for item in coalesced(batch)]
        assert len(joined) <= len(deltas)
        assert _wholes(joined) == _wholes(deltas)


def _wholes(deltas: list[RequestOutput]) -> dict[str, RequestOutput]:
    whole = CumulativeOutputs()
    finals = {}
    for delta in deltas:
        done = whole.add(delta)
        if done is not None:
            finals[delta.request_id] = done
    return finals


async def _until_idle(engine: Engine) -> None:
    """Waits (without blocking the loop the deliveries run on) until the engine holds
    no request: every output of the request, and its end, are then queued."""
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not go idle"
        await asyncio.sleep(0.01)


def test_a_consumer_back_after_the_end_gets_the_rest_joined(tiny_dir: Path) -> None:
    """A consumer that takes the first delta and comes back once the request finished
    finds the rest queued and gets it as one delta: together the two carry exactly the
    tokens and text of an uninterrupted greedy run."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = AsyncEngine(Engine.from_pretrained(tiny_dir, **ENGINE), ServingMetrics("t", max_model_len=256))
    try:

        async def run() -> list[RequestOutput]:
            stream = engine.generate("late", PROMPT, params)
            outputs = [await anext(stream)]
            await _until_idle(engine.engine)
            outputs += [output async for output in stream]
            return outputs

        outputs = asyncio.run(run())
    finally:
        engine.shutdown()
    want = Engine.from_pretrained(tiny_dir, **ENGINE).generate([PROMPT], params)[0]
    assert len(outputs) == 2 and [o.finished for o in outputs] == [False, True]
    assert outputs[0].phase_times is not None
    assert outputs[0].token_ids + outputs[1].token_ids == want.token_ids
    assert outputs[0].text + outputs[1].text == want.text
    assert outputs[1].num_output_tokens == params.max_tokens and outputs[1].finish_reason == want.finish_reason


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[Any]:
    instance = LLMServer.func_or_class(AppArgs(model=str(tiny_dir), served_model_name=MODEL, engine=ENGINE, ray_metrics=False))
    yield instance
    instance.__del__()


async def _late_items(server: Any, items: AsyncIterator[Any]) -> list[str]:
    """A stream's items, read as a client that leaves the rest queued until its
    request has finished."""
    read = [await anext(items)]
    await _until_idle(server.engine.engine)
    read += [item async for item in items]
    assert not any(isinstance(item, OpenAIError) for item in read)
    return read


def _events(items: list[str]) -> list[Any]:
    """The SSE events of a stream's items, parsed (``[DONE]`` as the string)."""
    events = []
    for event in "".join(items).split("\n\n")[:-1]:
        assert event.startswith("data: ")
        data = event[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("consumer", ["prompt", "late"])
def test_a_streamed_completion_carries_the_whole_answer_coalesced_or_not(server: Any, consumer: str) -> None:
    """A streamed completion's chunks, whether read as they come or left queued until
    the request finished (then joined into one item), add up to the non-streamed answer: its text, finish reason and usage."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    whole = asyncio.run(server.completions(body))

    async def streamed() -> list[str]:
        items = server.completions_stream({**body, "stream": True, "stream_options": {"include_usage": True}})
        if consumer == "late":
            return await _late_items(server, items)
        return [item async for item in items]

    items = asyncio.run(streamed())
    events = _events(items)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    choices = [choice for event in events[:-2] for choice in event["choices"]]
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
    assert [c["finish_reason"] for c in choices][-1] == whole["choices"][0]["finish_reason"]
    assert all(c["finish_reason"] is None for c in choices[:-1])
    if consumer == "late":
        assert len(items) == 3  # the first chunk; the rest in one; the usage and [DONE]
    else:
        assert len(items) > 3


def test_a_late_chat_stream_carries_the_whole_message(server: Any) -> None:
    """A streamed chat answer read late (its deltas joined) has the role chunk first
    and adds up to the non-streamed message's content, finish reason and usage."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me more"}], "max_tokens": 12, "temperature": 0.0}
    whole = asyncio.run(server.chat(body))
    items = asyncio.run(_late_items(server, server.chat_stream({**body, "stream": True, "stream_options": {"include_usage": True}})))
    events = _events(items)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
    deltas = [c["delta"] for event in events[1:-2] for c in event["choices"]]
    message = whole["choices"][0]["message"]
    assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (message.get("reasoning_content") or "")
    assert events[-3]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_the_load_is_recorded_while_a_request_decodes_and_once_idle(tiny_dir: Path) -> None:
    """With no request added or ended, a decoding request's growing PAGE count still
    reaches the gauge (at most LOAD_REFRESH_S late); once the engine is idle the gauges
    read no request and no PAGE."""
    metrics = ServingMetrics("t", max_model_len=256)
    engine = AsyncEngine(Engine.from_pretrained(tiny_dir, **ENGINE), metrics)
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    seen: set[float] = set()
    try:

        async def run() -> None:
            async for output in engine.generate("long", PROMPT, params):
                if not output.finished:
                    seen.add(metrics.value("cache_pages_used"))
                    await asyncio.sleep(LOAD_REFRESH_S / 4)
            await _until_idle(engine.engine)

        asyncio.run(run())
        deadline = time.monotonic() + 10
        while metrics.value("num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.shutdown()
    # 5 + 120 tokens in PAGEs of 32: pages 1 to 4 while it runs.
    assert seen & {2.0, 3.0}, seen
    assert metrics.value("num_requests_running") == metrics.value("num_requests_waiting") == 0
    assert metrics.value("cache_pages_used") == 0
