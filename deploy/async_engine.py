"""The engine of one replica driven for asyncio: one step-loop thread, one stream per request.

Owns :class:`AsyncEngine`: the only thread that ever calls the wrapped engine (a
``SteppedEngine``: ``add_request``, ``step``, ``abort``, ``has_unfinished_requests``,
``stats``; the engine in this process, or one in a child process,
deploy/engine_process.py, whose refusals of adds arrive from ``step``), the thread-safe
command queue that carries adds and aborts to it, and the per-request asyncio queues its
``RequestOutput`` deltas (what each sample gained in a step) are delivered to with
``loop.call_soon_threadsafe``; the deltas of a sample that queued up while its consumer
was busy reach it joined into one (:func:`coalesced`: the same tokens and text, fewer
chunks to stream). A consumer that stops early (cancellation, a client disconnect,
``aclose``) aborts its request, which frees its PAGEs and STATE slot. An exception from
``step`` ends every in-flight request with :class:`EngineDeadError` and marks the engine
dead for good (a replica's health check then fails and Serve replaces it). A request the
engine itself ends in error (finish reason ``error``: its group lost a rank and
restarts) raises :class:`RequestFailedError` from its stream, and the engine serves on.
Either is counted as a failed request, never as a finished one. The messages of both are
fit for a client: what went wrong inside is the error's ``__cause__`` and the log's.
It also measures each sequence's TTFT, inter-token,
decode and end-to-end latency (its queue and prefill times are the engine's,
``RequestOutput.phase_times``), and records the engine's load (``_observe_load``:
not on every step, which every token waits for).

Must not import: ``ray``, ``torch``, ``model``, ``actors``, or the HTTP modules of
``deploy`` (``openai_api``, ``app``); from ``deploy`` only ``deploy.metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Sequence

from dsv41.cluster.interface import RequestRefused, SteppedEngine

from dsv41.cluster.options import EngineError
from dsv41.cluster.request import FinishReason, PhaseTimes, RequestOutput
from dsv41.cluster.sampling_params import SamplingParams, SamplingParamsError
from dsv41.deploy.metrics import EngineLoad, FinishedSequence, ServingMetrics

logger = logging.getLogger(__name__)

# Sample ids of an ``n`` > 1 request are ``{request_id}#{i}`` (EngineClient.add_request).
SAMPLE_ID_SEPARATOR = "#"
# While no request changes, the load gauges are recorded at most this often (scrapes
# and Ray's export read them seconds apart).
LOAD_REFRESH_S = 0.1


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; no request can run on this replica any more."""


class RequestFailedError(RuntimeError):
    """The engine ended this request in error (its group lost a rank, ending every
    request it ran, and restarts); the engine serves on, so a retry can succeed."""


REQUEST_FAILED_MESSAGE = "the engine lost a rank while running this request (its group restarts); retry"


class _End:
    """Delivered after the last snapshot of a request whose samples all finished."""


_END = _End()


@dataclass
class _SampleTiming:
    first_token_time: float | None = None
    last_token_time: float | None = None
    phase_times: PhaseTimes | None = None


@dataclass
class _Stream:
    """The engine thread's record of one request: where its snapshots go and when
    its sequences produced tokens. Touched only on the engine thread."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException | _End]
    num_samples: int
    arrival_time: float
    num_prompt_tokens: int
    admitted: bool = False
    num_finished: int = 0
    samples: dict[str, _SampleTiming] = field(default_factory=dict)

    def deliver(self, item: RequestOutput | BaseException | _End) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
        except RuntimeError:
            # The consumer's loop is closed: nobody reads this stream any more; the
            # consumer's exit already queued (or will queue) the abort.
            logger.debug("dropping an output for a closed event loop")


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    stream: _Stream


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Shutdown:
    pass


_Command = _Add | _Abort | _Shutdown


def _finished_sequence(output: RequestOutput, stream: _Stream, timing: _SampleTiming, now: float) -> FinishedSequence:
    """What a finished sequence's histograms observe: its decode time from when its
    first and last tokens reached this loop, its queue and prefill times the engine's."""
    assert output.finish_reason is not None
    phases = timing.phase_times
    decode = None
    if timing.first_token_time is not None and timing.last_token_time is not None:
        decode = timing.last_token_time - timing.first_token_time
    return FinishedSequence(
        finish_reason=output.finish_reason.value,
        e2e_latency=now - stream.arrival_time,
        num_prompt_tokens=stream.num_prompt_tokens,
        num_generation_tokens=output.num_output_tokens,
        queue_time=None if phases is None else phases.queue_s,
        prefill_time=None if phases is None else phases.prefill_s,
        decode_time=decode,
    )


def _coalescible(output: RequestOutput) -> bool:
    """Whether a delta may be joined with its neighbours: not one with logprobs (a
    chunk's logprob entries and text offsets follow the engine's steps)."""
    return output.logprobs is None and output.prompt_logprobs is None


def coalesced(items: Sequence[RequestOutput | BaseException | _End]) -> list[RequestOutput | BaseException | _End]:
    """``items`` (what queued up for one consumer, in order) with each run of
    consecutive deltas of one sample joined into one delta: its tokens and text those
    of the run in order, its finish fields and token count the run's last, its
    ``phase_times`` the run's (only a first token's delta has them). Anything else, and
    deltas with logprobs, stay as they are and where they are."""
    joined: list[RequestOutput | BaseException | _End] = []
    for item in items:
        last = joined[-1] if joined else None
        if (
            isinstance(item, RequestOutput)
            and isinstance(last, RequestOutput)
            and last.request_id == item.request_id
            and not last.finished
            and _coalescible(last)
            and _coalescible(item)
        ):
            joined[-1] = replace(
                item,
                token_ids=last.token_ids + item.token_ids,
                text=last.text + item.text,
                phase_times=last.phase_times if last.phase_times is not None else item.phase_times,
            )
        else:
            joined.append(item)
    return joined


def parent_request_id(sample_id: str) -> str:
    """The request id a sample id belongs to (itself for ``n`` == 1)."""
    parent, separator, _ = sample_id.rpartition(SAMPLE_ID_SEPARATOR)
    return parent if separator else sample_id


def engine_load(engine: SteppedEngine) -> EngineLoad:
    """What the engine holds now, summed over its DP ranks. Runs on the engine thread."""
    stats = engine.stats()
    ranks = stats.ranks
    return EngineLoad(
        requests_running=stats.requests_running,
        requests_waiting=stats.requests_waiting,
        num_pages=sum(s.num_pages for s in ranks),
        pages_used=sum(s.pages_used for s in ranks),
        prefix_lookup_tokens=sum(s.lookup_tokens for s in ranks),
        prefix_hit_tokens=sum(s.hit_tokens for s in ranks),
        preemptions=sum(stats.preemptions),
        pages_cached=sum(s.pages_cached for s in ranks),
        num_slots=sum(s.num_slots for s in ranks),
        slots_used=sum(s.slots_used for s in ranks),
        images=sum(s.images for s in ranks),
        image_pages=sum(s.image_pages for s in ranks),
        evictions=sum(s.evictions for s in ranks),
        image_evictions=sum(s.image_evictions for s in ranks),
        offload_fetched_pages=sum(s.fetched_pages for s in ranks),
        prefix_replayed_tokens=sum(s.replayed_tokens for s in ranks),
        offload_fetched_images=sum(s.fetched_images for s in ranks),
    )


class AsyncEngine:
    """A SteppedEngine driven for asyncio callers (see the module docstring).

    ``generate`` yields the ``RequestOutput`` deltas of every sample of the request
    (ids ``{request_id}#{i}`` when ``params.n`` > 1) until all have finished,
    consecutive deltas of a sample that were waiting together joined (:func:`coalesced`).
    A request the engine refuses raises its ``EngineError`` / ``SamplingParamsError``
    from the first iteration, with nothing queued.

    ``interrupt_step``: for an engine whose ``step`` waits for another process
    (``EngineProcess.interrupt_step``), called after each queued command, so the step
    loop stops waiting and sends it before the engine's next step, not after it."""

    def __init__(
        self,
        engine: SteppedEngine,
        metrics: ServingMetrics,
        *,
        name: str = "dsv41-engine",
        interrupt_step: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self._interrupt_step = interrupt_step
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._dead_reason: str | None = None
        # Held while deciding death and while queueing an add, so that no add is
        # queued after the engine thread's final drain of the command queue.
        self._lock = threading.Lock()
        self._closed = False
        self._next_load_record = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the asyncio side -------------------------------------------------------------

    def check_health(self) -> None:
        """Raises EngineDeadError once the step loop has failed or stopped."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if SAMPLE_ID_SEPARATOR in request_id:
            raise EngineError(f"request_id: {request_id!r} contains {SAMPLE_ID_SEPARATOR!r} (sample ids use it)")
        outputs: asyncio.Queue[RequestOutput | BaseException | _End] = asyncio.Queue()
        prompt = tuple(prompt_token_ids)
        stream = _Stream(asyncio.get_running_loop(), outputs, params.n, time.monotonic(), len(prompt))
        with self._lock:
            self.check_health()
            self._command(_Add(request_id, prompt, params, stream))
        completed = False
        try:
            while True:
                items = [await outputs.get()]
                while not outputs.empty():
                    items.append(outputs.get_nowait())
                for item in coalesced(items):
                    if isinstance(item, _End):
                        completed = True
                        return
                    if isinstance(item, BaseException):
                        completed = True
                        raise item
                    yield item
        finally:
            if not completed:
                self._command(_Abort(request_id))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops the step loop; in-flight requests end with EngineDeadError."""
        if not self._closed:
            self._closed = True
            self._command(_Shutdown())
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise EngineDeadError(f"the engine thread did not stop within {timeout_s} s (a step is stuck)")

    def _command(self, command: _Command) -> None:
        self._commands.put(command)
        if self._interrupt_step is not None:
            self._interrupt_step()

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                commands = self._take_commands(block=not self.engine.has_unfinished_requests())
                for command in commands:
                    if isinstance(command, _Shutdown):
                        self._die("the engine was shut down", None)
                        return
                    if isinstance(command, _Add):
                        self._add(command)
                    else:
                        self._abort(command.request_id)
                ended = False
                if self.engine.has_unfinished_requests():
                    try:
                        outputs = self.engine.step()
                    except RequestRefused as refused:
                        self._refuse(refused)
                    else:
                        ended = self._deliver(outputs, time.monotonic())
                self._observe_load(changed=bool(commands) or ended)
        except BaseException as exc:  # noqa: BLE001 - any failure of the engine ends every request
            logger.exception("the engine step loop failed")
            self._die("the engine step loop failed", exc)

    def _observe_load(self, *, changed: bool) -> None:
        """Records the engine's load when its requests changed (added, aborted, ended),
        when it is idle, and otherwise at most every LOAD_REFRESH_S: reading and
        recording it is some 18 metric records, which a decode step that changes no
        request would add to the time of every token."""
        now = time.monotonic()
        if changed or now >= self._next_load_record or not self.engine.has_unfinished_requests():
            self.metrics.observe_load(engine_load(self.engine))
            self._next_load_record = now + LOAD_REFRESH_S

    def _take_commands(self, *, block: bool) -> list[_Command]:
        """Every queued command; waits for the first one only when the engine is idle."""
        commands: list[_Command] = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except (EngineError, SamplingParamsError) as exc:
            command.stream.deliver(exc)
            return
        self._streams[command.request_id] = command.stream

    def _refuse(self, refused: RequestRefused) -> None:
        """Delivers the refusal of an add its engine answered late (nothing was queued)."""
        stream = self._streams.pop(refused.request_id, None)
        if stream is not None:
            stream.deliver(refused.error)

    def _abort(self, request_id: str) -> None:
        # A request that finished (or was refused) before the abort arrived has no stream.
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            self.metrics.observe_aborted()

    def _deliver(self, outputs: list[RequestOutput], now: float) -> bool:
        """Hands each output to its stream; True when a sample finished or failed."""
        ended = False
        for output in outputs:
            request_id = parent_request_id(output.request_id)
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            timing = stream.samples.setdefault(output.request_id, _SampleTiming())
            if output.token_ids:
                first = timing.last_token_time is None
                self.metrics.observe_tokens(
                    len(output.token_ids),
                    first_token_latency=now - stream.arrival_time if first else None,
                    gap=None if timing.last_token_time is None else now - timing.last_token_time,
                    num_prompt_tokens=stream.num_prompt_tokens,
                )
                if first:
                    timing.first_token_time = now
                    timing.phase_times = output.phase_times
                timing.last_token_time = now
            ended |= output.finished
            if output.finish_reason == FinishReason.ERROR:
                self._fail(request_id, stream)
                continue
            if output.finished:
                assert output.finish_reason is not None
                self.metrics.observe_finished(_finished_sequence(output, stream, timing, now))
                stream.num_finished += 1
            stream.deliver(output)
            if output.finished and stream.num_finished == stream.num_samples:
                del self._streams[request_id]
                stream.deliver(_END)
        return ended

    def _fail(self, request_id: str, stream: _Stream) -> None:
        """Ends a request one of whose samples the engine ended in error (any
        sibling still running is aborted: the request fails as a whole)."""
        del self._streams[request_id]
        self.engine.abort(request_id)
        self.metrics.observe_failed()
        stream.deliver(RequestFailedError(REQUEST_FAILED_MESSAGE))

    def _die(self, reason: str, cause: BaseException | None) -> None:
        """Marks the engine dead and ends every in-flight and queued request."""
        with self._lock:
            self._dead_reason = reason

        def dead() -> EngineDeadError:
            error = EngineDeadError(reason)
            error.__cause__ = cause
            return error

        # Metrics before deliveries: a consumer woken by its error may read them at once.
        for stream in self._streams.values():
            self.metrics.observe_failed()
            stream.deliver(dead())
        self._streams.clear()
        for command in self._take_commands(block=False):
            if isinstance(command, _Add):
                self.metrics.observe_failed()
                command.stream.deliver(dead())

