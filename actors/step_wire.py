"""The bytes of one rank's step and of its result, as every step transport carries them.

Owns the step wire between the group's driver and one rank: ``pack_step`` turns a
ScheduledBatch and the step's DP metadata words (None for a group of one rank) into
bytes, ``unpack_step`` turns them back into the same ScheduledBatch; ``pack_result`` /
``unpack_result`` do the same for a StepResult.

The batch is a delta already (cluster/batch.py): a request's sampling parameters and
seed travel in its first segment on the rank alone, a segment's PAGEs as those its
table gained since its last segment, and the requests that left the rank by id; the
rank's PersistentBatch keeps the rest. So the wire keeps no state and compares
nothing: each segment travels as the tuple of its field values (no per-object
pickling of the segment dataclass), all of a step in one pickle.

Must not import: deploy, ray.
"""

from __future__ import annotations

import dataclasses
import operator
import pickle
from typing import Any

from dsv41.cluster.batch import ScheduledBatch, ScheduledSegment
from dsv41.cluster.runner import SampledToken, StepResult

SEGMENT_FIELDS = tuple(f.name for f in dataclasses.fields(ScheduledSegment))
_segment_values = operator.attrgetter(*SEGMENT_FIELDS)


def pack_step(batch: ScheduledBatch, metadata_words: list[int] | None) -> bytes:
    rows = [_segment_values(segment) for segment in batch.segments]
    step = (batch.step_id, batch.released_request_ids, rows, metadata_words)
    return pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_step(data: bytes) -> tuple[ScheduledBatch, list[int] | None]:
    step_id, released, rows, metadata_words = pickle.loads(data)
    segments = []
    for values in rows:
        # Fields the driver's ScheduledSegment already validated: restored as pickle
        # restores a dataclass, without running __init__ again.
        segment = object.__new__(ScheduledSegment)
        segment.__dict__.update(zip(SEGMENT_FIELDS, values))
        segments.append(segment)
    return ScheduledBatch(step_id, tuple(segments), released), metadata_words


def pack_result(result: StepResult) -> bytes:
    sampled = [(request_id, token.token_id, token.logprobs) for request_id, token in result.sampled.items()]
    return pickle.dumps(
        (result.step_id, sampled, result.row_logits, result.row_selections), protocol=pickle.HIGHEST_PROTOCOL
    )


def unpack_result(data: bytes) -> StepResult:
    step_id, sampled, row_logits, row_selections = pickle.loads(data)
    tokens: dict[str, Any] = {request_id: SampledToken(token_id, logprobs) for request_id, token_id, logprobs in sampled}
    return StepResult(step_id=step_id, sampled=tokens, row_logits=row_logits, row_selections=row_selections)
