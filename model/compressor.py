"""The CSA2 compressor of Full layers: compressed KV entries and their index keys.

Owns the ratio-2 softmax pooling of token pairs (fp32, no overlap; a trailing odd
token's projections are the "compressor tail" a paged runtime keeps), the ratio-1
per-token entries, the NVFP4 rounding of compressed KV, and the owner's MXFP4 index
keys computed from the latent before RoPE (MODEL_FACTS section 4).
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.model.epilogue import TORCH_EPILOGUE, Epilogue, EpilogueKernels
from dsv41.model.formats import round_nvfp4
from dsv41.model.linalg import linear, small_sum
from dsv41.model.rope import Rope


@dataclass(frozen=True)
class CompressorWeights:
    wkv: torch.Tensor  # [head_dim, hidden] fp32
    wgate: torch.Tensor | None  # [head_dim, hidden] fp32, ratio 2 only
    norm: torch.Tensor  # [head_dim]
    index_wk: torch.Tensor  # [index_head_dim, head_dim]
    index_k_norm: torch.Tensor  # [index_head_dim]


@dataclass(frozen=True)
class CompressedEntries:
    # [G, head_dim] fp32 rope(norm(pooled)) before NVFP4. Storage packs this, not the
    # rounded rows: re-packing an NVFP4-rounded block whose E4M3 scale is subnormal
    # can pick another scale and lose values.
    kv_unrounded: torch.Tensor
    index_keys: torch.Tensor  # [G, index_head_dim] MXFP4-rounded, compute dtype
    dtype: torch.dtype

    @property
    def kv(self) -> torch.Tensor:
        """[G, head_dim] NVFP4-rounded compressed KV in the compute dtype."""
        return round_nvfp4(self.kv_unrounded).to(self.dtype)


def ratio2_projections(x: torch.Tensor, w: CompressorWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(v, g) = (wkv(x), wgate(x)) in fp32 per token: what pooling consumes and what a
    pending odd token leaves behind as the compressor tail."""
    if w.wgate is None:
        raise ValueError("ratio2_projections: this compressor has no wgate (ratio 1)")
    xf = x.float()
    return linear(xf, w.wkv.float()), linear(xf, w.wgate.float())


def pool_pairs(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """v, g [G, 2, D] fp32 -> sum over the pair of v * softmax(g) per channel [G, D]."""
    return small_sum(v * torch.softmax(g, dim=1), 1).squeeze(1)


def ratio1_latent(x: torch.Tensor, w: CompressorWeights) -> torch.Tensor:
    """Ratio 1: the fp32 ``wkv`` weight is cast to the activation dtype."""
    return linear(x, w.wkv.to(x.dtype))


def finish_entries(
    pooled: torch.Tensor,
    w: CompressorWeights,
    eps: float,
    rope: Rope,
    entry_positions: torch.Tensor,
    dtype: torch.dtype,
    kernels: EpilogueKernels = TORCH_EPILOGUE,
) -> CompressedEntries:
    """norm -> (NVFP4(rope(latent)) as KV, MXFP4(rope(k_norm(wk(latent)))) as index keys).

    ``entry_positions`` are the RoPE positions: a group's first token (2j at ratio 2, j
    at ratio 1). The fp32 latent is normed twice, into ``dtype`` for the index keys'
    projection and through the rope into the KV: the same bits both times."""
    latent = kernels.epilogue(pooled, Epilogue(dtype, norm=w.norm, eps=eps))
    key_spec = Epilogue(dtype, norm=w.index_k_norm, eps=eps, rope=rope, round_to="mxfp4")
    index_keys = kernels.epilogue(linear(latent, w.index_wk), key_spec, entry_positions)
    kv_spec = Epilogue(torch.float32, norm=w.norm, eps=eps, rope=rope)
    return CompressedEntries(
        kv_unrounded=kernels.epilogue(pooled, kv_spec, entry_positions), index_keys=index_keys, dtype=dtype
    )
