"""DP placement: which data-parallel rank runs a new request.

Owns the placement rule of one engine group. Each rank has its own pools, so a prefix
is cached only on the ranks that computed it: a request goes to the rank whose block
manager holds the longest cached prefix of its tokens (prefix affinity), unless that
rank is full (``max_num_seqs`` requests); otherwise, and among equal prefixes, to the
least loaded rank (fewest unfinished requests), then the lowest rank id.

Must not import: model, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


class PlacementError(ValueError):
    """Placement inputs that do not describe a group of ranks."""


@dataclass(frozen=True)
class RankLoad:
    """What placement weighs of one rank: its unfinished requests and how many tokens
    of the request's prefix its prefix cache holds."""

    unfinished: int
    cached_prefix_tokens: int

    def __post_init__(self) -> None:
        for name in ("unfinished", "cached_prefix_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise PlacementError(f"RankLoad.{name}: {value!r} (allowed: an int >= 0)")


def place(loads: Sequence[RankLoad], max_num_seqs: int) -> int:
    """The rank a new request goes to (see the module docstring)."""
    if not loads:
        raise PlacementError("loads: empty (allowed: one RankLoad per DP rank)")
    if max_num_seqs <= 0:
        raise PlacementError(f"max_num_seqs: {max_num_seqs} (allowed: > 0)")
    with_room = [r for r, load in enumerate(loads) if load.unfinished < max_num_seqs]
    candidates = with_room or list(range(len(loads)))
    return min(candidates, key=lambda r: (-loads[r].cached_prefix_tokens, loads[r].unfinished, r))
