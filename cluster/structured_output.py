"""Structured outputs: grammars compiled once per spec, a matcher per request, and
the token mask each sampling step applies, on xgrammar (the engine vLLM and SGLang use).

Owns :class:`StructuredOutputError` (a spec the grammar engine refuses, naming the
field and why), :func:`check_structured_outputs` (the tokenizer-free parse of a spec:
what the HTTP layer runs before queueing), :func:`grammar_tokenizer_info` (the
vocabulary as the grammar engine reads it), :class:`GrammarCache` (compiled grammars
in an LRU keyed by the spec) and :class:`StructuredOutputManager` (the driver's
matchers: one per request with a grammar, advanced with each accepted token, and the
packed mask of what it allows next, which travels in the segment's
``SamplingGuide``).

Where the state lives is vLLM's choice: the matchers are the engine's, beside the
requests, not the ranks' (a rank keeps none of a request's tokens). A preempted request keeps
its tokens (it recomputes their KV), so its matcher stays where it was and its next
mask is the same; :meth:`StructuredOutputManager.rollback` takes tokens back for a
caller that un-accepts them (speculative decoding).

Special tokens are never allowed by a grammar except :data:`OUTPUT_MARKERS`, the ones
the model writes inside an answer (PROTOCOL.md: ``</think>`` ends the reasoning,
``｜DSML｜`` spells the tool-call tags), which a grammar may spell as the text they
decode to; EOS ends a grammar (its stop token).

Must not import: ray, ``model``, ``cache``, ``actors``, ``deploy``; from ``cluster``
only ``cluster.request`` and ``cluster.sampling_guide``.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from typing import Sequence

import xgrammar
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from dsv41.cluster.sampling_guide import bitmask_words
from dsv41.cluster.sampling_params import SamplingParamsError, StructuredOutputs, short_repr

logger = logging.getLogger(__name__)

# PROTOCOL.md's markers the model writes in its output (deploy/chat_protocol.py's
# THINK_END and DSML; tests/cluster/test_structured_output.py checks they agree).
OUTPUT_MARKERS = ("</think>", "｜DSML｜")
DEFAULT_GRAMMAR_CACHE_SIZE = 256
# xgrammar's C++ errors open with a timestamp, a source location and a failed check's
# text; what follows is the reason.
_XGRAMMAR_NOISE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


class StructuredOutputError(SamplingParamsError):
    """A structured-output spec the grammar engine cannot use; the message names the
    field and the engine's reason."""


# xgrammar 0.2.9's JSON string characters are laxer than JSON: a length-bounded string
# (minLength / maxLength) lets raw control characters through (JSON requires them
# escaped; json.loads refuses them), and every string lets UTF-8-encoded surrogates
# through (not UTF-8: decoders read each byte as U+FFFD, so a bounded string comes
# out longer than its bound). The grammars that hold JSON get this class instead.
_LAX_STRING_CHARS = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')
_JSON_STRING_CHARS = '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'


def _json_strings_strict(grammar: xgrammar.Grammar) -> xgrammar.Grammar:
    text = str(grammar)
    strict = text
    for lax in _LAX_STRING_CHARS:
        strict = strict.replace(lax, _JSON_STRING_CHARS)
    return grammar if strict == text else xgrammar.Grammar.from_ebnf(strict)


def _grammar(spec: StructuredOutputs) -> xgrammar.Grammar:
    kind = spec.kind
    try:
        if kind == "json":
            return _json_strings_strict(xgrammar.Grammar.from_json_schema(spec.json, any_whitespace=False, strict_mode=True))
        if kind == "json_object":
            return _json_strings_strict(xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False))
        if kind == "regex":
            return xgrammar.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgrammar.Grammar.from_ebnf(choice_ebnf(spec.choice))
        if kind == "grammar":
            return xgrammar.Grammar.from_ebnf(spec.grammar)
        return _json_strings_strict(xgrammar.Grammar.from_structural_tag(spec.structural_tag))
    except (RuntimeError, ValueError, TypeError) as exc:
        lines = str(exc).strip().splitlines()
        reason = _XGRAMMAR_NOISE.sub("", lines[-1]) if lines else type(exc).__name__
        raise StructuredOutputError(f"structured_outputs: the {kind} does not compile: {short_repr(reason, 400)}") from None


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are
    EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def check_structured_outputs(spec: StructuredOutputs) -> None:
    """Parses ``spec`` without a vocabulary (cheap: no token tables are built), so a
    refusal comes before a request is queued. Raises :class:`StructuredOutputError`."""
    _grammar(spec)


def grammar_tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgrammar.TokenizerInfo:
    """The vocabulary as xgrammar reads it: each token's bytes (byte-level BPE decoded
    by xgrammar's own detection), ids past the tokenizer (the model's padding rows)
    and special tokens other than :data:`OUTPUT_MARKERS` never allowed."""
    info = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer), vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
    )
    vocab = list(info.decoded_vocab)
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and added.content not in OUTPUT_MARKERS and token_id < vocab_size:
            vocab[token_id] = b""  # an empty token is one xgrammar never allows
    return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


class GrammarCache:
    """Compiled grammars, each compiled once per spec and kept in an LRU of
    ``capacity`` specs (xgrammar's own cache is off: this one is the only copy)."""

    def __init__(self, info: xgrammar.TokenizerInfo, capacity: int = DEFAULT_GRAMMAR_CACHE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: {capacity} (allowed: >= 1)")
        self.capacity = capacity
        self.vocab_size = info.vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[StructuredOutputs, xgrammar.CompiledGrammar] = OrderedDict()
        self.compilations = 0

    def get(self, spec: StructuredOutputs) -> xgrammar.CompiledGrammar:
        compiled = self._compiled.get(spec)
        if compiled is not None:
            self._compiled.move_to_end(spec)
            return compiled
        compiled = self._compiler.compile_grammar(_grammar(spec))
        self.compilations += 1
        self._compiled[spec] = compiled
        if len(self._compiled) > self.capacity:
            self._compiled.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)


class StructuredOutputManager:
    """The engine's matchers, one per request (sample) with a grammar."""

    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}
        self._bitmask = xgrammar.allocate_token_bitmask(1, cache.vocab_size)
        if self._bitmask.shape[1] != bitmask_words(cache.vocab_size):
            raise RuntimeError(f"xgrammar's bitmask has {self._bitmask.shape[1]} words per row, not {bitmask_words(cache.vocab_size)}")

    def add(self, request_id: str, spec: StructuredOutputs) -> None:
        """A fresh matcher for ``request_id`` (compiling ``spec`` unless cached)."""
        self._matchers[request_id] = xgrammar.GrammarMatcher(self.cache.get(spec))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def allowed_tokens(self, request_id: str) -> bytes:
        """The packed mask of the tokens the request's grammar allows next."""
        self._matchers[request_id].fill_next_token_bitmask(self._bitmask)
        return self._bitmask[0].numpy().tobytes()

    def accept(self, request_id: str, token_id: int) -> None:
        """Advances the request's matcher by a sampled token; a token its mask forbade
        is an engine bug, raised."""
        if not self._matchers[request_id].accept_token(token_id):
            raise RuntimeError(f"request {request_id!r}: the grammar refused token {token_id}, which its mask allowed")

    def rollback(self, request_id: str, num_tokens: int) -> None:
        self._matchers[request_id].rollback(num_tokens)

    def is_terminated(self, request_id: str) -> bool:
        return self._matchers[request_id].is_terminated()

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def clear(self) -> None:
        self._matchers.clear()

