"""Python client helpers for batch jobs: completions through a Serve DeploymentHandle.

Owns :func:`llm_handle` (the LLM server deployment of a running application),
:func:`generate` and :func:`stream` (one prompt's completion, whole or as token
deltas), :func:`complete_dataset` (a Ray Data dataset of prompts mapped through the LLM
servers by a bounded pool of actors) and :data:`SAMPLING_FIELDS` (the keyword
arguments all three pass on). They call ``LLMServer.generate_stream`` (deploy/llm_server.py):
each delta is ``{"token_ids", "text", "finish_reason", "usage"}``, and a refused request
raises the server's :class:`~deploy.openai_api.OpenAIError` (``status``, ``param`` and a
message naming the field).

Must not import: ``torch``, ``model``, ``cache``, ``cluster``, ``actors``, ``fastapi``,
``deploy.app``, ``deploy.llm_server`` (the client side of a batch job needs Ray and the
error type only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable, Mapping, Sequence

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from dsv41.deploy.openai_errors import OpenAIError

if TYPE_CHECKING:
    import pyarrow
    import ray.data

# deploy.app's build_app binds the LLM servers under their class's name, Serve's default.
LLM_SERVER_DEPLOYMENT = "LLMServer"
SAMPLING_FIELDS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "structured_outputs",
)
OUTPUT_COLUMNS = ("text", "token_ids", "finish_reason", "usage")

Prompt = str | Sequence[int]


def llm_handle(app_name: str = "default") -> DeploymentHandle:
    """The LLM server deployment of the running application ``app_name``."""
    return serve.get_deployment_handle(LLM_SERVER_DEPLOYMENT, app_name=app_name)


def _check_sampling(sampling: Mapping[str, Any]) -> None:
    """Refuses what the server would not (its range checks stay the server's)."""
    unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"{unknown[0]}: unknown sampling argument (allowed: {', '.join(SAMPLING_FIELDS)})")


def _body(prompt: Prompt, sampling: Mapping[str, Any]) -> dict[str, Any]:
    _check_sampling(sampling)
    return {"prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt], **sampling}


def _start(handle: DeploymentHandle, prompt: Prompt, sampling: Mapping[str, Any]) -> DeploymentResponseGenerator:
    return handle.options(stream=True).generate_stream.remote(_body(prompt, sampling))


def _checked(delta: dict[str, Any] | OpenAIError) -> dict[str, Any]:
    if isinstance(delta, OpenAIError):
        raise delta
    return delta


@dataclass
class _Completion:
    """The deltas of one stream joined into the completion they make up."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None

    def add(self, delta: dict[str, Any] | OpenAIError) -> None:
        delta = _checked(delta)
        self.texts.append(delta["text"])
        self.token_ids.extend(delta["token_ids"])
        self.finish_reason, self.usage = delta["finish_reason"], delta["usage"]

    def result(self) -> dict[str, Any]:
        return {"text": "".join(self.texts), "token_ids": self.token_ids, "finish_reason": self.finish_reason, "usage": self.usage}


def _collect(deltas: Iterable[dict[str, Any] | OpenAIError]) -> dict[str, Any]:
    completion = _Completion()
    for delta in deltas:
        completion.add(delta)
    return completion.result()


def generate(handle: DeploymentHandle, prompt: Prompt, **sampling: Any) -> dict[str, Any]:
    """The completion of ``prompt`` (text or token ids): ``{"text", "token_ids",
    "finish_reason", "usage"}``. Blocks; call it from synchronous code (a driver, a Ray
    task); from a coroutine, join :func:`stream`'s deltas instead."""
    return _collect(_start(handle, prompt, sampling))


async def stream(handle: DeploymentHandle, prompt: Prompt, **sampling: Any) -> AsyncIterator[dict[str, Any]]:
    """The deltas of ``prompt``'s completion as the server produces them; leaving the
    loop early aborts the request on the server."""
    deltas = _start(handle, prompt, sampling)
    try:
        async for delta in deltas:
            yield _checked(delta)
    finally:
        deltas.cancel()


class _CompleteBatch:
    """Ray Data's callable class: one batch of prompts, every prompt in flight at once."""

    def __init__(self, handle: DeploymentHandle, prompt_column: str, sampling: Mapping[str, Any]) -> None:
        self.handle = handle
        self.prompt_column = prompt_column
        self.sampling = dict(sampling)

    def __call__(self, batch: pyarrow.Table) -> pyarrow.Table:
        import pyarrow as pa

        prompts = batch.column(self.prompt_column).to_pylist()
        streams = [_start(self.handle, prompt, self.sampling) for prompt in prompts]
        try:
            completions = [_collect(s) for s in streams]
        except BaseException:
            # The batch fails as a whole: the prompts still running would be wasted work.
            for s in streams:
                s.cancel()
            raise
        usage_type = pa.struct([(name, pa.int64()) for name in ("prompt_tokens", "completion_tokens", "total_tokens")])
        columns = {
            "text": pa.array([c["text"] for c in completions], pa.string()),
            "token_ids": pa.array([c["token_ids"] for c in completions], pa.list_(pa.int64())),
            "finish_reason": pa.array([c["finish_reason"] for c in completions], pa.string()),
            "usage": pa.array([c["usage"] for c in completions], usage_type),
        }
        for name, column in columns.items():
            batch = batch.append_column(name, column)
        return batch


def complete_dataset(
    ds: ray.data.Dataset,
    *,
    app_name: str | None = None,
    handle: DeploymentHandle | None = None,
    prompt_column: str = "prompt",
    concurrency: int = 1,
    batch_size: int = 16,
    num_cpus: float = 0.25,
    **sampling: Any,
) -> ray.data.Dataset:
    """``ds`` with the completion of each row's ``prompt_column`` (text or token ids)
    added as the columns ``text``, ``token_ids``, ``finish_reason`` and ``usage`` (a
    struct of the three counts). The LLM servers are ``handle`` or the LLM server
    deployment of the application ``app_name`` (give one). ``concurrency`` actors each
    keep one batch of ``batch_size`` requests in flight, so at most ``concurrency *
    batch_size`` requests wait on the servers at once; the actors only wait on them,
    hence their small default ``num_cpus``. A refused prompt fails the job with the
    server's error. Lazy, like every Ray Data transform."""
    if (app_name is None) == (handle is None):
        raise ValueError("app_name, handle: give exactly one")
    for name, value in (("concurrency", concurrency), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {value!r} (allowed: an integer >= 1)")
    if not isinstance(num_cpus, (int, float)) or isinstance(num_cpus, bool) or num_cpus < 0:
        raise ValueError(f"num_cpus: {num_cpus!r} (allowed: a number >= 0)")
    taken = sorted(set(OUTPUT_COLUMNS) & set(ds.columns()))
    if prompt_column not in ds.columns():
        raise ValueError(f"prompt_column: {prompt_column!r} is not a column (allowed: {', '.join(ds.columns())})")
    if taken:
        raise ValueError(f"ds: has the output column(s) {taken} already (rename them first)")
    _check_sampling(sampling)
    import ray.data

    return ds.map_batches(
        _CompleteBatch,
        fn_constructor_kwargs={
            "handle": handle if handle is not None else llm_handle(app_name),
            "prompt_column": prompt_column,
            "sampling": sampling,
        },
        batch_format="pyarrow",
        batch_size=batch_size,
        # A fixed pool of `concurrency` actors (map_batches' own `concurrency` is deprecated).
        compute=ray.data.ActorPoolStrategy(size=concurrency),
        num_cpus=num_cpus,
    )
