"""What sampling a request's next token needs beyond its parameters, known only where
its history is: :class:`SamplingGuide`, the grammar's allowed tokens at this point of
the output (a packed bitmask) and the token counts the penalties read.

The engine builds one per sampling segment that needs it (``cluster.engine``, from
``cluster.structured_output``'s matchers and the request's tokens); it travels with
the segment to the rank (``ScheduledSegment.guide``) and the sampler turns the step's
guides into batched tensors (``SamplingMetadata.from_params``). A rank keeps none of a
request's tokens (its PersistentBatch holds the parameters, seed and PAGE table
alone), so a guide carries everything: a preempted request's next guide is built from
the same tokens and gives the same sample.

Must not import: torch, ray, ``model``, ``cache``, ``actors``, ``deploy``, or any
other ``cluster`` module.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

# xgrammar's bitmask layout: bit t % 32 of int32 word t // 32 is set when token t is
# allowed, words little-endian.
BITMASK_WORD_BITS = 32
BITMASK_WORD_BYTES = 4


def bitmask_words(vocab_size: int) -> int:
    """Words of one row's bitmask over ``vocab_size`` tokens."""
    return -(-vocab_size // BITMASK_WORD_BITS)


@dataclass(frozen=True)
class SamplingGuide:
    """``allowed_tokens``: the packed bitmask of the tokens the request's grammar
    allows next (``bitmask_words(vocab) * 4`` bytes), None without a grammar.
    ``penalty_token_ids`` / ``penalty_output_counts``: every distinct token of the
    prompt and the output, with how often it occurs in the output (0: the prompt
    only); empty without penalties."""

    allowed_tokens: bytes | None = None
    penalty_token_ids: tuple[int, ...] = ()
    penalty_output_counts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.penalty_token_ids) != len(self.penalty_output_counts):
            raise ValueError(
                f"SamplingGuide.penalty_output_counts: one per penalty token id, got "
                f"{len(self.penalty_output_counts)} for {len(self.penalty_token_ids)}"
            )
        if self.allowed_tokens is not None and len(self.allowed_tokens) % BITMASK_WORD_BYTES:
            raise ValueError(
                f"SamplingGuide.allowed_tokens: whole {BITMASK_WORD_BYTES}-byte words, got {len(self.allowed_tokens)} bytes"
            )


def penalty_counts(prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(distinct token ids of prompt and output, each one's count in the output), ids
    ascending: what a guide carries for the penalties."""
    counts = Counter(output_token_ids)
    ids = sorted(counts.keys() | set(prompt_token_ids))
    return tuple(ids), tuple(counts.get(t, 0) for t in ids)
