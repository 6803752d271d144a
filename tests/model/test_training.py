"""Training the tiny model (model/training.py): the training forward is the inference
arithmetic, its gradients reach the weights behind the roundings, and the corpus split
is fixed."""

from __future__ import annotations

import torch

from dsv41.model.reference import ReferenceModel
from dsv41.model.tiny import TINY, build_tokenizer
from dsv41.model.training import HELDOUT_EVERY, Corpus, TrainableModel, straight_through_roundings, target_loss


def test_straight_through_roundings_change_no_value_and_let_gradients_through() -> None:
    """Under straight_through_roundings the reference's logits are bit-identical, and the
    window-KV and compressor weights, which sit behind FP8 / NVFP4 roundings, get
    gradients; without it those roundings cut them off."""
    trainable = TrainableModel.initial(TINY, build_tokenizer(TINY), seed=0)
    model = ReferenceModel(trainable.params, batch_invariant=False)
    window = torch.randint(3, trainable.config.vocab_size, (97,), generator=torch.Generator().manual_seed(0))
    behind_roundings = ("layers.0.attn.wkv.weight", "layers.2.attn.compressor.wkv.weight")
    leaves = [trainable.leaves[name] for name in behind_roundings]
    for leaf in leaves + [trainable.leaves["head.weight"]]:
        leaf.requires_grad_(True)
    plain = model.forward(window).logits
    target_loss(model, window).backward()
    assert all(leaf.grad is None for leaf in leaves)
    with straight_through_roundings():
        assert torch.equal(model.forward(window).logits, plain)
        target_loss(model, window).backward()
    assert all(leaf.grad is not None and leaf.grad.abs().sum() > 0 for leaf in leaves)


def test_the_corpus_holds_out_every_eighth_module_by_name() -> None:
    """The standard library's top-level modules, sorted by name: every HELDOUT_EVERY-th
    is held out, the rest train, none in both."""
    corpus = Corpus.stdlib()
    files = sorted(corpus.train + corpus.heldout, key=lambda path: path.name)
    assert corpus.heldout == tuple(files[HELDOUT_EVERY - 1 :: HELDOUT_EVERY])
    assert not set(corpus.train) & set(corpus.heldout)
    assert all(path.parent == corpus.root and path.suffix == ".py" for path in files)
