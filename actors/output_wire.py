"""The request outputs of a step between an engine group's scheduler actor and its client.

Owns ``OutputSender`` (the SchedulerActor's end) and ``OutputReceiver`` (the
``EngineGroup`` client's end). The engine's outputs are already deltas
(``cluster.request.RequestOutput``: what a request gained in the step), so a frame
carries each as a tuple of its fields, as it is, and its size follows what the step
produced, not how long the outputs already are. Frames are numbered: a receiver that
misses one (a lost reply) raises instead of handing out a delta that does not follow
what its caller has.

Must not import: deploy.
"""

from __future__ import annotations

from typing import Any, Sequence

from dsv41.cluster.request import FinishReason, PhaseTimes, RequestOutput

# One request's delta: (request_id, new token ids, new text, new logprob entries or
# None, new prompt logprob entries or None, finish reason value or None, stop reason,
# output tokens so far, (queue_s, prefill_s) on the first token's output or None).
OutputDelta = tuple[
    str, tuple[int, ...], str, tuple | None, tuple | None, str | None, Any, int, tuple[float, float] | None
]
# One step's outputs on the wire: the step's number and its deltas.
OutputFrame = tuple[int, list[OutputDelta]]


class OutputWireError(RuntimeError):
    """A frame that does not follow the last one: a wire bug or a lost reply."""


class OutputSender:
    """The scheduler actor's end: numbers each step's frame."""

    def __init__(self) -> None:
        self._step = 0

    def frame(self, outputs: Sequence[RequestOutput]) -> OutputFrame:
        """One step's outputs as a frame, numbered after the previous one."""
        self._step += 1
        return self._step, [
            (
                output.request_id,
                output.token_ids,
                output.text,
                output.logprobs,
                output.prompt_logprobs,
                None if output.finish_reason is None else output.finish_reason.value,
                output.stop_reason,
                output.num_output_tokens,
                None if output.phase_times is None else (output.phase_times.queue_s, output.phase_times.prefill_s),
            )
            for output in outputs
        ]


class OutputReceiver:
    """The client's end: the outputs of each frame, in order."""

    def __init__(self) -> None:
        self._step = 0

    def outputs(self, frame: OutputFrame) -> list[RequestOutput]:
        step, deltas = frame
        if step != self._step + 1:
            raise OutputWireError(f"output frame {step} after frame {self._step}: a step's outputs were lost")
        self._step = step
        return [
            RequestOutput(
                request_id=request_id,
                token_ids=token_ids,
                finished=finish_reason is not None,
                finish_reason=None if finish_reason is None else FinishReason(finish_reason),
                num_output_tokens=num_output_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                text=text,
                stop_reason=stop_reason,
                phase_times=None if phase_times is None else PhaseTimes(*phase_times),
            )
            for (
                request_id,
                token_ids,
                text,
                logprobs,
                prompt_logprobs,
                finish_reason,
                stop_reason,
                num_output_tokens,
                phase_times,
            ) in deltas
        ]
