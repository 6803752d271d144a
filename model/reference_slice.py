"""The reference slice: an 8-layer cut of V4.1-Flash that one GPU holds, for benchmarks.

Owns :class:`SliceSpec` (what a slice changes in its base config), ``REFERENCE_SLICE``
(the GPU issue's slice of V4.1-Flash) and ``SMALL_SLICE`` (the same layer roles at
widths a CPU runs in seconds), the slice's word-level tokenizer, and its random
weights: :class:`SliceWeights` makes every declared tensor's stored form directly on
the target device, deterministically from (seed, tensor name), and
:func:`load_slice` hands them to ``model/loader.py``'s ``load_generated``, so rank
sharding, the declaration checks and the post-load pass are the loader's own. No
checkpoint is written: the reference slice's routed experts alone are ~36 GB of bf16.

Must not import: ``cache``, ``cluster``, ``actors``, ``deploy``, ``ray``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from dsv41.model.config import ARCHITECTURE, MODEL_TYPE, QuantizationConfig, V41Config
from dsv41.model.engram import build_compressed_token_map, engram_row_counts
from dsv41.model.formats import MXFP4_BLOCK
from dsv41.model.loader import ExpertShard, LoadedCheckpoint, TensorPart, load_generated, tp_split_axis
from dsv41.model.tiny import SPECIAL_TOKENS, SYSTEM_TOKEN, init_rule
from dsv41.model.weights import TensorKind, TensorSpec, quantize

EXPERT_FORMATS = ("bf16", "fp4")
# How the slice stores its FP8_WEIGHT kinds (attention projections, shared experts,
# the indexer's wq_b, Engram's wkv): plain bf16, or FP8 E4M3 with 32x32 E8M0 scales as
# the released checkpoint does.
DENSE_FORMATS = ("bf16", "fp8")
# Size fields a slice may also replace (config.json names): SMALL_SLICE shrinks them.
WIDTH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "candidate_topk_blocks",
    "candidate_block_size",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "hc_mult",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_head_dim",
)
# Routed experts are drawn in granules of this many intermediate channels, each from
# its own seed: a TP slice holds whole FP4 scale groups (ExpertShard.check_intermediate),
# so every TP world's slice is a run of granules and is made without the others.
EXPERT_GRANULE = MXFP4_BLOCK


@dataclass(frozen=True)
class SliceSpec:
    """What a slice changes in its base config (config.json names): the layer pattern,
    the Engram layers and table size, the routed expert count, and ``widths``, any
    further size fields replaced. Everything else is the base config's; DSpark is off."""

    name: str
    num_hidden_layers: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    engram_layer_ids: tuple[int, ...]
    engram_vocab_size: int
    n_routed_experts: int
    widths: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("SliceSpec.name: empty (allowed: a non-empty name)")
        for name in ("num_hidden_layers", "candidate_source_layer_id", "engram_vocab_size", "n_routed_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SliceSpec.{name}: {value!r} (allowed: a non-negative int)")
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ValueError(f"SliceSpec.{name}: {value!r} (allowed: a tuple of ints)")
        seen: set[str] = set()
        for entry in self.widths:
            field_name, value = entry
            if field_name not in WIDTH_FIELDS:
                raise ValueError(f"SliceSpec.widths: {field_name!r} (allowed: {', '.join(WIDTH_FIELDS)})")
            if field_name in seen:
                raise ValueError(f"SliceSpec.widths: {field_name!r} given twice (allowed: each field once)")
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SliceSpec.widths[{field_name!r}]: {value!r} (allowed: a positive int)")
            seen.add(field_name)


# The GPU issue's slice: V4.1-Flash widths, two window layers (Engram on 1), ratio-2
# Full owners 2 and 4 with a Reuse between, the ratio-1 Full owner 5 (candidate source,
# decoder start), Reuse 6, Reindex 7; 64 routed experts per layer.
REFERENCE_SLICE = SliceSpec(
    name="reference-slice",
    num_hidden_layers=8,
    compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1),
    kv_source_layer_ids=(2, 4, 5),
    index_source_layer_ids=(2, 4, 5, 7),
    candidate_source_layer_id=5,
    engram_layer_ids=(1,),
    engram_vocab_size=100003,
    n_routed_experts=64,
)

# The same layer roles at widths a CPU runs in seconds (the benchmarks' --small mode):
# a 128-token prompt passes the window (32), index_topk (32 of 64 ratio-2 entries)
# and the candidate budget (16 blocks x 4 = 64 of 128 ratio-1 entries).
SMALL_SLICE = dataclasses.replace(
    REFERENCE_SLICE,
    name="small-slice",
    engram_vocab_size=1009,
    n_routed_experts=16,
    widths=(
        ("vocab_size", 4096),
        ("hidden_size", 256),
        ("num_attention_heads", 8),
        ("head_dim", 64),
        ("qk_rope_head_dim", 32),
        ("q_lora_rank", 64),
        ("o_groups", 2),
        ("o_lora_rank", 64),
        ("sliding_window", 32),
        ("candidate_topk_blocks", 16),
        ("candidate_block_size", 4),
        ("index_n_heads", 4),
        ("index_head_dim", 64),
        ("index_topk", 32),
        ("moe_intermediate_size", 128),
        ("engram_n_heads", 2),
        ("engram_head_dim", 64),
    ),
)


def slice_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer with one word per model token id: PROTOCOL.md's special
    tokens at ids 0, 1, 2, ... (as the tiny model's), then ``w<id>``. Every id decodes
    to its own text, so every id has its own Engram compressed id. Words split at
    whitespace and around every character but ASCII letters and digits, so a special
    token's text typed as plain text falls apart into unknown words (the first ordinary
    id) and never becomes its id: what a server's prompt encoder requires of a
    tokenizer (deploy/chat_protocol.py PromptEncoder)."""
    if vocab_size <= len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size: {vocab_size} (allowed: more than the {len(SPECIAL_TOKENS)} special tokens + 1)")
    vocab = {token: token_id for token_id, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{token_id}": token_id for token_id in range(len(SPECIAL_TOKENS), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=f"w{len(SPECIAL_TOKENS)}"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("[^0-9A-Za-z]"), behavior="isolated")]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


@dataclass(frozen=True)
class SliceModel:
    """Everything of a slice's checkpoint but its weights: the nested config.json
    (``raw_config``), the validated config and the tokenizer."""

    spec: SliceSpec
    expert_format: str
    raw_config: dict[str, Any]
    config: V41Config
    tokenizer: Tokenizer

    def __post_init__(self) -> None:
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format: {self.expert_format!r} (allowed: {', '.join(EXPERT_FORMATS)})")
        declared = "fp4" if self.config.quantization is not None else "bf16"
        if declared != self.expert_format:
            raise ValueError(
                f"expert_format: {self.expert_format!r}, but the config's quantization_config declares "
                f"{declared!r} experts (allowed: the config's)"
            )

    @classmethod
    def build(cls, spec: SliceSpec, base: V41Config, *, expert_format: str = "bf16") -> "SliceModel":
        """``spec`` applied to ``base`` (V4.1-Flash's config). Routed experts are stored
        as bf16 or as FP4 (E2M1 + E8M0, quantization_config's expert_dtype); every other
        weight is plain bf16/fp32. Raises ConfigError naming a field the cut breaks."""
        text = base.to_text_config()
        text.update(dict(spec.widths))
        text.update(
            num_hidden_layers=spec.num_hidden_layers,
            compress_ratios=list(spec.compress_ratios),
            kv_source_layer_ids=list(spec.kv_source_layer_ids),
            index_source_layer_ids=list(spec.index_source_layer_ids),
            candidate_source_layer_id=spec.candidate_source_layer_id,
            engram_layer_ids=list(spec.engram_layer_ids),
            engram_vocab_size=spec.engram_vocab_size,
            n_routed_experts=spec.n_routed_experts,
            num_nextn_predict_layers=0,
            dspark_target_layer_ids=[],
        )
        text["engram_num_embeddings"] = engram_row_counts(
            spec.engram_layer_ids, text["engram_max_ngram_size"], text["engram_n_heads"], spec.engram_vocab_size
        )
        tokenizer = slice_tokenizer(text["vocab_size"])
        _, text["engram_compressed_vocab_size"] = build_compressed_token_map(
            tokenizer, text["vocab_size"], pad_token_id=text["engram_pad_token_id"]
        )
        # DSpark is off, but its noise token must still be a token of this vocabulary.
        text["dspark_noise_token_id"] = SPECIAL_TOKENS.index(SYSTEM_TOKEN)
        raw: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": text}
        if expert_format == "fp4":
            quantization = dataclasses.asdict(QuantizationConfig(expert_dtype="fp4"))
            raw["quantization_config"] = {**quantization, "weight_block_size": list(quantization["weight_block_size"])}
        return cls(spec, expert_format, raw, V41Config.from_dict(raw), tokenizer)


@dataclass(frozen=True)
class GenerationProgress:
    """Where a generation stands: the tensor just made, and totals so far."""

    tensor: str
    tensors_made: int
    bytes_made: int
    seconds: float


class SliceWeights:
    """Makes declared tensors' stored forms (a ``model.loader.TensorMaker``).

    Values follow make_tiny's initialisation rules (model/tiny.py), drawn in float32 on
    ``device`` from a seed derived from (``seed``, tensor name), rounded to bf16 (FP32
    kinds stay float32), routed experts quantised to FP4 under ``expert_format="fp4"``,
    the FP8_WEIGHT kinds quantised to FP8 (32x32 tiles) under ``dense_format="fp8"``.
    Routed experts are drawn per granule of EXPERT_GRANULE intermediate channels, so a
    rank's experts or TP slice equal the same part of the whole model, made without
    the rest. The same seed gives the same tensors on every device of one type (CPU and
    CUDA generators draw different streams). Engram tables are moved to the host."""

    def __init__(
        self,
        *,
        seed: int,
        expert_format: str,
        device: torch.device | str,
        dense_format: str = "bf16",
        progress: Callable[[GenerationProgress], None] | None = None,
    ) -> None:
        if expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format: {expert_format!r} (allowed: {', '.join(EXPERT_FORMATS)})")
        if dense_format not in DENSE_FORMATS:
            raise ValueError(f"dense_format: {dense_format!r} (allowed: {', '.join(DENSE_FORMATS)})")
        self.dense_format = dense_format
        self.seed = seed
        self.expert_format = expert_format
        self.device = torch.device(device)
        self.progress = progress
        self._generator = torch.Generator(device=self.device)
        self._started = time.monotonic()
        self._tensors_made = 0
        self._bytes_made = 0

    def __call__(self, spec: TensorSpec, part: TensorPart | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        values = self._initial_values(spec, part)
        scale = None
        if spec.kind is not TensorKind.FP32:
            values = values.to(torch.bfloat16)
            quantised = (spec.kind is TensorKind.FP4_EXPERT and self.expert_format == "fp4") or (
                spec.kind is TensorKind.FP8_WEIGHT and self.dense_format == "fp8"
            )
            if quantised:
                held = spec if part is None else dataclasses.replace(spec, shape=part.shape_of(spec.shape))
                values, scale = quantize(held, values.float())
        if spec.kind is TensorKind.ENGRAM_TABLE:
            values = values.cpu()
        self._tensors_made += 1
        self._bytes_made += values.nbytes + (0 if scale is None else scale.nbytes)
        if self.progress is not None:
            self.progress(
                GenerationProgress(spec.name, self._tensors_made, self._bytes_made, time.monotonic() - self._started)
            )
        return values, scale

    def _initial_values(self, spec: TensorSpec, part: TensorPart | None) -> torch.Tensor:
        mean, std = _initial_distribution(spec)
        axis = tp_split_axis(spec.name)
        if axis is None:
            if part is not None:
                raise ValueError(f"{spec.name}: asked for a part, but only routed experts are split")
            noise = self._noise(spec.name, spec.shape)
        else:
            start, stop = (0, spec.shape[axis]) if part is None else (part.start, part.stop)
            if part is not None and part.axis != axis:
                raise ValueError(f"{spec.name}: a part along axis {part.axis} (allowed: {axis}, the intermediate dim)")
            if start % EXPERT_GRANULE or stop % EXPERT_GRANULE:
                raise ValueError(
                    f"{spec.name}: part [{start}, {stop}) (allowed: multiples of {EXPERT_GRANULE}, the FP4 scale group)"
                )
            granule_shape = spec.shape[:axis] + (EXPERT_GRANULE,) + spec.shape[axis + 1 :]
            noise = torch.cat(
                [
                    self._noise(f"{spec.name}#{granule}", granule_shape)
                    for granule in range(start // EXPERT_GRANULE, stop // EXPERT_GRANULE)
                ],
                dim=axis,
            )
        return noise.mul_(std).add_(mean)

    def _noise(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        digest = hashlib.blake2b(f"{self.seed}:{key}".encode(), digest_size=8).digest()
        self._generator.manual_seed(int.from_bytes(digest, "little") >> 1)
        return torch.randn(shape, generator=self._generator, device=self.device, dtype=torch.float32)


def _initial_distribution(spec: TensorSpec) -> tuple[float, float]:
    """(mean, std) of a tensor's initial values: make_tiny's rules; every 2-D tensor
    they do not name is a projection, at std 1/sqrt(fan_in)."""
    rule = init_rule(spec.name)
    if rule is not None:
        return rule
    if len(spec.shape) != 2:
        raise ValueError(f"{spec.name}: no initialisation rule for a {len(spec.shape)}-D tensor")
    return 0.0, 1.0 / math.sqrt(spec.shape[1])


def load_slice(
    model: SliceModel,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    weight_storage: str = "decoded",
    dense_format: str = "bf16",
    shard: ExpertShard | None = None,
    progress: Callable[[GenerationProgress], None] | None = None,
) -> LoadedCheckpoint:
    """One rank's part of the slice (``shard``: its experts; None: all), its weights
    made on ``device`` (Engram tables on the host) and post-load processed there."""
    maker = SliceWeights(
        seed=seed, expert_format=model.expert_format, dense_format=dense_format, device=device, progress=progress
    )
    source = (
        f"{model.spec.name} ({model.expert_format} experts, {dense_format} dense weights, seed {seed}, "
        f"generated on {torch.device(device)})"
    )
    return load_generated(
        model.config, model.tokenizer, maker, source=source, dtype=dtype, weight_storage=weight_storage, shard=shard
    )
