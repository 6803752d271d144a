"""DSpark over the paged store: the drafter's window rings written from a target
forward, and a batch of draft blocks reading them in place.

Owns the two halves of the drafter a paged runtime runs around its target forward
(the arithmetic is model/dspark.py's): ``write_context``, each computed target row's
stage keys (from the streams entering ``dspark_target_layer_ids``, which the forward
captures) stored into each stage's window ring at the forward's own ring writes, so a
stage ring holds a row wherever the target's rings do and, with the same speculative
slack, a rejected row only loses visibility; and ``draft``, B blocks after target
positions p, each reading its stage rings' rows p-W+1..p by flat row.

Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from typing import Mapping

import torch

from dsv41.model.dspark import DraftOutput, draft, ring_keys, target_features
from dsv41.model.kernels.interface import PagedKernels, PlaneSource
from dsv41.model.kernels.torch_backend import gather_plane_rows
from dsv41.model.linalg import batch_invariant
from dsv41.model.params import DSparkParams, ModelParams


class PagedDrafter:
    """The DSpark drafter of one rank, over its store and kernels."""

    def __init__(self, params: ModelParams, kernels: PagedKernels, batch_invariant: bool = False) -> None:
        if params.dspark is None:
            raise ValueError("PagedDrafter: these params have no DSpark stages (the checkpoint ships no mtp.* tensors)")
        self.params = params
        self.dspark: DSparkParams = params.dspark
        self.kernels = kernels
        self.batch_invariant = batch_invariant
        self.target_layers = params.config.dspark_target_layer_ids
        self.stage_layers = tuple(stage.layer_id for stage in self.dspark.stages)

    @torch.no_grad()
    def write_context(
        self,
        layer_inputs: Mapping[int, torch.Tensor],
        positions: torch.Tensor,
        write_rows: torch.Tensor,
        write_dst: torch.Tensor,
        store: PlaneSource,
    ) -> None:
        """Stores the stage keys of the forward's rows ``write_rows`` (rows of the
        captured streams, at ``positions`` [rows]) into every stage ring at flat ring
        rows ``write_dst``: the target's own ring writes of those rows."""
        if write_rows.numel() == 0:
            return
        missing = [layer for layer in self.target_layers if layer not in layer_inputs]
        if missing:
            raise ValueError(f"layer_inputs: no streams of target layers {missing} (allowed: the forward's capture)")
        eps = self.params.config.rms_norm_eps
        with batch_invariant(self.batch_invariant):
            main_x = target_features([layer_inputs[i][write_rows] for i in self.target_layers], self.dspark, eps)
            keys = ring_keys(main_x, self.params, positions[write_rows])
        for layer, stage_keys in zip(self.stage_layers, keys):
            self.kernels.write_rows(store.window_plane(layer), write_dst, stage_keys)

    @torch.no_grad()
    def draft(
        self,
        anchors: torch.Tensor,
        last_target: torch.Tensor,
        ring_rows: torch.Tensor,
        ring_valid: torch.Tensor,
        store: PlaneSource,
    ) -> DraftOutput:
        """B greedy blocks: ``anchors`` [B] the tokens the target emitted at p+1,
        ``last_target`` [B] the positions p, ``ring_rows`` [B, W] the flat ring rows of
        positions p-W+1..p and ``ring_valid`` [B, W] which of them hold a row."""
        blocks, window = ring_rows.shape
        flat = ring_rows.clamp_min(0).flatten()
        ring = [
            gather_plane_rows(store.window_plane(layer), flat).view(blocks, window, -1) for layer in self.stage_layers
        ]
        with batch_invariant(self.batch_invariant):
            return draft(self.params, anchors, last_target, ring, ring_valid)
