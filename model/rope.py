"""Rotary position embedding of DeepSeek-V4.1, with YaRN on the compressed layers.

Owns the per-layer-kind frequencies (rope_theta without YaRN on window layers,
compress_rope_theta with YaRN on every layer of ratio > 0) and the adjacent-pair
rotation of the *last* ``rope_dim`` channels of a head, forward and inverse (the
attention output is rotated back at the query position). Must not import: cache,
cluster, actors, deploy, ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv41.model.config import RopeScaling
from dsv41.model.linalg import pointwise


def rope_inv_freq(rope_dim: int, theta: float, yarn: RopeScaling | None) -> torch.Tensor:
    """float64 inverse frequencies [rope_dim / 2]; YaRN changes frequencies only."""
    i = torch.arange(0, rope_dim, 2, dtype=torch.float64)
    freq = theta ** (-i / rope_dim)
    if yarn is None:
        return freq
    d, orig = rope_dim, yarn.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return freq / yarn.factor * ramp + freq * (1 - ramp)


@dataclass(frozen=True)
class Rope:
    """The rotation of one layer kind: ``rope_dim`` trailing channels at ``inv_freq``."""

    rope_dim: int
    inv_freq: torch.Tensor  # float64 [rope_dim / 2]

    @classmethod
    def build(cls, rope_dim: int, theta: float, yarn: RopeScaling | None) -> "Rope":
        return cls(rope_dim, rope_inv_freq(rope_dim, theta, yarn))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq.to(positions.device)
        return pointwise(torch.cos, angles).float(), pointwise(torch.sin, angles).float()

    def apply(self, x: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """Rotates pairs (2i, 2i+1) of the last rope_dim channels of ``x`` [T, ..., D]
        by position * inv_freq[i] (the conjugate rotation when ``inverse``)."""
        cos, sin = self.cos_sin(positions)
        if inverse:
            sin = -sin
        extra = x.dim() - positions.dim() - 1
        shape = cos.shape[:-1] + (1,) * extra + cos.shape[-1:]
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        head, tail = x[..., : -self.rope_dim], x[..., -self.rope_dim :].float()
        even, odd = tail[..., 0::2], tail[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        return torch.cat((head, rotated.to(x.dtype)), dim=-1)
