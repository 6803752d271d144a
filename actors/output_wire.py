"""The request outputs of a step between an engine group's scheduler actor and its client.

Owns ``OutputSender`` (the SchedulerActor's end) and ``OutputReceiver`` (the
``EngineGroup`` client's end). A ``RequestOutput`` carries a request's whole output so
far: its token ids, text and logprobs. Sent as they are, a step of 64 requests 2,048
tokens into their outputs would carry 131,072 token ids, and a stream's bytes would grow
with the square of its length. The sender sends each request only what it gained
since its last output (tokens, text, logprob entries; the final fields as they are);
the receiver appends and hands back outputs equal to the engine's own.

Each output only extends the one before it (``Request.to_output`` holds back text
that a stop string could still take, so a finished text never drops text already
handed out): appending deltas rebuilds it exactly. Both ends drop a request when it
finishes or is aborted. Steps are numbered: a receiver that misses one (a lost reply)
raises instead of appending to stale text.

Must not import: deploy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from dsv41.cluster.request import FinishReason, RequestOutput

# One request's delta: (request_id, new token ids, new text, new logprob entries or
# None, new prompt logprob entries or None, finish reason value or None, stop reason).
OutputDelta = tuple[str, tuple[int, ...], str, tuple | None, tuple | None, str | None, Any]
# One step's outputs on the wire: the step's number and its deltas.
OutputFrame = tuple[int, list[OutputDelta]]


class OutputWireError(RuntimeError):
    """Deltas that do not follow what this end holds: a wire bug or a lost reply."""


@dataclass
class _Held:
    """One unfinished request's output so far, on the receiver."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


def _request_ids(request_id: str, known: Iterable[str]) -> list[str]:
    """``request_id`` and its samples (``{id}#{i}``) among ``known``."""
    prefix = f"{request_id}#"
    return [rid for rid in known if rid == request_id or rid.startswith(prefix)]


class _WireEnd:
    """What both ends share: a table of unfinished requests and the frame count."""

    def __init__(self) -> None:
        self._table: dict[str, Any] = {}
        self._step = 0

    def forget(self, request_id: str) -> None:
        """Drops an aborted request (and its samples)."""
        for rid in _request_ids(request_id, list(self._table)):
            del self._table[rid]

    @property
    def num_requests(self) -> int:
        return len(self._table)


class OutputSender(_WireEnd):
    """The scheduler actor's end: per unfinished request, how many token ids, text
    characters, logprob and prompt logprob entries its client already has."""

    def frame(self, outputs: Sequence[RequestOutput]) -> OutputFrame:
        """The deltas of one step's outputs, numbered after the previous frame."""
        deltas: list[OutputDelta] = []
        for output in outputs:
            tokens, text, logprobs, prompt_logprobs = self._table.get(output.request_id, (0, 0, 0, 0))
            deltas.append(
                (
                    output.request_id,
                    output.token_ids[tokens:],
                    output.text[text:],
                    None if output.logprobs is None else output.logprobs[logprobs:],
                    None if output.prompt_logprobs is None else output.prompt_logprobs[prompt_logprobs:],
                    None if output.finish_reason is None else output.finish_reason.value,
                    output.stop_reason,
                )
            )
            if output.finished:
                self._table.pop(output.request_id, None)
            else:
                self._table[output.request_id] = (
                    len(output.token_ids),
                    len(output.text),
                    0 if output.logprobs is None else len(output.logprobs),
                    0 if output.prompt_logprobs is None else len(output.prompt_logprobs),
                )
        self._step += 1
        return self._step, deltas


class OutputReceiver(_WireEnd):
    """The client's end: each unfinished request's output so far (a ``_Held``)."""

    def outputs(self, frame: OutputFrame) -> list[RequestOutput]:
        """The step's outputs, each the request's whole output so far."""
        step, deltas = frame
        if step != self._step + 1:
            raise OutputWireError(f"output frame {step} after frame {self._step}: a step's outputs were lost")
        self._step = step
        outputs = []
        for request_id, token_ids, text, logprobs, prompt_logprobs, finish_reason, stop_reason in deltas:
            held = self._table.get(request_id) or _Held()
            held.token_ids.extend(token_ids)
            held.text += text
            held.logprobs = _extended(held.logprobs, logprobs, request_id, "logprobs")
            held.prompt_logprobs = _extended(held.prompt_logprobs, prompt_logprobs, request_id, "prompt_logprobs")
            finished = finish_reason is not None
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    token_ids=tuple(held.token_ids),
                    finished=finished,
                    finish_reason=None if finish_reason is None else FinishReason(finish_reason),
                    logprobs=None if held.logprobs is None else tuple(held.logprobs),
                    prompt_logprobs=None if held.prompt_logprobs is None else tuple(held.prompt_logprobs),
                    text=held.text,
                    stop_reason=stop_reason,
                )
            )
            if finished:
                self._table.pop(request_id, None)
            else:
                self._table[request_id] = held
        return outputs


def _extended(held: list | None, new: tuple | None, request_id: str, name: str) -> list | None:
    """``held`` with ``new`` appended (a request's logprobs arrive with every delta or never)."""
    if new is None:
        if held is not None:
            raise OutputWireError(f"request {request_id!r}: {name} stopped arriving")
        return None
    if held is None:
        return list(new)
    held.extend(new)
    return held
