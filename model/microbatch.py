"""A step's forward as steps: one driven to its end, or two microbatches interleaved.

Owns the execution primitives of prefill two-batch overlap (the spec's "Prefill
two-batch overlap"). A forward is a generator (``Steps``) that yields each time its
MoE has issued a collective that is still in flight; ``run_steps`` drives one to its
end (an ordinary forward: a MoE without collectives never yields), ``interleave``
alternates several, so while one microbatch's gather or reduce is in flight the
other computes (its attention, its experts). Every rank interleaves the same way
and its microbatches yield at the same points, so every rank issues the same
collectives in the same order. Also owns ``EngramRows``: each Engram layer's table
rows for a step's rows, looked up once (by the kernels backend, on the host or on the
forward's device) and handed to every forward that reads them (the one forward of a
step, or both microbatches of a split one: the lookup they share), and
``StagedEngramRows``, the rows of a forward whose every row runs every layer, read on
its device from n-grams already there (a graph-replayed decode step's: a captured
graph holds no host work).

Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from typing import Callable, Generator, Protocol, Sequence, TypeVar

import torch

from dsv41.model.params import LayerParams

T = TypeVar("T")

# A computation that yields while a collective it issued is in flight.
Steps = Generator[None, None, T]

# The MoE of one layer for a microbatch's rows, yielding while its collectives run
# (cluster/distributed.DPExpertExchange.microbatch gives one per microbatch).
MoESteps = Callable[[LayerParams, torch.Tensor], Steps[torch.Tensor]]

# An Engram layer's table rows [N, input_dim] (float32) of n-grams [N, max_ngram], on
# the n-grams' device (PagedRuntime.engram_rows: hashed and read by the kernels backend).
EngramRead = Callable[[LayerParams, torch.Tensor], torch.Tensor]


class EngramSource(Protocol):
    """Where a forward reads each Engram layer's table rows for its rows."""

    def embeddings(self, layer: LayerParams, rows: torch.Tensor) -> torch.Tensor:
        """The table rows [len(rows), input_dim] of ``rows`` (step rows) at Engram ``layer``."""
        ...


def run_steps(steps: Steps[T]) -> T:
    """Drives ``steps`` to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def interleave(steps: Sequence[Steps[T]]) -> list[T]:
    """Drives every one of ``steps`` to its end, in turns: each runs until it yields
    (a collective of its in flight), then the next. Results in order. When one
    raises, the others are closed and the error propagates (a peer then fails the
    step at its collectives' timeout)."""
    results: list[T | None] = [None] * len(steps)
    live = list(range(len(steps)))
    try:
        while live:
            for i in tuple(live):
                try:
                    next(steps[i])
                except StopIteration as done:
                    results[i] = done.value
                    live.remove(i)
    finally:
        for i in live:
            steps[i].close()
    return results  # type: ignore[return-value]


class EngramRows:
    """The Engram tables' rows of a step's rows (``ngrams`` [R, max_ngram], where
    ``read`` takes them), each layer's read once, when a forward first reaches the
    layer, and kept until ``readers`` forwards have taken theirs.

    ``decoder_rows``: under decoder SWA bounded replay the step rows the decoder runs
    (ascending); a layer from ``decoder_start`` on is looked up for those alone.
    None: every row runs every layer."""

    def __init__(
        self,
        read: EngramRead,
        ngrams: torch.Tensor,
        decoder_start: int,
        decoder_rows: torch.Tensor | None = None,
        readers: int = 1,
    ) -> None:
        if readers < 1:
            raise ValueError(f"readers: {readers} (allowed: >= 1)")
        self.read = read
        self.ngrams = ngrams
        self.decoder_start = decoder_start
        self.decoder_rows = None if decoder_rows is None else decoder_rows.cpu()
        self.readers = readers
        self._looked_up: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}

    def embeddings(self, layer: LayerParams, rows: torch.Tensor) -> torch.Tensor:
        """The looked-up rows [len(rows), input_dim] (fp32, on the n-grams' device) of
        ``rows`` (step rows) at Engram ``layer``."""
        if layer.engram is None:
            raise RuntimeError(f"layer {layer.layer_id}: no Engram table to look up")
        layer_id = layer.layer_id
        rows = rows.cpu()
        if layer_id not in self._looked_up:
            wanted = None
            if self.decoder_rows is not None and layer_id >= self.decoder_start:
                wanted = self.decoder_rows
            ngrams = self.ngrams if wanted is None else self.ngrams[wanted]
            where = None
            if wanted is not None:
                where = torch.full((self.ngrams.shape[0],), -1, dtype=torch.long)
                where[wanted] = torch.arange(wanted.numel())
            table = self.read(layer, ngrams)
            self._looked_up[layer_id] = (table, where, 0)
        table, where, taken = self._looked_up[layer_id]
        at = rows if where is None else where[rows]
        if bool((at < 0).any()):
            raise RuntimeError(f"layer {layer_id}: Engram rows asked for outside the rows the decoder runs")
        if taken + 1 == self.readers:
            del self._looked_up[layer_id]
        else:
            self._looked_up[layer_id] = (table, where, taken + 1)
        return table[at]


class StagedEngramRows:
    """Each Engram layer's table rows of every row of a step, read on the forward's
    device from the step's n-grams staged there (``ngrams`` [R, max_ngram]), for a
    forward whose every row runs every layer: nothing here touches the host."""

    def __init__(self, read: EngramRead, ngrams: torch.Tensor) -> None:
        self.read = read
        self.ngrams = ngrams

    def embeddings(self, layer: LayerParams, rows: torch.Tensor) -> torch.Tensor:
        if layer.engram is None:
            raise RuntimeError(f"layer {layer.layer_id}: no Engram table to look up")
        if rows.numel() != self.ngrams.shape[0]:
            raise RuntimeError(
                f"layer {layer.layer_id}: {rows.numel()} rows asked for, {self.ngrams.shape[0]} staged "
                "(staged rows serve a forward whose every row runs every layer)"
            )
        return self.read(layer, self.ngrams)
