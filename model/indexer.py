"""The lightning indexer: index queries, ReLU-weighted scores, candidate blocks and
the deterministic top-k selection of compressed entries.

Owns MODEL_FACTS section 4's "Indexer and selection". Every function takes, per query
row, the key rows it may score in ascending position order, so a dense sequence and a
paged gather are the same call. Ties in a selection go to the smaller position (the
stable sort below), which keeps selections independent of row width.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.model.config import LayerTopology, V41Config
from dsv41.model.epilogue import TORCH_EPILOGUE, Epilogue, EpilogueKernels
from dsv41.model.linalg import linear, ordered_sum, tiled_dots
from dsv41.model.rope import Rope
from dsv41.model.stored_weights import Weight

EMPTY = -1  # an unused selection slot


@dataclass(frozen=True)
class IndexerWeights:
    wq_b: Weight  # [index_heads * index_head_dim, q_lora]
    weights_proj: torch.Tensor  # [index_heads, hidden]


def index_query(
    q_latent: torch.Tensor,
    x: torch.Tensor,
    w: IndexerWeights,
    n_heads: int,
    rope: Rope,
    positions: torch.Tensor,
    kernels: EpilogueKernels = TORCH_EPILOGUE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(MXFP4(rope(wq_b(q_latent))) [T, Hi, Di] fp32, head weights [T, Hi] fp32)."""
    q = linear(q_latent, w.wq_b).reshape(q_latent.shape[0], n_heads, -1)
    q = kernels.epilogue(q, Epilogue(torch.float32, rope=rope, round_to="mxfp4"), positions)
    head_dim = q.shape[-1]
    weights = linear(x, w.weights_proj).float() * (head_dim**-0.5 * n_heads**-0.5)
    return q, weights


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """score(s, t) = sum_h w_h * ReLU(q_h . k_t) in fp32, the heads added in head order.

    keys [C, Di] (every row scores the same keys) or [T, K, Di] (each row its own)."""
    kf = keys.float()
    if kf.dim() == 2:
        kf = kf.unsqueeze(0).expand(q.shape[0], -1, -1)
    dots = torch.relu(tiled_dots(q, kf))
    return ordered_sum(head_weights[:, h : h + 1] * dots[:, h] for h in range(dots.shape[1]))


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many compressed entries a query at each position sees: entry j becomes
    visible at its last token, j < (s + 1) // ratio."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def candidate_mask(scores: torch.Tensor, visible: torch.Tensor, block_size: int, topk_blocks: int) -> torch.Tensor:
    """Which scored entries are candidates of the candidate source.

    scores [T, K] over entries 0..K-1, with -inf where invisible. Block score = max
    over its visible entries; the newest visible block is forced in; the top
    ``topk_blocks`` blocks are kept (ties: smaller block). The block count follows
    from K alone, so nothing here waits on the device (a captured decode graph holds
    this too)."""
    if scores.numel() == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    entries = scores.shape[1]
    num_blocks = (entries - 1) // block_size + 1
    ids = torch.arange(entries, device=scores.device).expand_as(scores)
    block_of = torch.div(ids, block_size, rounding_mode="floor")
    block_scores = torch.full((scores.shape[0], num_blocks), float("-inf"), dtype=torch.float32, device=scores.device)
    block_scores = block_scores.scatter_reduce(1, block_of, scores.float(), reduce="amax", include_self=True)
    newest = torch.div(visible - 1, block_size, rounding_mode="floor").clamp_min(0)
    has_visible = (visible > 0).unsqueeze(1)
    forced = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(1, newest.unsqueeze(1), True) & has_visible
    block_scores = block_scores.masked_fill(forced, float("inf"))
    keep = min(topk_blocks, num_blocks)
    order = torch.sort(block_scores, dim=1, descending=True, stable=True).indices[:, :keep]
    kept_scores = torch.gather(block_scores, 1, order)
    chosen = torch.zeros_like(block_scores, dtype=torch.bool)
    chosen.scatter_(1, order, kept_scores > float("-inf"))
    return torch.gather(chosen, 1, block_of) & (scores > float("-inf"))


def select_topk(scores: torch.Tensor, entry_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k entry ids per row, ascending, EMPTY-padded to width k.

    scores [T, K] with -inf where not selectable; entry_ids [T, K] (or [K]) ascending
    per row. k = min(index_topk, selectable) per row; equal scores prefer the smaller
    position."""
    ids = entry_ids.expand_as(scores)
    width = min(k, scores.shape[1])
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :width]
    picked = torch.gather(ids, 1, order)
    picked = picked.masked_fill(torch.gather(scores, 1, order) == float("-inf"), EMPTY)
    # EMPTY sorts last once mapped above every real id.
    big = torch.iinfo(picked.dtype).max
    picked = torch.sort(picked.masked_fill(picked == EMPTY, big), dim=1).values
    picked = picked.masked_fill(picked == big, EMPTY)
    if width < k:
        picked = torch.cat((picked, picked.new_full((picked.shape[0], k - width), EMPTY)), dim=1)
    return picked


@dataclass
class SelectionState:
    """What selecting layers publish during one forward: each one's top-k per row,
    and the candidate mask of the candidate source."""

    selections: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None

    def select(self, topology: LayerTopology, scores: torch.Tensor, visible: torch.Tensor, config: V41Config) -> None:
        """Publishes a FULL or REINDEX layer's selection from its raw scores [T, C]
        over entries 0..C-1 (each row sees ``visible`` of them): the candidate source
        also publishes candidates; a Reindex layer is masked to them."""
        entry_ids = torch.arange(scores.shape[1], device=scores.device)
        scores = scores.masked_fill(entry_ids.unsqueeze(0) >= visible.unsqueeze(1), float("-inf"))
        if topology.is_candidate_source:
            self.candidates = candidate_mask(scores, visible, config.candidate_block_size, config.candidate_topk_blocks)
        if topology.uses_candidates:
            if self.candidates is None:
                raise RuntimeError(f"layer {topology.layer_id}: Reindex layer before the candidate source")
            scores = scores.masked_fill(~self.candidates, float("-inf"))
        self.selections[topology.layer_id] = select_topk(scores, entry_ids, config.index_topk)
