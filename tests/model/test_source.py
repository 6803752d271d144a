"""Model sources: a checkpoint directory or a generated slice, named by one string.

Properties: every source round-trips through its string (the form that crosses to Ray
actors); a bad source string or field is refused naming what is allowed; a checkpoint
source loads exactly what the loader reads from that directory; a generated source's
config and tokenizer are the slice's own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.params import load_model_params
from dsv41.model.reference_slice import DENSE_FORMATS, EXPERT_FORMATS, SMALL_SLICE, SliceModel
from dsv41.model.source import SLICES, ModelSource, ModelSourceError


@given(
    name=st.sampled_from(sorted(SLICES)),
    experts=st.sampled_from(EXPERT_FORMATS),
    dense=st.sampled_from(DENSE_FORMATS),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_generated_sources_round_trip_through_their_string(name: str, experts: str, dense: str, seed: int) -> None:
    """parse(str(source)) == source, and the short form takes the defaults."""
    source = ModelSource(slice_name=name, expert_format=experts, dense_format=dense, seed=seed)
    assert ModelSource.parse(str(source)) == source
    assert ModelSource.parse(f"generated:{name}") == ModelSource(slice_name=name)
    assert ModelSource.parse(source) is source


def test_a_directory_is_a_checkpoint_source(tmp_path: Path) -> None:
    """Any string without the generated: prefix names a checkpoint directory."""
    assert ModelSource.parse(tmp_path) == ModelSource(checkpoint_dir=tmp_path)
    assert str(ModelSource.parse(str(tmp_path))) == str(tmp_path)


@pytest.mark.parametrize(
    "text, named",
    [
        ("generated:no-such-slice", "slice_name"),
        ("generated:small-slice,experts=fp8", "expert_format"),
        ("generated:small-slice,dense=fp4", "dense_format"),
        ("generated:small-slice,seed=-1", "seed"),
        ("generated:small-slice,seed=x", "seed"),
        ("generated:small-slice,dtype=bf16", "allowed: experts"),
        ("generated:small-slice,seed=1,seed=2", "each once"),
        ("generated:small-slice,experts", "allowed: experts"),
    ],
)
def test_bad_sources_are_refused_naming_what_is_allowed(text: str, named: str) -> None:
    with pytest.raises(ModelSourceError, match=rf"{named}.*allowed|allowed.*{named}|{named}"):
        ModelSource.parse(text)


def test_a_source_is_one_kind() -> None:
    with pytest.raises(ModelSourceError, match="exactly one"):
        ModelSource()
    with pytest.raises(ModelSourceError, match="exactly one"):
        ModelSource(checkpoint_dir=Path("x"), slice_name="small-slice")


def test_checkpoint_source_loads_what_the_loader_reads(tiny_dir: Path) -> None:
    """The same tensors as load_model_params, the same tokenizer and config."""
    source = ModelSource.parse(tiny_dir)
    params, tokenizer = source.load_params(dtype=torch.float32)
    want, checkpoint = load_model_params(tiny_dir, dtype=torch.float32, text_only=True)
    assert source.config() == want.config == params.config
    assert tokenizer.to_str() == checkpoint.tokenizer.to_str() == source.tokenizer().to_str()
    assert torch.equal(params.embed, want.embed)
    assert torch.equal(params.layers[-1].attn.wo_b, want.layers[-1].attn.wo_b)


def test_generated_source_is_the_slice() -> None:
    """Config and tokenizer of generated:small-slice are SliceModel.build's."""
    model = SliceModel.build(SMALL_SLICE, V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True))
    source = ModelSource.parse("generated:small-slice")
    assert source.config() == model.config
    assert source.tokenizer().to_str() == model.tokenizer.to_str()
