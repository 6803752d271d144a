"""The torch backend of the paged kernels: gather rows, then the model's own arithmetic.

Owns the reference implementation of ``PagedKernels``: it decodes the gathered plane
rows with model/formats.py and calls model/attention.sparse_attention and
model/indexer.index_scores, so its results are the dense reference's by construction;
its routed expert slots are model/moe.routed_expert_slots over the params' own expert weights
(an FP4 checkpoint's experts decoded at load time, whatever the bank's weight format);
its ratio-2 pooling is model/compressor.pool_pairs and its row stores are
model/formats.py's quantisers, so they define the bytes every backend stores; its mHC
site steps are model/mhc.TorchHc's, its projections' epilogues
model/epilogue.TorchEpilogue's, its MoE steps around the routed experts
model/moe.TorchMoe's and its Engram rows model/engram.HostEngram's (the host lookup).
Runs anywhere. Must not import: cache, cluster, actors, deploy, ray, triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from dsv41.model.attention import sparse_attention
from dsv41.model.compressor import pool_pairs
from dsv41.model.engram import HostEngram
from dsv41.model.epilogue import TorchEpilogue
from dsv41.model.formats import (
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
    round_fp8,
    round_mxfp4,
    round_nvfp4,
)
from dsv41.model.indexer import index_scores
from dsv41.model.kernels.interface import EXPERT_WEIGHT_FORMATS, ExpertBank, PairAddresses, PlaneView, check_row_write
from dsv41.model.mhc import TorchHc
from dsv41.model.moe import ExpertWeights, Routing, TorchMoe, routed_expert_slots


QUANTIZERS = {"fp8": quantize_fp8, "nvfp4": quantize_nvfp4, "mxfp4": quantize_mxfp4}
ROUNDINGS = {"fp8": round_fp8, "nvfp4": round_nvfp4, "mxfp4": round_mxfp4}


def plane_units_rows(plane: PlaneView, flat_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unit, row) indices of flat rows: unit r // rows, row r % rows."""
    rows = plane.values.shape[1]
    return torch.div(flat_rows, rows, rounding_mode="floor"), flat_rows.remainder(rows)


def gather_plane_rows(plane: PlaneView, flat_rows: torch.Tensor) -> torch.Tensor:
    """Decoded rows [N, width] (fp32, or bf16 rows as stored) of a plane by flat row."""
    unit, row = plane_units_rows(plane, flat_rows)
    values = plane.values[unit, row]
    if plane.fmt == "bf16":
        return values
    scales = plane.scales[unit, row]
    decode = {"fp8": dequantize_fp8, "nvfp4": dequantize_nvfp4, "mxfp4": dequantize_mxfp4}[plane.fmt]
    return decode(values, scales)


@dataclass(frozen=True)
class TorchExpertBank:
    """The torch backend's bank: the held experts themselves, by global id."""

    experts: Mapping[int, ExpertWeights]

    @property
    def expert_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.experts))


class TorchKernels(TorchHc, TorchEpilogue, TorchMoe, HostEngram):
    name = "torch"

    def attend(
        self,
        q: torch.Tensor,
        chunk_kv: torch.Tensor,
        chunk_rows: torch.Tensor,
        ring_rows: torch.Tensor,
        window_valid: torch.Tensor,
        ring: PlaneView,
        entry_rows: torch.Tensor | None,
        main: PlaneView | None,
        sink: torch.Tensor,
        softmax_scale: float,
    ) -> torch.Tensor:
        dim = q.shape[-1]
        ring_keys = gather_plane_rows(ring, ring_rows.clamp_min(0).flatten()).view(*ring_rows.shape, dim)
        keys = torch.where(
            (chunk_rows >= 0).unsqueeze(-1), chunk_kv[chunk_rows.clamp_min(0)], ring_keys.to(chunk_kv.dtype)
        )
        valid = window_valid
        if entry_rows is not None and main is not None:
            comp = gather_plane_rows(main, entry_rows.clamp_min(0).flatten()).view(*entry_rows.shape, dim)
            keys = torch.cat((keys, comp.to(chunk_kv.dtype)), dim=1)
            valid = torch.cat((valid, entry_rows >= 0), dim=1)
        return sparse_attention(q, keys, valid, sink, softmax_scale)

    def score(
        self,
        q: torch.Tensor,
        head_weights: torch.Tensor,
        tile_rows: torch.Tensor,
        row_segments: torch.Tensor,
        index: PlaneView,
    ) -> torch.Tensor:
        # Each segment's tile is read once and shared by its rows.
        keys = gather_plane_rows(index, tile_rows.clamp_min(0).flatten())
        keys = keys.view(*tile_rows.shape, q.shape[-1])[row_segments]
        scores = index_scores(q, head_weights, keys)
        return scores.masked_fill(tile_rows[row_segments] < 0, float("-inf"))

    def expert_bank(self, experts: Mapping[int, ExpertWeights], weight_format: str) -> TorchExpertBank:
        if weight_format not in EXPERT_WEIGHT_FORMATS:
            raise ValueError(f"weight_format: {weight_format!r} (allowed: {', '.join(EXPERT_WEIGHT_FORMATS)})")
        return TorchExpertBank(experts)

    def routed_expert_slots(self, x: torch.Tensor, routing: Routing, bank: ExpertBank, limit: float) -> torch.Tensor:
        if not isinstance(bank, TorchExpertBank):
            raise TypeError(f"bank: {type(bank).__name__} (allowed: a TorchExpertBank from TorchKernels.expert_bank)")
        return routed_expert_slots(x, routing, bank.experts, limit)

    # -- ratio-2 compression and the quantised stores ------------------------------------

    def pool_ratio2(
        self, v: torch.Tensor, g: torch.Tensor, pairs: PairAddresses, tails: torch.Tensor
    ) -> torch.Tensor:
        first, second = pairs.first_rows, pairs.second_rows
        pending = tails[pairs.first_tail_slots.clamp_min(0)]  # [G, 2, D]
        from_rows = (first >= 0).unsqueeze(1)
        first_v = torch.where(from_rows, v[first.clamp_min(0)], pending[:, 0])
        first_g = torch.where(from_rows, g[first.clamp_min(0)], pending[:, 1])
        second_v, second_g = v[second.clamp_min(0)], g[second.clamp_min(0)]
        pooled = pool_pairs(torch.stack((first_v, second_v), dim=1), torch.stack((first_g, second_g), dim=1))
        pooled = pooled.masked_fill((second < 0).unsqueeze(1), 0.0)
        keep = pairs.tail_write_slots >= 0
        slots, rows = pairs.tail_write_slots[keep], pairs.tail_write_rows[keep]
        tails[slots, 0] = v[rows].float()
        tails[slots, 1] = g[rows].float()
        return pooled

    def write_rows(
        self, plane: PlaneView, flat_rows: torch.Tensor, values: torch.Tensor, round_to: str | None = None
    ) -> None:
        check_row_write(plane, flat_rows, values, round_to)
        keep = flat_rows >= 0
        unit, row = plane_units_rows(plane, flat_rows[keep])
        values = values[keep]
        if plane.fmt == "bf16":
            rounded = ROUNDINGS[round_to](values.float()) if round_to is not None else values
            plane.values[unit, row] = rounded.to(plane.values.dtype)
            return
        packed, scales = QUANTIZERS[plane.fmt](values)
        plane.values[unit, row] = packed
        plane.scales[unit, row] = scales
