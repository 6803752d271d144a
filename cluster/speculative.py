"""Speculative decoding on one rank: DSpark drafts, their verification, and what of a
verify is committed.

Owns what a speculating ModelRunner does around its target forward (MODEL_FACTS
section 9, the spec's native five-token DSpark):

- a verify segment runs [anchor, d_1..d_k] at positions P..P+k with decode semantics
  (every layer on every row), tentatively: the rings have k rows of slack and the
  compressed entries of a rejected row are never visible to a row that is kept, so a
  rejected row only loses visibility; its ratio-2 tail candidates are staged
  (cache/addressing.staged_tail_row) and its cursor is not advanced;
- the target's token of every verify row is drawn by the step's own sampler at the
  output index that row's token would have without speculation (greedy: the argmax;
  seeded: the request's counter-based draw), and the drafts are accepted while they
  equal those tokens (``accepted_count``). For DSpark's greedy drafter (a draft
  distribution one-hot at its token) this is the standard rejection-sampling rule: a
  draft d is kept with probability p(d), and at the first rejection the token is drawn
  from p without d, renormalised (max(0, p - q) normalised); every emitted token is
  the draw plain decoding makes at its index, so with the same seed speculation emits
  exactly the tokens decoding without it does;
- the accepted prefix's state: the committed length (the runner advances the cursor
  and Engram history by it), the staged tail of the position the prefix ends on;
- the next blocks: the drafter's rings written from this forward's rows (the streams
  entering ``dspark_target_layer_ids``), and a block drafted after each sampling
  request's last emitted token.

The scheduler owns the drafts between steps (cluster/scheduler.py) and the lookahead
PAGEs; the engine appends the emitted tokens and commits the accepted length.

Must not import: actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from dsv41.cache.addressing import PoolShape, StepAddresses, draft_ring_rows, staged_tail_row
from dsv41.cache.plane_io import PlaneIO
from dsv41.model.dspark_paged import PagedDrafter
from dsv41.model.kernels.interface import PagedKernels
from dsv41.model.params import ModelParams


def accepted_count(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens of the rows before them
    (``targets[i]`` is the target's token after row i; ``drafts[i]`` the draft there)."""
    count = 0
    for draft, target in zip(drafts, targets):
        if draft != target:
            break
        count += 1
    return count


@dataclass(frozen=True)
class DraftRequest:
    """A block to draft after a step: the slot, the token the target just emitted
    (the anchor, at position ``last_target`` + 1), and the first position the slot's
    rings hold for this request."""

    request_id: str
    slot: int
    anchor: int
    last_target: int
    window_start: int


class Speculator:
    """The drafter of one speculating rank over its pools."""

    def __init__(
        self,
        params: ModelParams,
        kernels: PagedKernels,
        store: PlaneIO,
        shape: PoolShape,
        num_speculative_tokens: int,
        batch_invariant: bool,
    ) -> None:
        self.drafter = PagedDrafter(params, kernels, batch_invariant)
        self.store = store
        self.shape = shape
        self.num_speculative_tokens = num_speculative_tokens
        self.capture_layers = tuple(params.config.dspark_target_layer_ids)

    def write_context(self, layer_inputs: Mapping[int, torch.Tensor], stage: StepAddresses) -> None:
        """The drafter's ring rows of a forward's rows: ``layer_inputs`` as the forward
        captured them, over the rows of ``stage`` (the decoder's under decoder replay:
        the drafter's window follows the decoder), at that stage's own ring writes."""
        window = stage.window
        self.drafter.write_context(layer_inputs, stage.positions, window.write_rows, window.write_dst, self.store)

    def commit_tail(self, slot: int, start: int, committed_end: int) -> None:
        """After a verify from ``start`` kept positions [start, committed_end): a
        prefix ending on an even position leaves that token pending, staged by the
        forward; it becomes the slot's committed tail."""
        if committed_end % 2 == 1 and self.store.geometry.tail_owners:
            self.store.commit_staged_tail(slot, staged_tail_row(start, committed_end - 1))

    def draft(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        """Each request's next block of drafts (num_speculative_tokens tokens)."""
        if not requests:
            return {}
        rows, valid = draft_ring_rows(
            [r.slot for r in requests], [r.last_target for r in requests], [r.window_start for r in requests], self.shape
        )
        device = self.store.pools.device
        out = self.drafter.draft(
            torch.tensor([r.anchor for r in requests], dtype=torch.long, device=device),
            torch.tensor([r.last_target for r in requests], dtype=torch.long, device=device),
            rows.to(device),
            valid.to(device),
            self.store,
        )
        tokens = out.tokens[:, : self.num_speculative_tokens].tolist()
        return {r.request_id: tuple(t) for r, t in zip(requests, tokens)}
