"""The tokenizer endpoints of vLLM's server, answered as vLLM answers them.

Owns :class:`TokenizerEndpoints`: the bodies of ``POST /tokenize`` (a ``prompt``, or
chat ``messages`` rendered as ``/v1/chat/completions`` renders them), ``POST
/detokenize`` and ``GET /tokenizer_info`` (what lm_eval's remote tokenizer reads:
``bos_token``, ``eos_token``, ``pad_token``, the added tokens), each request read
field by field and refused with a 400 (``deploy.openai_api``'s error shape) naming the
field. Nothing here runs the engine.

Must not import: ``ray``, ``fastapi``, ``torch``, ``model``, ``cache``, ``actors``,
``deploy.app``, ``deploy.llm_server`` (which import this module).
"""

from __future__ import annotations

from typing import Any, Mapping

from tokenizers import Tokenizer

from dsv41.cluster.sampling_params import short_repr
from dsv41.deploy.chat_protocol import PromptEncoder, render_pieces
from dsv41.deploy.openai_api import CHAT_TEMPLATE_KWARGS
from dsv41.deploy.openai_errors import bad_request

TOKENIZE_PROMPT_FIELDS = ("model", "prompt", "add_special_tokens", "return_token_strs")
TOKENIZE_CHAT_FIELDS = (
    "model",
    "messages",
    "tools",
    "chat_template_kwargs",
    "reasoning_effort",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "return_token_strs",
)
DETOKENIZE_FIELDS = ("model", "tokens")
# vLLM's name for a tokenizers-backed (fast) Hugging Face tokenizer: what it reports
# as tokenizer_class for DeepSeek's tokenizer.json.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _check_fields(body: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise bad_request(unknown[0], f"{unknown[0]}: unknown field (allowed: {', '.join(allowed)})")


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(name, f"{name}: {short_repr(value)} (allowed: true, false)")
    return value


class TokenizerEndpoints:
    """The tokenizer endpoints' answers for one served model's tokenizer.

    ``/tokenize`` of a ``prompt`` tokenizes it as ``/v1/completions`` does
    (``add_special_tokens``, default true, adds the tokenizer's post-processor tokens:
    DeepSeek's BOS); of ``messages``, as ``/v1/chat/completions`` renders them (the
    rendering places BOS itself; the prompt ends with the assistant header, so
    ``add_generation_prompt`` must be true and ``continue_final_message`` false).
    ``return_token_strs`` adds each id's token string. ``/detokenize`` decodes with
    special tokens kept, as vLLM does."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompts: PromptEncoder,
        *,
        max_model_len: int,
        bos_token_id: int,
        eos_token_id: int,
        pad_token_id: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._prompts = prompts
        self._max_model_len = max_model_len
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._info = {
            "tokenizer_class": TOKENIZER_CLASS,
            "bos_token": tokenizer.id_to_token(bos_token_id),
            "eos_token": tokenizer.id_to_token(eos_token_id),
            "pad_token": tokenizer.id_to_token(pad_token_id),
            "model_max_length": max_model_len,
            "added_tokens_decoder": {
                str(token_id): {
                    "content": token.content,
                    "lstrip": token.lstrip,
                    "normalized": token.normalized,
                    "rstrip": token.rstrip,
                    "single_word": token.single_word,
                    "special": token.special,
                }
                for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
            },
        }

    def tokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``{"count", "max_model_len", "tokens", "token_strs"}`` for ``body``."""
        if "messages" in body:
            ids = self._tokenize_chat(body)
        else:
            _check_fields(body, TOKENIZE_PROMPT_FIELDS)
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("prompt", f"prompt: {short_repr(prompt)} (allowed: a string, or messages instead)")
            ids = self._prompts.encode_text(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
        strings = [self._tokenizer.id_to_token(t) for t in ids] if _flag(body, "return_token_strs", False) else None
        return {"count": len(ids), "max_model_len": self._max_model_len, "tokens": ids, "token_strs": strings}

    def detokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``{"prompt": text}`` for ``body["tokens"]``."""
        _check_fields(body, DETOKENIZE_FIELDS)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad_request("tokens", f"tokens: {short_repr(tokens)} (allowed: a list of token ids)")
        outside = [t for t in tokens if not 0 <= t < self._vocab_size]
        if outside:
            raise bad_request("tokens", f"tokens: {outside[:8]} outside the vocabulary 0..{self._vocab_size - 1}")
        return {"prompt": self._tokenizer.decode(tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: the tokenizer's class and configuration (no
        ``chat_template``: DeepSeek V4's prompt format is code, not a Jinja template)."""
        return self._info

    def _tokenize_chat(self, body: Mapping[str, Any]) -> list[int]:
        _check_fields(body, TOKENIZE_CHAT_FIELDS)
        for name, allowed in (("add_generation_prompt", True), ("continue_final_message", False), ("add_special_tokens", False)):
            if _flag(body, name, allowed) != allowed:
                raise bad_request(name, f"{name}: {not allowed} is not supported (allowed: {str(allowed).lower()})")
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise bad_request("messages", "messages: a non-empty list of messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or not set(kwargs) <= set(CHAT_TEMPLATE_KWARGS):
            raise bad_request(
                "chat_template_kwargs", f"chat_template_kwargs: {short_repr(kwargs)} (allowed: {', '.join(CHAT_TEMPLATE_KWARGS)})"
            )
        reasoning_effort = body.get("reasoning_effort")
        pieces = render_pieces(
            messages,
            tools=body.get("tools"),
            thinking=kwargs.get("thinking", reasoning_effort is not None),
            reasoning_effort=reasoning_effort,
        )
        return self._prompts.encode_pieces(pieces)
