"""The output wire (no Ray): a frame carries a step's delta outputs as they are, the
receiver hands back the engine's own outputs, a lost frame is refused, and a step's
frame does not grow with how long outputs already are."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from dsv41.actors.output_wire import OutputReceiver, OutputSender, OutputWireError
from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams

OPTIONS = dict(block_size=32, max_num_seqs=8, max_num_batched_tokens=64)
PROMPTS = [[5, 9, 200, 17, 3], [40, 41, 42], list(range(60, 100)), [7, 8]]


def _stop_string(engine: Engine, prompt: list[int]) -> str:
    """Two characters an uninterrupted greedy run of ``prompt`` produces a few tokens
    in: a stop string that the run meets, with text held back before it."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    text = engine.generate([prompt], params)[0].text
    assert len(text) >= 8, text
    return text[4:6]


def test_frames_carry_every_steps_outputs_exactly(tiny_dir: Path) -> None:
    """A mix of greedy, sampled with logprobs and prompt logprobs, n=3 and stop-string
    requests, one of them aborted midway: at every step the receiver's outputs,
    through pickle, equal the engine's own deltas (tokens, text, logprobs, reasons,
    counts, phase times)."""
    engine = Engine.from_pretrained(tiny_dir, **OPTIONS)
    stop = _stop_string(engine, PROMPTS[0])
    requests = {
        "greedy": (PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
        "stopped": (PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])),
        "logprobs": (PROMPTS[2], SamplingParams(max_tokens=7, temperature=1.0, seed=3, logprobs=2, prompt_logprobs=1)),
        "samples": (PROMPTS[1], SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=3)),
        "aborted": (PROMPTS[3], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)),
    }
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    sender, receiver = OutputSender(), OutputReceiver()
    seen = set()
    timed = set()
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        assert receiver.outputs(pickle.loads(pickle.dumps(sender.frame(outputs)))) == outputs
        timed.update(o.request_id for o in outputs if o.phase_times is not None)
        seen.update((o.request_id, o.finish_reason, o.stop_reason) for o in outputs if o.finished)
        steps += 1
        if steps == 3:
            assert engine.abort("aborted")
    assert ("stopped", "stop", stop) in seen
    # Every sequence's first-token output carried its phase times across.
    assert timed == {"greedy", "stopped", "logprobs", "aborted"} | {f"samples#{i}" for i in range(3)}
    assert {f"samples#{i}" for i in range(3)} <= {rid for rid, _, _ in seen}


def test_a_lost_frame_is_refused() -> None:
    """Frames are numbered: one that skips a number raises instead of handing out
    outputs that do not follow what the caller has."""
    sender, receiver = OutputSender(), OutputReceiver()
    receiver.outputs(sender.frame([]))
    sender.frame([])
    with pytest.raises(OutputWireError, match="frame 3 after frame 1"):
        receiver.outputs(sender.frame([]))


def test_a_decode_frame_does_not_grow_with_the_output(tiny_dir: Path) -> None:
    """A decode step's frame is as big at 60 output tokens as at 3: each request
    carries only what it gained."""
    engine = Engine.from_pretrained(tiny_dir, **OPTIONS)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    sender = OutputSender()
    sizes = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if len(outputs) == len(PROMPTS) and all(not o.finished for o in outputs):
            sizes.append(len(pickle.dumps(sender.frame(outputs))))
    assert len(sizes) > 50
    assert max(sizes[-5:]) <= max(sizes[:5]) + 64
