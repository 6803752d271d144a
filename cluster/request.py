"""Requests: what a client asks for, the record the scheduler keeps, what it gets back.

Owns: :class:`SamplingParams` (the validated, frozen sampling declaration of one
request), :class:`RequestStatus` and :class:`FinishReason`, :class:`Request` (the
mutable per-request record the scheduler owns: tokens, status, cursor, sampling seed,
collected logprobs and text), :class:`RequestOutput` (the frozen snapshot handed back
to callers) and :class:`SeedSource` (where a request without a seed gets one); and the
bounds one request's work is held to: those of any engine at construction
(:data:`MAX_N`, :data:`MAX_INT64`, the stop limits), those of a given engine in
``SamplingParams.validate_for`` (vocabulary, the context), each cheap whatever the
values (:func:`short_repr` keeps the refusals short too).

Must not import: torch, tokenizers, ray, ``model``, ``cache``, ``actors``, ``deploy``,
or the other ``cluster`` modules (they import this one). The text fields are written
by ``cluster.stopping``; this module only stores and reports them.
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Sequence

# The OpenAI API caps top logprobs at 20; vLLM's default max_logprobs is the same.
MAX_LOGPROBS = 20
# Integers the sampling metadata carries as int64 (top_k, max_tokens): anything
# larger is refused here rather than overflowing a tensor inside the engine step.
MAX_INT64 = 2**63 - 1
# Samples of one request: OpenAI's own cap on ``n``. Each is a sequence the engine
# queues (and an id it builds), so the bound is checked before any is made.
MAX_N = 128
# Stop conditions are checked after every token: each stop string is searched for in
# the text's tail (its length), each stop token id compared. The counts and lengths are
# bounded so that one request cannot make that check cost more than a step.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 512
# Incremental detokenisation starts this many prompt tokens before the first output
# token, so decoders whose output depends on the preceding token (a leading space,
# a word-piece join) render the first output token as it reads in context.
DETOKENIZE_CONTEXT_TOKENS = 5
# Seeds drawn for requests stay non-negative int64 values (printable, JSON-safe).
_SEED_BITS = 63
# vLLM's ranges for the penalties; OpenAI's for a logit bias, and a bound on its
# entries (each is a scatter into its row of logits every step).
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
# A grammar's text (a JSON schema, a regex, an EBNF grammar, the choices) is compiled
# against the whole vocabulary; its size is bounded before anything parses it.
MAX_GRAMMAR_CHARS = 1 << 16
MAX_CHOICES = 256


class SamplingParamsError(ValueError):
    """A sampling parameter outside its allowed range; the message names the field."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match, vLLM's ``StructuredOutputsParams``: exactly one of
    ``json`` (a JSON Schema's text), ``json_object`` (any JSON object), ``regex``,
    ``choice`` (one of these strings), ``grammar`` (xgrammar's EBNF) or
    ``structural_tag`` (xgrammar's structural tag JSON: the HTTP layer's tool calls
    and its thinking-mode wrappers). Whether the text compiles is the grammar engine's
    check (``cluster.structured_output``); here only the shape and the sizes."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                f"structured_outputs: give exactly one of {', '.join(_STRUCTURED_KINDS)}, got {given or 'none'}"
            )
        if not isinstance(self.json_object, bool):
            raise SamplingParamsError(f"structured_outputs.json_object: must be a bool, got {short_repr(self.json_object)}")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_GRAMMAR_CHARS):
                raise SamplingParamsError(
                    f"structured_outputs.{name}: must be a non-empty string of at most {MAX_GRAMMAR_CHARS} "
                    f"characters, got {short_repr(value)}"
                )
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if (
                not choice
                or len(choice) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in choice)
                or sum(map(len, choice)) > MAX_GRAMMAR_CHARS
            ):
                raise SamplingParamsError(
                    f"structured_outputs.choice: must be 1..{MAX_CHOICES} non-empty strings of at most "
                    f"{MAX_GRAMMAR_CHARS} characters in all, got {short_repr(self.choice)}"
                )
            object.__setattr__(self, "choice", choice)

    @property
    def kind(self) -> str:
        """Which of the fields is set."""
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))


_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request, checked on construction.

    ``temperature`` 0 is greedy (argmax; top_k / top_p / seed then play no part).
    ``top_k`` -1 is off. ``stop`` takes a string or a list of strings, like OpenAI's
    ``stop``, and is stored as a tuple; ``stop_token_ids`` likewise. ``logprobs`` and
    ``prompt_logprobs`` are the number of top alternatives reported per position
    (0: only the chosen / actual token), ``None`` for none. ``seed`` None draws one
    from the engine's :class:`SeedSource`; an integer seed is taken modulo 2**64.
    ``max_tokens`` and ``top_k`` are at most :data:`MAX_INT64` here and ``n`` at most
    :data:`MAX_N`; what bounds them on a given engine (the context, the vocabulary) is
    :meth:`validate_for`'s.

    vLLM's semantics for the rest: ``repetition_penalty`` (> 0, 1 off) divides a
    positive logit and multiplies a negative one of every token in the prompt or the
    output; ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]) subtract from a
    token's logit once if it is in the output and once per occurrence there. ``min_p``
    (in [0, 1]) drops tokens whose probability after temperature is below ``min_p``
    times the most likely one's. ``min_tokens`` masks EOS and ``stop_token_ids`` until
    that many tokens are out. ``logit_bias`` maps token ids to a bias in [-100, 100]
    added to their logits (stored as sorted ``(id, bias)`` pairs). ``structured_outputs``
    constrains the output to a grammar (:class:`StructuredOutputs`).

    ``skip_special_tokens`` (vLLM's default: on) leaves the tokenizer's special tokens
    out of the decoded text, except those in ``kept_special_token_ids`` (the markers a
    protocol's parser reads from the output, such as ``</think>``).
    ``spaces_between_special_tokens`` is vLLM's: a ``tokenizers`` (fast) tokenizer's
    decoder puts no space of its own around special tokens, so, as in vLLM's fast
    detokenizer, it changes nothing for a ByteLevel tokenizer like DeepSeek's.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    kept_special_token_ids: tuple[int, ...] | list[int] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] | dict[int, float] = ()
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT64:
            raise SamplingParamsError(f"max_tokens: must be an integer in 1..{MAX_INT64}, got {short_repr(self.max_tokens)}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(
                f"temperature: must be a finite number >= 0 (0 = greedy), got {short_repr(self.temperature)}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p: must be a number in (0, 1], got {short_repr(self.top_p)}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= MAX_INT64):
            raise SamplingParamsError(f"top_k: must be -1 (off) or an integer in 1..{MAX_INT64}, got {short_repr(self.top_k)}")
        if self.seed is not None and not _is_int(self.seed):
            raise SamplingParamsError(f"seed: must be None or an integer, got {short_repr(self.seed)}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name}: must be a bool, got {short_repr(getattr(self, name))}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise SamplingParamsError(f"n: must be an integer in 1..{MAX_N}, got {short_repr(self.n)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise SamplingParamsError(f"{name}: must be None or an integer in 0..{MAX_LOGPROBS}, got {short_repr(value)}")
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(
            self, "kept_special_token_ids", _normalise_token_ids("kept_special_token_ids", self.kept_special_token_ids)
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise SamplingParamsError(
                    f"{name}: must be a number in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], got {short_repr(value)}"
                )
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise SamplingParamsError(
                f"repetition_penalty: must be a finite number > 0 (1 = off), got {short_repr(self.repetition_penalty)}"
            )
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise SamplingParamsError(f"min_p: must be a number in [0, 1], got {short_repr(self.min_p)}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens: must be an integer in 0..max_tokens ({self.max_tokens}), got {short_repr(self.min_tokens)}"
            )
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise SamplingParamsError(
                f"structured_outputs: must be None or a StructuredOutputs, got {short_repr(self.structured_outputs)}"
            )
        if self.structured_outputs is not None and self.ignore_eos:
            raise SamplingParamsError("ignore_eos: must be false with structured_outputs (a grammar ends at EOS)")

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling needs the request's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def max_stop_length(self) -> int:
        """Characters of the longest stop string (0 without stop strings)."""
        return max((len(s) for s in self.stop), default=0)

    def validate_for(self, vocab_size: int, max_model_len: int, prompt_len: int) -> None:
        """Check what depends on the model and the prompt: ``top_k`` and token ids
        inside the vocabulary and the whole sequence inside the context limit. Cheap
        whatever the values: nothing is built per sample or per token."""
        if self.top_k > vocab_size:
            raise SamplingParamsError(f"top_k: {self.top_k} exceeds the vocabulary (allowed: -1 or 1..{vocab_size})")
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", [t for t, _ in self.logit_bias])):
            out_of_vocab = [t for t in ids if t >= vocab_size]
            if out_of_vocab:
                raise SamplingParamsError(
                    f"{name}: {short_repr(out_of_vocab)} outside the vocabulary (allowed: 0..{vocab_size - 1})"
                )
        if prompt_len < 1:
            raise SamplingParamsError(f"prompt: must hold at least one token, got {prompt_len}")
        if prompt_len + self.max_tokens > max_model_len:
            raise SamplingParamsError(
                f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) = "
                f"{prompt_len + self.max_tokens} exceeds the context limit max_model_len={max_model_len} "
                f"(allowed: max_tokens <= {max_model_len - prompt_len})"
            )


def _normalise_stop(stop: object) -> tuple[str, ...]:
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise SamplingParamsError(f"stop: must be a non-empty string or a list of non-empty strings, got {short_repr(stop)}")
    if len(items) > MAX_STOP_STRINGS:
        raise SamplingParamsError(f"stop: must be at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    longest = max((len(s) for s in items), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise SamplingParamsError(
            f"stop: must be strings of at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}"
        )
    return tuple(items)


def _normalise_token_ids(name: str, ids: object) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
        raise SamplingParamsError(f"{name}: must be a list of integers >= 0, got {short_repr(ids)}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise SamplingParamsError(f"{name}: must be at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    return tuple(ids)


def _normalise_logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    items = list(bias.items()) if isinstance(bias, dict) else bias
    if not isinstance(items, (list, tuple)) or not all(
        isinstance(item, (list, tuple)) and len(item) == 2 for item in items
    ):
        raise SamplingParamsError(f"logit_bias: must map token ids to biases, got {short_repr(bias)}")
    if len(items) > MAX_LOGIT_BIAS_TOKENS:
        raise SamplingParamsError(f"logit_bias: must hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(items)}")
    for token, value in items:
        if not _is_int(token) or token < 0:
            raise SamplingParamsError(f"logit_bias: token ids must be integers >= 0, got {short_repr(token)}")
        if not _is_real(value) or not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
            raise SamplingParamsError(
                f"logit_bias: token {token}'s bias must be a number in [-{MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}], "
                f"got {short_repr(value)}"
            )
    if len({token for token, _ in items}) != len(items):
        raise SamplingParamsError("logit_bias: a token id is given more than once")
    return tuple(sorted((token, float(value)) for token, value in items))


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: refusals quote what they refuse,
    not megabytes of it."""
    if _is_int(value) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


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
    """Adds up each request's deltas: ``add`` returns the request's whole output so far
    (every token, text and logprob entry in one RequestOutput), built only for the
    callers that ask (``EngineClient.generate``, validation, tests). A finished
    request is dropped once its last output is built."""

    def __init__(self) -> None:
        self._held: dict[str, _HeldOutput] = {}

    def add(self, delta: RequestOutput) -> RequestOutput:
        held = self._held.setdefault(delta.request_id, _HeldOutput())
        held.token_ids.extend(delta.token_ids)
        held.texts.append(delta.text)
        held.logprobs = _extended(held.logprobs, delta.logprobs)
        held.prompt_logprobs = _extended(held.prompt_logprobs, delta.prompt_logprobs)
        if delta.finished:
            del self._held[delta.request_id]
        return RequestOutput(
            request_id=delta.request_id,
            token_ids=tuple(held.token_ids),
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            num_output_tokens=delta.num_output_tokens,
            logprobs=None if held.logprobs is None else tuple(held.logprobs),
            prompt_logprobs=None if held.prompt_logprobs is None else tuple(held.prompt_logprobs),
            text="".join(held.texts),
            stop_reason=delta.stop_reason,
        )

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)


@dataclass
class _HeldOutput:
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


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

    ``num_computed_tokens`` is the cursor: tokens whose KV the cache holds.
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
        if not all(_is_int(t) and t >= 0 for t in self.prompt_token_ids):
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
