"""The LLM server deployment: one engine per replica, and how a replica builds it.

Owns :func:`make_engine` (the one place a replica's engine is built: ``backend:
local`` in process, ``backend: process`` in a child process the replica owns
(deploy/engine_process.py), ``backend: ray`` an ``actors`` engine group in the
replica's own placement group, :func:`llm_server_placement`) and :class:`LLMServer` (the
deployment whose every replica owns one engine, driven by an ``AsyncEngine``: the
completion and chat calls the ingress makes, the token stream of the gRPC service
and ``deploy.client``, the tokenizer endpoints, the replica's metrics and health
check). Ray Serve LLM's layering: this is its server; deploy/app.py is the ingress
and the builder, deploy/app_args.py the configs.

Faults: a replica is the unit Serve replaces. Its health check fails once its engine
cannot serve (the step loop died, a ``backend: process`` replica's engine process
exited, or a ``backend: ray`` group's SchedulerActor is gone), and Serve starts a new
replica. A ``backend: process`` replica stops its engine process when it stops; the
child exits by itself when the replica dies (its socket closes). A ``backend: ray``
replica runs its group in the replica's own placement group
(``placement_group_bundles``: the replica's resources, then one bundle per rank), which
Serve creates with the replica and removes when the replica stops or dies; the group's
actors are owned by the replica, so they die with it too, and its actor names carry the
replica's id.

Must not import at module level: ``torch`` or ``actors`` (``make_engine`` imports the
backend it builds). Must not be imported by ``model``, ``cache``, ``cluster``, ``actors``.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime.
import asyncio
import functools
import logging
import uuid
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping

from ray import serve

from dsv41.cluster.interface import SteppedEngine
from dsv41.cluster.request import CumulativeOutputs, RequestOutput
from dsv41.cluster.sampling_params import MAX_N, SamplingParams
from dsv41.deploy.app_args import AppArgs, _replica_bundle
from dsv41.deploy.async_engine import AsyncEngine, EngineDeadError, parent_request_id
from dsv41.deploy.chat_parser import OUTPUT_MARKERS
from dsv41.deploy.chat_protocol import PromptEncoder, render_pieces
from dsv41.deploy.heap import idle_heap_trim, serving
from dsv41.deploy.memory_probe import probe_for, read_probe
from dsv41.deploy.openai_api import ChatCompletionRequest, CompletionRequest
from dsv41.deploy.openai_errors import REFUSALS, OpenAIError, bad_request, error_for, model_not_found
from dsv41.deploy.openai_responses import (
    SSE_DONE,
    ChatStreamWriter,
    CompletionWriter,
    chat_completion_response,
    now,
    sse,
    usage,
)
from dsv41.deploy.ray_metrics import replica_metrics
from dsv41.deploy.tokenizer_api import TokenizerEndpoints

if TYPE_CHECKING:
    from dsv41.actors.engine_group import EngineGroup
    from dsv41.deploy.engine_process import EngineProcess

logger = logging.getLogger(__name__)

def llm_server_placement(args: AppArgs) -> dict[str, Any]:
    """The LLM server's Serve options that give each ``backend: ray`` replica a
    placement group of its own, made and removed by Serve with the replica: bundle 0
    the replica's resources (and its group's zero-resource actors), bundles 1..dp the
    ranks', STRICT_PACK (the ranks and their driver share a node); none for ``local``."""
    if args.backend != "ray":
        return {}
    ranks = [args.group_options().rank_bundle()] * args.dp
    return {
        "placement_group_bundles": [_replica_bundle(args.ray_actor_options), *ranks],
        "placement_group_strategy": "STRICT_PACK",
    }


def make_engine(args: AppArgs) -> SteppedEngine:
    """The engine of this replica: ``local`` loads it in this process; ``process`` in a
    child process (loaded before this returns); ``ray`` (inside
    a Serve replica deployed with :func:`llm_server_placement`) starts an engine group
    in the replica's placement group, its actors named after the replica
    (``dsv41-{app}-{replica id}``), so that any number of replicas share a cluster."""
    model_dir = args.model_dir()
    options = args.engine_options()
    if args.backend == "local":
        from dsv41.cluster.engine import Engine

        return Engine.from_pretrained(model_dir, **options)
    if args.backend == "process":
        from dsv41.deploy.engine_process import EngineProcess

        return EngineProcess(model_dir, options)
    import ray

    from dsv41.actors.engine_group import EngineGroup
    from dsv41.actors.group import GroupPlacement

    placement_group = ray.util.get_current_placement_group()
    if placement_group is None:
        raise RuntimeError("backend 'ray': the replica has no placement group (deploy it with llm_server_placement)")
    context = serve.get_replica_context()
    placement = GroupPlacement(placement_group, tuple(range(1, args.dp + 1)), 0)
    group = EngineGroup(
        str(model_dir),
        dp=args.dp,
        expert_mode=args.expert_mode,
        group_options=args.group_options(),
        name=f"dsv41-{context.app_name}-{context.replica_tag}",
        placement=placement,
        **options,
    )
    return group.__enter__()


async def _merged(streams: list[AsyncGenerator[RequestOutput, None]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The items of several streams as they come, tagged with the stream's index. When
    the consumer stops, every stream is cancelled (which aborts its request). One
    stream (one prompt) is read directly: no task and queue between it and the
    consumer, whose every token would pay their hop."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    items: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                items.put_nowait((index, item))
            items.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            items.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await items.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _whole_outputs(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> dict[int, RequestOutput]:
    """Each choice's whole output, its deltas added up (a non-streaming answer)."""
    whole = CumulativeOutputs()
    finals: dict[int, RequestOutput] = {}
    async for index, output in outputs:
        done = whole.add(output)
        if done is not None:
            finals[index] = done
    return finals


def _sample_index(output: RequestOutput) -> int:
    parent = parent_request_id(output.request_id)
    return 0 if parent == output.request_id else int(output.request_id[len(parent) + 1 :])


@serve.deployment
class LLMServer:
    """One engine per replica; the ingress calls it through a DeploymentHandle. Every
    method answers a refused request with an :class:`OpenAIError` value (not raised:
    the ingress turns it into the HTTP answer); the endpoints take the ingress's
    ``request_id`` (Serve's), under which a refusal that hides its reason from the
    client (a dead engine) is logged."""

    def __init__(self, args: AppArgs) -> None:
        self.args = args
        self.model_name = args.model_name
        engine = make_engine(args)
        # An engine group (backend ray) and an engine process (backend process) have
        # processes of their own to watch and release.
        self._group: "EngineGroup | None" = engine if args.backend == "ray" else None
        self._engine_process: "EngineProcess | None" = engine if args.backend == "process" else None
        self.tokenizer = engine.tokenizer
        self.prompts = PromptEncoder(engine.tokenizer)
        added = {token.content: token_id for token_id, token in engine.tokenizer.get_added_tokens_decoder().items()}
        self.chat_marker_ids = tuple(added[marker] for marker in OUTPUT_MARKERS if marker in added)
        self.limits = args.request_limits()
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.config.vocab_size
        self.metrics = replica_metrics(self.model_name, self.max_model_len, args.metrics_prefix, args.ray_metrics)
        interrupt = self._engine_process.interrupt_step if self._engine_process is not None else None
        self.engine = AsyncEngine(engine, self.metrics, interrupt_step=interrupt)
        config = engine.config
        self.tokenizer_endpoints = TokenizerEndpoints(
            engine.tokenizer,
            self.prompts,
            max_model_len=self.max_model_len,
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        self._heap_trim = idle_heap_trim(args.heap_trim_idle_s, name="dsv41-llm-server-heap-trim")
        self._memory_probe = probe_for(args.probe_options())

    # -- Serve hooks ------------------------------------------------------------------

    async def check_health(self) -> None:
        """Serve's replica health check (and ``/health``'s): raises EngineDeadError once
        the step loop has died or the engine group cannot serve (its SchedulerActor is
        gone, or its ranks could not be started again), and Serve replaces the replica.
        A group that restarts after a rank failure is healthy: it recovers in place."""
        self.engine.check_health()
        if self._engine_process is not None:
            self._engine_process.check_alive()
        if self._group is not None:
            from dsv41.actors.group import RankGroupDead

            try:
                await self._group.check_alive()
            except RankGroupDead as exc:
                raise EngineDeadError("the engine group cannot serve") from exc

    def __del__(self) -> None:
        """Serve's shutdown hook: stops the heap trimmer and the step loop, then the
        engine process or group."""
        heap_trim = getattr(self, "_heap_trim", None)
        if heap_trim is not None:
            heap_trim.close()
        engine = getattr(self, "engine", None)
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            engine_process = getattr(self, "_engine_process", None)
            if engine_process is not None:
                engine_process.close()
            group = getattr(self, "_group", None)
            if group is not None:
                group.close()

    # -- endpoints --------------------------------------------------------------------

    async def health(self) -> OpenAIError | None:
        try:
            await self.check_health()
        except REFUSALS as exc:
            return error_for(exc)
        return None

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    async def memory_report(self, trim: bool = False) -> dict[str, Any]:
        """This replica's memory (``deploy.memory_probe``); refused unless the
        application was built with ``memory_probe``."""
        return read_probe(self._memory_probe, trim=trim)

    def tokenize(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any] | OpenAIError:
        return self._tokenizer_answer(self.tokenizer_endpoints.tokenize, body, request_id)

    def detokenize(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any] | OpenAIError:
        return self._tokenizer_answer(self.tokenizer_endpoints.detokenize, body, request_id)

    def tokenizer_info(self) -> dict[str, Any]:
        return self.tokenizer_endpoints.tokenizer_info()

    async def completions(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any] | OpenAIError:
        try:
            request, prompts, params = self._completion_request(body)
            finals = await _whole_outputs(self._run(prompts, params))
        except REFUSALS as exc:
            return error_for(exc, request_id)
        return CompletionWriter(request, prompts, _response_id("cmpl"), self.model_name, now(), self.tokenizer).response(finals)

    async def completions_stream(self, body: dict[str, Any], request_id: str | None = None) -> AsyncIterator[str | OpenAIError]:
        """SSE events; the first item is an OpenAIError instead when refused."""
        try:
            request, prompts, params = self._completion_request(body)
            outputs = self._run(prompts, params)
            first = await anext(outputs)
        except REFUSALS as exc:
            yield error_for(exc, request_id)
            return
        writer = CompletionWriter(request, prompts, _response_id("cmpl"), self.model_name, now(), self.tokenizer)
        async for events in _stream_events(first, outputs, writer.events, writer.closing, request_id):
            yield events

    async def generate_stream(
        self, body: dict[str, Any], request_id: str | None = None
    ) -> AsyncIterator[dict[str, Any] | OpenAIError]:
        """The token deltas of one prompt (a completions body with one prompt, ``n`` 1, no
        logprobs, no echo), for the gRPC ingress and ``deploy.client``: ``{"token_ids", "text",
        "finish_reason", "usage"}`` per step, the last with ``finish_reason`` and
        ``usage`` set. An OpenAIError item ends the stream (the first item when refused)."""
        try:
            # The served model is implied: a token stream's callers address a deployment.
            request, prompts, params = self._completion_request({"model": self.model_name, **body})
            if len(prompts) != 1:
                raise bad_request("prompt", f"prompt: {len(prompts)} prompts (allowed: one per token stream)")
            asked = {"n": params.n != 1, "logprobs": params.logprobs is not None, "echo": request.echo}
            asked["prompt_logprobs"] = params.prompt_logprobs is not None
            name = next((field for field, given in asked.items() if given), None)
            if name is not None:
                raise bad_request(name, f"{name}: {body[name]!r} (allowed: absent on a token stream)")
            outputs = self._run(prompts, params)
            first = await anext(outputs)
        except REFUSALS as exc:
            yield error_for(exc, request_id)
            return
        try:
            async for _, output in _starting_with(first, outputs):
                if not output.token_ids and not output.text and not output.finished:
                    continue
                yield {
                    "token_ids": list(output.token_ids),
                    "text": output.text,
                    "finish_reason": None if output.finish_reason is None else output.finish_reason.value,
                    "usage": usage(len(prompts[0]), output.num_output_tokens) if output.finished else None,
                }
        except REFUSALS as exc:
            yield error_for(exc, request_id)

    async def chat(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any] | OpenAIError:
        try:
            request, prompt, params = self._chat_request(body)
            finals = await _whole_outputs(self._run([prompt], params))
        except REFUSALS as exc:
            return error_for(exc, request_id)
        return chat_completion_response(
            request, _response_id("chatcmpl"), self.model_name, now(), finals, len(prompt), self.tokenizer
        )

    async def chat_stream(self, body: dict[str, Any], request_id: str | None = None) -> AsyncIterator[str | OpenAIError]:
        """SSE events; the first item is an OpenAIError instead when refused."""
        try:
            request, prompt, params = self._chat_request(body)
            outputs = self._run([prompt], params)
            first = await anext(outputs)
        except REFUSALS as exc:
            yield error_for(exc, request_id)
            return
        writer = ChatStreamWriter(request, _response_id("chatcmpl"), self.model_name, now(), self.tokenizer)
        closing = functools.partial(writer.closing, len(prompt))
        opening = "".join(writer.opening())
        async for events in _stream_events(first, outputs, writer.events, closing, request_id, opening):
            yield events

    # -- internals --------------------------------------------------------------------

    def _tokenizer_answer(
        self, endpoint: Callable[[Mapping[str, Any]], dict[str, Any]], body: dict[str, Any], request_id: str | None
    ) -> dict[str, Any] | OpenAIError:
        try:
            self._check_model(body)
            return endpoint(body)
        except REFUSALS as exc:
            return error_for(exc, request_id)

    def _check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if isinstance(model, str) and model and model != self.model_name:
            raise model_not_found(model, self.model_name)

    def _completion_request(self, body: dict[str, Any]) -> tuple[CompletionRequest, list[tuple[int, ...]], SamplingParams]:
        self._check_model(body)
        request = CompletionRequest.from_json(body)
        params = request.params()
        sequences = len(request.prompts) * params.n
        # (n alone past the bound is SamplingParams', naming n.)
        if sequences > MAX_N:
            raise bad_request(
                "prompt",
                f"prompt: {len(request.prompts)} prompts x n={params.n} = {sequences} choices "
                f"(allowed: at most {MAX_N} per request)",
            )
        # A text prompt that cannot fit is refused before it is tokenized.
        room = self.max_model_len - 1
        prompts = [p if isinstance(p, tuple) else tuple(self.prompts.encode_text(p, max_tokens=room)) for p in request.prompts]
        for prompt in prompts:
            self._check_prompt(prompt, params)
        return request, prompts, params

    def _chat_request(self, body: dict[str, Any]) -> tuple[ChatCompletionRequest, tuple[int, ...], SamplingParams]:
        self._check_model(body)
        request = ChatCompletionRequest.from_json(body, self.limits)
        pieces = render_pieces(
            request.messages,
            tools=request.tools,
            tool_choice=request.tool_choice,
            thinking=request.thinking,
            reasoning_effort=request.reasoning_effort,
            response_format=request.response_format,
        )
        prompt = tuple(self.prompts.encode_pieces(pieces, max_tokens=self.max_model_len - 1))
        params = request.params(len(prompt), self.max_model_len, self.chat_marker_ids)
        self._check_prompt(prompt, params)
        return request, prompt, params

    def _check_prompt(self, prompt: tuple[int, ...], params: SamplingParams) -> None:
        """What the engine would refuse, refused before anything streams (the cheap
        checks first: a prompt is at most a body's worth of ids)."""
        params.validate_for(self.vocab_size, self.max_model_len, len(prompt))
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(400, f"prompt: token ids {bad[:8]} outside the vocabulary 0..{self.vocab_size - 1}", param="prompt")

    def _run(
        self, prompts: list[tuple[int, ...]], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Every prompt's outputs; index = prompt * n + sample (OpenAI's choice order)."""
        request_id = uuid.uuid4().hex
        streams = [self.engine.generate(f"{request_id}-{i}", prompt, params) for i, prompt in enumerate(prompts)]

        async def indexed() -> AsyncGenerator[tuple[int, RequestOutput], None]:
            with serving(self._heap_trim):
                async with aclosing(_merged(streams)) as merged:
                    async for prompt_index, output in merged:
                        yield prompt_index * params.n + _sample_index(output), output

        return indexed()


async def _starting_with(
    first: tuple[int, RequestOutput], rest: AsyncGenerator[tuple[int, RequestOutput], None]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item


async def _stream_events(
    first: tuple[int, RequestOutput],
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    events: Callable[[int, RequestOutput], Iterable[str]],
    closing: Callable[[], Iterable[str]],
    request_id: str | None,
    opening: str = "",
) -> AsyncIterator[str]:
    """A started stream's events, those of one output in one item (each item is a
    message through Ray and a chunk through the ingress and the proxy): ``opening``
    and the first output's first, then the closing ones in one; a request that fails
    midway ends it with its error as an event and ``[DONE]`` (the status line is
    already sent)."""
    try:
        async for index, output in _starting_with(first, outputs):
            item = opening + "".join(events(index, output))
            opening = ""
            if item:
                yield item
    except REFUSALS as exc:
        yield sse(error_for(exc, request_id).body()) + SSE_DONE
        return
    yield "".join(closing())


def _response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
