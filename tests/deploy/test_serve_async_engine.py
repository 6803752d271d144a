"""AsyncEngine (no Ray): one step-loop thread driving a real tiny engine for asyncio
callers, the engine on that thread or in a child process (deploy/engine_process.py):
every property of the shared fixture's tests holds for both placements alike, and on the
thread under async scheduling (outputs a step later, the same tokens)."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from pathlib import Path
from typing import Iterator

import pytest

from dsv41.cluster.engine import Engine
from dsv41.cluster.ranks import DPLayout
from dsv41.cluster.request import CumulativeOutputs, RequestOutput
from dsv41.cluster.sampling_params import SamplingParams, SamplingParamsError
from dsv41.deploy.async_engine import REQUEST_FAILED_MESSAGE, AsyncEngine, EngineDeadError, RequestFailedError
from dsv41.deploy.engine_process import EngineProcess
from dsv41.deploy.metrics import ServingMetrics

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 200, 17, 3], [40, 41, 42], list(range(60, 100))]


ENGINE_OPTIONS = {"block_size": 32, "max_model_len": 256}


@pytest.fixture(scope="module", params=["thread", "thread-async-scheduling", "process"])
def engine(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[AsyncEngine]:
    if request.param.startswith("thread"):
        async_scheduling = request.param == "thread-async-scheduling"
        stepped: Engine | EngineProcess = Engine.from_pretrained(
            tiny_dir, async_scheduling=async_scheduling, **ENGINE_OPTIONS
        )
        interrupt = None
    else:
        stepped = EngineProcess(tiny_dir, ENGINE_OPTIONS)
        interrupt = stepped.interrupt_step
    async_engine = AsyncEngine(stepped, ServingMetrics("t", max_model_len=256), interrupt_step=interrupt)
    yield async_engine
    async_engine.shutdown()
    if isinstance(stepped, EngineProcess):
        stepped.close()


async def _collect(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """The stream's deltas added up: what a client has after each one."""
    whole = CumulativeOutputs()
    stream = engine.generate(request_id, prompt, params)
    return [whole.add(output) or whole.output(output.request_id) async for output in stream]


def _pages_used(engine: AsyncEngine) -> int:
    return sum(rank.pages_used for rank in engine.engine.stats().ranks)


def _idle(engine: AsyncEngine) -> bool:
    """Whether the step loop runs dry within a few seconds: after the last output it
    still runs the step that tells the rank the requests left."""
    deadline = time.monotonic() + 10
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not engine.engine.has_unfinished_requests()


def test_concurrent_streams_are_in_order_and_equal_uninterrupted_runs(engine: AsyncEngine, tiny_dir: Path) -> None:
    """Each stream's deltas add up to a growing sequence (each sum a strict prefix of
    the next: a delta carries one token, or the run of tokens that queued up while its
    consumer was busy), the last one is finished, and concurrent requests end with
    exactly the tokens of an uninterrupted greedy run of the same engine configuration."""
    async def run_all() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(_collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)))

    streams = asyncio.run(run_all())
    want = Engine.from_pretrained(tiny_dir, **ENGINE_OPTIONS).generate(PROMPTS, GREEDY)
    for stream, expected in zip(streams, want):
        lengths = [len(o.token_ids) for o in stream]
        assert lengths[0] >= 1 and lengths[-1] == GREEDY.max_tokens
        assert all(before < after for before, after in zip(lengths, lengths[1:]))
        for before, after in zip(stream, stream[1:]):
            assert after.token_ids[: len(before.token_ids)] == before.token_ids
            assert after.text.startswith(before.text)
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        assert stream[-1].token_ids == expected.token_ids
    assert _idle(engine) and _pages_used(engine) == 0


def test_n_samples_share_one_stream_and_each_finishes(engine: AsyncEngine) -> None:
    """With n > 1 the stream carries every sample ({id}#{i}) and ends once all finished;
    an explicit seed reproduces the samples."""
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=7, n=3)

    def finals() -> dict[str, tuple[int, ...]]:
        outputs = asyncio.run(_collect(engine, "n", PROMPTS[0], params))
        return {o.request_id: o.token_ids for o in outputs if o.finished}

    first = finals()
    assert sorted(first) == ["n#0", "n#1", "n#2"] and all(len(t) == 4 for t in first.values())
    assert finals() == first


def test_consumer_exit_aborts_the_request_and_frees_its_pages(engine: AsyncEngine) -> None:
    """Closing the stream after its first token (a client disconnect) aborts the
    request: the engine holds no request and no PAGE afterwards, and the abort is counted."""
    aborted_before = engine.metrics.value("requests_aborted")

    async def first_then_leave() -> RequestOutput:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        async with aclosing(engine.generate("leaver", PROMPTS[2], params)) as stream:
            async for output in stream:
                return output
        raise AssertionError("no output")

    async def cancelled() -> None:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        task = asyncio.create_task(_collect(engine, "cancelled", PROMPTS[1], params))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    assert len(asyncio.run(first_then_leave()).token_ids) >= 1
    asyncio.run(cancelled())
    # The aborts travel through the command queue; one more request drains it.
    asyncio.run(_collect(engine, "after", PROMPTS[1], GREEDY))
    assert _idle(engine) and _pages_used(engine) == 0
    assert engine.metrics.value("requests_aborted") == aborted_before + 2


def test_refused_request_raises_from_the_stream_and_queues_nothing(engine: AsyncEngine) -> None:
    """A prompt beyond the context limit raises the engine's SamplingParamsError from
    the first iteration; nothing stays queued, and the next request runs."""
    with pytest.raises(SamplingParamsError, match="max_model_len"):
        asyncio.run(_collect(engine, "long", list(range(1, 300)), GREEDY))
    assert _idle(engine) and _pages_used(engine) == 0
    assert asyncio.run(_collect(engine, "next", PROMPTS[1], GREEDY))[-1].finished


class _DyingEngine(Engine):
    """A real engine whose fourth step fails, as a lost device would."""

    steps = 0

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps == 4:
            raise RuntimeError("device lost")
        return super().step()


def test_engine_death_ends_every_request_and_fails_health(tiny_dir: Path) -> None:
    """A step that raises ends every in-flight request with EngineDeadError (whose
    message says only that the step loop failed; the step's exception is its cause),
    marks the engine dead (check_health raises) and refuses later requests at once."""
    engine = AsyncEngine(_DyingEngine.from_pretrained(tiny_dir, block_size=32), ServingMetrics("t", max_model_len=256))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def run_two() -> list[object]:
        return await asyncio.gather(
            _collect(engine, "a", PROMPTS[0], params), _collect(engine, "b", PROMPTS[1], params), return_exceptions=True
        )

    results = asyncio.run(run_two())
    assert all(isinstance(r, EngineDeadError) and str(r) == "the engine step loop failed" for r in results)
    assert all(isinstance(r.__cause__, RuntimeError) and str(r.__cause__) == "device lost" for r in results)
    with pytest.raises(EngineDeadError):
        engine.check_health()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(engine, "c", PROMPTS[0], params))
    assert engine.metrics.value("requests_failed") == 2
    engine.shutdown()


class _RankLosingEngine(Engine):
    """A one-rank DP engine (its rank a thread) that loses its rank at its third step:
    as after a rank failure, every request in flight ends with finish reason "error"
    (``fail_all``: as ``recover`` ends them, but the ranks keep running and are told
    to drop what they hold)."""

    steps = 0

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps == 3:
            return self.fail_all("injected rank failure")
        return super().step()


def test_a_request_the_engine_fails_raises_and_counts_as_failed(tiny_dir: Path) -> None:
    """A request (two samples) the engine ends in error raises RequestFailedError from
    its stream after the snapshots it had, counted once in requests_failed and never
    as a finish reason; the engine serves on: check_health passes and the next request
    gets the tokens of an uninterrupted run."""
    engine = AsyncEngine(_RankLosingEngine.in_process(tiny_dir, DPLayout(1), block_size=32), ServingMetrics("t", max_model_len=256))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, n=2)
    got: list[RequestOutput] = []

    async def run() -> None:
        async for output in engine.generate("doomed", PROMPTS[0], params):
            got.append(output)

    with pytest.raises(RequestFailedError) as failed:
        asyncio.run(run())
    assert str(failed.value) == REQUEST_FAILED_MESSAGE
    assert got and all(not o.finished for o in got)
    engine.check_health()
    after = asyncio.run(_collect(engine, "after", PROMPTS[1], GREEDY))[-1]
    want = Engine.from_pretrained(tiny_dir, block_size=32).generate([PROMPTS[1]], GREEDY)[0]
    assert after.token_ids == want.token_ids
    assert engine.metrics.value("requests_failed") == 1
    assert 'finished_reason="error"' not in engine.metrics.render().decode()
    engine.shutdown()
