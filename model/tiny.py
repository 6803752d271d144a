"""The embedded default model: a small DeepSeek-V4.1 checkpoint in the official format.

Owns the tiny presets (:class:`TinySpec`, ``TINY``, ``TINY_ALT``), the tiny BPE
tokenizer (trained here on text this module produces, or on given text, with the
special tokens of PROTOCOL.md), the checkpoint writer (:func:`write_checkpoint`:
config.json in the released nested layout, tokenizer.json, weights sharded into two
safetensors files with an index), :func:`make_tiny`, which writes deterministic random
weights through it, plain or quantised through ``model/weights.py``, and where the
shipped trained checkpoint lives (:data:`TRAINED_TINY_DIR`, the embedded default model;
model/training.py makes it).

Must not import: ``cache``, ``cluster``, ``actors``, ``deploy``, ``ray``.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv41.model.config import ARCHITECTURE, MODEL_TYPE, V41Config
from dsv41.model.engram import build_compressed_token_map, engram_row_counts
from dsv41.model.loader import INDEX_FILE, TOKENIZER_FILE
from dsv41.model.weights import SCALE_SUFFIX, TensorKind, TensorSpec, checkpoint_tensors, quantize

# PROTOCOL.md's special tokens, with the same strings (fullwidth U+FF5C and U+2581).
# Their order here is their id: BOS, EOS and pad at 0, 1, 2 as in the released model.
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
SYSTEM_TOKEN = "<｜System｜>"  # also the DSpark noise token
SPECIAL_TOKENS = (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    SYSTEM_TOKEN,
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜latest_reminder｜>",
    "<｜deepseek_image｜>",
)
_BYTE_ALPHABET_SIZE = 256

SHARD_FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
CONFIG_FILE = "config.json"
# The trained TINY checkpoint shipped as package data: the default model of the CLI and
# of `dsv41 serve` (bench/train_tiny.py writes it; BENCHMARKS.md records how).
TRAINED_TINY_DIR = Path(__file__).resolve().parent / "assets" / "tiny-trained"


def embedded_model_dir() -> Path:
    """The embedded model: the trained tiny checkpoint shipped as package data."""
    if not (TRAINED_TINY_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the embedded model is missing from {TRAINED_TINY_DIR} (an install without package data?); "
            "pass --model DIR, or write one with `dsv41 train-tiny DIR`"
        )
    return TRAINED_TINY_DIR

# Fields every V4.1 checkpoint shares with Flash whatever its size (MODEL_FACTS section 1).
_ARCHITECTURE_FIELDS: dict[str, Any] = {
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "tie_word_embeddings": False,
}
_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [32, 32],
    "activation_scheme": "dynamic",
    "expert_dtype": "fp4",
}
# The formats' scale groups are 32 wide; a TP expert slice must hold whole groups.
_SCALE_GROUP = 32
# Every preset must split over two ranks both ways (EP-2 and TP-2), so sharded loading
# and multi-rank serving run on the embedded model.
_SPLIT_WORLD = 2


@dataclass(frozen=True)
class TinySpec:
    """The sizes of a tiny checkpoint (config.json names). ``compress_ratios`` covers
    the target layers then the three DSpark stages; ``tokenizer_vocab_size`` is the BPE
    trainer's target (the config's vocab_size is the trained tokenizer's size);
    ``seed_offset`` is added to make_tiny's seed, so each preset's default weights
    come from a seed of its own."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
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
    moe_intermediate_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    engram_layer_ids: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    tokenizer_vocab_size: int
    seed_offset: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                    raise ValueError(f"TinySpec.{f.name}: {value} (allowed: a tuple of ints)")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TinySpec.{f.name}: {value!r} (allowed: a non-negative int)")
        # Quantised experts keep a scale per 32 input values and hold whole groups
        # (Engram rows may end in a partial group: any engram_head_dim is written).
        if self.hidden_size % _SCALE_GROUP:
            raise ValueError(f"TinySpec.hidden_size: {self.hidden_size} (allowed: a multiple of {_SCALE_GROUP})")
        tp_granule = _SCALE_GROUP * _SPLIT_WORLD
        if self.moe_intermediate_size % tp_granule:
            raise ValueError(
                f"TinySpec.moe_intermediate_size: {self.moe_intermediate_size} (allowed: a multiple of "
                f"{tp_granule}, so a TP-{_SPLIT_WORLD} expert slice holds whole scale groups)"
            )
        for name in ("n_routed_experts", "dspark_n_routed_experts"):
            if getattr(self, name) % _SPLIT_WORLD:
                raise ValueError(
                    f"TinySpec.{name}: {getattr(self, name)} (allowed: a multiple of {_SPLIT_WORLD}, "
                    f"so EP-{_SPLIT_WORLD} holds whole experts)"
                )
        minimum_vocab = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS) + 1
        if self.tokenizer_vocab_size < minimum_vocab:
            raise ValueError(
                f"TinySpec.tokenizer_vocab_size: {self.tokenizer_vocab_size} (allowed: >= {minimum_vocab}, the byte "
                "alphabet, the special tokens and at least one merge)"
            )


# Flash's mode pattern at small scale: window layers 0-1 (Engram on 1), ratio-2 Full
# owners 2 and 4 with a Reuse between (Engram on 4), ratio-1 Full owner 6 (candidate
# source, decoder start), Reuse 7, Reindex 8, Reuse 9, three DSpark stages. A 300-token
# prompt passes the window (32), index_topk (16 of 150 ratio-2 entries) and the
# candidate budget (8 blocks x 4 = 32 of 300 ratio-1 entries).
TINY = TinySpec(
    hidden_size=64,
    num_hidden_layers=10,
    num_attention_heads=4,
    head_dim=32,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=32,
    sliding_window=32,
    compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0),
    kv_source_layer_ids=(2, 4, 6),
    index_source_layer_ids=(2, 4, 6, 8),
    candidate_source_layer_id=6,
    candidate_topk_blocks=8,
    candidate_block_size=4,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    engram_layer_ids=(1, 4),
    engram_max_ngram_size=3,
    engram_n_heads=2,
    engram_head_dim=32,
    engram_vocab_size=1000,
    dspark_target_layer_ids=(7, 8, 9),
    dspark_markov_rank=32,
    dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=2,
    tokenizer_vocab_size=512,
    seed_offset=0,
)

# The same kind of pattern with other sizes, so nothing is tuned to TINY: window 0-1
# (Engram on 1), ratio-2 Full 2, Reuse 3-4, ratio-2 Full 5 (Engram), Reuse 6, ratio-1
# Full 7 (candidate source), Reuse 8, Reindex 9, Reuse 10, Reindex 11; hc_mult 3 and
# Flash's 4-gram Engram.
TINY_ALT = TinySpec(
    hidden_size=96,
    num_hidden_layers=12,
    num_attention_heads=6,
    head_dim=64,
    qk_rope_head_dim=32,
    q_lora_rank=64,
    o_groups=3,
    o_lora_rank=32,
    sliding_window=48,
    compress_ratios=(0, 0, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0),
    kv_source_layer_ids=(2, 5, 7),
    index_source_layer_ids=(2, 5, 7, 9, 11),
    candidate_source_layer_id=7,
    candidate_topk_blocks=6,
    candidate_block_size=8,
    index_n_heads=16,
    index_head_dim=64,
    index_topk=24,
    n_routed_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    hc_mult=3,
    hc_sinkhorn_iters=20,
    engram_layer_ids=(1, 5),
    engram_max_ngram_size=4,
    engram_n_heads=3,
    engram_head_dim=64,
    engram_vocab_size=700,
    dspark_target_layer_ids=(9, 10, 11),
    dspark_markov_rank=48,
    dspark_n_routed_experts=6,
    dspark_num_experts_per_tok=2,
    tokenizer_vocab_size=400,
    seed_offset=1000,
)


def make_tiny(out_dir: str | Path, *, quantized: bool = False, seed: int = 0, spec: TinySpec = TINY) -> Path:
    """Writes a tiny checkpoint into ``out_dir`` and returns its path. The same
    arguments give byte-identical files; ``quantized`` stores the FP8/FP4/Engram kinds
    quantised (with ``.scale`` siblings) from the same underlying random weights."""
    tokenizer = build_tokenizer(spec)
    raw_config = tiny_config(spec, tokenizer, quantized=quantized)
    stored = random_tensors(V41Config.from_dict(raw_config), seed + spec.seed_offset, quantized=quantized)
    return write_checkpoint(out_dir, raw_config, tokenizer, stored)


def write_checkpoint(
    out_dir: str | Path, raw_config: dict[str, Any], tokenizer: Tokenizer, stored: dict[str, torch.Tensor]
) -> Path:
    """Writes a checkpoint in the official format: ``stored`` (every stored tensor by
    name, each ``.scale`` right after its values) sharded into two safetensors files
    with an index, tokenizer.json, then config.json. Returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, stored)
    _write_atomically(out / TOKENIZER_FILE, tokenizer.to_str(pretty=True).encode())
    # config.json last: a directory left half-written has no config, so it is refused
    # as "not a checkpoint" before anything else is read.
    _write_atomically(out / CONFIG_FILE, (json.dumps(raw_config, indent=2) + "\n").encode())
    return out


# -- tokenizer ----------------------------------------------------------------------------

_CORPUS_SEED = 20250401
_CORPUS_SENTENCES = 3000
_PARAGRAPHS = """\
DeepSeek-V4.1 is served by a paged runtime. A request arrives over HTTP, is tokenized,
and waits in the scheduler's queue until a rank has room for it. Every layer keeps its
own sliding window of recent keys; the full layers also compress the past into shorter
rows, and an indexer picks which of those rows each query reads.
The cache is split into pages. A page holds a block of tokens for every plane, and the
prefix index hashes each full page so that two requests sharing a prompt share its pages.
When memory runs short, the scheduler preempts the newest request and replays it later.
Mixture-of-experts layers route each token to two of eight experts, plus one shared
expert that every token uses. Hashed n-gram memory adds what the last few tokens say.
"What is the capital of France?" asked the user. "Paris," said the assistant, "and it
has been for a long time." Numbers like 0, 1, 2, 3, 42, 128, 2048 and 3.14159 appear too.
def forward(tokens: list[int]) -> Tensor:
    return model(tokens)  # comments, (brackets), [lists], {braces} and "quotes"
"""
_SUBJECTS = (
    "the model", "a request", "the scheduler", "every layer", "the cache", "our engine", "the router",
    "a small cat", "the old dog", "my friend", "the teacher", "this system", "the river", "a student",
    "the city", "each token", "the server", "a good idea", "the weather", "the ship",
)
_VERBS = (
    "reads", "writes", "moves", "sees", "keeps", "finds", "makes", "takes", "sends", "builds",
    "answers", "chooses", "follows", "counts", "opens", "closes", "learns", "holds", "drops", "brings",
)
_OBJECTS = (
    "the window", "a page", "three blocks", "the prompt", "many experts", "the answer", "a long story",
    "the last row", "some water", "the green door", "two apples", "the key", "an old book", "the road",
    "the output", "its memory", "the morning light", "a new plan", "the index", "every query",
)
_ENDINGS = (
    "today", "again", "quickly", "in the end", "before noon", "with care", "at night", "for now",
    "without a sound", "on time", "as planned", "once more",
)


def _corpus() -> list[str]:
    """The tokenizer's training text: fixed paragraphs plus seeded generated sentences."""
    rng = random.Random(_CORPUS_SEED)
    lines = _PARAGRAPHS.splitlines()
    for _ in range(_CORPUS_SENTENCES):
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"
        if rng.random() < 0.3:
            sentence = f"{sentence}, and {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        punctuation = rng.choice((".", ".", ".", "!", "?"))
        lines.append(sentence[0].upper() + sentence[1:] + punctuation + f" {rng.randrange(1000)}")
    return lines


def build_tokenizer(spec: TinySpec) -> Tokenizer:
    """A byte-level BPE tokenizer trained deterministically on :func:`_corpus`, with
    :data:`SPECIAL_TOKENS` at ids 0, 1, 2, ..."""
    return train_tokenizer(_corpus(), spec.tokenizer_vocab_size)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of ``vocab_size`` ids trained on ``texts``, with
    :data:`SPECIAL_TOKENS` at ids 0, 1, 2, ..."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise RuntimeError(f"tokenizer: {token!r} got id {tokenizer.token_to_id(token)}, expected {expected_id}")
    return tokenizer


# -- config ------------------------------------------------------------------------------


def tiny_config(spec: TinySpec, tokenizer: Tokenizer, *, quantized: bool) -> dict[str, Any]:
    """The released nested config.json layout for ``spec`` and its tokenizer."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    pad_id = SPECIAL_TOKENS.index(PAD_TOKEN)
    _, num_compressed = build_compressed_token_map(tokenizer, vocab_size, pad_token_id=pad_id)
    sizes = {f.name: getattr(spec, f.name) for f in fields(spec)}
    for name in ("tokenizer_vocab_size", "seed_offset"):
        del sizes[name]
    text_config: dict[str, Any] = {
        **{k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()},
        **_ARCHITECTURE_FIELDS,
        "vocab_size": vocab_size,
        "engram_num_embeddings": engram_row_counts(
            spec.engram_layer_ids, spec.engram_max_ngram_size, spec.engram_n_heads, spec.engram_vocab_size
        ),
        "engram_compressed_vocab_size": num_compressed,
        "engram_pad_token_id": pad_id,
        "dspark_noise_token_id": SPECIAL_TOKENS.index(SYSTEM_TOKEN),
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": pad_id,
    }
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "text_config": dict(sorted(text_config.items())),
        "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 0},
    }
    if quantized:
        raw["quantization_config"] = dict(_QUANTIZATION_CONFIG)
    return raw


# -- weights -----------------------------------------------------------------------------

# (name suffix, mean, std), first match wins. Every 2-D tensor not listed is a
# projection, drawn at std 1/sqrt(fan_in) so activations stay O(1) through all layers.
_INIT_RULES: tuple[tuple[str, float, float], ...] = (
    ("norm.weight", 1.0, 0.1),  # every RMSNorm weight
    ("engram.q_weight", 1.0, 0.1),
    ("engram.k_weight", 1.0, 0.1),
    ("_base.weight", 0.0, 0.5),  # hc_*_base
    ("_scale.weight", 0.0, 0.1),  # hc_*_scale: a small data-dependent part of the mix
    ("attn.attn_sink", 0.0, 0.1),
    ("gate.bias", 0.0, 0.01),
    ("gate.bias_vl", 0.0, 0.01),
    ("embed.weight", 0.0, 1.0),  # embed, engram.embed, markov_head.embed: unit rows
)


def init_rule(name: str) -> tuple[float, float] | None:
    """(mean, std) of a named tensor's initial values, or None for a projection
    (std 1/sqrt(fan_in)); shared by every random-weight generator of the project."""
    for suffix, mean, std in _INIT_RULES:
        if name.endswith(suffix):
            return mean, std
    return None


def _initial_values(spec: TensorSpec, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(spec.shape, generator=generator, dtype=torch.float32)
    rule = init_rule(spec.name)
    if rule is not None:
        return rule[0] + rule[1] * noise
    if len(spec.shape) != 2:
        raise ValueError(f"{spec.name}: no initialisation rule for a {len(spec.shape)}-D tensor")
    return noise / math.sqrt(spec.shape[1])


def random_tensors(config: V41Config, seed: int, *, quantized: bool = False) -> dict[str, torch.Tensor]:
    """Every stored tensor of a random checkpoint of ``config`` in declaration order,
    each ``.scale`` right after its values.

    The underlying weights are drawn in float32 and rounded to bf16 (FP32 kinds stay
    float32): the plain checkpoint stores exactly them and the quantised one quantises
    exactly them, so the two differ only by quantisation."""
    generator = torch.Generator().manual_seed(seed)
    stored: dict[str, torch.Tensor] = {}
    for spec in checkpoint_tensors(config).values():
        values = _initial_values(spec, generator)
        if spec.kind is TensorKind.FP32:
            stored[spec.name] = values
            continue
        underlying = values.to(torch.bfloat16)
        if quantized and spec.kind.quantizable:
            stored[spec.name], stored[spec.scale_name] = quantize(spec, underlying.float())
        else:
            stored[spec.name] = underlying
    return stored


def _write_shards(out: Path, stored: dict[str, torch.Tensor]) -> None:
    """Two shard files split at half the bytes (a tensor and its scale stay together),
    plus the index, so the sharded loading path is the one the tiny model exercises."""
    total = sum(t.numel() * t.element_size() for t in stored.values())
    shards: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    written = 0
    for name, tensor in stored.items():
        second = written >= total // 2 and not name.endswith(SCALE_SUFFIX)
        target = shards[1] if second or shards[1] else shards[0]
        target[name] = tensor
        written += tensor.numel() * tensor.element_size()
    weight_map: dict[str, str] = {}
    for file_name, tensors in zip(SHARD_FILES, shards):
        temporary = out / (file_name + ".tmp")
        save_file(tensors, str(temporary), metadata={"format": "pt"})
        os.replace(temporary, out / file_name)
        weight_map.update({name: file_name for name in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_atomically(out / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
