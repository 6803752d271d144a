"""The DSpark drafter of DeepSeek-V4.1: five draft tokens from the target's features,
and the rules that verify them (MODEL_FACTS section 9).

Owns the drafter's arithmetic, batched over draft blocks (one block per request):

- target features: the residual streams entering ``dspark_target_layer_ids``, each
  averaged over the hc streams, concatenated, ``main_x = main_norm(main_proj(.))``;
- each stage's ring key of a target position, ``FP8(rope(kv_norm(wkv(main_x))))``
  (``ring_keys``); a block reads its stage's rows p-W+1..p, p the last target position
  processed (``ring_window``);
- the draft block [anchor, noise x (block-1)] embedded and copied into the hc streams,
  three single-pass mHC stages, each a window attention (every block row sees all block
  rows, bidirectionally, plus the ring rows) and an MoE of the dspark experts;
- the head: collapse with the last pre, ``norm``, base logits from the target's head,
  the Markov bias of the previous token, greedy left-to-right choice; the confidence
  head on the pre-norm hidden state.

Also the dense composition over one whole sequence (:class:`ReferenceDrafter`: the
target's ReferenceModel forward, a draft after any prefix position, the speculative
greedy loop) and the verification rules as pure functions of the drafts and the
target's rows, batched over requests: greedy, and standard speculative rejection
sampling. The verification rules take their randomness as arguments: a caller derives
it from (seed, output index) counters, as cluster/sampler.py derives its draws.

Where the facts are unsettled (?) the reading sits in one place each: the anchor
alignment in :func:`block_positions`; the stages' RoPE (rope_theta without YaRN) is
``V41Config.layer_rope`` of a DSpark layer (ratio 0), built into each stage's LayerParams.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dsv41.model.attention import output_projection, project_query, project_window_kv, query_latent, sparse_attention
from dsv41.model.config import V41Config
from dsv41.model.linalg import batch_invariant, linear, ordered_sum, pointwise
from dsv41.model.mhc import collapse, first_pre, run_site
from dsv41.model.moe import moe_forward
from dsv41.model.norm import rms_norm
from dsv41.model.params import DSparkParams, LayerParams, ModelParams
from dsv41.model.reference import ReferenceModel

NO_TOKEN = -1  # an unused slot of a verification's emitted tokens


def _dspark(params: ModelParams) -> DSparkParams:
    if params.dspark is None:
        raise ValueError("DSpark: these params have no DSpark stages (the checkpoint ships no mtp.* tensors)")
    return params.dspark


# -- features and rings ------------------------------------------------------------------


def target_features(layer_inputs: Sequence[torch.Tensor], dspark: DSparkParams, eps: float) -> torch.Tensor:
    """``main_x`` [T, hidden] in the compute dtype from the streams [T, hc, hidden]
    entering each target layer of dspark_target_layer_ids, in that order: each averaged
    over its hc streams (fp32, streams added in order), concatenated, projected, normed."""
    averaged = [ordered_sum(s[:, i].float() for i in range(s.shape[1])) / s.shape[1] for s in layer_inputs]
    features = torch.cat(averaged, dim=-1).to(dspark.main_proj.dtype)
    return rms_norm(linear(features, dspark.main_proj), dspark.main_norm, eps)


def ring_keys(main_x: torch.Tensor, params: ModelParams, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each stage's ring key of the target positions, FP8(rope(kv_norm(wkv(main_x)))):
    one [T, head_dim] per stage, what a stage's window ring stores."""
    eps = params.config.rms_norm_eps
    return tuple(project_window_kv(main_x, s.attn, eps, s.rope, positions) for s in _dspark(params).stages)


def ring_window(last_target: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring rows a block after target position p reads: positions p-W+1..p [B, W]
    (oldest first) and whether each exists (position >= 0)."""
    positions = last_target.unsqueeze(1) - window + 1 + torch.arange(window, device=last_target.device)
    return positions, positions >= 0


def block_positions(last_target: torch.Tensor, block_size: int) -> torch.Tensor:
    """The positions of the block drafted after target position p [B] -> [B, block].

    (?) Anchor alignment, MODEL_FACTS section 9's serving convention: the anchor is the
    token the target emitted at position p+1, the block sits at p+1..p+block, and block
    row k drafts position p+2+k."""
    return last_target.unsqueeze(1) + 1 + torch.arange(block_size, device=last_target.device)


# -- the draft block -------------------------------------------------------------------------


def block_hidden(
    params: ModelParams,
    anchors: torch.Tensor,
    last_target: torch.Tensor,
    ring: Sequence[torch.Tensor],
    ring_valid: torch.Tensor,
) -> torch.Tensor:
    """The pre-norm hidden states of B draft blocks [B, block, hidden] fp32.

    ``anchors`` [B]: each block's anchor token; ``last_target`` [B]: the last target
    position p each block follows; ``ring``: per stage, each block's ring rows
    [B, W, head_dim] (``ring_window``'s order); ``ring_valid`` [B, W]."""
    cfg = params.config
    dspark = _dspark(params)
    blocks, block = anchors.shape[0], cfg.dspark_block_size
    if len(ring) != len(dspark.stages):
        raise ValueError(f"ring: {len(ring)} stages' rows (allowed: one per stage, {len(dspark.stages)})")
    tokens = torch.full((blocks, block), cfg.dspark_noise_token_id, dtype=torch.long, device=anchors.device)
    tokens[:, 0] = anchors
    positions = block_positions(last_target, block).reshape(-1)
    dtype = params.embed.dtype
    rows = blocks * block
    streams = params.embed[tokens.reshape(-1)].to(dtype).unsqueeze(1)
    streams = streams.expand(rows, cfg.hc_mult, cfg.hidden_size).contiguous()
    pre = first_pre(rows, cfg.hc_mult, device=streams.device)
    for stage, stage_ring in zip(dspark.stages, ring):

        def attention(h: torch.Tensor, stage: LayerParams = stage, stage_ring: torch.Tensor = stage_ring) -> torch.Tensor:
            return _block_attention(stage, h, positions, stage_ring, ring_valid, cfg)

        def moe(h: torch.Tensor, stage: LayerParams = stage) -> torch.Tensor:
            return moe_forward(h, stage.moe, cfg.dspark_num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)

        streams, pre = run_site(streams, pre, stage.hc_attn, stage.attn_norm, attention, cfg)
        streams, pre = run_site(streams, pre, stage.hc_ffn, stage.ffn_norm, moe, cfg)
    return collapse(streams, pre).view(blocks, block, cfg.hidden_size)


def _block_attention(
    stage: LayerParams,
    h: torch.Tensor,
    positions: torch.Tensor,
    ring: torch.Tensor,
    ring_valid: torch.Tensor,
    cfg: V41Config,
) -> torch.Tensor:
    """A stage's window attention: every row of a block reads its block's ring rows,
    then all of its block's rows (bidirectional)."""
    blocks, block = ring.shape[0], cfg.dspark_block_size
    q_lat = query_latent(h, stage.attn, cfg.rms_norm_eps)
    q = project_query(q_lat, stage.attn, cfg.num_attention_heads, stage.rope, positions)
    kv = project_window_kv(h, stage.attn, cfg.rms_norm_eps, stage.rope, positions)
    keys = torch.cat((ring.to(kv.dtype), kv.view(blocks, block, -1)), dim=1)
    valid = torch.cat((ring_valid, ring_valid.new_ones(blocks, block)), dim=1)
    o = sparse_attention(
        q,
        keys.repeat_interleave(block, dim=0),
        valid.repeat_interleave(block, dim=0),
        stage.attn.attn_sink,
        cfg.head_dim**-0.5,
    )
    return output_projection(o, stage.attn, cfg.o_groups, stage.rope, positions)


def base_logits(params: ModelParams, hidden: torch.Tensor) -> torch.Tensor:
    """U = head(norm(h)) [..., vocab] fp32 from pre-norm hidden states, with the
    target's fp32 head."""
    normed = rms_norm(hidden, _dspark(params).norm, params.config.rms_norm_eps, out_dtype=torch.float32)
    return linear(normed, params.head.float())


def markov_bias(dspark: DSparkParams, previous: torch.Tensor) -> torch.Tensor:
    """markov_head.head(markov_head.embed[x_{k-1}]) [..., vocab] fp32."""
    return linear(dspark.markov_embed[previous].float(), dspark.markov_head.float())


def confidence(dspark: DSparkParams, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """c_k = sigmoid(proj([h_k ; markov_embed[x_{k-1}]])) in fp32, h_k pre-norm [..., hidden]."""
    joined = torch.cat((hidden.float(), dspark.markov_embed[previous].float()), dim=-1)
    return pointwise(torch.sigmoid, linear(joined, dspark.confidence_proj.float()).squeeze(-1))


@dataclass(frozen=True)
class DraftOutput:
    """B greedy drafts: ``tokens`` [B, block] (row k drafts position p+2+k), the logits
    each token was chosen from, U_k + Markov bias of x_{k-1} [B, block, vocab] fp32, and
    the confidences [B, block] fp32."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidences: torch.Tensor


def greedy_draft(params: ModelParams, hidden: torch.Tensor, anchors: torch.Tensor) -> DraftOutput:
    """Chooses x_k = argmax(U_k + bias(x_{k-1})) left to right, x_0 the anchor (ties to
    the smaller id), from the blocks' pre-norm hidden states [B, block, hidden]."""
    dspark = _dspark(params)
    base = base_logits(params, hidden)
    previous = anchors
    tokens, logits, confidences = [], [], []
    for k in range(hidden.shape[1]):
        row = base[:, k] + markov_bias(dspark, previous)
        confidences.append(confidence(dspark, hidden[:, k], previous))
        previous = row.argmax(dim=-1)
        tokens.append(previous)
        logits.append(row)
    return DraftOutput(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(confidences, 1))


def draft(
    params: ModelParams,
    anchors: torch.Tensor,
    last_target: torch.Tensor,
    ring: Sequence[torch.Tensor],
    ring_valid: torch.Tensor,
) -> DraftOutput:
    """B blocks' greedy drafts from their anchors and ring rows (see ``block_hidden``)."""
    return greedy_draft(params, block_hidden(params, anchors, last_target, ring, ring_valid), anchors)


# -- the dense composition ------------------------------------------------------------------


@dataclass(frozen=True)
class DraftContext:
    """One dense target forward over a whole sequence, kept for drafting after any of
    its positions: the target's logits [T, vocab] and each stage's ring keys [T, head_dim]."""

    token_ids: torch.Tensor
    logits: torch.Tensor
    ring: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class SpeculativeRun:
    """A speculative greedy generation: the tokens, and the drafts accepted at each
    verification (0..block)."""

    tokens: list[int]
    accepted: list[int]


class ReferenceDrafter:
    """DSpark over the dense reference: a target forward gives the features of every
    position of a sequence (causal: position t's depend on tokens 0..t only), so one
    forward serves a draft after any of its positions. Runs in the target's
    batch-invariant mode, so a block's draft does not depend on the others drafted with it."""

    def __init__(self, target: ReferenceModel) -> None:
        _dspark(target.params)
        self.target = target
        self.params = target.params
        self.config = target.config

    @torch.no_grad()
    def context(self, token_ids: list[int] | torch.Tensor) -> DraftContext:
        cfg = self.config
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        out = self.target.forward(ids, capture_layers=cfg.dspark_target_layer_ids)
        with batch_invariant(self.target.batch_invariant):
            main_x = target_features(
                [out.layer_inputs[i] for i in cfg.dspark_target_layer_ids], _dspark(self.params), cfg.rms_norm_eps
            )
            ring = ring_keys(main_x, self.params, torch.arange(ids.numel(), device=main_x.device))
        return DraftContext(token_ids=ids, logits=out.logits, ring=ring)

    @torch.no_grad()
    def draft(
        self, context: DraftContext, last_target: Sequence[int] | torch.Tensor, anchors: Sequence[int] | torch.Tensor
    ) -> DraftOutput:
        """One block per (p, anchor): drafts after target position p of the context's
        sequence, the anchor being the token at p+1 (the one the target emitted)."""
        device = context.ring[0].device
        last = torch.as_tensor(last_target, dtype=torch.long, device=device)
        anchor_ids = torch.as_tensor(anchors, dtype=torch.long, device=device)
        length = context.token_ids.numel()
        if last.dim() != 1 or last.shape != anchor_ids.shape or int(last.min()) < 0 or int(last.max()) >= length:
            raise ValueError(
                f"last_target, anchors: [B] positions in [0, {length}) and one anchor each, got "
                f"{tuple(last.shape)} and {tuple(anchor_ids.shape)}"
            )
        positions, valid = ring_window(last, self.config.sliding_window)
        ring = [keys[positions.clamp_min(0)] for keys in context.ring]
        with batch_invariant(self.target.batch_invariant):
            return draft(self.params, anchor_ids, last, ring, valid)

    def speculative_greedy(self, prompt: Sequence[int], max_tokens: int) -> SpeculativeRun:
        """Greedy generation of ``max_tokens`` with a draft of dspark_block_size tokens
        verified at every step: the target runs [anchor, d_1..d_k] after the accepted
        sequence, ``verify_greedy`` keeps the matching prefix and the target's next token.
        End of sequence does not stop it."""
        if not prompt or max_tokens < 1:
            raise ValueError(f"prompt, max_tokens: a non-empty prompt and max_tokens >= 1, got {len(prompt)}, {max_tokens}")
        processed = list(prompt)
        context = self.context(processed)
        anchor = int(context.logits[-1].argmax())
        tokens, accepted = [anchor], []
        while len(tokens) < max_tokens:
            last = len(processed) - 1
            drafts = self.draft(context, [last], [anchor]).tokens
            context = self.context(processed + [anchor] + drafts[0].tolist())
            rows = context.logits[last + 1 : last + 2 + drafts.shape[1]]
            verdict = verify_greedy(drafts, rows.unsqueeze(0))
            count = int(verdict.accepted[0])
            accepted.append(count)
            processed += [anchor] + drafts[0, :count].tolist()
            emitted = verdict.tokens[0, : count + 1].tolist()
            tokens += emitted
            anchor = emitted[-1]
        return SpeculativeRun(tokens=tokens[:max_tokens], accepted=accepted)


# -- verification ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Verification:
    """The outcome of verifying R requests' k drafts: ``accepted`` [R] (0..k) and the
    tokens each emits [R, k+1], the accepted drafts then the target's own token (the
    correction at the first rejection, or the bonus token after k acceptances), then
    NO_TOKEN."""

    accepted: torch.Tensor
    tokens: torch.Tensor


def _check_rows(drafts: torch.Tensor, target: torch.Tensor, name: str) -> None:
    if drafts.dim() != 2 or target.dim() != 3 or target.shape[:2] != (drafts.shape[0], drafts.shape[1] + 1):
        raise ValueError(
            f"drafts, {name}: [R, k] and [R, k+1, vocab] (the target's rows for [anchor, d_1..d_k]), "
            f"got {tuple(drafts.shape)} and {tuple(target.shape)}"
        )


def _leading_accepts(accept: torch.Tensor) -> torch.Tensor:
    """How many of each row's leading entries are True [R]."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> Verification:
    """Greedy verification: accept d_i while it equals the target's argmax of the row
    before it (the anchor's row for d_1); emit the target's argmax of the first
    mismatching row, or of the last row (the bonus) when all k match. The emitted
    tokens are then the target's own argmax on every row up to the first mismatch."""
    _check_rows(drafts, target_logits, "target_logits")
    target = target_logits.argmax(dim=-1)
    accepted = _leading_accepts(drafts == target[:, :-1])
    emitted = torch.arange(target.shape[1], device=target.device) <= accepted.unsqueeze(1)
    return Verification(accepted=accepted, tokens=torch.where(emitted, target, NO_TOKEN))


def verify_stochastic(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    gumbel: torch.Tensor,
) -> Verification:
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft
    d_i, drawn from q_i = ``draft_probs`` [R, k, vocab], is accepted while
    uniform_i < p_i(d_i) / q_i(d_i), p_i = ``target_probs`` [R, k+1, vocab]; at the first
    rejection the emitted token is drawn from norm(max(0, p_i - q_i)), after k
    acceptances from p_k (the bonus). The emitted tokens then follow the target's
    distribution exactly, whatever q is. A greedy drafter's q is one-hot at its draft.

    Randomness comes in: ``uniforms`` [R, k] in (0, 1) for the acceptance tests and
    ``gumbel`` [R, k+1, vocab] standard Gumbel noise for the draws (Gumbel-max: the
    token of the largest log weight + noise)."""
    _check_rows(drafts, target_probs, "target_probs")
    rows, k = drafts.shape
    if draft_probs.shape != target_probs[:, :k].shape or uniforms.shape != drafts.shape:
        raise ValueError(
            f"draft_probs, uniforms: [R, k, vocab] and [R, k] = {tuple(target_probs[:, :k].shape)} and "
            f"{tuple(drafts.shape)}, got {tuple(draft_probs.shape)} and {tuple(uniforms.shape)}"
        )
    if gumbel.shape != target_probs.shape:
        raise ValueError(f"gumbel: {tuple(gumbel.shape)} (allowed: the target rows' shape {tuple(target_probs.shape)})")
    p, q = target_probs.double(), draft_probs.double()
    index = drafts.unsqueeze(-1)
    p_draft, q_draft = p[:, :k].gather(-1, index).squeeze(-1), q.gather(-1, index).squeeze(-1)
    accepted = _leading_accepts(uniforms.double() * q_draft < p_draft)
    # The row the emitted token is drawn at: a rejected draft's residual, or the bonus
    # row's p (no draft there, so q is zero and the residual is p itself).
    residual = (p - torch.cat((q, q.new_zeros(rows, 1, q.shape[-1])), dim=1)).clamp_min(0)
    at = torch.arange(rows, device=drafts.device)
    weights, target_row = residual[at, accepted], p[at, accepted]
    # A rejection leaves no residual mass only where p <= q everywhere, i.e. p == q up
    # to rounding, where rejecting has probability zero: the draw is then p's.
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, target_row)
    drawn = (weights.log() + gumbel.double()[at, accepted]).argmax(dim=-1)
    slots = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    padded = torch.cat((drafts, drafts.new_full((rows, 1), NO_TOKEN)), dim=1)
    tokens = torch.where(slots < accepted.unsqueeze(1), padded, NO_TOKEN)
    tokens[at, accepted] = drawn
    return Verification(accepted=accepted, tokens=tokens)
