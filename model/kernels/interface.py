"""The kernel interface of the paged hot paths, and the plane handles kernels read.

Owns two contracts: ``PlaneView`` (one stored plane as the storage layer exposes it,
read in place by kernels) and ``PagedKernels`` (sparse attention over window rows plus
selected compressed rows, and the index scorer over a request's tile of entry rows).
It also owns ``ExpertBank``, a layer's held routed experts arranged once for one
backend's grouped expert GEMMs (``PagedKernels.expert_bank`` / ``routed_expert_slots``).
And the writes of the compression path: ``PairAddresses`` (which rows pair up into
ratio-2 entries, which pair starts on a STATE tail) for ``PagedKernels.pool_ratio2``,
and ``PagedKernels.write_rows``, which stores rows into a plane in its format, with
``check_row_write``, the one statement of what such a write accepts.
``PagedKernels`` is also model/mhc.HcKernels: a site's mHC mix, collapse + RMSNorm
and expand; model/epilogue.EpilogueKernels: a projection's RMSNorm, RoPE and fake
quantisation; model/moe.MoeKernels: the router, the shared expert and the MoE
layer's output; and model/engram.EngramKernels: an Engram table's rows, read on the
host or on the forward's device.
Every backend computes the same function; the torch backend is the reference.
Must not import: cache, cluster, actors, deploy, ray, triton.
"""

from __future__ import annotations

from typing import Mapping, Protocol

import torch

from dsv41.model.engram import EngramKernels
from dsv41.model.epilogue import EpilogueKernels
from dsv41.model.formats import FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK
from dsv41.model.mhc import HcKernels
from dsv41.model.moe import ExpertWeights, MoeKernels, Routing

PLANE_FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
# The quantised grids a write can round to, and the channels one scale covers in each.
SCALE_GROUPS = {"fp8": FP8_BLOCK, "nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}


class PlaneView(Protocol):
    """A plane in place: ``values`` [units, rows, width] (bf16 rows, or bytes: E4M3, or
    two E2M1 codes per byte), ``scales`` [units, rows, groups] bytes (E8M0 for fp8 and
    mxfp4, E4M3 for nvfp4) or None for bf16. A flat row r is unit r // rows, row r % rows."""

    values: torch.Tensor
    scales: torch.Tensor | None
    fmt: str


class PlaneSource(Protocol):
    """Where the kernels find the planes of one rank's pools."""

    def window_plane(self, layer: int) -> PlaneView: ...
    def main_plane(self, owner: int) -> PlaneView: ...
    def index_plane(self, owner: int) -> PlaneView: ...


# How a bank holds expert weights: "plain" as the params hold them (the compute dtype),
# "mxfp4" as E2M1 pairs with an E8M0 scale per 32 input values (an FP4 checkpoint's own
# form; the params hold it decoded, exactly).
EXPERT_WEIGHT_FORMATS = ("plain", "mxfp4")


class ExpertBank(Protocol):
    """The routed experts one rank holds for one layer, in the form one backend's
    expert GEMMs read; made once per layer by that backend's ``expert_bank``.
    ``expert_ids``: their global ids, ascending."""

    expert_ids: tuple[int, ...]


class PairAddresses(Protocol):
    """The ratio-2 groups a step completes and the tokens it leaves pending
    (cache/addressing.CompressionPlan fits it). Rows index the step's v / g rows."""

    first_rows: torch.Tensor  # [G] row of a group's first token, or NO_ROW: it is its slot's tail
    first_tail_slots: torch.Tensor  # [G] STATE slot whose tail holds the first token where first_rows is NO_ROW
    second_rows: torch.Tensor  # [G] row of the group's second token, or NO_ROW for a padding group
    tail_write_rows: torch.Tensor  # [N] rows whose token stays pending
    tail_write_slots: torch.Tensor  # [N] the slots whose tail they become, or NO_ROW (skipped)


def check_row_write(plane: PlaneView, flat_rows: torch.Tensor, values: torch.Tensor, round_to: str | None) -> None:
    """Raises ValueError, naming the argument, unless ``write_rows(plane, flat_rows,
    values, round_to)`` is a write every backend stores the same way."""
    if plane.fmt not in PLANE_FORMATS:
        raise ValueError(f"plane.fmt: {plane.fmt!r} (allowed: {', '.join(PLANE_FORMATS)})")
    if round_to is not None and round_to not in SCALE_GROUPS:
        raise ValueError(f"round_to: {round_to!r} (allowed: None, {', '.join(SCALE_GROUPS)})")
    if round_to is not None and plane.fmt not in ("bf16", round_to):
        raise ValueError(
            f"round_to: {round_to!r} on a {plane.fmt} plane (allowed: None or {plane.fmt!r}: "
            "a quantised plane's rounding is its own format)"
        )
    if flat_rows.dim() != 1 or values.dim() != 2 or values.shape[0] != flat_rows.shape[0]:
        raise ValueError(
            f"values: {tuple(values.shape)} for flat_rows {tuple(flat_rows.shape)} (allowed: [N, width] for [N])"
        )
    width = values.shape[1]
    grid = round_to or plane.fmt
    if grid in SCALE_GROUPS and width % SCALE_GROUPS[grid]:
        raise ValueError(f"values: width {width} is not a multiple of {grid}'s scale group {SCALE_GROUPS[grid]}")
    stored = width // 2 if plane.fmt in ("nvfp4", "mxfp4") else width
    if plane.values.shape[-1] != stored:
        raise ValueError(
            f"values: width {width} does not fit a {plane.fmt} plane of {plane.values.shape[-1]} stored columns"
        )
    if plane.fmt != "bf16":
        groups = width // SCALE_GROUPS[plane.fmt]
        if plane.scales is None or plane.scales.shape[-1] != groups:
            raise ValueError(f"plane.scales: a {plane.fmt} plane of width {width} needs {groups} scales a row")


class PagedKernels(HcKernels, EpilogueKernels, MoeKernels, EngramKernels, Protocol):
    name: str

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
        """Sparse attention of q [R, H, D] over each row's window keys — this step's
        ``chunk_kv`` rows (``chunk_rows`` [R, W]) or flat ``ring_rows`` of the ring
        plane, ``window_valid`` [R, W] — plus the flat ``entry_rows`` [R, K] of the main
        plane (NO_ROW = -1 for an empty slot). fp32 softmax with a zero-value sink key.
        Returns [R, H, D] in q's dtype."""
        ...

    def score(
        self,
        q: torch.Tensor,
        head_weights: torch.Tensor,
        tile_rows: torch.Tensor,
        row_segments: torch.Tensor,
        index: PlaneView,
    ) -> torch.Tensor:
        """Index scores [R, C] = sum_h w_h ReLU(q_h . k_c) of each row (q [R, Hi, Di] and
        head weights [R, Hi] fp32) against its segment's tile of flat entry rows
        (``tile_rows`` [S, C], ``row_segments`` [R]); -inf where the tile has NO_ROW."""
        ...

    def expert_bank(self, experts: Mapping[int, ExpertWeights], weight_format: str) -> ExpertBank:
        """Arranges the held ``experts`` (by global id) for ``routed_expert_slots``, once per
        layer: a backend may keep references to the weights or make packed copies.
        ``weight_format`` is one of EXPERT_WEIGHT_FORMATS; "mxfp4" declares that the
        weights hold MXFP4 values exactly (decoded from FP4), and a backend that packs
        them refuses weights that do not."""
        ...

    def routed_expert_slots(self, x: torch.Tensor, routing: Routing, bank: ExpertBank, limit: float) -> torch.Tensor:
        """model/moe.routed_expert_slots: each (row, slot)'s routed contribution
        w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit) * weight) from the
        bank's experts, [T, k, hidden] fp32 — zero where the slot's expert is not held
        (EP), a partial over the held intermediate slice under TP. Each (row, slot) is
        computed alone: its value does not depend on the other rows of the call."""
        ...

    # -- ratio-2 compression and the quantised stores ------------------------------------

    def pool_ratio2(
        self, v: torch.Tensor, g: torch.Tensor, pairs: PairAddresses, tails: torch.Tensor
    ) -> torch.Tensor:
        """model/compressor.pool_pairs of every group ``pairs`` completes: [G, D] fp32,
        per channel the sum over the pair of v * softmax(g). A group's second token,
        and its first unless that is NO_ROW, are rows of this step's ``v`` / ``g`` [R, D]
        fp32; a NO_ROW first token is its slot's pending tail in ``tails`` [slots, 2, D]
        fp32 (v at 0, g at 1; the STATE plane, in place). After every read, the rows
        ``pairs`` leaves pending are stored into their slots' tails. A padding group's
        row is zero."""
        ...

    def write_rows(
        self, plane: PlaneView, flat_rows: torch.Tensor, values: torch.Tensor, round_to: str | None = None
    ) -> None:
        """Stores ``values`` [N, D] (fp32 or bf16, finite) at ``flat_rows`` [N] of
        ``plane`` in place, bit for bit as model/formats.py gives them: a bf16 plane
        holds the values, first rounded to ``round_to``'s grid when one is named, as
        bf16; an fp8 / nvfp4 / mxfp4 plane holds quantize_<fmt>(values) (``round_to``,
        if named, is that format: the quantisation is the rounding). NO_ROW rows are
        skipped. check_row_write states what is accepted."""
        ...
