"""The engine's phase times (``RequestOutput.phase_times``): a sequence's first-token
output alone carries them, its queue time covers the steps it waited through, and
its prefill time the steps its chunked prompt took."""

from __future__ import annotations

import time
from pathlib import Path

from dsv41.cluster.engine import Engine
from dsv41.cluster.request import RequestOutput
from dsv41.cluster.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _run(engine: Engine) -> list[tuple[float, float, list[RequestOutput]]]:
    """Every step until the engine is idle: (start, end, outputs)."""
    steps = []
    while engine.has_unfinished_requests():
        start = time.monotonic()
        outputs = engine.step()
        steps.append((start, time.monotonic(), outputs))
    return steps


def test_queue_time_covers_the_wait_and_only_first_outputs_carry_times(tiny_dir: Path) -> None:
    """With one sequence running at a time, three requests queued together: each
    request's first output (and no other) carries its phase times, both >= 0; a
    request's queue time is at least the time from the last add until the request
    before it finished (it could not be scheduled before that)."""
    engine = Engine.from_pretrained(tiny_dir, block_size=32, max_num_seqs=1, max_model_len=256)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 9, 200, 17, 3], PARAMS)
    added = time.monotonic()
    steps = _run(engine)
    phases, finished_at = {}, {}
    for _, end, outputs in steps:
        for output in outputs:
            first = output.num_output_tokens == len(output.token_ids) and output.token_ids
            assert (output.phase_times is not None) == bool(first), output
            if output.phase_times is not None:
                phases[output.request_id] = output.phase_times
            if output.finished:
                finished_at[output.request_id] = end
    assert set(phases) == {"r0", "r1", "r2"}
    assert all(p.queue_s >= 0 and p.prefill_s >= 0 for p in phases.values())
    for before, after in (("r0", "r1"), ("r1", "r2")):
        assert phases[after].queue_s >= finished_at[before] - added


def test_prefill_time_covers_every_chunk_of_the_prompt(tiny_dir: Path) -> None:
    """A 100-token prompt prefilled 16 tokens a step: its prefill time is at least
    the time of every step that ran strictly between its first chunk's step and the
    step that sampled its first token (all of them lie inside that interval)."""
    engine = Engine.from_pretrained(
        tiny_dir, block_size=32, max_num_batched_tokens=16, long_prefill_token_threshold=16, max_model_len=256
    )
    engine.add_request("long", list(range(10, 110)), PARAMS)
    steps = _run(engine)
    first = next(i for i, (_, _, outputs) in enumerate(steps) if any(o.phase_times for o in outputs))
    assert first >= 6, "the prompt took one chunk per step"
    phase = next(o.phase_times for o in steps[first][2] if o.phase_times is not None)
    assert phase.prefill_s >= sum(end - start for start, end, _ in steps[1:first])
