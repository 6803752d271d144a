"""Requests: the record the scheduler keeps and what a caller gets back.

Owns :class:`RequestStatus` and :class:`FinishReason`, :class:`Request` (the mutable
per-request record the scheduler owns: tokens, status, cursor, sampling seed,
collected logprobs and text, :class:`OutputText`), :class:`RequestOutput` (what a
request gained in a step, a delta) and :class:`CumulativeOutputs` (deltas added up
for the callers that ask), and :class:`SeedSource` (where a request without a seed
gets one). What a client asks for is ``cluster.sampling_params``.

Must not import: torch, tokenizers, ray, ``model``, ``cache``, ``actors``, ``deploy``,
or the other ``cluster`` modules but ``cluster.sampling_params`` (they import this
one). The text fields are written by ``cluster.stopping``; this module only stores
and reports them.
"""

from __future__ import annotations

import enum
import hashlib
import random
from dataclasses import dataclass, field
from typing import Sequence

from dsv41.cluster.sampling_params import SamplingParams, is_int


# Incremental detokenisation starts this many prompt tokens before the first output
# token, so decoders whose output depends on the preceding token (a leading space,
# a word-piece join) render the first output token as it reads in context.
DETOKENIZE_CONTEXT_TOKENS = 5
# Seeds drawn for requests stay non-negative int64 values (printable, JSON-safe).
_SEED_BITS = 63


class FinishReason(enum.StrEnum):
    """Why a request ended, spelled as the OpenAI API spells ``finish_reason``."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestStatus(enum.Enum):
    """Where a request is in its life; the FINISHED_* members are terminal."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True)
class PhaseTimes:
    """Where a sequence spent the time before its first token, in seconds of the
    engine's clock: ``queue_s`` from its arrival until the scheduler first gave it rows,
    ``prefill_s`` from then until its first token was sampled (vLLM's queued and
    prefill intervals; a preemption after that counts in neither)."""

    queue_s: float
    prefill_s: float


@dataclass(frozen=True)
class RequestOutput:
    """What one request gained in one step (vLLM's ``RequestOutputKind.DELTA``): the
    engine's step hands these back, so a step's work per request does not grow with the
    request's output.

    ``token_ids`` are the tokens generated in this step, ``logprobs`` their entries
    (``{token_id: logprob}``: the chosen token plus the top ``params.logprobs``),
    ``prompt_logprobs`` the prompt entries computed since the last output (the whole
    prompt, ``None`` first, in a request's first output; ``None`` when not asked for).
    ``text`` is the text gained: while the request runs, decoded text is handed out only
    up to its last complete character and before the last ``len(longest stop string) -
    1`` characters (they may yet start a stop string), so a finished request's texts add
    up to its whole text, cut before a matched stop string. ``num_output_tokens`` counts
    every token generated so far. ``stop_reason`` is the stop string or stop token id
    that ended the request (``None`` for EOS, length, abort and error).
    ``phase_times`` is set on the output that carries the first token (``None`` on
    every other). ``CumulativeOutputs`` adds deltas up where a caller wants the whole
    output so far.
    """

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_output_tokens: int
    logprobs: tuple[dict[int, float], ...] | None = None
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None
    text: str = ""
    stop_reason: int | str | None = None
    phase_times: PhaseTimes | None = None

    def __post_init__(self) -> None:
        if self.finished != (self.finish_reason is not None):
            raise ValueError(
                f"finish_reason: must be set exactly when finished, got finished={self.finished} "
                f"finish_reason={self.finish_reason!r}"
            )
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"logprobs: one entry per new token, got {len(self.logprobs)} for {len(self.token_ids)} tokens"
            )
        if self.num_output_tokens < len(self.token_ids):
            raise ValueError(
                f"num_output_tokens: {self.num_output_tokens} is fewer than this output's {len(self.token_ids)} tokens"
            )


class CumulativeOutputs:
    """Adds up each request's deltas for the callers that want whole outputs
    (``EngineClient.generate``, validation, tests, non-streaming answers). ``add``
    costs what the delta holds; a whole output is built only when asked for: by
    ``add`` of the delta that finishes the request (which then drops it), or by
    ``output`` while it runs."""

    def __init__(self) -> None:
        self._held: dict[str, _HeldOutput] = {}

    def add(self, delta: RequestOutput) -> RequestOutput | None:
        """Adds ``delta``; returns the request's whole output if ``delta`` finishes it
        (None otherwise)."""
        held = self._held.get(delta.request_id)
        if held is None:
            held = self._held[delta.request_id] = _HeldOutput(delta)
        held.last = delta
        held.token_ids.extend(delta.token_ids)
        held.texts.append(delta.text)
        held.logprobs = _extended(held.logprobs, delta.logprobs)
        held.prompt_logprobs = _extended(held.prompt_logprobs, delta.prompt_logprobs)
        if not delta.finished:
            return None
        del self._held[delta.request_id]
        return held.whole()

    def output(self, request_id: str) -> RequestOutput:
        """The whole output so far of a request still running (its deltas added)."""
        return self._held[request_id].whole()

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)


@dataclass
class _HeldOutput:
    last: RequestOutput  # the latest delta: the whole output's finish fields and counts
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def whole(self) -> RequestOutput:
        last = self.last
        return RequestOutput(
            request_id=last.request_id,
            token_ids=tuple(self.token_ids),
            finished=last.finished,
            finish_reason=last.finish_reason,
            num_output_tokens=last.num_output_tokens,
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else tuple(self.prompt_logprobs),
            text="".join(self.texts),
            stop_reason=last.stop_reason,
        )


def _extended(held: list | None, new: tuple | None) -> list | None:
    if new is None:
        return held
    if held is None:
        return list(new)
    held.extend(new)
    return held


class OutputText:
    """A request's decoded text, grown a token's piece at a time: appending, reading
    the tail, cutting the tail and reading what follows an offset cost what they touch,
    not the text's length (a ``str`` grown with ``+`` is copied whole per token)."""

    def __init__(self, text: str = "") -> None:
        self._pieces: list[str] = []
        self._length = 0
        self.append(text)

    def __len__(self) -> int:
        return self._length

    def __str__(self) -> str:
        return "".join(self._pieces)

    def append(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._length += len(text)

    def since(self, start: int, end: int | None = None) -> str:
        """The characters ``[start, end)`` (``end`` None: to the end), read from the
        back: O(the characters from ``start`` on)."""
        end = self._length if end is None else end
        if not 0 <= start <= end <= self._length:
            raise ValueError(f"since: [{start}, {end}) is not inside the text's {self._length} characters")
        pieces, position = [], self._length
        for piece in reversed(self._pieces):
            if position <= start:
                break
            pieces.append(piece)
            position -= len(piece)
        text = "".join(reversed(pieces))
        return text[start - position : end - position]

    def tail(self, chars: int) -> str:
        """The last ``chars`` characters (all of them when shorter)."""
        return self.since(max(self._length - chars, 0))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` characters: O(the characters cut)."""
        if not 0 <= length <= self._length:
            raise ValueError(f"truncate: {length} is not inside the text's {self._length} characters")
        while self._length > length:
            last = self._pieces.pop()
            self._length -= len(last)
            if self._length < length:
                self.append(last[: length - self._length])


@dataclass(eq=False)
class Request:
    """The scheduler's mutable record of one request (compared by identity).

    ``num_computed_tokens`` is the cursor: tokens whose KV the cache holds (under
    async scheduling, also those a step in flight computes).
    ``num_pending_tokens``: under async scheduling, the tokens steps in flight draw
    for it, scheduled before they are known (cluster/batch.PLACEHOLDER_TOKEN).
    ``sampling_seed`` is the seed the sampler actually uses (``params.seed`` or one
    drawn from the engine's :class:`SeedSource`). ``output_text`` is the decoded
    output (an :class:`OutputText`: complete characters only until the request
    finishes) and the two
    ``text_*_offset`` fields are the incremental detokeniser's cursor into
    :attr:`all_token_ids`; ``cluster.stopping`` maintains all three.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    sampling_seed: int
    arrival_time: float
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    stop_reason: int | str | None = None
    output_text: OutputText = field(default_factory=OutputText)
    output_token_ids: list[int] = field(init=False, default_factory=list)
    logprobs: list[dict[int, float]] | None = field(init=False)
    prompt_logprobs: list[dict[int, float] | None] | None = field(init=False)
    text_prefix_offset: int = field(init=False)
    text_read_offset: int = field(init=False)
    # What take_output has handed out: output tokens, text characters, prompt entries.
    _sent_tokens: int = field(init=False, default=0, repr=False)
    _sent_text: int = field(init=False, default=0, repr=False)
    _sent_prompt_logprobs: int = field(init=False, default=0, repr=False)
    # One list of prompt + output ids, appended in step with output_token_ids, so the
    # detokeniser and the runner read a window of it without concatenating per step.
    _all_token_ids: list[int] = field(init=False, repr=False)
    # The engine's clock when the scheduler first gave the request rows, and when its
    # first token was sampled (None until then): its first output's PhaseTimes.
    scheduled_time: float | None = field(init=False, default=None, repr=False)
    first_token_time: float | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {self.request_id!r}")
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids: request {self.request_id!r} has an empty prompt")
        if not all(is_int(t) and t >= 0 for t in self.prompt_token_ids):
            raise ValueError(f"prompt_token_ids: must be integers >= 0 (request {self.request_id!r})")
        self.logprobs = None if self.params.logprobs is None else []
        # Nothing predicts the first prompt token, so its entry is None from the start.
        self.prompt_logprobs = None if self.params.prompt_logprobs is None else [None]
        self.text_read_offset = len(self.prompt_token_ids)
        self.text_prefix_offset = max(self.text_read_offset - DETOKENIZE_CONTEXT_TOKENS, 0)
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt then output ids (a live view: do not mutate)."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        """Record one sampled token (and its logprobs when the request asked for them)."""
        if self.is_finished:
            raise RuntimeError(f"request {self.request_id!r} is {self.status.name}; it takes no more tokens")
        if (logprobs is None) != (self.logprobs is None):
            raise ValueError(
                f"logprobs: request {self.request_id!r} has params.logprobs={self.params.logprobs}, "
                f"got {'no' if logprobs is None else 'an'} entry"
            )
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)

    def finish(self, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Move to a terminal status (the scheduler then frees the request's cache)."""
        if not status.is_finished:
            raise ValueError(f"status: {status.name} is not a finished status")
        if self.is_finished:
            raise RuntimeError(f"request {self.request_id!r} already finished as {self.status.name}")
        self.status = status
        self.stop_reason = stop_reason

    def take_output(self) -> RequestOutput:
        """What the request gained since its last output (``RequestOutput``), handed
        out now: O(what it gained), whatever its length."""
        finished = self.is_finished
        visible = len(self.output_text)
        if not finished:
            visible = max(visible - max(self.params.max_stop_length - 1, 0), 0)
        if visible < self._sent_text:
            raise RuntimeError(
                f"request {self.request_id!r}: text shrank below what was handed out ({visible} < {self._sent_text})"
            )
        tokens = self.output_token_ids[self._sent_tokens :]
        phase_times = None
        if tokens and self._sent_tokens == 0 and self.scheduled_time is not None and self.first_token_time is not None:
            phase_times = PhaseTimes(
                queue_s=self.scheduled_time - self.arrival_time, prefill_s=self.first_token_time - self.scheduled_time
            )
        output = RequestOutput(
            request_id=self.request_id,
            token_ids=tuple(tokens),
            finished=finished,
            finish_reason=self.status.finish_reason,
            num_output_tokens=len(self.output_token_ids),
            logprobs=None if self.logprobs is None else tuple(self.logprobs[self._sent_tokens :]),
            prompt_logprobs=(
                None if self.prompt_logprobs is None else tuple(self.prompt_logprobs[self._sent_prompt_logprobs :])
            ),
            text=self.output_text.since(self._sent_text, visible),
            stop_reason=self.stop_reason,
            phase_times=phase_times,
        )
        self._sent_tokens = len(self.output_token_ids)
        self._sent_text = visible
        if self.prompt_logprobs is not None:
            self._sent_prompt_logprobs = len(self.prompt_logprobs)
        return output


class SeedSource:
    """The engine's source of sampling seeds, itself seeded so a run is reproducible.

    A request without a seed gets the next draw; with ``n`` > 1 each sample gets its
    own seed (for an explicit seed: the seed itself, then seeds derived from
    ``(seed, index)``, so an explicit seed means the same stream with any ``n``).
    """

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def seeds_for(self, params: SamplingParams) -> tuple[int, ...]:
        if params.seed is None:
            return tuple(self._rng.getrandbits(_SEED_BITS) for _ in range(params.n))
        return (params.seed,) + tuple(_derived_seed(params.seed, i) for i in range(1, params.n))


def _derived_seed(seed: int, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)
