"""The torch backend of the paged kernels: gather rows, then the model's own arithmetic.

Owns the reference implementation of ``PagedKernels``: it decodes the gathered plane
rows with model/formats.py and calls model/attention.sparse_attention and
model/indexer.index_scores, so its results are the dense reference's by construction.
Runs anywhere. Must not import: cache, cluster, actors, deploy, ray, triton.
"""

from __future__ import annotations

import torch

from model.attention import sparse_attention
from model.formats import dequantize_fp8, dequantize_mxfp4, dequantize_nvfp4
from model.indexer import index_scores
from model.kernels.interface import PlaneView


def gather_plane_rows(plane: PlaneView, flat_rows: torch.Tensor) -> torch.Tensor:
    """Decoded rows [N, width] (fp32, or bf16 rows as stored) of a plane by flat row."""
    rows = plane.values.shape[1]
    unit, row = torch.div(flat_rows, rows, rounding_mode="floor"), flat_rows.remainder(rows)
    values = plane.values[unit, row]
    if plane.fmt == "bf16":
        return values
    scales = plane.scales[unit, row]
    decode = {"fp8": dequantize_fp8, "nvfp4": dequantize_nvfp4, "mxfp4": dequantize_mxfp4}[plane.fmt]
    return decode(values, scales)


class TorchKernels:
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
