"""The DeepSeek-V4.1 configuration and the attention topology derived from it.

Owns: reading a checkpoint's ``config.json`` (the released nested layout with
``text_config`` / ``vision_config`` / ``quantization_config``, or a flat text-only
layout; ``rope_scaling`` or ``rope_parameters``; the generic fields transformers'
``PretrainedConfig`` writes into every config it saves, wherever they appear, by the
rules of ``model/config_fields.py``), validating every field before any weight is read, and deriving each layer's
attention role.

Must not import: ``cache``, ``cluster``, ``actors``, ``deploy``, ``ray``, torch.
Every refusal raises :class:`ConfigError` naming the field and what is allowed. A
field this runtime does not know is logged as a warning naming it (once per
config.json and process) and ignored.
"""

from __future__ import annotations

import enum
import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from dsv41.model.config_fields import (
    IGNORED_FIELDS,
    PRETRAINED_CONFIG_FIELDS,
    QUANTIZATION_IGNORED,
    TOP_LEVEL_SECTIONS,
    TOP_LEVEL_WRAPPER_FIELDS,
    ConfigError,
    check_pretrained_config_fields,
    same_value,
    warn_unknown,
)

ARCHITECTURE = "DeepseekV41ForCausalLM"
MODEL_TYPE = "deepseek_v41"
# V4.1-Flash's published config.json, shipped with the package: the base the generated
# slices (model/reference_slice.py) cut from, and the tests' full-size config.
FLASH_CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "v41_flash"

class LayerMode(enum.Enum):
    """What a layer's attention reads besides its own sliding window."""

    WINDOW = "window"  # window only (ratio 0, or a DSpark stage)
    FULL = "full"  # owns compressor + index keys; publishes KV, keys and selection
    REINDEX = "reindex"  # own index query against the last owner's keys, inside candidates
    REUSE = "reuse"  # the last published compressed KV and selection, unchanged


@dataclass(frozen=True)
class RopeScaling:
    """YaRN frequency scaling of the compressed (ratio > 0) layers."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ConfigError(f"rope_scaling.factor: must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError(
                "rope_scaling.original_max_position_embeddings: must be > 0, "
                f"got {self.original_max_position_embeddings}"
            )
        if not self.beta_fast > self.beta_slow > 0:
            raise ConfigError(
                f"rope_scaling.beta_fast/beta_slow: need beta_fast > beta_slow > 0, "
                f"got {self.beta_fast}/{self.beta_slow}"
            )


@dataclass(frozen=True)
class QuantizationConfig:
    """How the checkpoint stores its weights (MODEL_FACTS section 7)."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    scale_fmt: str = "ue8m0"
    weight_block_size: tuple[int, int] = (32, 32)
    expert_dtype: str = "fp4"
    # Activations are quantised per block as they are computed (static input scales
    # would be tensors this model does not have).
    activation_scheme: str = "dynamic"

    def __post_init__(self) -> None:
        allowed = {
            "quant_method": ("fp8",),
            "fmt": ("e4m3",),
            "scale_fmt": ("ue8m0",),
            "expert_dtype": ("fp4", "fp8", "bf16"),
            "activation_scheme": ("dynamic",),
        }
        for name, values in allowed.items():
            value = getattr(self, name)
            if value not in values:
                raise ConfigError(
                    f"quantization_config.{name}: {value!r} is not supported (allowed: {', '.join(values)})"
                )
        if tuple(self.weight_block_size) != (32, 32):
            raise ConfigError(
                f"quantization_config.weight_block_size: {list(self.weight_block_size)} is not supported "
                "(allowed: [32, 32])"
            )


@dataclass(frozen=True)
class LayerTopology:
    """One layer's attention role. Owners are layer ids (None where there is none)."""

    layer_id: int
    ratio: int
    mode: LayerMode
    kv_owner: int | None  # whose compressed KV the layer attends over
    index_owner: int | None  # whose index keys the layer scores against
    topk_owner: int | None  # whose top-k selection the layer uses
    is_candidate_source: bool
    uses_candidates: bool  # REINDEX after the candidate source: masks scores to candidates
    is_engram: bool
    is_dspark: bool
    is_decoder: bool


@dataclass(frozen=True)
class AttentionTopology:
    """Per-layer roles of all target layers and DSpark stages."""

    layers: tuple[LayerTopology, ...]
    num_target_layers: int
    full_owners: tuple[int, ...]
    owner_ratios: tuple[int, ...]
    candidate_source: int
    decoder_start: int
    dspark_layers: tuple[int, ...]

    @property
    def target_layers(self) -> tuple[LayerTopology, ...]:
        return self.layers[: self.num_target_layers]

    @property
    def encoder_layers(self) -> tuple[int, ...]:
        return tuple(range(self.decoder_start))

    @property
    def decoder_layers(self) -> tuple[int, ...]:
        return tuple(range(self.decoder_start, self.num_target_layers))

    def layer(self, layer_id: int) -> LayerTopology:
        return self.layers[layer_id]

    def describe(self) -> str:
        rows = ["layer ratio mode     kv_owner index_owner topk_owner flags"]
        for t in self.layers:
            flags = [
                name
                for name, on in (
                    ("candidate-source", t.is_candidate_source),
                    ("candidates", t.uses_candidates),
                    ("engram", t.is_engram),
                    ("dspark", t.is_dspark),
                    ("decoder", t.is_decoder),
                )
                if on
            ]
            rows.append(
                f"{t.layer_id:5d} {t.ratio:5d} {t.mode.value:8s} {_opt(t.kv_owner):>8s} "
                f"{_opt(t.index_owner):>11s} {_opt(t.topk_owner):>10s} {','.join(flags)}"
            )
        return "\n".join(rows)


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


_SUPPORTED_STRINGS = {
    "scoring_func": ("sqrtsoftplus",),
    "topk_method": ("noaux_tc",),
}


@dataclass(frozen=True)
class V41Config:
    """The text model's fields (config.json names), validated on construction."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: RopeScaling
    engram_layer_ids: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_num_embeddings: tuple[int, ...]
    engram_compressed_vocab_size: int
    engram_pad_token_id: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_noise_token_id: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    max_position_embeddings: int = 1 << 20
    tie_word_embeddings: bool = False
    quantization: QuantizationConfig | None = None
    vision_num_layers: int = 0
    topology: AttentionTopology = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate_sizes()
        self._validate_strings()
        self._validate_layer_lists()
        # Deriving the topology runs the remaining cross-field checks.
        object.__setattr__(self, "topology", derive_topology(self))

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, text_only: bool = False) -> "V41Config":
        """Reads ``model_dir/config.json``. ``text_only`` serves a checkpoint whose
        vision tower has layers by ignoring it (images are not supported)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"config.json: not found in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config.json: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, text_only=text_only, source=str(path.resolve()))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, text_only: bool = False, source: str | None = None) -> "V41Config":
        """The config of a parsed config.json: the released nested layout (``raw``
        has a ``text_config``) or the flat one. ``source`` (the file's path) names the
        config in the unknown-field warning, which is logged once per source and process
        (None: every time)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"config.json: a {type(raw).__name__} (allowed: a JSON object)")
        architectures = raw.get("architectures")
        if architectures is not None and ARCHITECTURE not in architectures:
            raise ConfigError(f"architectures: {architectures} (allowed: [{ARCHITECTURE!r}])")
        model_type = raw.get("model_type")
        if model_type is not None and model_type != MODEL_TYPE:
            raise ConfigError(f"model_type: {model_type!r} (allowed: {MODEL_TYPE!r})")
        nested = "text_config" in raw
        if nested and not isinstance(raw["text_config"], Mapping):
            raise ConfigError("text_config: not a JSON object")
        text = dict(raw["text_config"]) if nested else dict(raw)
        vision = raw.get("vision_config") or {}
        vision_layers = int(vision.get("num_hidden_layers", vision.get("depth", 0)) or 0)
        if vision_layers and not text_only:
            raise ConfigError(
                f"vision_config.num_hidden_layers: {vision_layers}, but images are not supported "
                "(allowed: 0, or load with text_only=True to serve text and ignore vision.* weights)"
            )
        unknown: list[str] = []
        quant_raw = raw.get("quantization_config", text.pop("quantization_config", None))
        quantization = _parse_quantization(quant_raw, unknown) if quant_raw else None
        rope_theta, compress_theta, scaling = _parse_rope(text)
        for key in ("rope_scaling", "rope_parameters", "rope_theta", "compress_rope_theta"):
            text.pop(key, None)
        # Checked at the top level above; a sub-config's own architectures and
        # model_type (transformers writes both into every sub-config) describe it alone.
        for key in ("architectures", "model_type", "vision_config"):
            text.pop(key, None)
        section = "text_config." if nested else ""
        check_pretrained_config_fields(text, section)
        known = {f.name for f in fields(cls) if f.init} - {"quantization", "vision_num_layers", "rope_scaling"}
        unknown.extend(
            section + name for name in sorted(set(text) - known - IGNORED_FIELDS - PRETRAINED_CONFIG_FIELDS.keys())
        )
        missing = sorted(
            f.name
            for f in fields(cls)
            if f.name in known and f.name not in text and f.default is MISSING
            and f.name not in ("rope_theta", "compress_rope_theta")
        )
        if missing:
            raise ConfigError(f"{'text_config' if nested else 'config.json'}: missing field(s) {missing}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in text or f.name not in known:
                continue
            value = text[f.name]
            values[f.name] = tuple(value) if isinstance(value, list) else value
        config = cls(
            **values,
            rope_theta=rope_theta,
            compress_rope_theta=compress_theta,
            rope_scaling=scaling,
            quantization=quantization,
            vision_num_layers=vision_layers,
        )
        if nested:
            unknown.extend(_check_top_level(raw, config, known))
        warn_unknown(unknown, source)
        return config

    def to_text_config(self) -> dict[str, Any]:
        """The ``text_config`` dict this config was read from (rope as ``rope_scaling``)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if not f.init or f.name in ("quantization", "vision_num_layers"):
                continue
            value = getattr(self, f.name)
            if f.name == "rope_scaling":
                value = {"type": "yarn", **{g.name: getattr(value, g.name) for g in fields(value)}}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    # -- derived sizes --------------------------------------------------------------

    @property
    def total_layers(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def engram_input_dim(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads * self.engram_head_dim

    def is_dspark_layer(self, layer_id: int) -> bool:
        return layer_id >= self.num_hidden_layers

    def layer_rope(self, layer_id: int) -> tuple[float, RopeScaling | None]:
        """(theta, YaRN or None) for a layer: compressed layers (ratio > 0, ratio 1
        too) use compress_rope_theta with YaRN; window layers rope_theta without."""
        if self.compress_ratios[layer_id] > 0:
            return self.compress_rope_theta, self.rope_scaling
        return self.rope_theta, None

    # -- validation -------------------------------------------------------------------

    def _validate_sizes(self) -> None:
        positive = (
            "vocab_size hidden_size num_hidden_layers num_attention_heads head_dim qk_rope_head_dim "
            "q_lora_rank o_groups o_lora_rank sliding_window candidate_topk_blocks candidate_block_size "
            "index_n_heads index_head_dim index_topk n_routed_experts num_experts_per_tok "
            "moe_intermediate_size hc_mult hc_sinkhorn_iters engram_max_ngram_size engram_n_heads "
            "engram_head_dim engram_vocab_size engram_compressed_vocab_size max_position_embeddings"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_key_value_heads != 1:
            raise ConfigError(
                f"num_key_value_heads: {self.num_key_value_heads} (allowed: 1; one latent is key and value)"
            )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ConfigError(
                f"qk_rope_head_dim: {self.qk_rope_head_dim} must be even and <= head_dim {self.head_dim}"
            )
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(
                f"index_head_dim: {self.index_head_dim} must be >= qk_rope_head_dim {self.qk_rope_head_dim}"
            )
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(
                f"o_groups: {self.o_groups} must divide num_attention_heads {self.num_attention_heads}"
            )
        for name, block in (("head_dim", 32), ("index_head_dim", 32)):
            if getattr(self, name) % block:
                raise ConfigError(
                    f"{name}: {getattr(self, name)} must be a multiple of {block} (the cache's scale blocks)"
                )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok: {self.num_experts_per_tok} exceeds n_routed_experts {self.n_routed_experts}"
            )
        if self.n_shared_experts not in (0, 1):
            raise ConfigError(f"n_shared_experts: {self.n_shared_experts} (allowed: 0, 1)")
        if self.norm_topk_prob is not True:
            raise ConfigError(f"norm_topk_prob: {self.norm_topk_prob} (allowed: true)")
        for name in ("routed_scaling_factor", "swiglu_limit", "rope_theta", "compress_rope_theta"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("hc_eps", "rms_norm_eps"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "engram_pad_token_id", "dspark_noise_token_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name}: {value!r} (allowed: one token id in the vocabulary [0, {self.vocab_size}))")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings: true (allowed: false; V4.1 has its own fp32 head)")
        if self.engram_max_ngram_size < 2:
            raise ConfigError(f"engram_max_ngram_size: {self.engram_max_ngram_size} (allowed: >= 2)")

    def _validate_strings(self) -> None:
        for name, allowed in _SUPPORTED_STRINGS.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not supported (allowed: {', '.join(allowed)})")

    def _validate_layer_lists(self) -> None:
        n = self.num_hidden_layers
        if len(self.compress_ratios) != n + self.num_nextn_predict_layers:
            raise ConfigError(
                f"compress_ratios: {len(self.compress_ratios)} entries, need num_hidden_layers + "
                f"num_nextn_predict_layers = {n + self.num_nextn_predict_layers}"
            )
        for i, r in enumerate(self.compress_ratios):
            if r not in (0, 1, 2):
                raise ConfigError(f"compress_ratios[{i}]: {r} (allowed: 0, 1, 2)")
            if i >= n and r != 0:
                raise ConfigError(f"compress_ratios[{i}]: {r}; DSpark layers are window-only (allowed: 0)")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "dspark_target_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)):
                raise ConfigError(f"{name}: {list(ids)} must be strictly increasing")
            for i in ids:
                if not 0 <= i < n:
                    raise ConfigError(f"{name}: layer {i} is outside [0, {n})")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ConfigError(
                f"engram_num_embeddings: {len(self.engram_num_embeddings)} entries for "
                f"{len(self.engram_layer_ids)} engram_layer_ids"
            )
        if self.num_nextn_predict_layers not in (0, 3):
            raise ConfigError(
                f"num_nextn_predict_layers: {self.num_nextn_predict_layers} (allowed: 0, or 3 DSpark stages)"
            )
        if self.num_nextn_predict_layers and self.dspark_block_size != 5:
            raise ConfigError(f"dspark_block_size: {self.dspark_block_size} (allowed: 5)")


def _check_top_level(raw: Mapping[str, Any], config: "V41Config", known: set[str]) -> list[str]:
    """The nested layout's top level: PretrainedConfig fields are checked as in
    text_config; another V4.1 field repeated there (transformers writes the token ids
    at every level) must be null or text_config's value, as a disagreement leaves
    which one the model means open. Returns the keys this runtime does not know."""
    check_pretrained_config_fields(raw, "")
    unknown = []
    ignored = TOP_LEVEL_SECTIONS | PRETRAINED_CONFIG_FIELDS.keys() | TOP_LEVEL_WRAPPER_FIELDS | IGNORED_FIELDS
    for name in sorted(set(raw) - ignored):
        if name not in known:
            unknown.append(name)
            continue
        value, expected = raw[name], getattr(config, name)
        expected = list(expected) if isinstance(expected, tuple) else expected
        if value is not None and not same_value(value, expected):
            raise ConfigError(
                f"{name}: the top level says {json.dumps(value)}, text_config {json.dumps(expected)} "
                "(allowed: null or text_config's value)"
            )
    return unknown


def _parse_quantization(raw: Mapping[str, Any], unknown: list[str]) -> QuantizationConfig:
    """The quantization_config; keys it does not know are appended to ``unknown``."""
    known = {f.name for f in fields(QuantizationConfig)}
    values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k in known}
    unknown.extend(f"quantization_config.{k}" for k in sorted(set(raw) - known - QUANTIZATION_IGNORED))
    return QuantizationConfig(**values)


def _parse_rope(text: Mapping[str, Any]) -> tuple[float, float, RopeScaling]:
    """Accepts the older flat ``rope_scaling`` dict and the newer ``rope_parameters``."""
    params = text.get("rope_parameters")
    scaling = text.get("rope_scaling")
    if params is not None and scaling is not None:
        raise ConfigError("rope_scaling/rope_parameters: give one, not both")
    source_name = "rope_parameters" if params is not None else "rope_scaling"
    source = dict(params if params is not None else (scaling or {}))
    rope_type = source.get("rope_type", source.get("type"))
    if rope_type != "yarn":
        raise ConfigError(f"{source_name}.rope_type: {rope_type!r} (allowed: 'yarn')")
    rope_theta = text.get("rope_theta", source.get("rope_theta"))
    if rope_theta is None:
        raise ConfigError("rope_theta: missing (in text_config or rope_parameters)")
    compress_theta = text.get("compress_rope_theta", source.get("compress_rope_theta"))
    if compress_theta is None:
        raise ConfigError("compress_rope_theta: missing (in text_config or rope_parameters)")
    try:
        yarn = RopeScaling(
            factor=float(source["factor"]),
            original_max_position_embeddings=int(source["original_max_position_embeddings"]),
            beta_fast=float(source.get("beta_fast", 32)),
            beta_slow=float(source.get("beta_slow", 1)),
        )
    except KeyError as exc:
        raise ConfigError(f"{source_name}.{exc.args[0]}: missing") from exc
    return float(rope_theta), float(compress_theta), yarn


def derive_topology(config: V41Config) -> AttentionTopology:
    """Each layer's mode and owners, refusing configs whose lists disagree."""
    n = config.num_hidden_layers
    ratios = config.compress_ratios
    kv_sources = set(config.kv_source_layer_ids)
    index_sources = set(config.index_source_layer_ids)
    candidate = config.candidate_source_layer_id
    if not kv_sources:
        raise ConfigError("kv_source_layer_ids: empty (allowed: at least one Full owner)")
    missing_index = sorted(kv_sources - index_sources)
    if missing_index:
        raise ConfigError(f"index_source_layer_ids: must include every kv source, missing {missing_index}")
    for i in sorted(index_sources):
        if ratios[i] == 0:
            raise ConfigError(
                f"index_source_layer_ids: layer {i} has compress_ratios[{i}] = 0; window-only layers "
                "are never sources"
            )
    if candidate not in kv_sources:
        raise ConfigError(
            f"candidate_source_layer_id: {candidate} is not a kv source (allowed: one of {sorted(kv_sources)})"
        )
    for layer in config.dspark_target_layer_ids:
        if layer >= n:
            raise ConfigError(f"dspark_target_layer_ids: {layer} is not a target layer")

    layers: list[LayerTopology] = []
    last_kv_owner: dict[int, int] = {}
    last_topk_owner: dict[int, int] = {}
    candidates_seen = False
    for i in range(config.total_layers):
        r = ratios[i]
        dspark = i >= n
        if r == 0 or dspark:
            mode, kv_owner, index_owner, topk_owner = LayerMode.WINDOW, None, None, None
        elif i in kv_sources:
            mode, kv_owner, index_owner, topk_owner = LayerMode.FULL, i, i, i
            last_kv_owner[r] = i
            last_topk_owner[r] = i
        elif r not in last_kv_owner:
            raise ConfigError(
                f"compress_ratios[{i}]: {r}, but no earlier kv source has ratio {r} "
                f"(kv_source_layer_ids: {sorted(kv_sources)})"
            )
        elif i in index_sources:
            if not candidates_seen or ratios[candidate] != r:
                raise ConfigError(
                    f"index_source_layer_ids: Reindex layer {i} needs the candidate source "
                    f"{candidate} (ratio {ratios[candidate]}) before it at the same ratio"
                )
            mode, kv_owner, index_owner, topk_owner = LayerMode.REINDEX, last_kv_owner[r], last_kv_owner[r], i
            last_topk_owner[r] = i
        else:
            mode = LayerMode.REUSE
            kv_owner, index_owner, topk_owner = last_kv_owner[r], last_kv_owner[r], last_topk_owner[r]
        if i == candidate:
            candidates_seen = True
        layers.append(
            LayerTopology(
                layer_id=i,
                ratio=r,
                mode=mode,
                kv_owner=kv_owner,
                index_owner=index_owner,
                topk_owner=topk_owner,
                is_candidate_source=i == candidate,
                uses_candidates=mode is LayerMode.REINDEX,
                is_engram=i in config.engram_layer_ids,
                is_dspark=dspark,
                is_decoder=False,
            )
        )
    decoder_start = max(kv_sources)
    # The decoder is everything from the last KV source on; it reads only global KV the
    # encoder's output produced, so its layers must all be ratio 1 and the encoder's 0 or 2.
    encoder_ratios = set(ratios[:decoder_start])
    decoder_ratios = set(ratios[decoder_start:n])
    if decoder_ratios != {1} or not encoder_ratios <= {0, 2}:
        raise ConfigError(
            "compress_ratios: layers from the last kv source "
            f"({decoder_start}) on must be ratio 1 and layers before it ratio 0 or 2 "
            "(the V4.1 encoder/decoder split)"
        )
    layers = [
        LayerTopology(**{**t.__dict__, "is_decoder": decoder_start <= t.layer_id < n}) for t in layers
    ]
    owners = tuple(sorted(kv_sources))
    if config.index_topk > config.candidate_topk_blocks * config.candidate_block_size:
        raise ConfigError(
            f"index_topk: {config.index_topk} exceeds candidate_topk_blocks * candidate_block_size "
            f"= {config.candidate_topk_blocks * config.candidate_block_size}"
        )
    return AttentionTopology(
        layers=tuple(layers),
        num_target_layers=n,
        full_owners=owners,
        owner_ratios=tuple(ratios[i] for i in owners),
        candidate_source=candidate,
        decoder_start=decoder_start,
        dspark_layers=tuple(range(n, config.total_layers)),
    )
