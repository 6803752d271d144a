"""Stop handling and incremental detokenisation of generated tokens.

Owns: :class:`StopChecker`, which after every sampled token decides whether the
request finished and why (stop token ids, EOS, stop strings, max_tokens) and advances
the request's decoded text with a ``tokenizers.Tokenizer``.

The text is stable under streaming: a token that leaves an incomplete UTF-8 character
(the decode ends in U+FFFD) adds nothing until a later token completes it; only when
the request finishes is such a tail decoded as it stands. Special tokens are left out
when the request skips them (``SamplingParams.skip_special_tokens``, vLLM's default),
but for those it keeps (``kept_special_token_ids``: ``<think>``, ``｜DSML｜``, which the
reasoning and tool parsers downstream read). The text grows by what each token adds
(``cluster.request.OutputText``): a token costs O(its text), whatever the output's length.

Must not import: torch, ray, ``model``, ``cache``, ``actors``, ``deploy``; from
``cluster`` only ``cluster.request``.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer

from dsv41.cluster.request import DETOKENIZE_CONTEXT_TOKENS, Request, RequestStatus
from dsv41.cluster.sampling_params import SamplingParams

_REPLACEMENT_CHARACTER = "\ufffd"


class StopChecker:
    """Decides, token by token, whether a request finished, and keeps its text.

    Call :meth:`check_stop` once after each ``request.append_output_token``. What the
    newest token does, in this order of precedence:

    1. It is in ``params.stop_token_ids``: finished "stop", ``stop_reason`` = the id.
    2. It is EOS and ``params.ignore_eos`` is off: finished "stop", ``stop_reason``
       None. Neither kind of stop token is decoded into the text (it stays in
       ``token_ids``).
    3. A stop string completes in the text decoded so far (also across token
       boundaries, and also in the tail flushed when 1 or 2 ends the request, since
       that string comes earlier in the text): finished "stop", ``stop_reason`` = the
       string, the text cut before it. Of several, the one starting first wins, then
       the one listed first.
    4. The request now has ``params.max_tokens`` tokens: finished "length".

    So a stop token, EOS or stop string at the same step as max_tokens reports "stop".
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int) -> None:
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        if not 0 <= eos_token_id < vocab_size:
            raise ValueError(
                f"eos_token_id: {eos_token_id} is outside the tokenizer's vocabulary 0..{vocab_size - 1}"
            )
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self._special_ids = frozenset(
            token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special
        )
        # The skipped ids per kept set: a handful of kept sets (one per protocol) in a server's life.
        self._skipped_by_kept: dict[tuple[int, ...], frozenset[int]] = {}

    def check_stop(self, request: Request) -> bool:
        """Account for the request's newest output token; finish it if it stops.
        Returns whether the request is now finished."""
        if request.is_finished or request.num_output_tokens == 0:
            raise RuntimeError(
                f"request {request.request_id!r}: check_stop needs a running request with a new token "
                f"(status {request.status.name}, {request.num_output_tokens} output tokens)"
            )
        params = request.params
        token_id = request.output_token_ids[-1]
        is_stop_token_id = token_id in params.stop_token_ids
        is_stop_token = is_stop_token_id or (token_id == self.eos_token_id and not params.ignore_eos)
        reached_length = request.num_output_tokens >= params.max_tokens

        text = request.output_text
        text_end = request.num_tokens - 1 if is_stop_token else request.num_tokens
        new_text, resolved = self._decode_new_text(request, text_end, flush=is_stop_token or reached_length)
        if params.stop:
            # A stop string completed now must end in the new text, so it starts no
            # earlier than this (also the end of what snapshots may already have shown).
            search_from = max(len(text) - params.max_stop_length + 1, 0)
            tail = text.since(search_from)
            # An unresolved tail is searched too (without its replacement characters),
            # so a request stops at the very token whose text completes a stop string
            # even when that token also starts an incomplete character.
            searched = tail + (new_text if resolved else new_text.rstrip(_REPLACEMENT_CHARACTER))
            stop_string_match = _first_stop_string(searched, params.stop)
            if stop_string_match is not None:
                start, stop_string = stop_string_match
                text.truncate(min(search_from + start, len(text)))
                text.append(searched[len(tail) : start])
                request.finish(RequestStatus.FINISHED_STOPPED, stop_string)
                return True
        if resolved:
            text.append(new_text)
        if is_stop_token:
            request.finish(RequestStatus.FINISHED_STOPPED, token_id if is_stop_token_id else None)
        elif reached_length:
            request.finish(RequestStatus.FINISHED_LENGTH)
        return request.is_finished

    def _decode_new_text(self, request: Request, end: int, flush: bool) -> tuple[str, bool]:
        """The text ``all_token_ids[:end]`` adds to what was emitted before, and whether
        it is resolved (complete characters, or ``flush``): only then do the offsets
        advance past it; an unresolved piece is decoded again with the next token.

        ``[text_prefix_offset, text_read_offset)`` are the tokens of the last emitted
        piece (at first, prompt tokens for context); decoding them with and without the
        new tokens and taking the difference renders the new tokens in context. A
        skipped special token with nothing pending adds nothing and moves the offsets
        on at once, the context kept to at most ``DETOKENIZE_CONTEXT_TOKENS`` tokens, so
        a run of them costs O(1) a token.
        """
        token_ids = request.all_token_ids
        skipped = self._skipped_ids(request.params)
        if request.text_read_offset == end - 1 and token_ids[end - 1] in skipped:
            request.text_read_offset = end
            request.text_prefix_offset = max(request.text_prefix_offset, end - DETOKENIZE_CONTEXT_TOKENS)
            return "", True
        emitted = self._decode(token_ids[request.text_prefix_offset : request.text_read_offset], skipped)
        extended = self._decode(token_ids[request.text_prefix_offset : end], skipped)
        new_text = extended[len(emitted) :]
        if not flush and (not new_text or extended.endswith(_REPLACEMENT_CHARACTER)):
            return new_text, False
        request.text_prefix_offset = request.text_read_offset
        request.text_read_offset = end
        return new_text, True

    def _skipped_ids(self, params: SamplingParams) -> frozenset[int]:
        """The ids left out of the text: the special tokens but the kept ones, when the
        request skips special tokens."""
        if not params.skip_special_tokens:
            return frozenset()
        kept = params.kept_special_token_ids
        skipped = self._skipped_by_kept.get(kept)
        if skipped is None:
            skipped = self._special_ids - frozenset(kept)
            self._skipped_by_kept[kept] = skipped
        return skipped

    def _decode(self, token_ids: Sequence[int], skipped: frozenset[int]) -> str:
        if skipped:
            token_ids = [t for t in token_ids if t not in skipped]
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)


def _first_stop_string(text: str, stop: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(index, order, s) for order, s in enumerate(stop) if (index := text.find(s)) >= 0]
    if not found:
        return None
    index, _, stop_string = min(found)
    return index, stop_string
