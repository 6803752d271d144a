"""The step wire: what a rank unpacks is exactly what the driver packed, and a step
carries the scheduler's deltas as they are.

Properties: any ScheduledBatch — new and running requests' segments, PAGE deltas
(kept and new PAGEs), slot preparations, images, fills and publications, sampling
guides, released requests — and its metadata words come back equal from
``unpack_step(pack_step(...))``, with no state on either end; a running request's
decode step carries neither its sampling parameters nor any PAGE it sent before, so
its bytes do not grow with its table; StepResults round-trip too.
"""

from __future__ import annotations

import pickle

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.actors.step_wire import pack_result, pack_step, unpack_result, unpack_step
from dsv41.cache.block_manager import StateImage
from dsv41.cache.offload import OffloadKey, UnitKind
from dsv41.cluster.batch import NewRequestData, ScheduledBatch, ScheduledSegment, SlotReset
from dsv41.cluster.offload_connector import PageFill, PagePublish
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
IMAGE = StateImage(layout_id="L", pages=(7, 8), image_bytes=100, num_tokens=64)
PREPARATIONS = [{}, {"reset": SlotReset(32, (4, 5))}, {"restore": IMAGE}]
EXTRAS = [
    {},
    {"store_after": IMAGE},
    {"fetch": (PageFill(pages=(3,), handle=("pin", 1)),)},
    {"publish": (PagePublish(pages=(4,), key=OffloadKey("L", b"\x01" * 16, UnitKind.PAGE)),)},
]
PAGES = st.lists(st.integers(0, 99), max_size=5).map(tuple)


@st.composite
def segments(draw: st.DrawFn, request_id: str) -> ScheduledSegment:
    new = draw(st.booleans())
    start = draw(st.integers(0, 500))
    return ScheduledSegment(
        request_id=request_id,
        slot=draw(st.integers(0, 7)),
        start=start,
        token_ids=tuple(draw(st.lists(st.integers(0, 1000), min_size=1, max_size=3))),
        write_from=draw(st.integers(0, start)),
        window_start=draw(st.integers(0, start)),
        sample=draw(st.booleans()),
        output_index=draw(st.integers(0, 9)),
        num_prompt_tokens=draw(st.integers(1, 400)),
        new_pages=draw(PAGES),
        kept_pages=0 if new else draw(st.integers(0, 60)),
        new_request=NewRequestData(draw(st.sampled_from(PARAMS)), draw(st.integers(0, 2**32))) if new else None,
        guide=draw(st.sampled_from(GUIDES)),
        want_prompt_logits=draw(st.booleans()),
        **draw(st.sampled_from(PREPARATIONS)),
        **draw(st.sampled_from(EXTRAS)),
    )


@st.composite
def batches(draw: st.DrawFn) -> ScheduledBatch:
    ids = draw(st.lists(st.sampled_from(REQUEST_IDS), unique=True, max_size=4))
    released = draw(st.lists(st.sampled_from(REQUEST_IDS), unique=True, max_size=3))
    return ScheduledBatch(draw(st.integers(0, 10**6)), tuple(draw(segments(rid)) for rid in ids), tuple(released))


@settings(max_examples=200, deadline=None)
@given(batch=batches(), words=st.none() | st.lists(st.integers(0, 2**40), max_size=8))
def test_every_unpacked_batch_equals_the_packed_one(batch: ScheduledBatch, words: list[int] | None) -> None:
    """Whatever the batch holds, the rank rebuilds it equal, and the metadata words."""
    assert unpack_step(pack_step(batch, words)) == (batch, words)


def _decode_step(kept: int) -> bytes:
    segment = ScheduledSegment(
        request_id="r", slot=0, start=100 * kept, token_ids=(5,), write_from=0, window_start=0, sample=True,
        output_index=9, num_prompt_tokens=20, new_pages=(41,), kept_pages=kept,
    )
    return pack_step(ScheduledBatch(2, (segment,)), [])


def test_a_running_decode_step_carries_no_parameters_and_only_its_new_pages() -> None:
    """A running request's decode segment holds its one new PAGE and how many the rank
    keeps, no SamplingParams; its bytes are the same at 40 PAGEs kept as at 200."""
    _, _, rows, _ = pickle.loads(_decode_step(40))
    ((values),) = rows
    assert (41,) in values and 40 in values
    assert not any(isinstance(v, (SamplingParams, NewRequestData)) for v in values)
    assert len(_decode_step(40)) == len(_decode_step(200))


def test_results_round_trip() -> None:
    """A StepResult's sampled tokens, logprobs, row logits and selections come back equal."""
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
