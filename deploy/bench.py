"""The serving benchmark behind ``dsv41 bench``: one workload, two drivers, one report.

Owns the two drivers that replay a workload (deploy/bench_workload.py: the workload,
the per-request records and the report) — an OpenAI-compatible endpoint over
streaming HTTP, and an in-process ``cluster.engine.Engine`` stepped directly — and
the ``dsv41 bench`` command around them. Running the same workload both ways gives
the Serve overhead (TTFT through Serve against the in-process engine).

Must not import: ``ray``, ``actors``, ``torch`` at module level. ``aiohttp`` is imported
by the HTTP driver and ``cluster`` / ``model`` by the in-process driver only, so the
CLI's argument parsing stays light.

Definitions, shared by both drivers so their numbers compare:
- A request's clock starts when it is sent (its Poisson arrival, or later when the
  concurrency cap holds it back) and its first token is the first chunk (engine step)
  that carries visible output.
- TTFT: first token - sent. E2EL: last event of the request - sent. ITL: the gaps
  between successive output-carrying chunks (a chunk carrying several tokens is one
  gap, as in vLLM's and SGLang's clients). TPOT: (E2EL - TTFT) / (output tokens - 1),
  for requests with more than one output token.
- Output tokens come from the server's ``usage`` (``stream_options.include_usage``)
  when it reports them, else from the number of output-carrying chunks (a lower bound
  when a chunk carries several tokens); in-process, from the engine's output. Input
  tokens come from ``usage`` or the known length of the prompt's ids. The summary says
  how many requests took each source.
- Throughputs divide the successful requests' totals by the benchmark duration (first
  send to last completion). Failed requests count in no throughput or latency; they
  are counted and their errors reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from dsv41.deploy.bench_workload import (
    DEFAULT_REQUEST_TIMEOUT_S,
    ENDPOINTS,
    FAILED_FINISH_REASONS,
    PROGRESS_STEPS,
    BenchError,
    BenchPrompt,
    BenchReport,
    Endpoint,
    Progress,
    RequestRecord,
    Workload,
)

if TYPE_CHECKING:
    import aiohttp

    from dsv41.cluster.engine import Engine

# -- the HTTP driver -------------------------------------------------------------------


@dataclass(frozen=True)
class HttpTarget:
    """An OpenAI-compatible server: ``base_url`` ends in ``/v1``; ``model`` is the
    name the server serves."""

    base_url: str
    model: str
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchError(
                f"base_url: {self.base_url!r} (allowed: an http:// or https:// URL, e.g. http://host:8000/v1)"
            )
        if not self.model:
            raise BenchError("model: empty (allowed: the model name the server serves)")
        if not self.request_timeout_s > 0:
            raise BenchError(f"request_timeout_s: {self.request_timeout_s!r} (allowed: a number > 0)")

    def url(self, endpoint: Endpoint) -> str:
        path = {"completions": "completions", "chat": "chat/completions"}[endpoint]
        return f"{self.base_url.rstrip('/')}/{path}"

    def payload(self, workload: Workload, prompt: BenchPrompt) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": workload.output_len,
            "temperature": workload.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if workload.ignore_eos:
            body["ignore_eos"] = True
        if workload.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt.prompt}]
        else:
            body["prompt"] = list(prompt.prompt) if isinstance(prompt.prompt, tuple) else prompt.prompt
        return body


def run_http(target: HttpTarget, workload: Workload, progress: Progress | None = None) -> BenchReport:
    """Replays ``workload`` against ``target`` with streaming requests."""
    return asyncio.run(run_http_async(target, workload, progress))


async def run_http_async(target: HttpTarget, workload: Workload, progress: Progress | None = None) -> BenchReport:
    import aiohttp

    prompts = workload.prompts()
    offsets = workload.arrival_offsets()
    tracker = _ProgressTracker(workload.num_prompts, progress)
    cap = asyncio.Semaphore(workload.max_concurrency) if workload.max_concurrency else None
    url = target.url(workload.endpoint)
    timeout = aiohttp.ClientTimeout(total=target.request_timeout_s)
    # limit=0: the workload's own cap decides concurrency, not the connection pool.
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()

        async def one(index: int) -> RequestRecord:
            async with cap or contextlib.nullcontext():
                prompt = prompts[index]
                record = await _stream_one(
                    session, url, target.payload(workload, prompt), prompt, index, start, workload.endpoint
                )
            tracker.done(record)
            return record

        tasks = []
        for index, offset in enumerate(offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    target_json = {"base_url": target.base_url, "model": target.model, "endpoint": workload.endpoint}
    return BenchReport.build("http", target_json, workload, records, duration)


class _StreamState:
    """What one streamed response has shown so far."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.token_times: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.error = ""

    def take(self, event: dict[str, Any], now: float, endpoint: Endpoint) -> None:
        if "error" in event:
            error = event["error"]
            self.error = f"stream error: {error.get('message', error) if isinstance(error, dict) else error}"
            return
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            if _carries_output(choice, endpoint):
                self.token_times.append(now)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def record(self, index: int, start: float, end: float, prompt: BenchPrompt) -> RequestRecord:
        usage = self.usage or {}
        completion_tokens = usage.get("completion_tokens")
        prompt_tokens = usage.get("prompt_tokens")
        error = self.error
        if not error and not self.done:
            error = "stream ended before data: [DONE]"
        if not error and self.finish_reason in FAILED_FINISH_REASONS:
            error = f"finish_reason: {self.finish_reason}"
        if not error and not self.token_times:
            error = "stream carried no output"
        return RequestRecord(
            index=index,
            sent_s=self.sent - start,
            success=not error,
            latency_s=end - self.sent,
            ttft_s=self.token_times[0] - self.sent if self.token_times else None,
            itl_s=tuple(np.diff(self.token_times).tolist()),
            input_tokens=prompt_tokens if isinstance(prompt_tokens, int) else prompt.num_tokens,
            output_tokens=completion_tokens if isinstance(completion_tokens, int) else len(self.token_times),
            output_tokens_source="usage" if isinstance(completion_tokens, int) else "chunks",
            finish_reason=self.finish_reason,
            error=error,
        )


def _carries_output(choice: dict[str, Any], endpoint: Endpoint) -> bool:
    """Whether a streamed choice shows the user output. The role-only opening chunk of
    a chat stream, the closing finish_reason chunk, and an empty-text chunk (a token
    held back mid-character) show nothing, so none of them is a token event."""
    if endpoint == "completions":
        return bool(choice.get("text"))
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


async def _stream_one(session: "aiohttp.ClientSession", url: str, payload: dict[str, Any], prompt: BenchPrompt,
                      index: int, start: float, endpoint: Endpoint) -> RequestRecord:
    import aiohttp

    state = _StreamState(time.perf_counter())
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                state.error = f"HTTP {response.status}: {body}"
            else:
                async for raw in response.content:
                    line = raw.decode("utf-8").strip()
                    # Blank lines end SSE events; ':' lines are comments (keep-alives).
                    if not line or line.startswith(":") or not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        state.done = True
                        break
                    state.take(json.loads(data), time.perf_counter(), endpoint)
                    if state.error:
                        break
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        state.error = f"{type(exc).__name__}: {exc}"
    return state.record(index, start, time.perf_counter(), prompt)


# -- the in-process driver ---------------------------------------------------------------


def run_in_process(engine: "Engine", workload: Workload, progress: Progress | None = None) -> BenchReport:
    """Replays ``workload`` on ``engine`` (idle, in this process), stepping it directly:
    a request is added once its arrival time has come and the concurrency cap has room,
    and its clock starts at that arrival (or at the moment a slot freed, when the cap
    held it back), as a server's queue would count it."""
    from dsv41.cluster.sampling_params import SamplingParams

    prompt_ids = _engine_prompts(engine, workload.endpoint, workload.prompts())
    offsets = workload.arrival_offsets()
    params = SamplingParams(
        max_tokens=workload.output_len, temperature=float(workload.temperature), ignore_eos=workload.ignore_eos
    )
    tracker = _ProgressTracker(workload.num_prompts, progress)
    records: list[RequestRecord] = []
    pending = deque(range(workload.num_prompts))
    in_flight: dict[str, _EngineRequest] = {}
    # When each free concurrency slot became free; a held-back request is sent then.
    free_slots: list[float] | None = None
    prefix = f"bench-{time.monotonic_ns()}"
    start = time.perf_counter()
    if workload.max_concurrency is not None:
        free_slots = [start] * workload.max_concurrency

    def finish(record: RequestRecord, freed_at: float) -> None:
        records.append(record)
        tracker.done(record)
        if free_slots is not None:
            heapq.heappush(free_slots, freed_at)

    while pending or in_flight:
        now = time.perf_counter()
        while pending and start + offsets[pending[0]] <= now and (free_slots is None or free_slots):
            index = pending.popleft()
            sent = max(start + offsets[index], heapq.heappop(free_slots) if free_slots is not None else 0.0)
            request_id = f"{prefix}-{index}"
            try:
                engine.add_request(request_id, prompt_ids[index], params)
            except ValueError as exc:  # EngineError / SamplingParamsError: nothing was queued
                finish(RequestRecord(index, sent - start, False, now - sent, input_tokens=len(prompt_ids[index]),
                                     error=f"{type(exc).__name__}: {exc}"), now)
                continue
            in_flight[request_id] = _EngineRequest(index, sent, len(prompt_ids[index]))
        if not in_flight:
            if pending:
                time.sleep(max(start + offsets[pending[0]] - time.perf_counter(), 0.0))
            continue
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"engine: idle with {len(in_flight)} benchmark request(s) unfinished")
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            state = in_flight.get(output.request_id)
            if state is None:
                continue
            state.take(len(output.token_ids), now)
            if output.finished:
                del in_flight[output.request_id]
                finish(state.record(start, now, str(output.finish_reason)), now)
    duration = time.perf_counter() - start
    # The step that tells the ranks the last requests left (not timed), so the engine
    # is left idle, as it came.
    while engine.has_unfinished_requests():
        engine.step()
    target = {"engine": type(engine).__name__, "endpoint": workload.endpoint}
    return BenchReport.build("in-process", target, workload, records, duration)


def _engine_prompts(engine: "Engine", endpoint: Endpoint, prompts: Sequence[BenchPrompt]) -> list[list[int]]:
    """The token ids the server would run for each prompt: ids as given; text through
    the chat template (chat) or the tokenizer alone (completions), as the server's
    ``deploy.chat_protocol.PromptEncoder`` encodes them."""
    from dsv41.deploy.chat_protocol import PromptEncoder, render_pieces

    encoder = PromptEncoder(engine.tokenizer)
    ids = []
    for prompt in prompts:
        if isinstance(prompt.prompt, tuple):
            ids.append(list(prompt.prompt))
        elif endpoint == "chat":
            ids.append(encoder.encode_pieces(render_pieces([{"role": "user", "content": prompt.prompt}])))
        else:
            ids.append(encoder.encode_text(prompt.prompt))
    return ids


class _EngineRequest:
    """The token events one in-process request has produced so far."""

    def __init__(self, index: int, sent: float, input_tokens: int) -> None:
        self.index = index
        self.sent = sent
        self.input_tokens = input_tokens
        self.num_tokens = 0
        self.token_times: list[float] = []

    def take(self, new_tokens: int, now: float) -> None:
        if new_tokens:
            self.num_tokens += new_tokens
            self.token_times.append(now)

    def record(self, start: float, end: float, finish_reason: str) -> RequestRecord:
        error = ""
        if finish_reason in FAILED_FINISH_REASONS:
            error = f"finish_reason: {finish_reason}"
        elif not self.token_times:
            error = "finished without output"
        return RequestRecord(
            index=self.index,
            sent_s=self.sent - start,
            success=not error,
            latency_s=end - self.sent,
            ttft_s=self.token_times[0] - self.sent if self.token_times else None,
            itl_s=tuple(np.diff(self.token_times).tolist()),
            input_tokens=self.input_tokens,
            output_tokens=self.num_tokens,
            output_tokens_source="engine",
            finish_reason=finish_reason,
            error=error,
        )


# -- progress and the command line -----------------------------------------------------


class _ProgressTracker:
    """Reports finished requests about PROGRESS_STEPS times over a run."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total = total
        self.progress = progress
        self.every = max(total // PROGRESS_STEPS, 1)
        self.finished = 0
        self.failed = 0

    def done(self, record: RequestRecord) -> None:
        self.finished += 1
        self.failed += not record.success
        if self.progress is not None and (self.finished % self.every == 0 or self.finished == self.total):
            self.progress(f"bench: {self.finished}/{self.total} requests finished, {self.failed} failed")


@dataclass(frozen=True)
class InProcessEngine:
    """The engine ``--in-process`` drives: ``model`` (a checkpoint directory or a
    generated slice) under ``options`` (EngineOptions fields), ``dp`` ranks as threads
    with experts split ``expert_mode``."""

    model: str
    options: dict[str, Any]
    dp: int = 1
    expert_mode: str = "ep"

    def build(self) -> "Engine":
        from dsv41.cluster.engine import Engine
        from dsv41.cluster.ranks import DPLayout

        if self.dp == 1:
            return Engine.from_pretrained(self.model, **self.options)
        return Engine.in_process(self.model, DPLayout(self.dp, self.expert_mode), **self.options)


def _in_process_spec(args: argparse.Namespace) -> InProcessEngine | None:
    """``--in-process``'s engine: the ``--config`` application's, else ``--model-dir``
    under the engine's defaults; None in HTTP mode."""
    if args.config and not args.in_process:
        raise SystemExit("--config: with --in-process only (an endpoint's engine is the server's)")
    if not args.in_process:
        return None
    if args.config:
        if args.model_dir:
            raise SystemExit("--config / --model-dir: give one of them (each names the in-process engine)")
        from dsv41.deploy.app_args import AppArgs, read_serve_config

        try:
            _, application = read_serve_config(args.config)
            app = AppArgs.from_dict(application.args or {})
        except ValueError as exc:
            raise SystemExit(f"--config: {exc}") from exc
        model = app.model if app.model is not None else str(app.model_dir())
        return InProcessEngine(model, app.engine_options(), app.dp, app.expert_mode)
    if not args.model_dir:
        raise SystemExit("--in-process: needs --model-dir or --config")
    return InProcessEngine(args.model_dir, {})


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``dsv41 bench`` options."""
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    target.add_argument("--model", help="model name the server serves (HTTP mode)")
    target.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    target.add_argument("--in-process", action="store_true", help="drive cluster.engine.Engine in this process")
    target.add_argument(
        "--model-dir",
        help="checkpoint directory or generated:SLICE: the in-process engine (default options); the vocabulary for "
        "--input-len",
    )
    target.add_argument(
        "--config",
        help="with --in-process: the engine of this Serve YAML's one application (its model, engine options, dp and "
        "expert_mode: what `dsv41 serve --config` serves), so the two drivers time one engine",
    )
    target.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S, help="seconds per request")
    load = parser.add_argument_group("workload")
    source = load.add_mutually_exclusive_group(required=True)
    source.add_argument("--input-len", type=int, help="random token-id prompts of this many tokens")
    source.add_argument("--prompt-text", help="send this text as every prompt")
    load.add_argument("--vocab-size", type=int, help="random token ids are drawn from [0, N) (default: --model-dir's)")
    load.add_argument("--num-prompts", type=int, default=100)
    load.add_argument("--output-len", type=int, default=128)
    load.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let EOS end a request early")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)"
    )
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    parser.add_argument("--out", help="write the JSON report here")


def run_bench_command(args: argparse.Namespace) -> BenchReport:
    """``dsv41 bench``: runs the workload, prints the table, writes ``--out``."""
    engine_spec = _in_process_spec(args)
    model = engine_spec.model if engine_spec is not None else args.model_dir
    vocab_size = args.vocab_size
    if args.input_len is not None and vocab_size is None:
        if not model:
            raise SystemExit(
                "--input-len: needs --vocab-size, --model-dir or --config (random token ids need the vocabulary)"
            )
        from dsv41.model.source import ModelSource

        vocab_size = ModelSource.parse(model).config().vocab_size
    try:
        workload = Workload(
            endpoint=args.endpoint,
            num_prompts=args.num_prompts,
            output_len=args.output_len,
            input_len=args.input_len,
            vocab_size=vocab_size,
            prompt_text=args.prompt_text,
            seed=args.seed,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
        )
        target = None if args.in_process else HttpTarget(args.base_url or "", args.model or "", args.request_timeout)
    except BenchError as exc:
        raise SystemExit(f"bench: {exc}") from exc

    def progress(line: str) -> None:
        print(line, file=sys.stderr)

    if engine_spec is not None:
        if args.base_url or args.model:
            raise SystemExit("--base-url / --model: HTTP mode only (not used with --in-process)")
        progress(f"bench: loading {engine_spec.model} ...")
        report = run_in_process(engine_spec.build(), workload, progress)
    else:
        report = run_http(target, workload, progress)
    print(report.table())
    if args.out:
        report.write_json(args.out)
        print(f"wrote {args.out}")
    return report
