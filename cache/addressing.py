"""Per-row addresses of one step's flat token batch in the PAGE/STATE pools.

Owns the translation of a step's segments (one per request: its STATE slot, the
positions it computes) and their page tables (a row of PAGE ids per segment, gathered
from the rank's cache/block_table.py) into index tensors the paged runtime reads and
writes through: window keys (this step's rows or the slot's ring), ring writes after
attention, compression plans (which ratio-2 pairs or ratio-1 rows complete an entry in
this step, where a pair's first member is a STATE tail, which PAGE row each entry
lands in, which entries are already cached and not rewritten), tail writes, and the
tiles of entry rows each request's index scorer reads; and under decoder SWA bounded
replay the decoder's rows and their own addresses (``build_decoder_addresses``).
Everything is plain integers: no model arithmetic and no pool access.

Must not import: model (other than model.formats), cluster, actors, deploy, ray.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from dsv41.cache.geometry import V41PoolGeometry

NO_ROW = -1  # an address slot that holds nothing (padding, or a key outside the window)


@dataclass(frozen=True)
class SegmentSpec:
    """One request's rows in a step.

    The step computes positions [start, start + length) of the request; its row of
    the step's page tables covers every position up to start + length. Compressed
    entries whose group ends at or below ``write_from`` are already in the prefix
    cache and are read, not written. ``window_start`` is the first position any
    window may read (a replay's first row: a fresh slot's ring holds nothing below
    it). ``tentative``: how many of the last rows are speculative drafts (a verify):
    the segment then leaves no row pending in its committed compressor tail, and
    stages every row that may become pending (``staged_tail_row``)."""

    slot: int
    start: int
    length: int
    write_from: int = 0
    window_start: int = 0
    tentative: int = 0

    def __post_init__(self) -> None:
        if self.length < 0:
            raise ValueError(f"SegmentSpec.length: {self.length} (allowed: >= 0)")
        if self.start < 0 or self.window_start < 0 or self.write_from < 0:
            raise ValueError("SegmentSpec.start/window_start/write_from: must be >= 0")
        if self.window_start > self.start:
            raise ValueError(
                f"SegmentSpec.window_start: {self.window_start} is past start {self.start} "
                "(a window cannot begin after the rows the step computes)"
            )
        if not 0 <= self.tentative < max(self.length, 1):
            raise ValueError(
                f"SegmentSpec.tentative: {self.tentative} (allowed: 0..length - 1 = {self.length - 1}; "
                "a verify's first row is the committed anchor)"
            )

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class PoolShape:
    """The few geometry numbers addressing needs."""

    block_size: int
    window: int
    ring_rows: int  # window + speculative slack
    ratios: tuple[int, ...]  # the distinct ratios of the Full owners

    def __post_init__(self) -> None:
        if self.ring_rows < self.window:
            raise ValueError(f"PoolShape.ring_rows: {self.ring_rows} < window {self.window}")
        for r in self.ratios:
            if r not in (1, 2) or self.block_size % r:
                raise ValueError(f"PoolShape.ratios: {r} (allowed: 1 or 2, dividing block_size {self.block_size})")

    @classmethod
    def of(cls, geometry: V41PoolGeometry, window: int) -> "PoolShape":
        """The shape of ``geometry``'s pools for a model whose sliding window is ``window``."""
        return cls(
            block_size=geometry.block_size,
            window=window,
            ring_rows=geometry.ring_rows,
            ratios=tuple(sorted(set(geometry.owner_ratios))),
        )

    def entries_per_page(self, ratio: int) -> int:
        return self.block_size // ratio


@dataclass(frozen=True)
class WindowPlan:
    """Window keys of every row: W sources each, oldest first, and the ring writes."""

    chunk_rows: torch.Tensor  # [R, W] this step's row holding the key, or NO_ROW
    ring_rows: torch.Tensor  # [R, W] flat ring row (slot * ring_rows + pos % ring_rows), or NO_ROW
    valid: torch.Tensor  # [R, W] bool
    write_rows: torch.Tensor  # [N] this step's rows whose KV goes into the ring after attention
    write_dst: torch.Tensor  # [N] flat ring rows they land in


@dataclass(frozen=True)
class CompressionPlan:
    """The compressed entries one ratio completes in this step (shared by every owner
    of that ratio, each writing its own planes)."""

    ratio: int
    first_rows: torch.Tensor  # [G] this step's row of a group's first token, or NO_ROW (it is a tail)
    first_tail_slots: torch.Tensor  # [G] STATE slot whose tail holds the first token, or NO_ROW
    second_rows: torch.Tensor  # [G] this step's row of the group's last token (ratio 1: the only one)
    entry_positions: torch.Tensor  # [G] RoPE position of the entry (the group's first token)
    dst: torch.Tensor  # [G] flat entry row in the owner's planes (page * entries_per_page + row)
    tail_write_rows: torch.Tensor  # [N] rows whose (v, g) stay pending in the STATE tail
    tail_write_slots: torch.Tensor  # [N]
    # A verify's rows that may be left pending, staged in tail rows >= 1 until acceptance.
    staged_rows: torch.Tensor  # [M] this step's rows
    staged_slots: torch.Tensor  # [M]
    staged_tail_rows: torch.Tensor  # [M] the tail row each is staged in (staged_tail_row)


@dataclass(frozen=True)
class EntryTile:
    """The entry rows each segment's index scorer and attention gather from: entry j
    of segment s lives at ``page_tables[s, j // per_page] * per_page + j % per_page``.
    The host builds and moves only the page tables (a PAGE per ``block_size`` tokens);
    ``entry_rows`` [S, C] (NO_ROW past a segment's count) is built on whatever device
    the tables were moved to, so the host's work per step does not grow with the
    context."""

    ratio: int
    entries_per_page: int
    width: int  # C: the longest segment's entry count
    page_tables: torch.Tensor  # [S, ceil(C / per_page)] PAGE ids, NO_ROW past a table's end
    counts: torch.Tensor  # [S] entries each segment has: end // ratio
    visible: torch.Tensor  # [R] how many entries each row sees: (pos + 1) // ratio

    @functools.cached_property
    def entry_rows(self) -> torch.Tensor:
        j = torch.arange(self.width, device=self.page_tables.device)
        segments = torch.arange(self.page_tables.shape[0], device=j.device).unsqueeze(1)
        rows = _entry_rows(self.page_tables, segments, j, self.entries_per_page)
        return torch.where(j < self.counts.unsqueeze(1), rows, NO_ROW)


@dataclass(frozen=True)
class StepAddresses:
    positions: torch.Tensor  # [R]
    row_segments: torch.Tensor  # [R] segment index of each row
    window: WindowPlan
    compression: dict[int, CompressionPlan]
    tiles: dict[int, EntryTile]


@dataclass(frozen=True)
class DecoderAddresses:
    """Under decoder SWA bounded replay, the step rows the decoder layers run and
    their addresses, laid out as a step of their own: each segment's decoder rows are
    its last rows, from its decoder view's start."""

    rows: torch.Tensor  # [D] step rows, ascending
    plan: StepAddresses  # over those rows (no compression plans: the decoder compresses nothing)


def _long(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def _tensor(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values))


@dataclass(frozen=True)
class _SegmentColumns:
    """A step's segments as int64 columns [S] (one Python pass over them), and each
    row's segment [R]: what the address builders compute from without a loop over
    segments or rows. numpy, not torch: on the host a numpy op on a few hundred
    integers costs a fraction of a torch op's dispatch."""

    starts: np.ndarray
    lengths: np.ndarray
    slots: np.ndarray
    write_from: np.ndarray
    window_starts: np.ndarray
    tentative: np.ndarray
    ends: np.ndarray
    bases: np.ndarray  # each segment's first row
    row_segments: np.ndarray  # [R]

    @classmethod
    def of(cls, segments: Sequence[SegmentSpec]) -> "_SegmentColumns":
        table = np.array(
            [(s.start, s.length, s.slot, s.write_from, s.window_start, s.tentative) for s in segments], dtype=np.int64
        ).reshape(-1, 6)
        starts, lengths, slots, write_from, window_starts, tentative = table.T
        return cls(
            starts=starts,
            lengths=lengths,
            slots=slots,
            write_from=write_from,
            window_starts=window_starts,
            tentative=tentative,
            ends=starts + lengths,
            bases=np.cumsum(lengths) - lengths,
            row_segments=np.repeat(np.arange(len(segments), dtype=np.int64), lengths),
        )


def build_decoder_addresses(
    segments: Sequence[SegmentSpec], views: Sequence[SegmentSpec], page_tables: torch.Tensor, shape: PoolShape
) -> DecoderAddresses:
    """The decoder's rows and addresses of a step of ``segments`` (``page_tables``:
    the step's, as ``build_step_addresses`` takes them). ``views[i]`` is the
    decoder's view of segment i: the same request and end, starting at the first
    position the decoder runs (the end: none of its rows), with the first position
    its windows may read (a tail's start: nothing of the decoder exists below it).
    Ring writes are the views' rows alone."""
    if len(views) != len(segments):
        raise ValueError(f"views: {len(views)} for {len(segments)} segments (allowed: one per segment)")
    rows: list[int] = []
    base = 0
    for i, (seg, view) in enumerate(zip(segments, views)):
        if view.slot != seg.slot or view.end != seg.end or view.start < seg.start:
            raise ValueError(
                f"views[{i}]: slot {view.slot}, positions [{view.start}, {view.end}) "
                f"(allowed: slot {seg.slot}, the last rows of [{seg.start}, {seg.end}))"
            )
        rows.extend(range(base + view.start - seg.start, base + seg.length))
        base += seg.length
    plan = build_step_addresses(views, page_tables, shape, compression=False)
    return DecoderAddresses(rows=_long(rows), plan=plan)


def _window_keys(per_row, offsets, window: int, ring_rows: int, where):
    """(chunk_rows, ring_rows, valid) [R, window] of the rows' window keys from their
    columns ``per_row`` [5, R] (position, segment start, window start, segment base
    row, slot) and ``offsets`` (0 .. window - 1), with the same module's ``where``:
    numpy arrays or torch tensors alike, integer arithmetic only."""
    pos, row_start, window_start, base, slot = per_row
    key_pos = pos[:, None] - window + 1 + offsets[None, :]
    valid = (key_pos >= window_start[:, None]) & (key_pos >= 0)
    in_chunk = key_pos >= row_start[:, None]
    chunk_rows = where(valid & in_chunk, base[:, None] + key_pos - row_start[:, None], NO_ROW)
    ring = where(valid & ~in_chunk, slot[:, None] * ring_rows + key_pos % ring_rows, NO_ROW)
    return chunk_rows, ring, valid


def build_step_addresses(
    segments: Sequence[SegmentSpec],
    page_tables: torch.Tensor,
    shape: PoolShape,
    *,
    compression: bool = True,
    device: torch.device | str | None = None,
) -> StepAddresses:
    """Addresses of a step; rows are laid out segment after segment. ``page_tables``
    [S, P] int64: row s the PAGE ids of segment s's request (NO_ROW past its count),
    which must cover the segment's end; P at least the PAGEs the furthest end needs.
    ``compression`` False leaves the compression plans out (a step's decoder view
    compresses nothing). ``device``: where the window's [R, window] addresses are
    expanded from the rows' columns (one copy of five per-row columns); None: on the
    host, with numpy (a 4,096-row prefill at window 128: 8-11 ms on the CPU box); every
    other tensor is on the host."""
    W, ring_rows, B = shape.window, shape.ring_rows, shape.block_size
    _check_page_tables(segments, page_tables, B)
    columns = _SegmentColumns.of(segments)
    starts, slots, window_starts = columns.starts, columns.slots, columns.window_starts
    seg_t, bases = columns.row_segments, columns.bases
    rows = np.arange(seg_t.size, dtype=np.int64)
    pos_t = starts[seg_t] + rows - bases[seg_t]
    # A segment's ring takes its rows' KV from its last ring_rows positions on.
    written = pos_t >= (columns.ends - ring_rows)[seg_t]
    write_dst = slots[seg_t[written]] * ring_rows + pos_t[written] % ring_rows

    per_row = np.stack((pos_t, starts[seg_t], window_starts[seg_t], bases[seg_t], slots[seg_t])).reshape(5, -1)
    if device is None:
        keys = map(_tensor, _window_keys(per_row, np.arange(W, dtype=np.int64), W, ring_rows, np.where))
    else:
        offsets = torch.arange(W, dtype=torch.int64, device=device)
        keys = _window_keys(_tensor(per_row).to(device), offsets, W, ring_rows, torch.where)
    chunk_rows, ring_rows_t, valid = keys
    window = WindowPlan(
        chunk_rows=chunk_rows,
        ring_rows=ring_rows_t,
        valid=valid,
        write_rows=_tensor(rows[written]),
        write_dst=_tensor(write_dst),
    )
    plans = {r: _compression_plan(columns, page_tables, shape, r) for r in shape.ratios} if compression else {}
    tiles = {r: _entry_tile(columns, page_tables, shape, r, pos_t) for r in shape.ratios}
    return StepAddresses(
        positions=_tensor(pos_t),
        row_segments=_tensor(seg_t),
        window=window,
        compression=plans,
        tiles=tiles,
    )


@dataclass(frozen=True)
class DecodeWidth:
    """The fixed width of a decode step replayed from a graph: ``requests`` rows, one
    per request (the step's own first, then padding requests), and ``pages`` PAGEs in
    every request's tile page table, whatever the step's own batch and context.
    Padding carries the sentinels: a padding row is the one row of a zero-length
    padding segment (its tile empty, nothing visible, no window key valid), every
    padding write names NO_ROW as its destination (a padding compression group reads
    row 0 and is never stored), so padding reads no state and writes none."""

    requests: int
    pages: int

    def __post_init__(self) -> None:
        for name in ("requests", "pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DecodeWidth.{name}: {value!r} (allowed: an integer >= 1)")


def decode_pages(segments: Sequence[SegmentSpec], shape: PoolShape) -> int:
    """The PAGEs the longest request of a decode step covers: the narrowest
    ``DecodeWidth.pages`` its tiles fit."""
    return max((-(-seg.end // shape.block_size) for seg in segments), default=1)


def build_decode_addresses(
    segments: Sequence[SegmentSpec], page_tables: torch.Tensor, shape: PoolShape, width: DecodeWidth
) -> StepAddresses:
    """The addresses of a decode step (one committed row per segment; ``page_tables``
    as ``build_step_addresses`` takes them) at ``width``: the step's own rows are
    exactly ``build_step_addresses``'s, and every tensor is padded to the shapes
    ``width`` fixes (DecodeWidth says what padding holds)."""
    if len(segments) > width.requests:
        raise ValueError(f"segments: {len(segments)} requests (allowed: at most width.requests = {width.requests})")
    for i, seg in enumerate(segments):
        if seg.length != 1 or seg.tentative:
            raise ValueError(
                f"segments[{i}]: {seg.length} rows, {seg.tentative} tentative (allowed: one committed row, a decode)"
            )
    if decode_pages(segments, shape) > width.pages:
        raise ValueError(f"segments: cover {decode_pages(segments, shape)} PAGEs (allowed: at most width.pages = {width.pages})")
    own = build_step_addresses(segments, page_tables, shape)
    rows = width.requests
    window = own.window
    padded_window = WindowPlan(
        chunk_rows=_padded(window.chunk_rows, rows, NO_ROW),
        ring_rows=_padded(window.ring_rows, rows, NO_ROW),
        valid=_padded(window.valid, rows, False),
        write_rows=_padded(window.write_rows, rows, 0),
        write_dst=_padded(window.write_dst, rows, NO_ROW),
    )
    compression = {
        ratio: CompressionPlan(
            ratio=ratio,
            first_rows=_padded(plan.first_rows, rows, NO_ROW),
            first_tail_slots=_padded(plan.first_tail_slots, rows, NO_ROW),
            second_rows=_padded(plan.second_rows, rows, 0),
            entry_positions=_padded(plan.entry_positions, rows, 0),
            dst=_padded(plan.dst, rows, NO_ROW),
            tail_write_rows=_padded(plan.tail_write_rows, rows, 0),
            tail_write_slots=_padded(plan.tail_write_slots, rows, NO_ROW),
            staged_rows=plan.staged_rows,
            staged_slots=plan.staged_slots,
            staged_tail_rows=plan.staged_tail_rows,
        )
        for ratio, plan in own.compression.items()
    }
    tiles = {}
    for ratio, tile in own.tiles.items():
        page_tables = torch.full((rows, width.pages), NO_ROW, dtype=torch.long)
        page_tables[: len(segments), : tile.page_tables.shape[1]] = tile.page_tables
        tiles[ratio] = EntryTile(
            ratio=ratio,
            entries_per_page=tile.entries_per_page,
            width=width.pages * tile.entries_per_page,
            page_tables=page_tables,
            counts=_padded(tile.counts, rows, 0),
            visible=_padded(tile.visible, rows, 0),
        )
    return StepAddresses(
        positions=_padded(own.positions, rows, 0),
        row_segments=torch.arange(rows),
        window=padded_window,
        compression=compression,
        tiles=tiles,
    )


def _padded(values: torch.Tensor, rows: int, fill: int | bool) -> torch.Tensor:
    """``values`` [N, ...] (host) followed by ``fill`` up to ``rows`` along the first
    dimension."""
    own = values.numpy()
    padded = np.full((rows, *own.shape[1:]), fill, dtype=own.dtype)
    padded[: own.shape[0]] = own
    return torch.from_numpy(padded)


def _check_page_tables(segments: Sequence[SegmentSpec], page_tables: torch.Tensor, block_size: int) -> None:
    """The tables are a row per segment, wide enough for the furthest end. That each
    row holds a PAGE up to its own segment's end is the caller's to know (the rank's
    PersistentBatch checks its counts): reading the rows here would cost the host a
    device-sized gather per step."""
    widest = max((-(-seg.end // block_size) for seg in segments), default=0)
    if (
        page_tables.dtype != torch.long
        or page_tables.dim() != 2
        or page_tables.shape[0] != len(segments)
        or page_tables.shape[1] < widest
    ):
        raise ValueError(
            f"page_tables: {page_tables.dtype} of shape {tuple(page_tables.shape)} "
            f"(allowed: int64 [{len(segments)}, >= {widest}], the PAGEs up to the furthest segment end)"
        )


def staged_tail_row(start: int, position: int) -> int:
    """The tail row a verify starting at ``start`` stages position ``position``'s (v, g)
    in: a ratio-2 token is left pending when the accepted prefix ends on it, which only
    an even position can be; rows 1, 2, ... in order, row 0 being the committed one."""
    return (position - start) // 2 + 1


def draft_ring_rows(
    slots: Sequence[int], last_positions: Sequence[int], window_starts: Sequence[int], shape: PoolShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring rows a DSpark block after target position p reads, per block: flat
    ring rows of positions p-W+1..p [B, W] (oldest first) and whether each holds one
    (at or past the block's window start and 0)."""
    window, ring_rows = shape.window, shape.ring_rows
    key_pos = _long(last_positions).unsqueeze(1) - window + 1 + torch.arange(window)
    valid = (key_pos >= _long(window_starts).unsqueeze(1)) & (key_pos >= 0)
    flat = _long(slots).unsqueeze(1) * ring_rows + key_pos.remainder(ring_rows)
    return torch.where(valid, flat, NO_ROW), valid


def _entry_rows(page_tables: torch.Tensor, segments: torch.Tensor, entries: torch.Tensor, per_page: int) -> torch.Tensor:
    """Flat rows in an owner's planes of compressed entries ``entries`` of the
    requests of ``segments`` (broadcast together)."""
    return page_tables[segments, entries // per_page] * per_page + entries % per_page


def _repeat(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``counts[s]`` items of each segment s laid out segment after segment: each
    item's segment and its index within its segment's items."""
    owners = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    firsts = np.cumsum(counts) - counts
    return owners, np.arange(owners.size, dtype=np.int64) - firsts[owners]


def _compression_plan(
    columns: _SegmentColumns, page_tables: torch.Tensor, shape: PoolShape, ratio: int
) -> CompressionPlan:
    starts, ends, slots, bases = columns.starts, columns.ends, columns.slots, columns.bases
    # Entry j is the group [j*r, (j+1)*r); it completes at its last token and is
    # written only when that group ends past write_from (else the cache holds it).
    # Every j from start // r on ends at or past start.
    first_entry = np.maximum(starts // ratio, columns.write_from // ratio)
    owners, index = _repeat(np.maximum(ends // ratio - first_entry, 0))
    entries = first_entry[owners] + index
    first = entries * ratio
    start, base = starts[owners], bases[owners]
    in_step = first >= start
    empty = np.zeros(0, dtype=np.int64)
    staged_rows = staged_slots = staged_tail_rows = tail_rows = tail_slots = empty
    if ratio == 2:
        tentative = columns.tentative > 0
        # A verify stages each even position of its rows; another segment leaves its
        # last row pending when its end is odd.
        even_start = starts + starts % 2
        staged, step = _repeat(np.where(tentative, np.maximum(ends - even_start + 1, 0) // 2, 0))
        positions = even_start[staged] + 2 * step
        staged_rows = bases[staged] + positions - starts[staged]
        staged_slots = slots[staged]
        staged_tail_rows = staged_tail_row(starts[staged], positions)
        pending = ~tentative & (columns.lengths > 0) & (ends % 2 == 1)
        tail_rows = (bases + columns.lengths - 1)[pending]
        tail_slots = slots[pending]
    return CompressionPlan(
        ratio=ratio,
        first_rows=_tensor(np.where(in_step, base + first - start, NO_ROW)),
        first_tail_slots=_tensor(np.where(in_step, NO_ROW, slots[owners])),
        second_rows=_tensor(base + first + ratio - 1 - start),
        entry_positions=_tensor(first),
        dst=_entry_rows(page_tables, _tensor(owners), _tensor(entries), shape.entries_per_page(ratio)),
        tail_write_rows=_tensor(tail_rows),
        tail_write_slots=_tensor(tail_slots),
        staged_rows=_tensor(staged_rows),
        staged_slots=_tensor(staged_slots),
        staged_tail_rows=_tensor(staged_tail_rows),
    )


def _entry_tile(
    columns: _SegmentColumns, page_tables: torch.Tensor, shape: PoolShape, ratio: int, positions: np.ndarray
) -> EntryTile:
    per_page = shape.entries_per_page(ratio)
    counts = columns.ends // ratio
    width = int(counts.max()) if counts.size else 0
    return EntryTile(
        ratio=ratio,
        entries_per_page=per_page,
        width=width,
        page_tables=page_tables[:, : -(-width // per_page)],
        counts=_tensor(counts),
        visible=_tensor((positions + 1) // ratio),
    )
