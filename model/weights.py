"""The checkpoint's tensor declarations: every tensor a DeepSeek-V4.1 checkpoint holds.

Owns the official tensor names, shapes and storage kinds of the text model and the
DSpark stages (MODEL_FACTS.md sections 7, 8 and 9), the geometry of each kind's
quantised form (values and ``.scale`` sibling), the one conversion between a kind and
its number format (through ``model/formats.py``), and the one alias between stored
spellings and the canonical names. The loader reads against these declarations and
the tiny-checkpoint writer writes from them, so a name or shape is spelled only here.

Must not import: ``cache``, ``cluster``, ``actors``, ``deploy``, ``ray``, safetensors.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import torch

from dsv41.model import formats
from dsv41.model.config import LayerMode, V41Config

# "core": the target model; "mtp": the DSpark stages (optional as a whole); "vision":
# the vision tower, whose tensors are recognised by prefix and never declared here
# (images are not supported; a text-only load skips them).
GROUPS = ("core", "mtp", "vision")
VISION_PREFIXES = ("vision.", "aligner.")
SCALE_SUFFIX = ".scale"
WEIGHT_SUFFIX = ".weight"

# (?) MODEL_FACTS' rule "`.weight` unless noted" makes the mHC tensors
# `layers.N.hc_attn_fn.weight`; public re-implementations hold them as bare parameters
# (`layers.N.hc_attn_fn`). The facts' spelling is canonical and the bare spelling is an
# accepted alias on load. This set is the one place that alias is declared.
BARE_PARAMETER_ALIASES = frozenset(
    f"hc_{site}_{part}" for site in ("attn", "ffn") for part in ("fn", "base", "scale")
)


class TensorKind(enum.Enum):
    """How a tensor is stored. The three quantisable kinds may also be stored plain
    (BF16/FP32, no ``.scale``); the others never carry a scale."""

    BF16 = "bf16"
    FP32 = "fp32"  # stays float32 whatever the compute dtype
    FP8_WEIGHT = "fp8_weight"  # E4M3 [out, in] + E8M0 `.scale` per 32x32 tile
    FP4_EXPERT = "fp4_expert"  # E2M1 packed int8 [out, in/2] + E8M0 `.scale` [out, in/32]
    ENGRAM_TABLE = "engram_table"  # E4M3 rows [rows, dim] + E8M0 `.scale` [rows, ceil(dim/32)]

    @property
    def quantizable(self) -> bool:
        return self in _QUANTIZABLE


_QUANTIZABLE = frozenset({TensorKind.FP8_WEIGHT, TensorKind.FP4_EXPERT, TensorKind.ENGRAM_TABLE})
# Kinds scaled per group of consecutive values along each row (FP8_WEIGHT uses 32x32
# tiles): ceil(dim / group) scales per row. An FP8 Engram row may end in a partial group
# with its own scale, as FP8_WEIGHT's edge tiles do; FP4 experts hold whole groups (a
# TP slice of the intermediate dim splits at group boundaries).
_ROW_SCALE_GROUP = {TensorKind.FP4_EXPERT: formats.MXFP4_BLOCK, TensorKind.ENGRAM_TABLE: formats.FP8_BLOCK}


@dataclass(frozen=True)
class TensorSpec:
    """One declared tensor: official name, logical (decoded) shape, kind, group.
    ``held_fp32``: a BF16 tensor whose compute-dtype values the device holds in float32,
    for arithmetic that reads it in fp32 every step (the router gate: its logits are
    fp32, MODEL_FACTS section 5), so no step copies it."""

    name: str
    shape: tuple[int, ...]
    kind: TensorKind
    group: str
    held_fp32: bool = False

    def __post_init__(self) -> None:
        if not self.name or self.name.endswith(SCALE_SUFFIX):
            raise ValueError(f"TensorSpec.name: {self.name!r} (allowed: a non-empty name not ending in '.scale')")
        if not isinstance(self.kind, TensorKind):
            raise ValueError(f"TensorSpec.kind of {self.name}: {self.kind!r} (allowed: a TensorKind)")
        if self.group not in GROUPS:
            raise ValueError(f"TensorSpec.group of {self.name}: {self.group!r} (allowed: {', '.join(GROUPS)})")
        if not self.shape or any(not isinstance(d, int) or d <= 0 for d in self.shape):
            raise ValueError(f"TensorSpec.shape of {self.name}: {self.shape} (allowed: positive integer dims)")
        if self.held_fp32 and self.kind is not TensorKind.BF16:
            raise ValueError(
                f"TensorSpec.held_fp32 of {self.name}: True with kind {self.kind.name} (allowed: True only with BF16)"
            )
        if self.kind.quantizable:
            if len(self.shape) != 2 or not self.name.endswith(WEIGHT_SUFFIX):
                raise ValueError(
                    f"TensorSpec {self.name}: kind {self.kind.name} needs a 2-D shape and a '.weight' name, "
                    f"got {self.shape}"
                )
            if self.kind is TensorKind.FP4_EXPERT and self.shape[1] % formats.MXFP4_BLOCK:
                raise ValueError(
                    f"TensorSpec.shape of {self.name}: last dim {self.shape[1]} must be a multiple of "
                    f"{formats.MXFP4_BLOCK} (the scale groups of {self.kind.name})"
                )

    @property
    def scale_name(self) -> str:
        """The quantised form's scale sibling: `.weight` replaced by `.scale`."""
        if not self.kind.quantizable:
            raise ValueError(f"{self.name}: kind {self.kind.name} takes no .scale")
        return self.name[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX

    @property
    def quantized_shape(self) -> tuple[int, ...]:
        """Shape of the stored values of the quantised form."""
        rows, cols = self._matrix()
        return (rows, cols // 2) if self.kind is TensorKind.FP4_EXPERT else (rows, cols)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Shape of the quantised form's E8M0 ``.scale``."""
        rows, cols = self._matrix()
        if self.kind is TensorKind.FP8_WEIGHT:
            block = formats.WEIGHT_BLOCK
            return (-(-rows // block), -(-cols // block))
        return (rows, formats.row_scale_groups(cols, _ROW_SCALE_GROUP[self.kind]))

    def _matrix(self) -> tuple[int, int]:
        if not self.kind.quantizable:
            raise ValueError(f"{self.name}: kind {self.kind.name} has no quantised form")
        rows, cols = self.shape
        return rows, cols


def canonical_name(stored_name: str) -> str:
    """The canonical name of a stored tensor name (the bare mHC alias gains `.weight`)."""
    if stored_name.rsplit(".", 1)[-1] in BARE_PARAMETER_ALIASES:
        return stored_name + WEIGHT_SUFFIX
    return stored_name


def is_vision_tensor(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


_ROUTED_EXPERT = re.compile(
    r"^(?:layers|mtp)\.\d+\.ffn\.experts\.(?P<expert>\d+)\.(?P<projection>w[123])\.(?:weight|scale)$"
)


def routed_expert(name: str) -> tuple[int, str] | None:
    """(expert id, "w1" | "w2" | "w3") of a routed expert's tensor or scale, else None."""
    match = _ROUTED_EXPERT.match(name)
    return (int(match["expert"]), match["projection"]) if match else None


# -- kind <-> number format -------------------------------------------------------------


def quantize(spec: TensorSpec, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantised form of a quantisable tensor: (values, scale), the scale as
    ``torch.float8_e8m0fnu`` bytes, both contiguous and ready to store."""
    if tuple(weight.shape) != spec.shape:
        raise ValueError(f"quantize {spec.name}: shape {tuple(weight.shape)}, declared {spec.shape}")
    if spec.kind is TensorKind.FP8_WEIGHT:
        values, scale = formats.quantize_fp8_weight(weight)
    elif spec.kind is TensorKind.FP4_EXPERT:
        values, scale = formats.quantize_fp4_weight(weight)
    elif spec.kind is TensorKind.ENGRAM_TABLE:
        codes, scale = formats.quantize_fp8(weight)
        values = codes.view(torch.float8_e4m3fn)
    else:
        raise ValueError(f"quantize {spec.name}: kind {spec.kind.name} has no quantised form")
    return values.contiguous(), scale.view(torch.float8_e8m0fnu).contiguous()


def dequantize(spec: TensorSpec, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact float32 decoding of a quantised weight (scales as E8M0 or uint8 bytes).

    Engram tables are not decoded whole: they stay packed on the host and
    ``EngramTable.lookup`` decodes the gathered rows."""
    if spec.kind is TensorKind.FP8_WEIGHT:
        return formats.dequantize_fp8_weight(values, scale)
    if spec.kind is TensorKind.FP4_EXPERT:
        return formats.dequantize_fp4_weight(values, scale)
    raise ValueError(f"dequantize {spec.name}: kind {spec.kind.name} is not a decoded weight kind")


# -- the declarations ----------------------------------------------------------------------


def checkpoint_tensors(config: V41Config) -> dict[str, TensorSpec]:
    """Every tensor of the text model and the DSpark stages, by canonical name."""
    specs = _Declarations()
    hidden = config.hidden_size
    specs.add("embed.weight", (config.vocab_size, hidden), TensorKind.BF16)
    specs.add("head.weight", (config.vocab_size, hidden), TensorKind.FP32)
    specs.add("norm.weight", (hidden,), TensorKind.BF16)
    for layer_id in range(config.num_hidden_layers):
        prefix = f"layers.{layer_id}."
        _declare_block(specs, config, prefix, "core", config.n_routed_experts)
        _declare_attention_extras(specs, config, prefix, layer_id)
        if layer_id in config.engram_layer_ids:
            _declare_engram(specs, config, prefix, config.engram_layer_ids.index(layer_id))
    for stage in range(config.num_nextn_predict_layers):
        prefix = f"mtp.{stage}."
        _declare_block(specs, config, prefix, "mtp", config.dspark_n_routed_experts)
        if stage == 0:
            targets = len(config.dspark_target_layer_ids)
            specs.add(prefix + "main_proj.weight", (hidden, targets * hidden), TensorKind.BF16, "mtp")
            specs.add(prefix + "main_norm.weight", (hidden,), TensorKind.BF16, "mtp")
        if stage == config.num_nextn_predict_layers - 1:
            rank = config.dspark_markov_rank
            specs.add(prefix + "norm.weight", (hidden,), TensorKind.BF16, "mtp")
            # (?) The facts give no storage type for the DSpark heads; MODEL_FACTS section 7
            # puts everything not listed as FP8/FP4 in BF16.
            specs.add(prefix + "markov_head.embed.weight", (config.vocab_size, rank), TensorKind.BF16, "mtp")
            specs.add(prefix + "markov_head.head.weight", (config.vocab_size, rank), TensorKind.BF16, "mtp")
            specs.add(prefix + "confidence_head.proj.weight", (1, hidden + rank), TensorKind.BF16, "mtp")
    return specs.by_name


class _Declarations:
    def __init__(self) -> None:
        self.by_name: dict[str, TensorSpec] = {}

    def add(
        self, name: str, shape: tuple[int, ...], kind: TensorKind, group: str = "core", held_fp32: bool = False
    ) -> None:
        if name in self.by_name:
            raise ValueError(f"checkpoint_tensors: {name} declared twice")
        self.by_name[name] = TensorSpec(name=name, shape=shape, kind=kind, group=group, held_fp32=held_fp32)


def _declare_block(specs: _Declarations, config: V41Config, prefix: str, group: str, n_experts: int) -> None:
    """What every block has: norms, mHC, the window attention projections, the MoE."""
    hidden, hc = config.hidden_size, config.hc_mult
    heads, head_dim = config.num_attention_heads, config.head_dim
    mix = (2 + hc) * hc
    specs.add(prefix + "attn_norm.weight", (hidden,), TensorKind.BF16, group)
    specs.add(prefix + "ffn_norm.weight", (hidden,), TensorKind.BF16, group)
    for site in ("attn", "ffn"):
        specs.add(prefix + f"hc_{site}_fn.weight", (mix, hc * hidden), TensorKind.FP32, group)
        specs.add(prefix + f"hc_{site}_base.weight", (mix,), TensorKind.FP32, group)
        specs.add(prefix + f"hc_{site}_scale.weight", (3,), TensorKind.FP32, group)
    attn = prefix + "attn."
    specs.add(attn + "wq_a.weight", (config.q_lora_rank, hidden), TensorKind.FP8_WEIGHT, group)
    specs.add(attn + "q_norm.weight", (config.q_lora_rank,), TensorKind.BF16, group)
    specs.add(attn + "wq_b.weight", (heads * head_dim, config.q_lora_rank), TensorKind.FP8_WEIGHT, group)
    specs.add(attn + "wkv.weight", (head_dim, hidden), TensorKind.FP8_WEIGHT, group)
    specs.add(attn + "kv_norm.weight", (head_dim,), TensorKind.BF16, group)
    o_in = heads * head_dim // config.o_groups
    specs.add(attn + "wo_a.weight", (config.o_groups * config.o_lora_rank, o_in), TensorKind.FP8_WEIGHT, group)
    specs.add(attn + "wo_b.weight", (hidden, config.o_groups * config.o_lora_rank), TensorKind.FP8_WEIGHT, group)
    specs.add(attn + "attn_sink", (heads,), TensorKind.FP32, group)
    ffn = prefix + "ffn."
    specs.add(ffn + "gate.weight", (n_experts, hidden), TensorKind.BF16, group, held_fp32=True)
    specs.add(ffn + "gate.bias", (n_experts,), TensorKind.FP32, group)
    specs.add(ffn + "gate.bias_vl", (n_experts,), TensorKind.FP32, group)
    inter = config.moe_intermediate_size
    for expert in range(n_experts):
        _declare_swiglu(specs, f"{ffn}experts.{expert}.", hidden, inter, TensorKind.FP4_EXPERT, group)
    if config.n_shared_experts:
        shared_inter = inter * config.n_shared_experts
        _declare_swiglu(specs, ffn + "shared_experts.", hidden, shared_inter, TensorKind.FP8_WEIGHT, group)


def _declare_swiglu(
    specs: _Declarations, prefix: str, hidden: int, inter: int, kind: TensorKind, group: str
) -> None:
    specs.add(prefix + "w1.weight", (inter, hidden), kind, group)
    specs.add(prefix + "w2.weight", (hidden, inter), kind, group)
    specs.add(prefix + "w3.weight", (inter, hidden), kind, group)


def _declare_attention_extras(specs: _Declarations, config: V41Config, prefix: str, layer_id: int) -> None:
    """The compressor and indexer tensors of Full owners and Reindex layers."""
    topology = config.topology.layer(layer_id)
    attn = prefix + "attn."
    index_q = (config.index_n_heads * config.index_head_dim, config.q_lora_rank)
    if topology.mode is LayerMode.FULL:
        hidden, head_dim = config.hidden_size, config.head_dim
        specs.add(attn + "compressor.wkv.weight", (head_dim, hidden), TensorKind.FP32)
        if topology.ratio == 2:
            specs.add(attn + "compressor.wgate.weight", (head_dim, hidden), TensorKind.FP32)
        specs.add(attn + "compressor.norm.weight", (head_dim,), TensorKind.BF16)
        specs.add(attn + "indexer.wq_b.weight", index_q, TensorKind.FP8_WEIGHT)
        specs.add(attn + "indexer.weights_proj.weight", (config.index_n_heads, hidden), TensorKind.BF16)
        specs.add(attn + "indexer.wk.weight", (config.index_head_dim, head_dim), TensorKind.BF16)
        specs.add(attn + "indexer.k_norm.weight", (config.index_head_dim,), TensorKind.BF16)
    elif topology.mode is LayerMode.REINDEX:
        specs.add(attn + "indexer.wq_b.weight", index_q, TensorKind.FP8_WEIGHT)
        specs.add(attn + "indexer.weights_proj.weight", (config.index_n_heads, config.hidden_size), TensorKind.BF16)


def _declare_engram(specs: _Declarations, config: V41Config, prefix: str, engram_index: int) -> None:
    hidden, hc = config.hidden_size, config.hc_mult
    rows = config.engram_num_embeddings[engram_index]
    engram = prefix + "engram."
    specs.add(engram + "embed.weight", (rows, config.engram_head_dim), TensorKind.ENGRAM_TABLE)
    specs.add(engram + "wkv.weight", ((hc + 1) * hidden, config.engram_input_dim), TensorKind.FP8_WEIGHT)
    # (?) The facts give no storage type for the Engram gate weights; they scale like norm weights.
    specs.add(engram + "q_weight", (hc, hidden), TensorKind.BF16)
    specs.add(engram + "k_weight", (hc, hidden), TensorKind.BF16)
