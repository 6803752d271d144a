"""Native DeepSeek-V4.1 checkpoint loading.

Owns reading a checkpoint directory (config.json, tokenizer.json, one
``model.safetensors`` or shards listed by ``model.safetensors.index.json``) against the
declarations of ``model/weights.py``: every structural problem is found from the
safetensors headers before any tensor data is read, and the config before any shard
is opened. Owns rank sharding of the routed experts (:class:`ExpertShard`), the host
memory maps of the Engram tables (never copied), load progress, and the one post-load
pass (decoding FP8/FP4 weights exactly, casting, building the Engram compressed-token
map) that runs exactly once per :class:`LoadedCheckpoint`. A checkpoint whose stored
tensors are made in memory instead (:func:`load_generated`: generated benchmark models)
goes through the same rank sharding, declaration checks and post-load pass.

Must not import: ``cache``, ``cluster``, ``actors``, ``deploy``, ``ray``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from dsv41.model.config import ConfigError, V41Config
from dsv41.model.engram import EngramTable, build_compressed_token_map, engram_row_counts
from dsv41.model.stored_weights import COMPUTE_DTYPES as STORED_COMPUTE_DTYPES
from dsv41.model.stored_weights import Fp4Weight, Fp8Weight, Weight
from dsv41.model.weights import (
    SCALE_SUFFIX,
    WEIGHT_SUFFIX,
    TensorKind,
    TensorSpec,
    canonical_name,
    checkpoint_tensors,
    dequantize,
    is_vision_tensor,
    routed_expert,
)

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"

# safetensors dtype strings -> torch dtypes (the ones a V4.1 checkpoint can hold).
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
_PLAIN_DTYPES = ("BF16", "F16", "F32")
_SCALE_DTYPES = ("F8_E8M0", "U8")
_QUANTIZED_VALUE_DTYPES: dict[TensorKind, tuple[str, ...]] = {
    TensorKind.FP8_WEIGHT: ("F8_E4M3",),
    TensorKind.FP4_EXPERT: ("I8", "U8"),
    TensorKind.ENGRAM_TABLE: ("F8_E4M3",),
}
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# How post-load holds the quantised weights: "stored" keeps FP8 / FP4 weights in the
# checkpoint's bytes (model/stored_weights.py), "decoded" decodes them to the compute
# dtype (the dense reference's form, and training's).
WEIGHT_STORAGE = ("stored", "decoded")
# Byte alignment of a stored weight's values and scales (the kernels' vector loads).
_ALIGNMENT = 16
_SUPPORTED_EXPERT_DTYPES = ("fp4", "bf16")
# A header this large is not a safetensors header (Flash's largest is a few MiB).
_MAX_HEADER_BYTES = 1 << 28
# Quantised experts keep one scale per 32 input values; a TP slice holds whole groups.
_EXPERT_SCALE_GROUP = 32
_MAX_LISTED_PROBLEMS = 20


class CheckpointError(ValueError):
    """A checkpoint that does not match its config's declarations; names the tensor or file."""


@dataclass(frozen=True)
class ExpertShard:
    """Which part of the routed experts a rank loads. ``ep``: whole experts
    ``[rank * E / world, (rank + 1) * E / world)``; ``tp``: every expert, slice ``rank``
    of ``world`` along moe_intermediate_size (w1/w3 rows, w2 columns)."""

    mode: str
    rank: int
    world: int

    def __post_init__(self) -> None:
        if self.mode not in ("ep", "tp"):
            raise ValueError(f"ExpertShard.mode: {self.mode!r} (allowed: 'ep', 'tp')")
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"ExpertShard.world: {self.world!r} (allowed: an int >= 1)")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise ValueError(f"ExpertShard.rank: {self.rank!r} (allowed: 0 <= rank < world = {self.world})")

    def expert_ids(self, num_experts: int, field_name: str = "n_routed_experts") -> tuple[int, ...]:
        """The global ids of the experts this rank holds."""
        if self.mode == "tp":
            return tuple(range(num_experts))
        if num_experts % self.world:
            raise ValueError(
                f"ExpertShard: ep world {self.world} does not divide {field_name} {num_experts} "
                "(allowed: a world size that divides the expert count)"
            )
        per_rank = num_experts // self.world
        return tuple(range(self.rank * per_rank, (self.rank + 1) * per_rank))

    def part(self, length: int) -> slice:
        """This rank's even share of a TP-split axis of ``length`` (``length`` divides
        by ``world``: check_intermediate holds for the logical axis, and its packed and
        scale forms divide with it)."""
        size = length // self.world
        return slice(self.rank * size, (self.rank + 1) * size)

    def check_intermediate(self, intermediate_size: int) -> None:
        """A TP slice of the expert intermediate dim must hold whole FP4 scale groups."""
        if self.mode != "tp":
            return
        if intermediate_size % (self.world * _EXPERT_SCALE_GROUP):
            raise ValueError(
                f"ExpertShard: tp world {self.world} splits moe_intermediate_size {intermediate_size} into slices "
                f"that are not multiples of {_EXPERT_SCALE_GROUP} (allowed: world * {_EXPERT_SCALE_GROUP} "
                f"divides {intermediate_size})"
            )


@dataclass(frozen=True)
class LoadProgress:
    """Where a load stands. ``*_done`` counts the tensors (and their stored bytes) of
    the current shard file dealt with so far: read, memory-mapped, or skipped (another
    rank's experts, the vision tower); ``checkpoint_bytes_*`` spans every shard."""

    shard_file: str
    shard_index: int
    num_shards: int
    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int
    checkpoint_bytes_done: int
    checkpoint_bytes_total: int


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file, from its header; offsets are absolute."""

    file: Path
    stored_name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class _StoredTensor:
    """A declared tensor as read from disk, before post-load decoding."""

    spec: TensorSpec
    values: torch.Tensor
    scale: torch.Tensor | None


class LoadedCheckpoint:
    """A loaded checkpoint. ``tensors`` holds every declared tensor this rank loaded by
    canonical name, decoded and cast, or its FP8 / FP4 weights as stored (``weight_storage``; Engram tables are in ``engram_tables`` instead,
    memory-mapped, by layer id); routed-expert names keep their global expert ids and
    TP-sharded ones hold the rank's slice. ``token_map`` / ``num_compressed`` are the
    Engram compressed-token map of the tokenizer."""

    def __init__(
        self,
        *,
        config: V41Config,
        tokenizer: Tokenizer,
        dtype: torch.dtype,
        weight_storage: str,
        shard: ExpertShard | None,
        stored: dict[str, _StoredTensor],
        engram_tables: dict[int, EngramTable],
        expert_ids: tuple[int, ...],
        dspark_expert_ids: tuple[int, ...],
        has_dspark: bool,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.weight_storage = weight_storage
        self.shard = shard
        self.tensors: dict[str, Weight] = {}
        self.engram_tables = engram_tables
        self.expert_ids = expert_ids
        self.dspark_expert_ids = dspark_expert_ids
        self.has_dspark = has_dspark
        self.token_map: torch.Tensor | None = None
        self.num_compressed: int | None = None
        self.post_load_runs = 0
        self._stored = stored

    def require_dspark(self) -> None:
        """Raises unless the checkpoint holds the DSpark stages (speculative decoding)."""
        if not self.has_dspark:
            raise CheckpointError(
                f"DSpark: this checkpoint has no mtp.* tensors (config declares {self.config.num_nextn_predict_layers} "
                "stages); speculative decoding needs a checkpoint that ships them"
            )

    def post_load(self) -> None:
        """Decodes quantised weights exactly (or, under ``weight_storage="stored"``,
        keeps FP8 and FP4 weights as stored), casts the rest to the compute dtype (FP32
        kinds stay float32; a ``held_fp32`` tensor's compute-dtype values are held in
        float32) and builds the Engram compressed-token map. Runs once: decoding twice
        would re-cast already-cast weights, so a second call is a bug and raises."""
        if self.post_load_runs:
            raise RuntimeError("LoadedCheckpoint.post_load: already ran; post-load processing runs exactly once")
        token_map, num_compressed = build_compressed_token_map(
            self.tokenizer, self.config.vocab_size, pad_token_id=self.config.engram_pad_token_id
        )
        if self.config.engram_layer_ids and num_compressed != self.config.engram_compressed_vocab_size:
            raise ConfigError(
                f"engram_compressed_vocab_size: config says {self.config.engram_compressed_vocab_size}, "
                f"the tokenizer compresses to {num_compressed}"
            )
        self.token_map, self.num_compressed = token_map, num_compressed
        for name, stored in self._stored.items():
            target = torch.float32 if stored.spec.kind is TensorKind.FP32 else self.dtype
            if stored.scale is None:
                values = stored.values.to(target)
                self.tensors[name] = values.float() if stored.spec.held_fp32 else values
            elif self.weight_storage == "stored":
                self.tensors[name] = _resident(stored, self.dtype)
            else:
                self.tensors[name] = dequantize(stored.spec, stored.values, stored.scale).to(target)
        self._stored = {}
        self.post_load_runs += 1


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where a shard file left it at an address a kernel's
    vector loads cannot take (safetensors packs tensors at any byte offset)."""
    return t if t.data_ptr() % _ALIGNMENT == 0 else t.clone()


def _resident(stored: _StoredTensor, dtype: torch.dtype) -> Weight:
    """A quantised weight in the checkpoint's own bytes (scales as raw E8M0 bytes)."""
    scale = _aligned(stored.scale.view(torch.uint8))
    if stored.spec.kind is TensorKind.FP8_WEIGHT:
        return Fp8Weight(_aligned(stored.values.view(torch.float8_e4m3fn)), scale, dtype)
    if stored.spec.kind is TensorKind.FP4_EXPERT:
        return Fp4Weight(_aligned(stored.values.view(torch.uint8)), scale, dtype)
    raise CheckpointError(f"{stored.spec.name}: kind {stored.spec.kind.name} has no resident stored form")


def _check_load_dtype(dtype: torch.dtype, weight_storage: str) -> None:
    if dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"dtype: {dtype} (allowed: {', '.join(str(d) for d in _COMPUTE_DTYPES)})")
    if weight_storage not in WEIGHT_STORAGE:
        raise ValueError(f"weight_storage: {weight_storage!r} (allowed: {', '.join(WEIGHT_STORAGE)})")
    if weight_storage == "stored" and dtype not in STORED_COMPUTE_DTYPES:
        raise ValueError(
            f"dtype: {dtype} with weight_storage 'stored' (allowed: {', '.join(map(str, STORED_COMPUTE_DTYPES))}, "
            "which hold every stored FP8 / FP4 value exactly; or weight_storage 'decoded')"
        )


def load_checkpoint(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    weight_storage: str = "decoded",
    shard: ExpertShard | None = None,
    text_only: bool = False,
    progress: Callable[[LoadProgress], None] | None = None,
) -> LoadedCheckpoint:
    """Loads ``model_dir`` for one rank (``shard``: its part of the routed experts;
    None: all of them), its quantised weights held as ``weight_storage`` says. ``text_only`` ignores a vision tower. ``progress`` is called
    after every tensor. Raises ConfigError / CheckpointError naming what is wrong."""
    root = Path(model_dir)
    config = V41Config.from_pretrained(root, text_only=text_only)
    _check_load_dtype(dtype, weight_storage)
    _check_config_for_loading(config)
    expert_ids, dspark_expert_ids = shard_experts(config, shard)
    tokenizer = read_tokenizer(root, config)
    specs = checkpoint_tensors(config)
    entries = read_headers(root)
    plan = _plan(specs, entries, shard, expert_ids, dspark_expert_ids, text_only)
    stored, engram_tables = _read(plan, specs, progress)
    checkpoint = LoadedCheckpoint(
        config=config,
        tokenizer=tokenizer,
        dtype=dtype,
        weight_storage=weight_storage,
        shard=shard,
        stored=stored,
        engram_tables=engram_tables,
        expert_ids=expert_ids,
        dspark_expert_ids=dspark_expert_ids if plan.has_dspark else (),
        has_dspark=plan.has_dspark,
    )
    checkpoint.post_load()
    return checkpoint


@dataclass(frozen=True)
class TensorPart:
    """The part of a declared tensor a TP rank holds: ``[start, stop)`` of its logical
    (decoded) shape along ``axis``."""

    axis: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.axis not in (0, 1):
            raise ValueError(f"TensorPart.axis: {self.axis!r} (allowed: 0, 1)")
        if not 0 <= self.start < self.stop:
            raise ValueError(f"TensorPart.start/stop: [{self.start}, {self.stop}) (allowed: 0 <= start < stop)")

    def shape_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The part's shape within a tensor of ``shape``."""
        return shape[: self.axis] + (self.stop - self.start,) + shape[self.axis + 1 :]


# Makes one declared tensor's stored form in memory, as a checkpoint would hold it:
# (values, its .scale or None); with a TensorPart, only that part of it.
TensorMaker = Callable[[TensorSpec, TensorPart | None], tuple[torch.Tensor, torch.Tensor | None]]


def load_generated(
    config: V41Config,
    tokenizer: Tokenizer,
    make: TensorMaker,
    *,
    source: str,
    dtype: torch.dtype = torch.float32,
    weight_storage: str = "decoded",
    shard: ExpertShard | None = None,
) -> LoadedCheckpoint:
    """Loads one rank's part of a checkpoint whose stored tensors ``make`` produces in
    memory: nothing is written or read from disk. ``make`` is asked only for what the
    rank holds (its experts; under TP, its slice of each), every answer is checked
    against the declarations as a shard file's header is, and the same post-load pass
    runs once. Every declared tensor is made (DSpark stages where the config has them);
    Engram tables must be made on the host. ``source`` names the maker in errors."""
    _check_load_dtype(dtype, weight_storage)
    _check_config_for_loading(config)
    _check_tokenizer(tokenizer, config, source)
    expert_ids, dspark_expert_ids = shard_experts(config, shard)
    specs = checkpoint_tensors(config)
    stored: dict[str, _StoredTensor] = {}
    engram_tables: dict[int, EngramTable] = {}
    problems: list[str] = []
    for name, spec in specs.items():
        held, axis = rank_part(name, shard, expert_ids, dspark_expert_ids)
        if not held:
            continue
        part = None
        if axis is not None and shard is not None:
            span = shard.part(spec.shape[axis])
            part = TensorPart(axis, span.start, span.stop)
        values, scale = make(spec, part)
        held_spec = spec if part is None else dataclasses.replace(spec, shape=part.shape_of(spec.shape))
        scale_entry = None if scale is None else _made_entry(source, spec.scale_name, scale)
        found = _check_stored(held_spec, _made_entry(source, name, values), scale_entry)
        if spec.kind is TensorKind.ENGRAM_TABLE and values.device.type != "cpu":
            found.append(f"{name}: made on {values.device}, but Engram tables live on the host (allowed: cpu)")
        if found:
            problems.extend(found)
        elif spec.kind is TensorKind.ENGRAM_TABLE:
            engram_tables[_engram_layer(name)] = EngramTable(values, scale)
        else:
            stored[name] = _StoredTensor(spec, values, scale)
    _raise_problems(problems)
    has_dspark = any(spec.group == "mtp" for spec in specs.values())
    checkpoint = LoadedCheckpoint(
        config=config,
        tokenizer=tokenizer,
        dtype=dtype,
        weight_storage=weight_storage,
        shard=shard,
        stored=stored,
        engram_tables=engram_tables,
        expert_ids=expert_ids,
        dspark_expert_ids=dspark_expert_ids if has_dspark else (),
        has_dspark=has_dspark,
    )
    checkpoint.post_load()
    return checkpoint


def _made_entry(source: str, name: str, tensor: torch.Tensor) -> HeaderEntry:
    """A made tensor described as a stored one, so that it is checked exactly as a shard
    file's header entry is (a dtype no checkpoint holds keeps torch's name and fails)."""
    dtype = _SAFETENSORS_DTYPES.get(tensor.dtype, str(tensor.dtype))
    return HeaderEntry(Path(source), name, dtype, tuple(tensor.shape), 0, tensor.numel() * tensor.element_size())


# -- before any shard is opened -------------------------------------------------------


def _check_config_for_loading(config: V41Config) -> None:
    quantization = config.quantization
    if quantization is not None and quantization.expert_dtype not in _SUPPORTED_EXPERT_DTYPES:
        raise ConfigError(
            f"quantization_config.expert_dtype: {quantization.expert_dtype!r} is not supported by this loader "
            f"(allowed: {', '.join(_SUPPORTED_EXPERT_DTYPES)})"
        )
    derived = engram_row_counts(
        config.engram_layer_ids, config.engram_max_ngram_size, config.engram_n_heads, config.engram_vocab_size
    )
    for index, (declared, rows) in enumerate(zip(config.engram_num_embeddings, derived)):
        if declared != rows:
            raise ConfigError(
                f"engram_num_embeddings[{index}] (layer {config.engram_layer_ids[index]}): config says {declared}, "
                f"the primes above engram_vocab_size sum to {rows}"
            )


def shard_experts(config: V41Config, shard: ExpertShard | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The routed experts (the target's, the DSpark stages') a rank of ``shard`` holds
    (``ExpertShard.expert_ids``; every one without a shard)."""
    if shard is None:
        return tuple(range(config.n_routed_experts)), tuple(range(config.dspark_n_routed_experts))
    shard.check_intermediate(config.moe_intermediate_size)
    target = shard.expert_ids(config.n_routed_experts)
    dspark = (
        shard.expert_ids(config.dspark_n_routed_experts, "dspark_n_routed_experts")
        if config.num_nextn_predict_layers
        else ()
    )
    return target, dspark


def read_tokenizer(root: Path, config: V41Config) -> Tokenizer:
    """The checkpoint's tokenizer, checked against its config's special tokens."""
    path = root / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"{TOKENIZER_FILE}: not found in {root} (the checkpoint's tokenizer is required)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises its own untyped errors
        raise CheckpointError(f"{TOKENIZER_FILE}: cannot be read ({exc})") from exc
    _check_tokenizer(tokenizer, config, TOKENIZER_FILE)
    return tokenizer


def _check_tokenizer(tokenizer: Tokenizer, config: V41Config, source: str) -> None:
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > config.vocab_size:
        raise CheckpointError(
            f"{source}: {size} token ids, more than config vocab_size {config.vocab_size} "
            "(allowed: at most vocab_size)"
        )


# -- headers ----------------------------------------------------------------------------


def _shard_files(root: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files in load order, and the index's weight_map (None: single file)."""
    index_path, single_path = root / INDEX_FILE, root / SINGLE_FILE
    if index_path.is_file() and single_path.is_file():
        raise CheckpointError(f"{root}: holds both {INDEX_FILE} and {SINGLE_FILE} (allowed: one of them)")
    if single_path.is_file():
        return [single_path], None
    if not index_path.is_file():
        raise CheckpointError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{INDEX_FILE}: not an index with a weight_map ({exc!r})") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{INDEX_FILE}: weight_map must map tensor names to file names")
    files: list[Path] = []
    for file_name in dict.fromkeys(weight_map.values()):
        if Path(file_name).name != file_name:
            raise CheckpointError(f"{INDEX_FILE}: shard {file_name!r} is not a file name in the checkpoint directory")
        path = root / file_name
        if not path.is_file():
            raise CheckpointError(f"{INDEX_FILE}: shard {file_name} not found in {root}")
        files.append(path)
    return files, weight_map


def read_safetensors_header(path: Path) -> dict[str, HeaderEntry]:
    """The tensors of one safetensors file from its header (8-byte little-endian
    length, then JSON with dtype, shape and data_offsets), validated against the file."""
    file_size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise CheckpointError(f"{path.name}: too short for a safetensors header")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > min(file_size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(f"{path.name}: header length {header_size} does not fit the file ({file_size} bytes)")
        try:
            header = json.loads(handle.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path.name}: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: header is not a JSON object")
    data_start = 8 + header_size
    entries: dict[str, HeaderEntry] = {}
    for name, raw in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = raw["dtype"], tuple(raw["shape"]), raw["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path.name}: {name}: malformed header entry {raw!r}") from exc
        if dtype not in _TORCH_DTYPES:
            raise CheckpointError(f"{path.name}: {name}: dtype {dtype!r} (allowed: {', '.join(_TORCH_DTYPES)})")
        nbytes = math.prod(shape) * _TORCH_DTYPES[dtype].itemsize
        if not 0 <= begin <= end <= file_size - data_start or end - begin != nbytes:
            raise CheckpointError(
                f"{path.name}: {name}: data_offsets [{begin}, {end}] do not hold {dtype} {list(shape)} "
                f"({nbytes} bytes) inside the file"
            )
        entries[name] = HeaderEntry(path, name, dtype, shape, data_start + begin, data_start + end)
    return entries


def read_headers(root: Path) -> dict[str, HeaderEntry]:
    """Every stored tensor by stored name, checked against the index's weight_map."""
    files, weight_map = _shard_files(root)
    entries: dict[str, HeaderEntry] = {}
    holders: dict[str, list[str]] = {}
    for path in files:
        for name, entry in read_safetensors_header(path).items():
            entries[name] = entry
            holders.setdefault(name, []).append(path.name)
    problems: list[str] = []
    for name, files_holding in holders.items():
        if len(files_holding) > 1:
            problems.append(f"{name}: stored in several shards ({', '.join(files_holding)})")
        elif weight_map is not None and weight_map.get(name) != files_holding[0]:
            mapped = weight_map.get(name)
            where = f"maps it to {mapped}" if mapped else "does not list it"
            problems.append(f"{name}: stored in {files_holding[0]}, but {INDEX_FILE} {where}")
    for name, file_name in (weight_map or {}).items():
        if name not in holders:
            problems.append(f"{name}: {INDEX_FILE} maps it to {file_name}, which does not hold it")
    _raise_problems(problems)
    return entries


def _raise_problems(problems: list[str]) -> None:
    if not problems:
        return
    listed = problems[:_MAX_LISTED_PROBLEMS]
    more = len(problems) - len(listed)
    raise CheckpointError(
        f"checkpoint does not match its config ({len(problems)} problem(s)):\n  "
        + "\n  ".join(listed)
        + (f"\n  ... and {more} more" if more else "")
    )


# -- the plan: what to read, checked before any data is read ------------------------------


@dataclass(frozen=True)
class _ReadItem:
    entry: HeaderEntry
    name: str  # canonical name of the declared tensor it belongs to
    is_scale: bool
    # TP slice along this axis of the stored tensor (None: whole tensor).
    slice_axis: int | None


@dataclass(frozen=True)
class _LoadPlan:
    files: tuple[Path, ...]
    items: dict[Path, tuple[_ReadItem, ...]]  # per file, in file order
    skipped: dict[Path, tuple[HeaderEntry, ...]]  # per file: vision, other ranks' experts
    has_dspark: bool
    shard: ExpertShard | None


def tp_split_axis(name: str) -> int | None:
    """The axis of a declared tensor that TP ranks split: a routed expert's
    moe_intermediate_size (w1/w3 are [inter, hidden]: rows; w2 is [hidden, inter]:
    columns); None for every other tensor, which every rank holds whole."""
    expert = routed_expert(name)
    if expert is None:
        return None
    return 1 if expert[1] == "w2" else 0


def rank_part(
    name: str, shard: ExpertShard | None, expert_ids: tuple[int, ...], dspark_expert_ids: tuple[int, ...]
) -> tuple[bool, int | None]:
    """Whether a rank holds a declared tensor, and the axis of the TP slice it holds
    (None: the whole tensor)."""
    expert = routed_expert(name)
    if expert is None:
        return True, None
    if expert[0] not in (dspark_expert_ids if name.startswith("mtp.") else expert_ids):
        return False, None
    return True, tp_split_axis(name) if shard is not None and shard.mode == "tp" else None


def _plan(
    specs: dict[str, TensorSpec],
    entries: dict[str, HeaderEntry],
    shard: ExpertShard | None,
    expert_ids: tuple[int, ...],
    dspark_expert_ids: tuple[int, ...],
    text_only: bool,
) -> _LoadPlan:
    """What each shard file contributes: checks every stored tensor against the
    declarations (raising all problems at once), then lists what this rank reads."""
    matched = _match_declarations(specs, entries, text_only)
    items: dict[Path, list[_ReadItem]] = {}
    skipped: dict[Path, list[HeaderEntry]] = {}
    for entry in matched.ignored:
        skipped.setdefault(entry.file, []).append(entry)
    for is_scale, by_name in ((False, matched.values), (True, matched.scales)):
        for name, entry in by_name.items():
            held, slice_axis = rank_part(name, shard, expert_ids, dspark_expert_ids)
            if not held:
                skipped.setdefault(entry.file, []).append(entry)
                continue
            items.setdefault(entry.file, []).append(_ReadItem(entry, name, is_scale, slice_axis))
    files = tuple(sorted({entry.file for entry in entries.values()}, key=lambda p: p.name))
    return _LoadPlan(
        files=files,
        items={f: tuple(sorted(items.get(f, []), key=lambda item: item.entry.begin)) for f in files},
        skipped={f: tuple(skipped.get(f, [])) for f in files},
        has_dspark=matched.has_dspark,
        shard=shard,
    )


@dataclass(frozen=True)
class _Matched:
    values: dict[str, HeaderEntry]  # canonical name -> stored values (or plain tensor)
    scales: dict[str, HeaderEntry]  # canonical name of the owner -> its .scale
    ignored: tuple[HeaderEntry, ...]  # vision tensors of a text-only load
    has_dspark: bool


def _match_declarations(specs: dict[str, TensorSpec], entries: dict[str, HeaderEntry], text_only: bool) -> _Matched:
    problems: list[str] = []
    values: dict[str, HeaderEntry] = {}
    scales: dict[str, HeaderEntry] = {}
    ignored: list[HeaderEntry] = []
    for stored_name, entry in entries.items():
        name = canonical_name(stored_name)
        if is_vision_tensor(name):
            if text_only:
                ignored.append(entry)
            else:
                problems.append(f"{stored_name}: a vision tensor (allowed only with text_only=True, which ignores it)")
            continue
        if name.endswith(SCALE_SUFFIX):
            owner = name[: -len(SCALE_SUFFIX)] + WEIGHT_SUFFIX
            target, declared = scales, specs.get(owner)
            if declared is not None and not declared.kind.quantizable:
                problems.append(f"{stored_name}: a .scale on {owner}, whose kind {declared.kind.name} takes none")
                continue
        else:
            owner, target, declared = name, values, specs.get(name)
        if declared is None:
            problems.append(f"{stored_name}: unexpected tensor (not declared for this config)")
            continue
        if owner in target:
            problems.append(f"{stored_name}: stored twice (as {target[owner].stored_name} and {stored_name})")
            continue
        target[owner] = entry
    for owner, entry in scales.items():
        if owner not in values:
            problems.append(f"{entry.stored_name}: a .scale without its tensor {owner}")
    # DSpark stages are optional as a whole: any mtp.* tensor makes all of them required.
    has_dspark = any(spec.group == "mtp" and name in values for name, spec in specs.items())
    for name, spec in specs.items():
        if name in values:
            problems.extend(_check_stored(spec, values[name], scales.get(name)))
        elif spec.group == "core" or has_dspark:
            problems.append(f"{name}: missing (expected {spec.kind.name} {list(spec.shape)})")
    _raise_problems(problems)
    return _Matched(values=values, scales=scales, ignored=tuple(ignored), has_dspark=has_dspark)


def _check_stored(spec: TensorSpec, values: HeaderEntry, scale: HeaderEntry | None) -> list[str]:
    """Problems of one declared tensor's stored form (plain, or values + .scale)."""
    name = values.stored_name
    if scale is None:
        if values.dtype not in _PLAIN_DTYPES:
            hint = " (quantised values need their .scale)" if spec.kind.quantizable else ""
            return [f"{name}: dtype {values.dtype}, expected one of {', '.join(_PLAIN_DTYPES)}{hint}"]
        if values.shape != spec.shape:
            return [f"{name}: shape {list(values.shape)}, expected {list(spec.shape)} ({spec.kind.name})"]
        return []
    problems = []
    allowed_values = _QUANTIZED_VALUE_DTYPES[spec.kind]
    if values.dtype not in allowed_values:
        problems.append(
            f"{name}: dtype {values.dtype}, expected {' or '.join(allowed_values)} (quantised {spec.kind.name})"
        )
    if values.shape != spec.quantized_shape:
        problems.append(
            f"{name}: shape {list(values.shape)}, expected {list(spec.quantized_shape)} "
            f"(quantised {spec.kind.name} of {list(spec.shape)})"
        )
    if scale.dtype not in _SCALE_DTYPES:
        problems.append(f"{scale.stored_name}: dtype {scale.dtype}, expected {' or '.join(_SCALE_DTYPES)} (E8M0)")
    if scale.shape != spec.scale_shape:
        problems.append(
            f"{scale.stored_name}: shape {list(scale.shape)}, expected {list(spec.scale_shape)} "
            f"(E8M0 scales of {spec.kind.name} {list(spec.shape)})"
        )
    return problems


# -- reading ----------------------------------------------------------------------------


def _read(
    plan: _LoadPlan, specs: dict[str, TensorSpec], progress: Callable[[LoadProgress], None] | None
) -> tuple[dict[str, _StoredTensor], dict[int, EngramTable]]:
    """Reads (or memory-maps) every planned tensor, one shard file at a time."""
    values: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    checkpoint_total = sum(
        entry.nbytes for f in plan.files for entry in (*(i.entry for i in plan.items[f]), *plan.skipped[f])
    )
    checkpoint_done = 0
    for index, path in enumerate(plan.files):
        started = time.monotonic()
        items, skipped = plan.items[path], plan.skipped[path]
        tensors_total = len(items) + len(skipped)
        bytes_total = sum(item.entry.nbytes for item in items) + sum(entry.nbytes for entry in skipped)
        # Skipped tensors are dealt with by not reading them.
        tensors_done = len(skipped)
        bytes_done = sum(entry.nbytes for entry in skipped)
        checkpoint_done += bytes_done
        mapped = 0

        def report() -> None:
            if progress is not None:
                progress(
                    LoadProgress(
                        shard_file=path.name,
                        shard_index=index,
                        num_shards=len(plan.files),
                        tensors_done=tensors_done,
                        tensors_total=tensors_total,
                        bytes_done=bytes_done,
                        bytes_total=bytes_total,
                        checkpoint_bytes_done=checkpoint_done,
                        checkpoint_bytes_total=checkpoint_total,
                    )
                )

        report()
        with safe_open(str(path), framework="pt") as handle:
            for item in items:
                if specs[item.name].kind is TensorKind.ENGRAM_TABLE:
                    tensor = _memory_map(item.entry)
                    mapped += 1
                else:
                    tensor = _read_tensor(handle, item, plan.shard)
                (scales if item.is_scale else values)[item.name] = tensor
                tensors_done += 1
                bytes_done += item.entry.nbytes
                checkpoint_done += item.entry.nbytes
                report()
        logger.info(
            "loaded shard %d/%d %s: %d tensors (%d memory-mapped, %d skipped), %.1f MiB in %.2f s",
            index + 1,
            len(plan.files),
            path.name,
            tensors_total,
            mapped,
            len(skipped),
            bytes_total / 2**20,
            time.monotonic() - started,
        )
    stored: dict[str, _StoredTensor] = {}
    tables: dict[int, EngramTable] = {}
    for name, tensor in values.items():
        spec = specs[name]
        if spec.kind is TensorKind.ENGRAM_TABLE:
            tables[_engram_layer(name)] = EngramTable(tensor, scales.get(name), file_mapped=True)
        else:
            stored[name] = _StoredTensor(spec, tensor, scales.get(name))
    return stored, tables


def _engram_layer(name: str) -> int:
    """The layer id of an Engram table's name (``layers.N.engram.embed.weight``)."""
    return int(name.split(".")[1])


def _read_tensor(handle: safe_open, item: _ReadItem, shard: ExpertShard | None) -> torch.Tensor:
    """The stored tensor, or the rank's TP slice of it (an even split of the sliced axis:
    the plain, packed and scale forms all divide into whole scale groups)."""
    if item.slice_axis is None or shard is None:
        return handle.get_tensor(item.entry.stored_name)
    part = shard.part(item.entry.shape[item.slice_axis])
    view = handle.get_slice(item.entry.stored_name)
    return view[part] if item.slice_axis == 0 else view[:, part]


def _memory_map(entry: HeaderEntry) -> torch.Tensor:
    """A tensor over a read-only memory map of the entry's bytes: nothing is copied."""
    raw = np.memmap(entry.file, dtype=np.uint8, mode="r", offset=entry.begin, shape=(entry.nbytes,))
    with warnings.catch_warnings():
        # The map is read-only on purpose (a private writable map of a ~100 GB table
        # would count against the commit limit); torch warns that it cannot write it.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        flat = torch.from_numpy(raw)
    return flat.view(_TORCH_DTYPES[entry.dtype]).reshape(entry.shape)
