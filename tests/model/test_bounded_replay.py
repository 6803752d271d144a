"""The dense oracle of decoder SWA bounded replay (model/bounded_replay.py) against the
full prefill, fp32 in the batch-invariant mode on the CPU.

What the spec says replay keeps exact is exact bit for bit: every encoder layer's
window KV and selections, every Full owner's compressed KV and index keys, and the
decoder's KV source's window KV and top-k selection on the tail (all of them computed
from the encoder's output). What it says changes does change: the last token's logits
and the decoder's ring rows past the KV source (the spec's accuracy note: "this is not
a full prefill"). A prompt no longer than the window is its own tail: its replay is the
full prefill's arithmetic, logits included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv41.model.bounded_replay import tail_start
from dsv41.model.params import load_model_params
from dsv41.model.reference import ReferenceModel, ReferenceOutput


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> ReferenceModel:
    model = ReferenceModel(load_model_params(tiny_dir)[0])
    assert model.batch_invariant, "the CPU default"
    return model


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_entries_equal(replay: ReferenceOutput, full: ReferenceOutput) -> None:
    assert replay.entries.keys() == full.entries.keys()
    for owner, entries in full.entries.items():
        assert torch.equal(replay.entries[owner].kv_unrounded, entries.kv_unrounded), f"owner {owner} KV"
        assert torch.equal(replay.entries[owner].index_keys, entries.index_keys), f"owner {owner} index keys"


@pytest.mark.parametrize("length", [33, 120, 300])
def test_the_encoder_and_the_global_path_are_the_full_prefills(reference: ReferenceModel, length: int) -> None:
    """Past the window: the encoder layers' window KV and selections on every row, the
    global KV, and the KV source's window KV and selection on the tail rows equal the
    full prefill's exactly."""
    cfg = reference.config
    topology = cfg.topology
    prompt = _prompt(cfg.vocab_size, length, length)
    full = reference.forward(prompt)
    replay = reference.forward(prompt, decoder_replay=True)
    tail = tail_start(length, cfg.sliding_window)
    assert replay.tail_start == tail == length - cfg.sliding_window
    for layer in topology.encoder_layers:
        assert torch.equal(replay.window_kv[layer], full.window_kv[layer]), f"encoder layer {layer}"
    for layer, selected in full.selections.items():
        if layer < topology.decoder_start:
            assert torch.equal(replay.selections[layer], selected), f"encoder layer {layer}"
    _assert_entries_equal(replay, full)
    source = topology.decoder_start
    assert topology.layer(source).is_candidate_source
    assert torch.equal(replay.window_kv[source], full.window_kv[source][tail:])
    assert torch.equal(replay.selections[source], full.selections[source][tail:])


@pytest.mark.parametrize("length", [33, 120, 300])
def test_the_last_logits_and_the_decoder_rings_differ_from_a_full_prefill(reference: ReferenceModel, length: int) -> None:
    """The spec's accuracy note, named: past the window the tail's windows are cut at
    the tail, so the last token's logits and the ring rows of every decoder layer after
    the KV source are not the full prefill's. Only the last token's logits come back,
    and the last layer's window KV covers the tail."""
    cfg = reference.config
    topology = cfg.topology
    prompt = _prompt(cfg.vocab_size, length, length)
    full = reference.forward(prompt)
    replay = reference.forward(prompt, decoder_replay=True)
    tail = replay.tail_start
    assert replay.logits.shape == (1, cfg.vocab_size)
    assert not torch.equal(replay.logits[0], full.logits[-1])
    for layer in topology.decoder_layers[1:]:
        assert replay.window_kv[layer].shape == (length - tail, cfg.head_dim)
        assert not torch.equal(replay.window_kv[layer], full.window_kv[layer][tail:]), f"decoder layer {layer}"


@pytest.mark.parametrize("length", [1, 2, 17, 32])
def test_a_prompt_no_longer_than_the_window_replays_as_the_full_prefill(reference: ReferenceModel, length: int) -> None:
    """A prompt of at most W tokens is its own tail: its replay computes the full
    prefill's last logits, window KV of every layer, global KV and selections bit for
    bit (the last layer's queries being the last row alone changes none of them)."""
    cfg = reference.config
    prompt = _prompt(cfg.vocab_size, length, 40 + length)
    full = reference.forward(prompt)
    replay = reference.forward(prompt, decoder_replay=True)
    assert replay.tail_start == 0
    assert torch.equal(replay.logits, full.logits[-1:])
    assert replay.window_kv.keys() == full.window_kv.keys()
    for layer, kv in full.window_kv.items():
        assert torch.equal(replay.window_kv[layer], kv), f"layer {layer}"
    for layer, selected in full.selections.items():
        want = selected[-1:] if layer == cfg.num_hidden_layers - 1 else selected
        assert torch.equal(replay.selections[layer], want), f"layer {layer}"
    _assert_entries_equal(replay, full)


def test_decoding_after_a_short_prompt_is_the_full_forward(reference: ReferenceModel) -> None:
    """A 20-token prompt (its own tail) then 25 decoded tokens, past the window: every
    decode row runs every layer with windows from the tail start (0), so the logits
    from the prompt's last row on are the full forward's."""
    cfg = reference.config
    tokens = _prompt(cfg.vocab_size, 45, 5)
    full = reference.forward(tokens)
    replay = reference.forward(tokens, decoder_replay=True, prompt_len=20)
    assert torch.equal(replay.logits, full.logits[19:])


def test_decoded_rows_do_not_depend_on_later_rows(reference: ReferenceModel) -> None:
    """Causality of the replayed request: a 90-token prompt and 30 decoded tokens; the
    logits of each row from the prompt's last on are those of the same request cut
    right after it, and the tail is the prompt's whatever follows."""
    cfg = reference.config
    tokens = _prompt(cfg.vocab_size, 120, 6)
    whole = reference.forward(tokens, decoder_replay=True, prompt_len=90)
    assert whole.logits.shape[0] == 31 and whole.tail_start == 90 - cfg.sliding_window
    for cut in (90, 91, 100, 120):
        part = reference.forward(tokens[:cut], decoder_replay=True, prompt_len=90)
        assert part.tail_start == whole.tail_start
        assert torch.equal(part.logits, whole.logits[: cut - 89]), f"cut {cut}"


def test_prompt_len_outside_the_sequence_or_without_replay_is_refused(reference: ReferenceModel) -> None:
    """prompt_len names the replayed prompt inside token_ids: 1..len(token_ids), and
    only under decoder_replay (a full forward computes every row's logits anyway)."""
    with pytest.raises(ValueError, match="prompt_len"):
        reference.forward([3, 4, 5], prompt_len=2)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="prompt_len"):
            reference.forward([3, 4, 5], decoder_replay=True, prompt_len=bad)
    with pytest.raises(ValueError, match="tail_start"):
        tail_start(0, 32)
