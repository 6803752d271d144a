"""The output wire (no Ray): deltas rebuild every step's outputs exactly, both ends
forget what ended, and a step's frame does not grow with how long outputs already are."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from dsv41.actors.output_wire import OutputReceiver, OutputSender, OutputWireError
from dsv41.cluster.engine import Engine
from dsv41.cluster.request import RequestOutput, SamplingParams

OPTIONS = dict(block_size=32, max_num_seqs=8, max_num_batched_tokens=64)
PROMPTS = [[5, 9, 200, 17, 3], [40, 41, 42], list(range(60, 100)), [7, 8]]


def _stop_string(engine: Engine, prompt: list[int]) -> str:
    """Two characters an uninterrupted greedy run of ``prompt`` produces a few tokens
    in: a stop string that the run meets, with text held back before it."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    text = engine.generate([prompt], params)[0].text
    assert len(text) >= 8, text
    return text[4:6]


def test_deltas_rebuild_every_output_and_both_ends_forget_what_ended(tiny_dir: Path) -> None:
    """A mix of greedy, sampled with logprobs and prompt logprobs, n=3 and stop-string
    requests, one of them aborted midway: at every step the receiver's outputs equal
    the engine's own (tokens, text, logprobs, reasons), and once all ended neither end
    holds a request."""
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
    seen: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        rebuilt = receiver.outputs(pickle.loads(pickle.dumps(sender.frame(outputs))))
        assert rebuilt == outputs
        seen.update((o.request_id, o) for o in outputs)
        steps += 1
        if steps == 3:
            assert engine.abort("aborted")
            sender.forget("aborted")
            receiver.forget("aborted")
    assert seen["stopped"].finish_reason == "stop" and seen["stopped"].stop_reason == stop
    assert seen["logprobs"].logprobs is not None and seen["logprobs"].prompt_logprobs is not None
    assert {f"samples#{i}" for i in range(3)} <= set(seen)
    assert sender.num_requests == receiver.num_requests == 0


def test_a_lost_frame_is_refused() -> None:
    """The receiver takes frames in order only: a skipped frame raises instead of
    appending a later delta to an older output."""
    sender, receiver = OutputSender(), OutputReceiver()
    receiver.outputs(sender.frame([]))
    sender.frame([])
    with pytest.raises(OutputWireError, match="lost"):
        receiver.outputs(sender.frame([]))


def test_a_decode_frame_does_not_grow_with_the_outputs_so_far(tiny_dir: Path) -> None:
    """Eight requests decoding: the pickled frame of step 40 is no larger than that of
    step 5 (plus a few bytes for longer step numbers and text), while their cumulative
    outputs are several times larger."""
    engine = Engine.from_pretrained(tiny_dir, **OPTIONS)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", [3 + i, 40, 41], params)
    sender = OutputSender()
    sizes: dict[int, tuple[int, int]] = {}
    for step in range(1, 41):
        outputs = engine.step()
        sizes[step] = (len(pickle.dumps(sender.frame(outputs))), len(pickle.dumps(outputs)))
    (early_frame, early_whole), (late_frame, late_whole) = sizes[5], sizes[40]
    assert late_frame <= early_frame + 64
    assert late_whole > 3 * early_whole
