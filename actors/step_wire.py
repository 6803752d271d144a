"""The bytes of one rank's step and of its result, as every step transport carries them.

Owns the step wire between the group's driver and one rank: ``StepPacker`` (the
driver's end, one per rank and wire session) turns a ScheduledBatch and the step's DP
metadata words (None for a group of one rank) into bytes; ``StepUnpacker`` (the
rank's end) turns them back into the same ScheduledBatch; ``pack_result`` / ``unpack_result`` do the same for a StepResult.

A running request's segment repeats most of itself step after step: its sampling
parameters never change and its PAGE table only grows. The packer remembers, per
request, what the rank was last sent and sends only the difference: the parameters
once, then "as before"; the PAGE table as the count of PAGEs kept plus the new ones.
The rest of a segment travels as a tuple of its field values (no per-object pickling
of dataclasses). The packer bounds what it remembers (least recently sent first) and
names what it forgot with the step it forgot them in (the rank drops them after that
step's rows), so both ends hold the same table without knowing when a request
finishes. A session id starts each pairing afresh: a rank that sees a new session
drops its table (new transport, new generation, or a benchmark reusing ranks).

Must not import: deploy, ray.
"""

from __future__ import annotations

import dataclasses
import operator
import pickle
import secrets
from collections import OrderedDict
from typing import Any

from dsv41.cluster.batch import ScheduledBatch, ScheduledSegment
from dsv41.cluster.runner import SampledToken, StepResult
from dsv41.cluster.sampling_params import SamplingParams

SEGMENT_FIELDS = tuple(f.name for f in dataclasses.fields(ScheduledSegment))
_ID_AT = SEGMENT_FIELDS.index("request_id")
_PARAMS_AT = SEGMENT_FIELDS.index("params")
_PAGES_AT = SEGMENT_FIELDS.index("page_table")
_segment_values = operator.attrgetter(*SEGMENT_FIELDS)
# Requests a packer remembers per rank: far above any running batch, so a request is
# re-sent whole only after that many others were sent since it last ran.
DEFAULT_CAPACITY = 4096


class StepWireError(RuntimeError):
    """Bytes that do not decode against this end's table: a wire bug, never data."""


@dataclasses.dataclass
class _Sent:
    params: SamplingParams
    page_table: tuple[int, ...]


class StepPacker:
    """The driver's end of one rank's wire for one session."""

    def __init__(self, session: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: {capacity} (allowed: >= 1)")
        self.session = session
        self.capacity = capacity
        self._sent: OrderedDict[str, _Sent] = OrderedDict()

    def pack(self, batch: ScheduledBatch, metadata_words: list[int] | None) -> bytes:
        rows = []
        for segment in batch.segments:
            values = list(_segment_values(segment))
            known = self._sent.get(segment.request_id)
            kept = 0
            if known is not None:
                self._sent.move_to_end(segment.request_id)
                if known.params is segment.params or known.params == segment.params:
                    values[_PARAMS_AT] = None
                else:
                    known.params = segment.params
                old, new = known.page_table, segment.page_table
                if new[: len(old)] == old:
                    kept = len(old)
                    values[_PAGES_AT] = new[kept:]
                known.page_table = new
            else:
                self._sent[segment.request_id] = _Sent(segment.params, segment.page_table)
            rows.append((kept, values))
        forgotten = []
        while len(self._sent) > self.capacity:
            forgotten.append(self._sent.popitem(last=False)[0])
        step = (self.session, batch.step_id, forgotten, rows, metadata_words)
        return pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)


def session_packers(world: int) -> list[StepPacker]:
    """One packer per rank for a new wire session (a random id no earlier session of
    these ranks had)."""
    session = secrets.randbits(63)
    return [StepPacker(session) for _ in range(world)]


class StepUnpacker:
    """A rank's end of its wire: rebuilds each step's ScheduledBatch."""

    def __init__(self) -> None:
        self.session: int | None = None
        self._sent: dict[str, _Sent] = {}

    def unpack(self, data: bytes) -> tuple[ScheduledBatch, list[int] | None]:
        session, step_id, forgotten, rows, metadata_words = pickle.loads(data)
        if session != self.session:
            self.session, self._sent = session, {}
        segments = []
        for kept, values in rows:
            request_id = values[_ID_AT]
            known = self._sent.get(request_id)
            if known is None:
                if kept or values[_PARAMS_AT] is None:
                    raise StepWireError(
                        f"session {session} step {step_id}: {request_id!r} refers to a table entry this rank lacks"
                    )
                known = self._sent[request_id] = _Sent(values[_PARAMS_AT], ())
            if values[_PARAMS_AT] is None:
                values[_PARAMS_AT] = known.params
            else:
                known.params = values[_PARAMS_AT]
            pages = known.page_table[:kept] + values[_PAGES_AT]
            values[_PAGES_AT] = known.page_table = pages
            # Fields the driver's ScheduledSegment already validated: restored as
            # pickle restores a dataclass, without running __init__ again.
            segment = object.__new__(ScheduledSegment)
            segment.__dict__.update(zip(SEGMENT_FIELDS, values))
            segments.append(segment)
        for request_id in forgotten:  # the packer forgot them after packing this step
            del self._sent[request_id]
        return ScheduledBatch(step_id, tuple(segments)), metadata_words


def pack_result(result: StepResult) -> bytes:
    sampled = [(request_id, token.token_id, token.logprobs) for request_id, token in result.sampled.items()]
    return pickle.dumps(
        (result.step_id, sampled, result.row_logits, result.row_selections), protocol=pickle.HIGHEST_PROTOCOL
    )


def unpack_result(data: bytes) -> StepResult:
    step_id, sampled, row_logits, row_selections = pickle.loads(data)
    tokens: dict[str, Any] = {request_id: SampledToken(token_id, logprobs) for request_id, token_id, logprobs in sampled}
    return StepResult(step_id=step_id, sampled=tokens, row_logits=row_logits, row_selections=row_selections)
