"""Sampling parameters: what a client asks one request's tokens to follow.

Owns :class:`SamplingParams` (the validated, frozen sampling declaration of one
request: length, temperature, top-k/p, min-p, penalties, logit bias, stops, seeds,
logprobs, the text options, and its :class:`StructuredOutputs`) and the bounds one
request's work is held to: those of any engine at construction (:data:`MAX_N`,
:data:`MAX_INT64`, the stop, penalty, logit-bias and grammar limits), those of a given
engine in ``SamplingParams.validate_for`` (vocabulary, the context), each cheap
whatever the values (:func:`short_repr` keeps the refusals short too). Every refusal
is a :class:`SamplingParamsError` naming the field and what is allowed.

Must not import: torch, tokenizers, ray, ``model``, ``cache``, ``actors``, ``deploy``,
or the other ``cluster`` modules (they import this one).
"""


from __future__ import annotations

import math
from dataclasses import dataclass


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


def is_int(value: object) -> bool:
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
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT64:
            raise SamplingParamsError(f"max_tokens: must be an integer in 1..{MAX_INT64}, got {short_repr(self.max_tokens)}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(
                f"temperature: must be a finite number >= 0 (0 = greedy), got {short_repr(self.temperature)}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p: must be a number in (0, 1], got {short_repr(self.top_p)}")
        if not is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= MAX_INT64):
            raise SamplingParamsError(f"top_k: must be -1 (off) or an integer in 1..{MAX_INT64}, got {short_repr(self.top_k)}")
        if self.seed is not None and not is_int(self.seed):
            raise SamplingParamsError(f"seed: must be None or an integer, got {short_repr(self.seed)}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name}: must be a bool, got {short_repr(getattr(self, name))}")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise SamplingParamsError(f"n: must be an integer in 1..{MAX_N}, got {short_repr(self.n)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
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
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
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
    if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
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
        if not is_int(token) or token < 0:
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
    if is_int(value) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
