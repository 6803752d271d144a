"""Decode steps replayed from CUDA graphs (the spec's FULL graph mode).

Owns the graph mode's declaration (``DecodeBuckets``: the batch-size and PAGE-count
buckets a replica captures, and which one a step runs at), the persistent step
(``StaticDecodeStep``: one bucket's inputs at fixed addresses, token ids, token-feed
rows, slots and addresses staged on the host in one pinned int64 buffer and moved in
one copy per step, and the forward that reads only them and the ``DeviceStepState``:
it takes a row's token from the token feed where the host does not know it yet, its
Engram n-grams from its slot's cursor, hashes them and reads the Engram tables' rows
on the device (model/runtime.PagedRuntime.engram_rows), and advances the cursors) and
``DecodeGraphs``: every bucket's step captured once at startup (largest first, one
memory pool, capture time and memory reported as progress) and a decode step run as
one replay. A step is run at its bucket's width (cache/addressing.DecodeWidth:
padding rows read and write nothing), so its real rows' logits are the eager
forward's bits in the batch-invariant mode. A step beyond the largest bucket runs
eagerly (logged once). Under DP attention every rank of a step replays the same width
(an idle rank on padding alone, ``run_padding``), and ``begin_width`` sets the MoE
exchange's shapes from the width before each run, so the collectives a graph captured
meet every peer's.

Must not import: actors, deploy, ray.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from dsv41.cache.addressing import (
    DecodeWidth,
    PoolShape,
    SegmentSpec,
    build_decode_addresses,
    decode_pages,
)
from dsv41.cache.geometry import CURSOR_POSITION
from dsv41.model.engram import EngramHashing
from dsv41.model.runtime import PagedRuntime, PagedStore

CUDAGRAPH_MODES = ("none", "full", "tr_hybrid")
# The page tables of a step of no request (what capture stages: padding alone).
_NO_PAGES = torch.zeros(0, 0, dtype=torch.long)

logger = logging.getLogger(__name__)


def default_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8, up to ``max_num_seqs`` (included): vLLM's
    default capture sizes, cut at the replica's batch."""
    sizes = {size for size in (1, 2, 4) if size < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def page_buckets(max_pages: int) -> tuple[int, ...]:
    """Powers of two below ``max_pages``, then ``max_pages``: a step's tiles are at
    most twice as wide as its longest request needs."""
    buckets = []
    count = 1
    while count < max_pages:
        buckets.append(count)
        count *= 2
    buckets.append(max_pages)
    return tuple(buckets)


@dataclass(frozen=True)
class DecodeBuckets:
    """The widths a replica captures: every (batch size, PAGE count) pair."""

    batch_sizes: tuple[int, ...]
    page_counts: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "page_counts"):
            values = getattr(self, name)
            if (
                not values
                or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values)
                or list(values) != sorted(set(values))
            ):
                raise ValueError(f"DecodeBuckets.{name}: {values!r} (allowed: distinct positive integers, ascending)")

    @classmethod
    def of(cls, max_num_seqs: int, max_pages: int, batch_sizes: Sequence[int] | None = None) -> "DecodeBuckets":
        """The buckets of a replica of ``max_num_seqs`` requests whose longest request
        covers ``max_pages`` PAGEs; ``batch_sizes`` None: ``default_batch_sizes``."""
        sizes = default_batch_sizes(max_num_seqs) if batch_sizes is None else tuple(sorted(set(batch_sizes)))
        return cls(batch_sizes=sizes, page_counts=page_buckets(max_pages))

    def width_for(self, requests: int, pages: int) -> DecodeWidth | None:
        """The narrowest captured width holding ``requests`` rows whose longest covers
        ``pages`` PAGEs; None beyond the largest bucket."""
        b = bisect.bisect_left(self.batch_sizes, requests)
        p = bisect.bisect_left(self.page_counts, pages)
        if b == len(self.batch_sizes) or p == len(self.page_counts):
            return None
        return DecodeWidth(requests=self.batch_sizes[b], pages=self.page_counts[p])

    def widths(self) -> list[DecodeWidth]:
        """Every width, largest first (the capture order: smaller graphs reuse the
        memory pool the largest sized)."""
        return [
            DecodeWidth(requests=b, pages=p)
            for b in reversed(self.batch_sizes)
            for p in reversed(self.page_counts)
        ]


def tensor_leaves(record: Any) -> list[torch.Tensor]:
    """The tensors of a record of dataclasses, dicts and tensors, in a fixed order
    (fields in declaration order, dict entries by key)."""
    if isinstance(record, torch.Tensor):
        return [record]
    if dataclasses.is_dataclass(record):
        return [leaf for f in dataclasses.fields(record) for leaf in tensor_leaves(getattr(record, f.name))]
    if isinstance(record, dict):
        return [leaf for key in sorted(record) for leaf in tensor_leaves(record[key])]
    return []


def with_leaves(record: Any, leaves: Iterator[torch.Tensor]) -> Any:
    """``record`` with its tensors replaced, in ``tensor_leaves`` order, by ``leaves``."""
    if isinstance(record, torch.Tensor):
        return next(leaves)
    if dataclasses.is_dataclass(record):
        changes = {f.name: with_leaves(getattr(record, f.name), leaves) for f in dataclasses.fields(record)}
        return dataclasses.replace(record, **changes)
    if isinstance(record, dict):
        return {key: with_leaves(record[key], leaves) for key in sorted(record)}
    return record


@dataclass(frozen=True)
class DeviceStepState:
    """What a decode graph reads and writes beyond the pools' planes, at fixed
    addresses: the slots' cursors (``[slots, 1 + history]``: position, then the
    Engram history), the token map (vocabulary id to compressed Engram id) and the
    token feed (the previous step's sampled tokens, one a row: what a row whose token
    the host does not know yet reads, cluster/batch.PLACEHOLDER_TOKEN)."""

    cursor: torch.Tensor
    token_map: torch.Tensor
    feed: torch.Tensor
    hashing: EngramHashing | None


class StaticDecodeStep:
    """One width's persistent decode step: the token ids, token-feed rows and slots
    of ``width.requests`` rows and their addresses, all int64, in one host buffer
    (pinned on a GPU) and one device buffer at fixed addresses, and the forward that
    reads only the device buffer and ``state`` (``forward``: what a graph captures).
    The forward takes each row's Engram n-grams from its slot's cursor and its token,
    and advances the cursors of the real rows, so a decode step reads no cursor on
    the host and writes none from it."""

    def __init__(
        self,
        runtime: PagedRuntime,
        store: PagedStore,
        shape: PoolShape,
        width: DecodeWidth,
        device: torch.device,
        state: DeviceStepState,
    ) -> None:
        self.runtime = runtime
        self.store = store
        self.shape = shape
        self.width = width
        self.device = device
        self.state = state
        self.template = build_decode_addresses([], _NO_PAGES, shape, width)
        rows = width.requests
        self.int_leaves = [
            torch.zeros(rows, dtype=torch.long),
            torch.zeros(rows, dtype=torch.long),
            torch.zeros(rows, dtype=torch.long),
            *tensor_leaves(self.template),
        ]
        pin = device.type == "cuda"
        int_total = sum(leaf.numel() for leaf in self.int_leaves)
        self.host_ints = torch.zeros(int_total, dtype=torch.long, pin_memory=pin)
        self.device_ints = torch.zeros(int_total, dtype=torch.long, device=device)
        self.row_index = torch.arange(rows, device=device)

    def load(
        self,
        token_ids: torch.Tensor,
        feed_rows: torch.Tensor,
        segments: Sequence[SegmentSpec],
        page_tables: torch.Tensor,
    ) -> None:
        """Stages a decode step (``token_ids`` [n] host, ``feed_rows`` [n] host: the
        token feed's row a row reads its token from, -1 where ``token_ids`` holds it;
        ``segments``' specs and their page tables) at this width and moves it to the
        device buffer: one copy. Padding rows read token 0 and slot 0's cursor, write
        no cursor, and their results are never read."""
        rows = self.width.requests
        if token_ids.numel() != len(segments) or feed_rows.numel() != len(segments):
            raise ValueError(
                f"token_ids / feed_rows: {token_ids.numel()} / {feed_rows.numel()} for {len(segments)} segments "
                "(allowed: one each)"
            )
        tokens = torch.zeros(rows, dtype=torch.long)
        tokens[: token_ids.numel()] = token_ids
        feed = torch.full((rows,), -1, dtype=torch.long)
        feed[: feed_rows.numel()] = feed_rows
        slots = torch.full((rows,), -1, dtype=torch.long)
        slots[: len(segments)] = torch.tensor([seg.slot for seg in segments], dtype=torch.long)
        leaves = [
            tokens,
            feed,
            slots,
            *tensor_leaves(build_decode_addresses(segments, page_tables, self.shape, self.width)),
        ]
        if len(leaves) != len(self.int_leaves):
            raise RuntimeError(f"{len(leaves)} decode inputs for the width's {len(self.int_leaves)}")
        for leaf, staged in zip(leaves, self.int_leaves):
            if leaf.shape != staged.shape:
                raise RuntimeError(f"a decode address of shape {tuple(leaf.shape)} for the width's {tuple(staged.shape)}")
        # One concatenation into the staging buffer (the valid mask's bools as 0/1).
        torch.cat([leaf.reshape(-1).long() for leaf in leaves], out=self.host_ints)
        self.device_ints.copy_(self.host_ints, non_blocking=True)

    def forward(self) -> torch.Tensor:
        """The logits [width.requests, vocab] of the staged step, read from the device
        buffers alone; the real rows' cursors advanced by one token."""
        views = []
        at = 0
        for leaf in self.int_leaves:
            view = self.device_ints[at : at + leaf.numel()].view(leaf.shape)
            # The window's valid mask is the one bool address; the conversion is a
            # kernel of the graph.
            views.append(view != 0 if leaf.dtype == torch.bool else view)
            at += leaf.numel()
        staged_tokens, feed, slots = views[0], views[1], views[2]
        plan = with_leaves(self.template, iter(views[3:]))
        state = self.state
        tokens = torch.where(feed >= 0, state.feed[feed.clamp(min=0)], staged_tokens)
        real = slots >= 0
        slot_rows = slots.clamp(min=0)
        cursors = state.cursor[slot_rows]
        compressed = state.token_map[tokens]
        histories = cursors[:, CURSOR_POSITION + 1 :]
        if state.hashing is None:
            ngrams = compressed.unsqueeze(1)
            advanced_history = histories
        else:
            ngrams = state.hashing.decode_ngram_ids(compressed, histories)
            advanced_history = state.hashing.decode_next_history(compressed, histories)
        logits = self.runtime.forward_staged(tokens, ngrams, plan, self.store)
        advanced = torch.cat((cursors[:, : CURSOR_POSITION + 1] + 1, advanced_history), dim=1)
        written = torch.where(real.unsqueeze(1), advanced, cursors)
        # Real rows come first: a padding row writes row 0's value to row 0's slot (its
        # own, unchanged, when no row is real), so no two writes to a slot differ.
        source = torch.where(real, self.row_index, 0)
        state.cursor.index_put_((slot_rows[source],), written[source])
        return logits


@dataclass(frozen=True)
class CaptureReport:
    graphs: int
    seconds: float
    memory_bytes: int  # device memory reserved since the graphs were set up: their pool and step buffers


class GraphRecorder:
    """Records CUDA graphs into one memory pool (``capture`` True, a CUDA device), or
    nothing (the CPU, where each function just runs), and reports what it recorded:
    the device memory reserved since it was made (the graphs' pool and whatever buffers
    were set up after it) and the time since ``start``."""

    def __init__(self, device: torch.device, capture: bool) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"capture: True on {device} (allowed: a CUDA device)")
        self.device = device
        self.capture = capture
        self._reserved_before = torch.cuda.memory_reserved(device) if capture else 0
        self._pool = None
        self._begin = time.perf_counter()
        self.graphs = 0

    def start(self) -> None:
        self._begin = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._begin

    def record(self, run: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        """Runs ``run`` once (compiling its kernels) and, when capturing, records it
        (``run`` must read and write only tensors at fixed addresses)."""
        run()
        if not self.capture:
            return None
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            run()
        self.graphs += 1
        return graph

    def finish(self, what: str, progress: Callable[[str], None]) -> CaptureReport:
        if self.capture:
            torch.cuda.synchronize(self.device)
        memory = torch.cuda.memory_reserved(self.device) - self._reserved_before if self.capture else 0
        report = CaptureReport(graphs=self.graphs, seconds=self.seconds, memory_bytes=memory)
        progress(f"{what}: {report.graphs} captured in {report.seconds:.1f} s, {memory / 2**20:.1f} MiB of device memory")
        return report


class DecodeGraphs:
    """Every bucket's decode step, captured as a CUDA graph (``capture`` True, a CUDA
    device) or run as its static step eagerly (``capture`` False: what the CPU tests
    check, the very function a graph captures), and decode steps run at their
    bucket's width."""

    def __init__(
        self,
        runtime: PagedRuntime,
        store: PagedStore,
        shape: PoolShape,
        buckets: DecodeBuckets,
        device: torch.device,
        state: DeviceStepState,
        *,
        capture: bool,
        begin_width: Callable[[DecodeWidth], None] | None = None,
    ) -> None:
        self._recorder = GraphRecorder(device, capture)
        self.runtime = runtime
        self.buckets = buckets
        self.capture = capture
        self.device = device
        self.begin_width = begin_width
        self.steps = {width: StaticDecodeStep(runtime, store, shape, width, device, state) for width in buckets.widths()}
        self.shape = shape
        vocab = runtime.params.head.shape[0]
        # Every graph writes its logits here (a copy inside the graph), so no graph
        # keeps an output of its own.
        self.logits = torch.zeros(buckets.batch_sizes[-1], vocab, dtype=torch.float32, device=device)
        self._graphs: dict[DecodeWidth, torch.cuda.CUDAGraph] = {}
        self._warned_beyond = False
        self.report: CaptureReport | None = None  # capture_all's

    def _run_static(self, step: StaticDecodeStep) -> None:
        self.logits[: step.width.requests].copy_(step.forward())

    @staticmethod
    def _load_padding(step: StaticDecodeStep) -> None:
        none = torch.zeros(0, dtype=torch.long)
        step.load(none, none, [], _NO_PAGES)

    def capture_all(self, progress: Callable[[str], None] = logger.info) -> CaptureReport:
        """Runs every bucket's step once on padding (compiling its kernels) and, when
        capturing, records it; reports each graph and the totals through ``progress``."""
        recorder = self._recorder
        recorder.start()
        total = len(self.steps)
        for i, (width, step) in enumerate(self.steps.items(), start=1):
            self._load_padding(step)
            if self.begin_width is not None:
                self.begin_width(width)
            graph = recorder.record(lambda: self._run_static(step))
            if graph is not None:
                self._graphs[width] = graph
            progress(
                f"decode graph {i}/{total}: {width.requests} requests x {width.pages} PAGEs "
                f"({recorder.seconds:.1f} s)"
            )
        self.report = recorder.finish("decode graphs", progress)
        return self.report

    def width_for(self, segments: Sequence[SegmentSpec]) -> DecodeWidth | None:
        """The bucket a decode step of ``segments`` runs at; None (logged once) when
        it is beyond the largest, and the step runs eagerly."""
        return self.width_of(len(segments), decode_pages(segments, self.shape))

    def width_of(self, requests: int, pages: int) -> DecodeWidth | None:
        """The bucket of a decode step of ``requests`` rows whose longest covers
        ``pages`` PAGEs (under DP attention: every rank's largest); None (logged once)
        beyond the largest."""
        width = self.buckets.width_for(requests, pages)
        if width is None and not self._warned_beyond:
            self._warned_beyond = True
            logger.warning(
                "decode graphs: a step of %d requests covering %d PAGEs is beyond the largest bucket "
                "(%d requests, %d PAGEs) and runs eagerly (logged once)",
                requests,
                pages,
                self.buckets.batch_sizes[-1],
                self.buckets.page_counts[-1],
            )
        return width

    def run(
        self,
        width: DecodeWidth,
        token_ids: torch.Tensor,
        feed_rows: torch.Tensor,
        segments: Sequence[SegmentSpec],
        page_tables: torch.Tensor,
    ) -> torch.Tensor:
        """The logits [len(segments), vocab] of a decode step run at ``width``
        (``StaticDecodeStep.load`` says what it takes), then the bucket's graph
        replayed (or its static step run); its rows' cursors advanced on the device."""
        step = self.steps[width]
        step.load(token_ids, feed_rows, segments, page_tables)
        self._replay(step)
        return self.logits[: len(segments)]

    def run_padding(self, width: DecodeWidth) -> None:
        """The graph of ``width`` replayed on padding rows alone (an idle DP rank's side
        of a step its peers run at ``width``: every layer's collectives meet theirs)."""
        step = self.steps[width]
        self._load_padding(step)
        self._replay(step)

    def _replay(self, step: StaticDecodeStep) -> None:
        width = step.width
        if self.begin_width is not None:
            self.begin_width(width)
        graph = self._graphs.get(width)
        if graph is not None:
            graph.replay()
        elif self.capture:
            raise RuntimeError(f"decode graphs: width {width} was never captured (capture_all first)")
        else:
            self._run_static(step)
