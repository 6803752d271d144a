"""The OpenAI API's answers: completion and chat responses, stream chunks, usage and
logprobs, written from the engine's outputs.

Owns :class:`CompletionWriter` (a completion answer: echo, prompt logprobs, whole or
streamed), :func:`chat_completion_response` and :class:`ChatStreamWriter` (a chat
answer: reasoning, content, ``tool_calls``, finish reason, parsed by
``deploy.chat_parser``), the logprob entries (``bytes`` from each token's own bytes),
usage and the SSE framing. Nothing here runs or reads a request.

Must not import: ``ray``, ``fastapi``, ``torch``, ``model``, ``cache``, ``actors``,
``deploy.app``, ``deploy.llm_server``.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tokenizers import decoders

from dsv41.cluster.request import RequestOutput
from dsv41.deploy.chat_parser import ChatDelta, ParsedMessage, StreamingChatParser, parse_assistant_output
from dsv41.deploy.openai_api import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"



# -- writing a response -------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted (what ``tokenizers``' ByteLevel pre-tokenizer
    maps each byte to): a character of a ByteLevel token's string back to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(shifted)}}


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=8)
def _added_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's added tokens, read once per tokenizer (token_bytes
    runs for every logprob entry)."""
    return frozenset(tokenizer.get_added_tokens_decoder())


def token_bytes(tokenizer: Tokenizer, token_id: int) -> list[int]:
    """The token's own bytes (OpenAI's logprob ``bytes``): for a byte-level BPE token
    (DeepSeek's) the bytes its string stands for, which may be part of a character; a
    byte-fallback token ``<0xNN>`` its byte; an added token, or a token of any other
    tokenizer, the UTF-8 of its text."""
    piece = tokenizer.id_to_token(token_id)
    if piece is None or token_id in _added_token_ids(tokenizer):
        return list(token_text(tokenizer, token_id).encode())
    if isinstance(tokenizer.decoder, decoders.ByteLevel) and all(c in _BYTE_LEVEL_ALPHABET for c in piece):
        return [_BYTE_LEVEL_ALPHABET[c] for c in piece]
    fallback = _BYTE_FALLBACK_TOKEN.fullmatch(piece)
    if fallback is not None:
        return [int(fallback.group(1), 16)]
    return list(token_text(tokenizer, token_id).encode())


# OpenAI's stand-in for a logprob of -inf (JSON has no infinity), as vLLM writes it.
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _ranked(entry: Mapping[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    entries: Sequence[Mapping[int, float] | None],
    text_offset: int,
) -> dict[str, Any]:
    """OpenAI's completion ``logprobs`` object for these tokens; ``text_offset`` is
    where the first one starts in the choice's text. An entry of ``None`` (an echoed
    prompt's first token: nothing predicts it) has ``None`` for its logprob and its
    alternatives. Alternatives with the same text keep the best logprob."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    top_logprobs: list[dict[str, float] | None] = []
    for entry in entries:
        if entry is None:
            top_logprobs.append(None)
            continue
        alternatives: dict[str, float] = {}
        for alt, lp in _ranked(entry):
            alternatives.setdefault(token_text(tokenizer, alt), _logprob(lp))
        top_logprobs.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [None if entry is None else _logprob(entry[t]) for t, entry in zip(token_ids, entries)],
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def prompt_logprobs_field(
    tokenizer: Tokenizer, prompt: Sequence[int], entries: Sequence[Mapping[int, float] | None], top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a completion choice: per prompt token ``None`` (the
    first) or ``{token id: {"logprob", "rank", "decoded_token"}}`` for the top ``top``
    and the prompt's own token. ``rank`` (1 = the most likely) is known for the top
    ``top``; the prompt's token outside them has rank ``None`` (past ``top``, not counted)."""
    field: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(prompt, entries):
        if entry is None:
            field.append(None)
            continue
        ranked = _ranked(entry)
        outside = len(entry) > top  # the prompt's token is not among the top
        field.append(
            {
                str(alt): {
                    "logprob": _logprob(lp),
                    "rank": None if outside and alt == token_id else rank,
                    "decoded_token": token_text(tokenizer, alt),
                }
                for rank, (alt, lp) in enumerate(ranked, start=1)
            }
        )
    return field


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: tuple[int, ...], entries: tuple[dict[int, float], ...], top: int
) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object: per token its logprob, its own bytes and the
    ``top`` best."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(tokenizer, token_id), "logprob": _logprob(logprob), "bytes": token_bytes(tokenizer, token_id)}

    return {
        "content": [
            {
                **item(t, entry[t]),
                "top_logprobs": [item(alt, lp) for alt, lp in _ranked(entry)[:top]],
            }
            for t, entry in zip(token_ids, entries)
        ]
    }


class CompletionWriter:
    """One completion answer, whole (:meth:`response`) or streamed (:meth:`events`,
    :meth:`closing`), from the engine's outputs of each choice (index = prompt * n +
    sample, in any interleaving of the choices).

    With ``echo`` a choice starts with its prompt: the prompt's text (a text prompt as
    given, token ids decoded with special tokens), and with ``logprobs`` the prompt's
    tokens and entries before the completion's (a stream: on the choice's first chunk).
    A request that does not generate (``max_tokens`` 0) answers the prompt alone,
    finish reason ``length``, no completion tokens (?). With ``prompt_logprobs`` asked,
    a whole answer's choices carry vLLM's ``prompt_logprobs``."""

    _KIND = "text_completion"

    def __init__(
        self,
        request: CompletionRequest,
        prompts: Sequence[tuple[int, ...]],
        response_id: str,
        model: str,
        created: int,
        tokenizer: Tokenizer,
    ) -> None:
        self._request = request
        self._prompts = prompts
        self._response_id = response_id
        self._model = model
        self._created = created
        self._tokenizer = tokenizer
        self._echoed: set[int] = set()
        self._sent_text: dict[int, int] = {}
        self._sent_tokens: dict[int, int] = {}

    def response(self, finals: Mapping[int, RequestOutput]) -> dict[str, Any]:
        """The non-streamed answer from each choice's whole output."""
        sampling = self._request.sampling
        choices = []
        for index in sorted(finals):
            output = finals[index]
            text, token_ids, entries = self._piece(index, output)
            logprobs = None if entries is None else completion_logprobs(self._tokenizer, token_ids, entries, 0)
            choice = completion_choice(index, text, logprobs, self._finish_reason(output))
            if sampling.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_field(
                    self._tokenizer, self._prompt(index), output.prompt_logprobs or (), sampling.prompt_logprobs
                )
            choices.append(choice)
        return completion_response(
            self._response_id, self._model, self._created, choices, usage(self._prompt_tokens(), sum(self._sent_tokens.values()))
        )

    def events(self, index: int, output: RequestOutput) -> list[str]:
        """The chunk a delta of choice ``index`` adds (none while it adds no text, no
        logprobs and does not finish)."""
        text_from = self._sent_text.get(index, 0)
        text, token_ids, entries = self._piece(index, output)
        self._sent_text[index] = text_from + len(text)
        if not text and not output.finished and not (token_ids and entries is not None):
            return []
        logprobs = None if entries is None else completion_logprobs(self._tokenizer, token_ids, entries, text_from)
        choice = completion_choice(index, text, logprobs, self._finish_reason(output))
        return [chunk(self._KIND, self._response_id, self._model, self._created, [choice])]

    def closing(self) -> list[str]:
        """The usage chunk (with ``stream_options.include_usage``) and ``[DONE]``."""
        events = []
        if self._request.include_usage:
            counts = usage(self._prompt_tokens(), sum(self._sent_tokens.values()))
            events.append(chunk(self._KIND, self._response_id, self._model, self._created, [], counts))
        return [*events, SSE_DONE]

    def _prompt(self, index: int) -> tuple[int, ...]:
        return self._prompts[index // self._request.sampling.n]

    def _prompt_tokens(self) -> int:
        return sum(map(len, self._prompts))

    def _finish_reason(self, output: RequestOutput) -> str | None:
        if output.finish_reason is None:
            return None
        return output.finish_reason.value if self._request.generates else "length"

    def _piece(
        self, index: int, output: RequestOutput
    ) -> tuple[str, tuple[int, ...], tuple[Mapping[int, float] | None, ...] | None]:
        """The text, token ids and logprob entries a delta adds to choice ``index``'s
        answer (the echoed prompt first), counting its completion tokens."""
        want_logprobs = self._request.sampling.logprobs is not None
        if self._request.generates:
            text, token_ids, entries = output.text, output.token_ids, output.logprobs
        else:
            text, token_ids, entries = "", (), () if want_logprobs else None
        self._sent_tokens[index] = self._sent_tokens.get(index, 0) + len(token_ids)
        if self._request.echo and index not in self._echoed:
            self._echoed.add(index)
            prompt = self._prompt(index)
            given = self._request.prompts[index // self._request.sampling.n]
            prompt_text = given if isinstance(given, str) else self._tokenizer.decode(list(prompt), skip_special_tokens=False)
            text, token_ids = prompt_text + text, prompt + token_ids
            if entries is not None:
                prompt_entries = output.prompt_logprobs or ()
                if len(prompt_entries) != len(prompt):
                    raise RuntimeError(
                        f"request {output.request_id!r}: {len(prompt_entries)} prompt logprob entries for a prompt of "
                        f"{len(prompt)} tokens in its first output"
                    )
                entries = (*prompt_entries, *entries)
        return text, token_ids, entries


def completion_response(
    response_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_counts: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_counts,
    }


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(
    response_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_counts: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_counts,
    }


def chat_finish_reason(output: RequestOutput, message: ParsedMessage | None, called_tools: bool) -> str | None:
    """OpenAI's finish_reason: ``tool_calls`` when a stopped answer called tools."""
    if output.finish_reason is None:
        return None
    if output.finish_reason.value == "stop" and (called_tools or (message is not None and message.tool_calls)):
        return "tool_calls"
    return output.finish_reason.value


def chat_choice(
    index: int, message: ParsedMessage, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "message": message.to_openai(), "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk_choice(
    index: int, delta: ChatDelta | None, logprobs: dict[str, Any] | None, finish_reason: str | None, *, first: bool = False
) -> dict[str, Any]:
    content: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
    if delta is not None:
        content.update(delta.to_openai())
    return {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion_response(
    request: ChatCompletionRequest,
    response_id: str,
    model: str,
    created: int,
    finals: Mapping[int, RequestOutput],
    prompt_tokens: int,
    tokenizer: Tokenizer,
) -> dict[str, Any]:
    """The non-streamed chat answer from each choice's finished output: the text read
    back as an assistant message (reasoning, content, ``tool_calls``; a malformed call
    block stays content), ``finish_reason`` ``tool_calls`` when a stopped answer called
    tools, token logprobs when asked for, and usage."""
    top = request.top_logprobs
    choices = []
    for index in sorted(finals):
        output = finals[index]
        message = parse_assistant_output(output.text, thinking=request.thinking, tools_enabled=request.tools_enabled)
        logprobs = None if output.logprobs is None else chat_logprobs(tokenizer, output.token_ids, output.logprobs, top)
        choices.append(chat_choice(index, message, logprobs, chat_finish_reason(output, message, False)))
    generated = sum(len(o.token_ids) for o in finals.values())
    return chat_response(response_id, model, created, choices, usage(prompt_tokens, generated))


class ChatStreamWriter:
    """The SSE events of one streamed chat answer, written from the engine's cumulative
    output snapshots of each choice (in any interleaving of the choices).

    Per choice: :meth:`opening`'s role chunk, then reasoning and content deltas as the
    streaming parser makes them certain, each tool call whole (id, type, function name
    and JSON arguments) as its invoke closes, token logprobs on the first piece of
    their step, and a last chunk with the finish reason (``tool_calls`` when a stopped
    answer called tools). :meth:`closing` adds the usage chunk when asked for and
    ``[DONE]``. Joining the deltas gives :func:`chat_completion_response`'s message."""

    _KIND = "chat.completion.chunk"

    def __init__(self, request: ChatCompletionRequest, response_id: str, model: str, created: int, tokenizer: Tokenizer) -> None:
        self._request = request
        self._response_id = response_id
        self._model = model
        self._created = created
        self._tokenizer = tokenizer
        self._top = request.top_logprobs
        choices = range(request.n)
        self._parsers = {
            i: StreamingChatParser(thinking=request.thinking, tools_enabled=request.tools_enabled) for i in choices
        }
        self._sent_tokens = dict.fromkeys(choices, 0)
        self._called_tools = dict.fromkeys(choices, False)

    def opening(self) -> list[str]:
        """Each choice's first chunk: the assistant role with empty content."""
        return [self._chunk([chat_chunk_choice(i, None, None, None, first=True)]) for i in self._parsers]

    def events(self, index: int, output: RequestOutput) -> list[str]:
        """The chunks a delta of choice ``index`` adds (none while its new text could
        still start a marker and no logprobs are due)."""
        parser = self._parsers[index]
        deltas = parser.feed(output.text)
        if output.finished:
            deltas += parser.finish()
        logprobs = (
            None
            if output.logprobs is None or not output.token_ids
            else chat_logprobs(self._tokenizer, output.token_ids, output.logprobs, self._top)
        )
        self._sent_tokens[index] += len(output.token_ids)
        self._called_tools[index] |= any(d.tool_call is not None for d in deltas)
        # Token logprobs ride on the first piece of their step (or an empty delta).
        pieces: list[ChatDelta | None] = list(deltas) or ([None] if logprobs is not None else [])
        events = [
            self._chunk([chat_chunk_choice(index, delta, logprobs if position == 0 else None, None)])
            for position, delta in enumerate(pieces)
        ]
        if output.finished:
            finish = chat_finish_reason(output, None, self._called_tools[index])
            events.append(self._chunk([chat_chunk_choice(index, None, None, finish)]))
        return events

    def closing(self, prompt_tokens: int) -> list[str]:
        """The usage chunk (with ``stream_options.include_usage``) and ``[DONE]``."""
        events = []
        if self._request.include_usage:
            events.append(self._chunk([], usage(prompt_tokens, sum(self._sent_tokens.values()))))
        return [*events, SSE_DONE]

    def _chunk(self, choices: list[dict[str, Any]], usage_counts: dict[str, int] | None = None) -> str:
        return chunk(self._KIND, self._response_id, self._model, self._created, choices, usage_counts)


def chunk(kind: str, response_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_counts: dict[str, int] | None = None) -> str:
    """One SSE event of a stream: ``kind`` is ``text_completion`` or ``chat.completion.chunk``."""
    payload: dict[str, Any] = {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_counts is not None:
        payload["usage"] = usage_counts
    return sse(payload)


def sse(payload: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def now() -> int:
    return int(time.time())
