"""Where a replica's model comes from: a checkpoint directory or a generated slice.

Owns :class:`ModelSource`, the one value every loader of a model takes (the in-process
engine, each DP rank, the scheduler that only needs the config and tokenizer): a
checkpoint directory in the official format, or ``generated:<slice>[,experts=bf16|fp4]
[,dense=bf16|fp8][,seed=N]``, one of model/reference_slice.py's slices with random weights made on the
rank's device (so a rank holding a Flash-width expert shard never reads or writes a
checkpoint). Both resolve to the same ``ModelParams``/tokenizer/config, and a source
round-trips through its string, which is how it crosses to Ray actors.

Must not import: ``cache``, ``cluster``, ``actors``, ``deploy``, ``ray``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer

from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.loader import ExpertShard, LoadProgress, read_tokenizer
from dsv41.model.params import ModelParams, load_model_params
from dsv41.model.reference_slice import DENSE_FORMATS, EXPERT_FORMATS, REFERENCE_SLICE, SMALL_SLICE, SliceModel, SliceSpec, load_slice

GENERATED_PREFIX = "generated:"
SLICES: dict[str, SliceSpec] = {spec.name: spec for spec in (REFERENCE_SLICE, SMALL_SLICE)}


@functools.lru_cache(maxsize=None)
def _slice_model(slice_name: str, expert_format: str) -> SliceModel:
    """A slice's config and tokenizer, built once per process: building them derives
    the Engram compressed-token map over the whole vocabulary (~1.5 s at Flash's), and
    an engine, its ranks and its scheduler each ask for them."""
    base = V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True)
    return SliceModel.build(SLICES[slice_name], base, expert_format=expert_format)


class ModelSourceError(ValueError):
    """A model source string that names nothing loadable; the message says why."""


@dataclass(frozen=True)
class ModelSource:
    """A checkpoint directory (``checkpoint_dir``) or a generated slice
    (``slice_name``, its routed experts' ``expert_format``, its FP8_WEIGHT kinds'
    ``dense_format`` and weight ``seed``)."""

    checkpoint_dir: Path | None = None
    slice_name: str | None = None
    expert_format: str = "bf16"
    seed: int = 0
    dense_format: str = "bf16"

    def __post_init__(self) -> None:
        if (self.checkpoint_dir is None) == (self.slice_name is None):
            raise ModelSourceError("ModelSource: give exactly one of checkpoint_dir and slice_name")
        if self.slice_name is not None and self.slice_name not in SLICES:
            raise ModelSourceError(f"ModelSource.slice_name: {self.slice_name!r} (allowed: {', '.join(SLICES)})")
        if self.expert_format not in EXPERT_FORMATS:
            raise ModelSourceError(
                f"ModelSource.expert_format: {self.expert_format!r} (allowed: {', '.join(EXPERT_FORMATS)})"
            )
        if self.dense_format not in DENSE_FORMATS:
            raise ModelSourceError(
                f"ModelSource.dense_format: {self.dense_format!r} (allowed: {', '.join(DENSE_FORMATS)})"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ModelSourceError(f"ModelSource.seed: {self.seed!r} (allowed: an int >= 0)")

    @classmethod
    def parse(cls, source: "str | Path | ModelSource") -> "ModelSource":
        """A directory path, or ``generated:<slice>[,experts=bf16|fp4][,dense=bf16|fp8][,seed=N]``."""
        if isinstance(source, ModelSource):
            return source
        text = str(source)
        if not text.startswith(GENERATED_PREFIX):
            return cls(checkpoint_dir=Path(text))
        name, *settings = text[len(GENERATED_PREFIX) :].split(",")
        values: dict[str, str] = {}
        for setting in settings:
            key, sep, value = setting.partition("=")
            if not sep or key not in ("experts", "dense", "seed") or key in values:
                raise ModelSourceError(
                    f"model source {text!r}: {setting!r} (allowed: experts=bf16|fp4, dense=bf16|fp8, seed=N, each once)"
                )
            values[key] = value
        seed = values.get("seed", "0")
        if not seed.isdigit():
            raise ModelSourceError(f"model source {text!r}: seed={seed!r} (allowed: an int >= 0)")
        return cls(
            slice_name=name,
            expert_format=values.get("experts", "bf16"),
            dense_format=values.get("dense", "bf16"),
            seed=int(seed),
        )

    def __str__(self) -> str:
        if self.checkpoint_dir is not None:
            return str(self.checkpoint_dir)
        dense = "" if self.dense_format == "bf16" else f",dense={self.dense_format}"
        return f"{GENERATED_PREFIX}{self.slice_name},experts={self.expert_format}{dense},seed={self.seed}"

    def _slice(self) -> SliceModel:
        assert self.slice_name is not None
        return _slice_model(self.slice_name, self.expert_format)

    def config(self) -> V41Config:
        """The model's text config (a vision tower is ignored)."""
        if self.checkpoint_dir is None:
            return self._slice().config
        return V41Config.from_pretrained(self.checkpoint_dir, text_only=True)

    def tokenizer(self) -> Tokenizer:
        if self.checkpoint_dir is None:
            return self._slice().tokenizer
        return read_tokenizer(self.checkpoint_dir, self.config())

    def load_params(
        self,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        weight_storage: str = "decoded",
        shard: ExpertShard | None = None,
        progress: Callable[[LoadProgress], None] | None = None,
    ) -> tuple[ModelParams, Tokenizer]:
        """One rank's weights (``shard``: its experts; None: all) on ``device``, and the
        tokenizer. A checkpoint is read to the host (``progress`` after each tensor)
        and moved; a slice is made on ``device`` directly (its Engram tables on the
        host either way)."""
        if self.checkpoint_dir is None:
            checkpoint = load_slice(
                self._slice(),
                seed=self.seed,
                dtype=dtype,
                device=device,
                weight_storage=weight_storage,
                dense_format=self.dense_format,
                shard=shard,
            )
            return ModelParams.from_checkpoint(checkpoint), checkpoint.tokenizer
        params, checkpoint = load_model_params(
            self.checkpoint_dir,
            dtype=dtype,
            weight_storage=weight_storage,
            shard=shard,
            text_only=True,
            progress=progress,
        )
        return params.to(device), checkpoint.tokenizer
