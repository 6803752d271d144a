"""Token graphs: the spec's TR_HYBRID graph mode (``cudagraph_mode`` "tr_hybrid").

Owns ``token_buckets`` (the row counts a replica records), ``TokenGraphs`` (each
layer's row-by-row parts around its attention, model/runtime.LayerSegments: the
layer's Engram update and attention-site opening before it, ``open_layer``; the
attention site's expand, the FFN site and its MoE after it, ``close_layer``, recorded
once per (layer, part, bucket) at startup) and the fixed buffers they read and write.
Attention (projections, compression, index scoring, selection, the attention itself
and its ring writes) runs eagerly between the graphs, so a step of any shape, prefill
chunks, decodes and both at once, replays them: a step's rows are padded to the
narrowest bucket holding them (every part is row by row, so the padding rows change
no real row and nothing is written for them); a step beyond the largest bucket runs
every part eagerly (logged once). Prefill rows past the largest bucket are where
launches no longer dominate.

Each bucket has one set of buffers, by role, that the parts read and write in turn:
``open_layer`` reads the streams and pre (and the Engram table rows) and writes the
next streams, the mix and the attention input; ``close_layer`` reads those and the
attention's output and writes the streams and pre back. A part's input that already
is its buffer (the previous part's output) is not copied, so a layer costs one copy
(the attention's output in) and two replays. On the CPU each part runs eagerly on the
padded buffers (``capture`` False): the very function a graph records, which the tests
check against the eager engine.

Under DP attention the close parts hold the MoE exchange's collectives, so every rank
must run each part at the same bucket: the rank picks a step's buckets from the DP
metadata (``use_step_buckets``: the encoder's from the largest rank's rows, the
decoder's from its decoder rows), and a rank none of whose rows reach a layer replays
that layer's close part on padding (``pad_layer``).

Must not import: actors, deploy, ray.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from dsv41.cluster.cuda_graphs import CaptureReport, GraphRecorder, page_buckets
from dsv41.model.mhc import HcMix
from dsv41.model.microbatch import MoESteps, Steps, run_steps
from dsv41.model.params import LayerParams
from dsv41.model.runtime import PagedRuntime

# Above this many rows a step's token-wise work is large enough that its launches no
# longer dominate; vLLM caps its default capture sizes at 512 tokens too.
MAX_DEFAULT_TOKEN_BUCKET = 512

logger = logging.getLogger(__name__)


def token_buckets(max_num_batched_tokens: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The row counts a replica records: ``sizes`` (sorted, distinct), else powers of
    two up to ``max_num_batched_tokens`` or MAX_DEFAULT_TOKEN_BUCKET, whichever is
    smaller (that one included)."""
    if sizes is not None:
        buckets = tuple(sorted(set(sizes)))
    else:
        buckets = page_buckets(min(max_num_batched_tokens, MAX_DEFAULT_TOKEN_BUCKET))
    if not buckets or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets):
        raise ValueError(f"token buckets: {buckets!r} (allowed: distinct positive integers)")
    return buckets


@dataclass(frozen=True)
class _Buffers:
    """One bucket's buffers, by role (every tensor [bucket rows, ...])."""

    streams: torch.Tensor  # open_layer's input, close_layer's output
    pre: torch.Tensor  # open_layer's input, close_layer's output
    table_rows: torch.Tensor  # open_layer's Engram input (config.engram_input_dim wide)
    opened: torch.Tensor  # open_layer's output streams, close_layer's input
    mix: HcMix  # open_layer's output, close_layer's input
    attention_input: torch.Tensor  # open_layer's output
    attention_output: torch.Tensor  # close_layer's input


def _put(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Writes ``value``'s rows at the start of ``buffer``, unless ``value`` already is
    them (the previous part's output)."""
    if value.data_ptr() == buffer.data_ptr() and value.stride() == buffer.stride():
        return
    buffer[: value.shape[0]].copy_(value)


class TokenGraphs:
    """Every layer's token-wise parts, recorded as CUDA graphs per bucket (``capture``
    True, a CUDA device) or run eagerly on the bucket's buffers (``capture`` False),
    and run for a step's rows at their bucket (model/runtime.LayerSegments)."""

    def __init__(
        self,
        runtime: PagedRuntime,
        buckets: Sequence[int],
        device: torch.device,
        *,
        capture: bool,
        begin_rows: Callable[[int], None] | None = None,
    ) -> None:
        self._recorder = GraphRecorder(device, capture)
        self.runtime = runtime
        self.buckets = tuple(buckets)
        self.device = device
        self.capture = capture
        # Under DP attention: sets the MoE exchange's shapes from a bucket before its
        # close parts are recorded; each step's are set by the rank (use_step_buckets).
        self.begin_rows = begin_rows
        self._decoder_start = runtime.config.topology.decoder_start
        self._step_buckets: tuple[int | None, int | None] | None = None
        self._buffers = {rows: self._allocate(rows) for rows in self.buckets}
        self._graphs: dict[tuple[int, str, int], torch.cuda.CUDAGraph] = {}
        self._warned_beyond = False
        self.report: CaptureReport | None = None

    def _allocate(self, rows: int) -> _Buffers:
        params = self.runtime.params
        cfg = params.config
        hc, hidden, dtype = cfg.hc_mult, cfg.hidden_size, params.embed.dtype

        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(rows, *shape, dtype=dtype, device=self.device)

        return _Buffers(
            streams=zeros(hc, hidden, dtype=dtype),
            pre=zeros(hc),
            table_rows=zeros(cfg.engram_input_dim),
            opened=zeros(hc, hidden, dtype=dtype),
            mix=HcMix(pre=zeros(hc), post=zeros(hc), comb=zeros(hc, hc)),
            attention_input=zeros(hidden, dtype=dtype),
            attention_output=zeros(hidden, dtype=dtype),
        )

    # -- the parts, on a bucket's buffers (what a graph records) ---------------------------

    def _open_part(self, layer: LayerParams, buffers: _Buffers) -> None:
        table_rows = None if layer.engram is None else buffers.table_rows
        streams, mix, h = self.runtime.open_layer(layer, buffers.streams, buffers.pre, table_rows)
        buffers.opened.copy_(streams)
        for mine, part in zip((buffers.mix.pre, buffers.mix.post, buffers.mix.comb), (mix.pre, mix.post, mix.comb)):
            mine.copy_(part)
        buffers.attention_input.copy_(h)

    def _close_part(self, layer: LayerParams, buffers: _Buffers) -> None:
        closing = self.runtime.close_layer(layer, buffers.opened, buffers.attention_output, buffers.mix, None)
        streams, pre = run_steps(closing)
        buffers.streams.copy_(streams)
        buffers.pre.copy_(pre)

    def _parts(self) -> Iterator[tuple[str, LayerParams, Callable[[LayerParams, _Buffers], None]]]:
        for layer in self.runtime.params.layers:
            yield "open", layer, self._open_part
            yield "close", layer, self._close_part

    def capture_all(self, progress: Callable[[str], None] = logger.info) -> CaptureReport:
        """Runs every layer's parts once at each bucket (compiling their kernels and
        arranging the expert banks) and, when capturing, records each; reports each
        bucket and the totals through ``progress``."""
        recorder = self._recorder
        recorder.start()
        # A recorded part keeps the kernels chosen while it was recorded: under the
        # runtime's arithmetic mode, as its forward runs the parts (outside it, the
        # batch-invariant mode's GEMMs and reductions would be recorded as cuBLAS's and
        # torch's, whose bits differ from the eager step's).
        with torch.no_grad(), self.runtime.arithmetic():
            for i, rows in enumerate(reversed(self.buckets), start=1):
                buffers = self._buffers[rows]
                for part, layer, run in self._parts():
                    if part == "close" and self.begin_rows is not None:
                        self.begin_rows(rows)
                    graph = recorder.record(lambda: run(layer, buffers))
                    if graph is not None:
                        self._graphs[(layer.layer_id, part, rows)] = graph
                progress(
                    f"token graphs {i}/{len(self.buckets)}: {rows} rows, {2 * len(self.runtime.params.layers)} "
                    f"parts ({recorder.seconds:.1f} s)"
                )
        self.report = recorder.finish("token graphs", progress)
        return self.report

    def bucket_for(self, rows: int) -> int | None:
        """The narrowest bucket holding ``rows`` rows; None (logged once) beyond the
        largest, where the parts run eagerly."""
        for bucket in self.buckets:
            if bucket >= rows:
                return bucket
        if not self._warned_beyond:
            self._warned_beyond = True
            logger.warning(
                "token graphs: a step of %d rows is beyond the largest bucket (%d rows) and runs eagerly "
                "(logged once)",
                rows,
                self.buckets[-1],
            )
        return None

    def use_step_buckets(self, encoder: int | None, decoder: int | None) -> None:
        """Under DP attention, the buckets of this step's parts, every rank's alike
        (the rank picks them from the step's DP metadata): ``encoder`` for the layers
        before the decoder's first, ``decoder`` from it on (under decoder replay the
        decoder's rows are fewer); None: that stage's parts run eagerly."""
        self._step_buckets = (encoder, decoder)

    def _bucket(self, layer: LayerParams, rows: int) -> int | None:
        if self._step_buckets is None:
            return self.bucket_for(rows)
        encoder, decoder = self._step_buckets
        return decoder if layer.layer_id >= self._decoder_start else encoder

    def _run(self, part: str, layer: LayerParams, rows: int, run: Callable[[LayerParams, _Buffers], None]) -> None:
        graph = self._graphs.get((layer.layer_id, part, rows))
        if graph is not None:
            graph.replay()
        elif self.capture:
            raise RuntimeError(f"token graphs: layer {layer.layer_id} {part} at {rows} rows was never captured")
        else:
            run(layer, self._buffers[rows])

    # -- model/runtime.LayerSegments --------------------------------------------------------

    def open_layer(
        self, layer: LayerParams, streams: torch.Tensor, pre: torch.Tensor, table_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, HcMix, torch.Tensor]:
        rows = streams.shape[0]
        bucket = self._bucket(layer, rows)
        if bucket is None:
            return self.runtime.open_layer(layer, streams, pre, table_rows)
        buffers = self._buffers[bucket]
        _put(buffers.streams, streams)
        _put(buffers.pre, pre)
        if table_rows is not None:
            _put(buffers.table_rows, table_rows)
        self._run("open", layer, bucket, self._open_part)
        mix = buffers.mix
        return (
            buffers.opened[:rows],
            HcMix(pre=mix.pre[:rows], post=mix.post[:rows], comb=mix.comb[:rows]),
            buffers.attention_input[:rows],
        )

    def close_layer(
        self, layer: LayerParams, streams: torch.Tensor, y: torch.Tensor, mix: HcMix, moe: MoESteps | None
    ) -> Steps[tuple[torch.Tensor, torch.Tensor]]:
        if moe is not None:
            raise ValueError("moe: a microbatch's MoE steps (allowed: None; token graphs run the runtime's own MoE)")
        rows = streams.shape[0]
        bucket = self._bucket(layer, rows)
        if bucket is None:
            return (yield from self.runtime.close_layer(layer, streams, y, mix, None))
        buffers = self._buffers[bucket]
        _put(buffers.opened, streams)
        _put(buffers.attention_output, y)
        for mine, part in zip((buffers.mix.pre, buffers.mix.post, buffers.mix.comb), (mix.pre, mix.post, mix.comb)):
            _put(mine, part)
        self._run("close", layer, bucket, self._close_part)
        return buffers.streams[:rows], buffers.pre[:rows]

    def pad_layer(self, layer: LayerParams, moe: MoESteps | None) -> Steps[None]:
        """A rank none of whose rows reach ``layer``: under DP attention its close part
        replayed at the step's bucket on whatever its buffers hold (no real row), so
        its MoE collectives meet the peers'; elsewhere the runtime's own."""
        bucket = None if self._step_buckets is None else self._bucket(layer, 0)
        if bucket is None:
            return (yield from self.runtime.pad_layer(layer, moe))
        self._run("close", layer, bucket, self._close_part)
