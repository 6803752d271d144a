"""Decoder SWA bounded replay: which rows of a prompt the decoder computes.

Owns the rule of the spec's "Decoder SWA bounded replay" (MODEL_FACTS section 10)
that the dense oracle (model/reference.py) and the paged runtime (model/runtime.py)
both follow. V4.1's decoder (layers from the last KV source on) reads the encoder only
through the KV source's compressed KV and index keys, and otherwise only its own
sliding windows; so at the end of a prompt of P tokens, with W the window:

- every row runs the encoder, and the KV source's compressed KV and index keys;
- the tail, the last W rows (every row when P <= W), starting at ``tail_start``, runs
  the decoder layers but the last, and the last layer's window KV; every decoder
  window starts at the tail: a tail row at position i reads [max(s, i - W + 1), i];
- the rows whose next-token logits are wanted (the prompt's last, and every decoded
  row after it) run the last layer's query, attention and FFN.

Decode steps then run every layer on their rows; their windows never reach below the
tail (position P reads from P - W + 1 > s). The last token's logits, and every decoder
ring row decode reads, differ from a full prefill's (the spec's accuracy note: from
the second decoder layer on a tail row's window holds rows computed from truncated
windows; the model is post-trained on this truncation); the encoder rows, the global
KV and the KV source's top-k selection are a full prefill's exactly. A prompt no
longer than the window is its own tail, and its logits are the full prefill's.

Also owns how a stage's selection state is cut to a subset of its rows (the last
layer's queries are fewer than its KV rows). Must not import: cache, cluster, actors,
deploy, ray.
"""

from __future__ import annotations

import torch

from dsv41.model.indexer import SelectionState


def tail_start(num_prompt_tokens: int, window: int) -> int:
    """The first position of a prompt's tail: the first row the decoder computes."""
    if num_prompt_tokens < 1 or window < 1:
        raise ValueError(
            f"tail_start: num_prompt_tokens {num_prompt_tokens}, window {window} (allowed: both >= 1)"
        )
    return max(0, num_prompt_tokens - window)


def selection_rows(state: SelectionState, rows: torch.Tensor | slice) -> SelectionState:
    """``state``'s selections and candidates of ``rows`` only: what a layer whose
    queries are a subset of the stage's rows selects from and publishes into."""
    candidates = None if state.candidates is None else state.candidates[rows]
    selections = {layer: picked[rows] for layer, picked in state.selections.items()}
    return SelectionState(selections=selections, candidates=candidates)
