"""Training the tiny V4.1 on the Python standard library's own sources: the embedded
default model (model/tiny.py's TRAINED_TINY_DIR) is made here.

Owns the corpus (the top-level modules of the running interpreter's standard library,
sorted by name, every ``HELDOUT_EVERY``-th held out), the differentiable forward (the
dense reference's own arithmetic, recorded by autograd, with straight-through gradients
for its fake-quantisation roundings), the two phases (the target on next-token
cross-entropy; then, the target frozen, the DSpark stages on the target's distributions
of the tokens p+2..p+6 and the confidence head on whether each greedy draft matches the
target's choice), the checkpoint it writes (through model/tiny.py's writer, plain
BF16/FP32), and the held-out evaluation (perplexity, bits per byte, DSpark acceptance).

Top-k selections (experts, compressed entries) are indices: no gradient flows through
them, so the weights that only select (``ffn.gate.bias*``, the indexer's) keep their
initial values.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import logging
import math
import sysconfig
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from dsv41.model import compressor, epilogue
from dsv41.model.config import V41Config
from dsv41.model.dspark import (
    ReferenceDrafter,
    base_logits,
    block_hidden,
    confidence,
    markov_bias,
    ring_keys,
    ring_window,
    target_features,
)
from dsv41.model.engram import EngramTable, build_compressed_token_map
from dsv41.model.params import ModelParams, load_model_params
from dsv41.model.reference import ReferenceModel
from dsv41.model.tiny import EOS_TOKEN, TINY, TinySpec, random_tensors, tiny_config, train_tokenizer, write_checkpoint
from dsv41.model.weights import TensorKind, checkpoint_tensors, routed_expert

logger = logging.getLogger(__name__)

HELDOUT_EVERY = 8
SEQUENCE_TOKENS = 256  # selections bite: index_topk 16 of 128 ratio-2 entries, 8 candidate blocks of 64
TARGET_SHARE = 0.75  # of the time budget; the rest trains the DSpark stages
DRAFT_BLOCKS = 128  # draft blocks per DSpark step, at random positions of one sequence
LEARNING_RATE = 4e-3
WARMUP_STEPS = 20
WEIGHT_DECAY = 0.1
GRADIENT_CLIP = 1.0

# The weights no gradient reaches: they only choose (top-k of experts and of compressed
# entries). The training checks that every other weight gets a gradient, so a rounding
# added to the arithmetic without a straight-through estimator here cannot silently
# freeze a weight.
_SELECTION_ONLY = ("ffn.gate.bias", "ffn.gate.bias_vl", "attn.indexer.")


# -- corpus ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """The standard library's top-level modules, by file name."""

    root: Path
    train: tuple[Path, ...]
    heldout: tuple[Path, ...]

    @classmethod
    def stdlib(cls) -> "Corpus":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = tuple(sorted(root.glob("*.py"), key=lambda path: path.name))
        if len(files) < 2 * HELDOUT_EVERY:
            raise RuntimeError(f"Corpus.stdlib: {root} holds {len(files)} modules (need >= {2 * HELDOUT_EVERY})")
        heldout = files[HELDOUT_EVERY - 1 :: HELDOUT_EVERY]
        return cls(root=root, train=tuple(f for f in files if f not in heldout), heldout=heldout)

    @staticmethod
    def texts(files: Sequence[Path]) -> list[str]:
        return [path.read_text(encoding="utf-8", errors="replace") for path in files]


def token_stream(tokenizer: Tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """The texts' tokens, each text followed by end-of-sentence, as one int64 stream."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids += encoding.ids + [eos]
    return torch.tensor(ids, dtype=torch.long)


# -- the differentiable forward ---------------------------------------------------------------


class _StraightThrough(torch.autograd.Function):
    """The rounded value forward, the identity backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
        return rounded

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _straight_through(rounding: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def rounded(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return _StraightThrough.apply(x, rounding(x.detach(), *args, **kwargs))

    return rounded


# Every fake-quantisation rounding of activations, by the module that applies it.
_ROUNDINGS = ((epilogue, "round_fp8"), (epilogue, "round_mxfp4"), (compressor, "round_nvfp4"))


@contextmanager
def straight_through_roundings() -> Iterator[None]:
    """Within the block the model's roundings pass gradients straight through: the
    training forward is the inference arithmetic itself. The patch is process-wide, but
    every rounded value is unchanged, so anything else running meanwhile computes the same."""
    with ExitStack() as stack:
        for module, name in _ROUNDINGS:
            stack.enter_context(mock.patch.object(module, name, _straight_through(getattr(module, name))))
        yield


@dataclass(frozen=True)
class TrainableModel:
    """fp32 leaves for every declared tensor (Engram tables included) and the params
    built on them, so a step's in-place updates are what the next forward reads."""

    raw_config: dict[str, Any]
    config: V41Config
    tokenizer: Tokenizer
    leaves: dict[str, torch.Tensor]
    params: ModelParams

    @classmethod
    def initial(cls, spec: TinySpec, tokenizer: Tokenizer, seed: int) -> "TrainableModel":
        """``spec``'s architecture with ``tokenizer``, from make_tiny's random weights."""
        raw_config = tiny_config(spec, tokenizer, quantized=False)
        config = V41Config.from_dict(raw_config)
        leaves = {name: t.float().requires_grad_(False) for name, t in random_tensors(config, seed).items()}
        tables = {
            layer: EngramTable(leaves[f"layers.{layer}.engram.embed.weight"], None) for layer in config.engram_layer_ids
        }
        token_map, num_compressed = build_compressed_token_map(
            tokenizer, config.vocab_size, pad_token_id=config.engram_pad_token_id
        )
        params = ModelParams.build(config, leaves, tables, token_map, num_compressed)
        return cls(raw_config=raw_config, config=config, tokenizer=tokenizer, leaves=leaves, params=params)

    def group(self, prefix: str, *, exclude: str | None = None) -> dict[str, torch.Tensor]:
        """The leaves under ``prefix`` (not under ``exclude``) that a gradient can reach."""
        return {
            name: leaf
            for name, leaf in self.leaves.items()
            if name.startswith(prefix)
            and not (exclude and name.startswith(exclude))
            and not any(marker in name for marker in _SELECTION_ONLY)
        }

    def write(self, out_dir: str | Path) -> Path:
        """The official-format checkpoint: FP32 kinds in float32, everything else BF16."""
        stored = {}
        for name, spec in checkpoint_tensors(self.config).items():
            value = self.leaves[name].detach()
            stored[name] = value.float() if spec.kind is TensorKind.FP32 else value.to(torch.bfloat16)
        return write_checkpoint(out_dir, self.raw_config, self.tokenizer, stored)


# -- the phases ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseReport:
    steps: int
    tokens: int
    seconds: float
    first_loss: float
    last_loss: float  # mean over the phase's last 20 steps


@dataclass(frozen=True)
class TrainingReport:
    target: PhaseReport
    dspark: PhaseReport
    corpus_files: int
    train_tokens: int


def _optimizer(leaves: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
    for leaf in leaves.values():
        leaf.requires_grad_(True)
    decayed = [t for t in leaves.values() if t.dim() == 2]
    other = [t for t in leaves.values() if t.dim() != 2]
    groups = [{"params": decayed, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=(0.9, 0.95))


def _learning_rate(step: int, progress: float) -> float:
    """Linear warm-up, then cosine decay to a tenth over the phase's time budget."""
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    return LEARNING_RATE * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _check_gradients(leaves: dict[str, torch.Tensor]) -> None:
    """Every leaf but a routed expert no row chose this step has a gradient."""
    missing = sorted(name for name, leaf in leaves.items() if leaf.grad is None and routed_expert(name) is None)
    if missing:
        raise RuntimeError(f"training: no gradient reaches {missing} (a rounding without a straight-through estimator?)")


def _run_phase(
    name: str,
    leaves: dict[str, torch.Tensor],
    seconds: float,
    loss_of_step: Callable[[], tuple[torch.Tensor, int]],
) -> PhaseReport:
    optimizer = _optimizer(leaves)
    started = time.monotonic()
    losses: list[float] = []
    tokens = step = 0
    while step == 0 or time.monotonic() - started < seconds:
        progress = (time.monotonic() - started) / seconds
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, progress)
        optimizer.zero_grad(set_to_none=True)
        loss, step_tokens = loss_of_step()
        loss.backward()
        if step == 0:
            _check_gradients(leaves)
        torch.nn.utils.clip_grad_norm_(list(leaves.values()), GRADIENT_CLIP)
        optimizer.step()
        losses.append(float(loss.detach()))
        tokens += step_tokens
        step += 1
        if step % 25 == 0:
            logger.info("%s step %d: loss %.3f (%.0f s)", name, step, sum(losses[-25:]) / 25, time.monotonic() - started)
    for leaf in leaves.values():
        leaf.requires_grad_(False)
    tail = losses[-20:]
    return PhaseReport(step, tokens, time.monotonic() - started, losses[0], sum(tail) / len(tail))


def _windows(stream: torch.Tensor, length: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Random windows of ``length`` tokens of the stream, forever."""
    while True:
        start = int(torch.randint(0, stream.numel() - length, (1,), generator=generator))
        yield stream[start : start + length]


def target_loss(model: ReferenceModel, window: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of the window's tokens after the first."""
    logits = model.differentiable_forward(window[:-1]).logits
    return F.cross_entropy(logits, window[1:])


def dspark_loss(model: ReferenceModel, window: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The DSpark stages' loss on blocks after the target positions ``positions``
    (each <= len(window) - 1 - block): the cross-entropy of the drafter's logits
    (U_k + bias of the text's token x_{k-1}) against the target's distribution at the row
    predicting p+2+k, plus the confidence head's binary cross-entropy against whether the
    drafter's argmax equals the target's."""
    params, cfg = model.params, model.config
    dspark = params.dspark
    block = cfg.dspark_block_size
    with torch.no_grad():
        out = model.differentiable_forward(window, capture_layers=cfg.dspark_target_layer_ids)
    main_x = target_features([out.layer_inputs[i] for i in cfg.dspark_target_layer_ids], dspark, cfg.rms_norm_eps)
    ring = ring_keys(main_x, params, torch.arange(window.numel()))
    ring_positions, valid = ring_window(positions, cfg.sliding_window)
    hidden = block_hidden(
        params, window[positions + 1], positions, [keys[ring_positions.clamp_min(0)] for keys in ring], valid
    )
    rows = positions.unsqueeze(1) + 1 + torch.arange(block)  # the target's row predicting p+2+k; also x_{k-1}'s position
    previous = window[rows]
    logits = base_logits(params, hidden) + markov_bias(dspark, previous)
    target_probs = torch.softmax(out.logits[rows], dim=-1)
    draft_loss = -(target_probs * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    right = (logits.argmax(-1) == out.logits[rows].argmax(-1)).float()
    confidence_loss = F.binary_cross_entropy(confidence(dspark, hidden, previous), right)
    return draft_loss + confidence_loss


def train_tiny(out_dir: str | Path, *, minutes: float, seed: int = 0, spec: TinySpec = TINY) -> TrainingReport:
    """Trains ``spec`` on the standard library for ``minutes`` of wall time (the target
    first, then the DSpark stages) and writes the checkpoint into ``out_dir``."""
    if not minutes > 0:
        raise ValueError(f"minutes: {minutes} (allowed: > 0)")
    corpus = Corpus.stdlib()
    train_texts = Corpus.texts(corpus.train)
    tokenizer = train_tokenizer(train_texts, spec.tokenizer_vocab_size)
    stream = token_stream(tokenizer, train_texts)
    trainable = TrainableModel.initial(spec, tokenizer, seed)
    model = ReferenceModel(trainable.params, batch_invariant=False)
    generator = torch.Generator().manual_seed(seed)
    windows = _windows(stream, SEQUENCE_TOKENS + 1, generator)
    budget = minutes * 60

    def target_step() -> tuple[torch.Tensor, int]:
        return target_loss(model, next(windows)), SEQUENCE_TOKENS

    block = trainable.config.dspark_block_size

    def dspark_step() -> tuple[torch.Tensor, int]:
        window = next(windows)
        positions = torch.randperm(window.numel() - 1 - block, generator=generator)[:DRAFT_BLOCKS]
        return dspark_loss(model, window, positions), DRAFT_BLOCKS * block

    with straight_through_roundings():
        target = _run_phase("target", trainable.group("", exclude="mtp."), budget * TARGET_SHARE, target_step)
        drafter = _run_phase("dspark", trainable.group("mtp."), budget * (1 - TARGET_SHARE), dspark_step)
    trainable.write(out_dir)
    return TrainingReport(target=target, dspark=drafter, corpus_files=len(corpus.train), train_tokens=stream.numel())


# -- evaluation ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeldoutScore:
    tokens: int
    nats_per_token: float
    bits_per_byte: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)


@torch.no_grad()
def heldout_score(model_dir: str | Path, texts: Sequence[str], *, max_chunks: int) -> HeldoutScore:
    """Next-token loss of a checkpoint on the texts (its own tokenizer), over up to
    ``max_chunks`` consecutive chunks of SEQUENCE_TOKENS + 1 tokens of their stream;
    bits per byte count the UTF-8 bytes of the text scored (end-of-sentence tokens have none)."""
    params, checkpoint = load_model_params(model_dir)
    model = ReferenceModel(params)
    stream = token_stream(checkpoint.tokenizer, texts)
    chunk = SEQUENCE_TOKENS + 1
    nats, tokens, scored_bytes = 0.0, 0, 0
    for start in range(0, stream.numel() - chunk + 1, chunk)[:max_chunks]:
        window = stream[start : start + chunk]
        nats += float(F.cross_entropy(model.forward(window[:-1]).logits, window[1:], reduction="sum"))
        tokens += chunk - 1
        scored_bytes += len(checkpoint.tokenizer.decode(window[1:].tolist(), skip_special_tokens=True).encode())
    return HeldoutScore(tokens=tokens, nats_per_token=nats / tokens, bits_per_byte=nats / math.log(2) / scored_bytes)


@dataclass(frozen=True)
class AcceptanceScore:
    verifications: int
    mean_accepted: float  # drafts accepted per verification, of dspark_block_size
    tokens_per_verification: float  # mean accepted + 1 (the target's own token)


@torch.no_grad()
def heldout_acceptance(
    model_dir: str | Path, texts: Sequence[str], *, prompts: int, prompt_tokens: int, max_tokens: int
) -> AcceptanceScore:
    """DSpark's acceptance on the checkpoint's own greedy continuations of ``prompts``
    held-out prompts (``prompt_tokens`` tokens each, evenly spaced in the texts' stream),
    through ReferenceDrafter.speculative_greedy."""
    params, checkpoint = load_model_params(model_dir)
    drafter = ReferenceDrafter(ReferenceModel(params))
    stream = token_stream(checkpoint.tokenizer, texts)
    stride = (stream.numel() - prompt_tokens) // prompts
    accepted: list[int] = []
    for i in range(prompts):
        prompt = stream[i * stride : i * stride + prompt_tokens].tolist()
        accepted += drafter.speculative_greedy(prompt, max_tokens).accepted
    mean = sum(accepted) / len(accepted)
    return AcceptanceScore(verifications=len(accepted), mean_accepted=mean, tokens_per_verification=mean + 1)
