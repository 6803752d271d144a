"""The step wire: what a rank unpacks is exactly what the driver packed.

Properties: over any sequence of batches — requests that come and go, whose PAGE
tables grow or are replaced (preemption, restore), whose sampling parameters change
— the rank's StepUnpacker rebuilds every ScheduledBatch equal to the packed one, with
the packer remembering as few requests as 1 (so it forgets and re-sends constantly);
a decode step of known requests sends no parameters and no old PAGE; a new session
starts the rank's table afresh, and bytes that refer to a table entry the rank lacks
are refused. StepResults round-trip too.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.actors.step_wire import StepPacker, StepUnpacker, StepWireError, pack_result, session_packers, unpack_result
from dsv41.cluster.batch import ScheduledBatch, ScheduledSegment
from dsv41.cluster.runner import SampledToken, StepResult
from dsv41.cluster.sampling_guide import SamplingGuide
from dsv41.cluster.sampling_params import SamplingParams, StructuredOutputs

REQUEST_IDS = [f"req-{i}" for i in range(6)]
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3),
    SamplingParams(max_tokens=4),
    SamplingParams(presence_penalty=0.5, logit_bias={3: 1.0}, structured_outputs=StructuredOutputs(regex="[a-z]+")),
]
GUIDES = [None, SamplingGuide(b"\xff\x00\x00\x01"), SamplingGuide(None, (1, 5, 9), (0, 2, 1))]


@st.composite
def batch_sequences(draw: st.DrawFn) -> list[ScheduledBatch]:
    tables: dict[str, tuple[int, ...]] = {}
    batches = []
    for step_id in range(draw(st.integers(1, 12))):
        segments = []
        for request_id in draw(st.lists(st.sampled_from(REQUEST_IDS), unique=True, max_size=4)):
            table = tables.get(request_id, ())
            change = draw(st.sampled_from(["keep", "grow", "replace"]))
            if change == "grow" or not table:
                table += tuple(draw(st.lists(st.integers(0, 99), min_size=1, max_size=3)))
            elif change == "replace":
                table = tuple(draw(st.lists(st.integers(0, 99), min_size=1, max_size=5)))
            tables[request_id] = table
            segments.append(
                ScheduledSegment(
                    request_id=request_id,
                    slot=draw(st.integers(0, 7)),
                    page_table=table,
                    start=draw(st.integers(0, 500)),
                    token_ids=tuple(draw(st.lists(st.integers(0, 1000), min_size=1, max_size=3))),
                    write_from=0,
                    window_start=0,
                    sample=draw(st.booleans()),
                    params=draw(st.sampled_from(PARAMS)),
                    seed=draw(st.integers(0, 2**32)),
                    output_index=draw(st.integers(0, 9)),
                    num_prompt_tokens=draw(st.integers(1, 400)),
                    guide=draw(st.sampled_from(GUIDES)),
                )
            )
        batches.append(ScheduledBatch(step_id, tuple(segments)))
    return batches


@settings(max_examples=150, deadline=None)
@given(batches=batch_sequences(), capacity=st.integers(1, 8))
def test_every_unpacked_batch_equals_the_packed_one(batches: list[ScheduledBatch], capacity: int) -> None:
    packer, unpacker = StepPacker(session=1, capacity=capacity), StepUnpacker()
    for batch in batches:
        words = [1, batch.step_id, 1]
        got, got_words = unpacker.unpack(packer.pack(batch, words))
        assert got == batch and got_words == words


def _decode_segment(request_id: str, pages: tuple[int, ...], start: int) -> ScheduledSegment:
    return ScheduledSegment(
        request_id=request_id, slot=0, page_table=pages, start=start, token_ids=(5,), write_from=0,
        window_start=0, sample=True, params=SamplingParams(temperature=0.5, seed=9), seed=1, output_index=start,
        num_prompt_tokens=start + 1,
    )


def test_a_known_decode_step_sends_neither_parameters_nor_old_pages() -> None:
    packer, unpacker = StepPacker(session=7), StepUnpacker()
    pages = tuple(range(40))
    unpacker.unpack(packer.pack(ScheduledBatch(1, (_decode_segment("r", pages, 100),)), []))
    _, _, _, rows, _ = pickle.loads(packer.pack(ScheduledBatch(2, (_decode_segment("r", pages + (41,), 101),)), []))
    ((kept, values),) = rows
    assert kept == 40 and (41,) in values and None in values
    assert not any(isinstance(v, SamplingParams) for v in values)


def test_a_new_session_starts_afresh_and_a_missing_entry_is_refused() -> None:
    unpacker = StepUnpacker()
    first = StepPacker(session=1)
    batch = ScheduledBatch(1, (_decode_segment("r", (1, 2), 10),))
    unpacker.unpack(first.pack(batch, []))
    (fresh,) = session_packers(1)
    assert unpacker.unpack(fresh.pack(batch, []))[0] == batch  # the new session's first step is whole
    later = ScheduledBatch(2, (_decode_segment("r", (1, 2), 11),))
    stale = first.pack(later, [])  # refers to session 1's entry, which the rank dropped
    with pytest.raises(StepWireError, match="lacks"):
        unpacker.unpack(stale)


def test_results_round_trip() -> None:
    result = StepResult(
        step_id=4,
        sampled={"a": SampledToken(3, None), "b": SampledToken(7, {7: -0.1, 2: -2.5})},
        row_logits={"a": torch.arange(6.0).reshape(2, 3)},
        row_selections={"a": {2: torch.tensor([[0, 1]])}},
    )
    got = unpack_result(pack_result(result))
    assert got.step_id == 4 and got.sampled == result.sampled
    assert torch.equal(got.row_logits["a"], result.row_logits["a"])
    assert torch.equal(got.row_selections["a"][2], result.row_selections["a"][2])
