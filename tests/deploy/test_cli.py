"""The `dsv41` command line: each command does what DESIGN.md's interface says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.deploy.cli import default_model_dir, main
from dsv41.model.config import FLASH_CONFIG_DIR
from dsv41.model.params import load_model_params
from dsv41.model.reference import ReferenceModel

FLASH = FLASH_CONFIG_DIR


def test_logits_reference_and_paged_agree_and_match_the_model(tiny_dir: Path, tmp_path: Path) -> None:
    """`dsv41 logits` writes one float32 [len, vocab] tensor per name; the paged
    runtime fed in cycling chunks gives the reference's logits."""
    ids = {"one": [5, 9, 200, 17] * 20, "two": list(range(3, 70))}
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    for runtime in ("reference", "paged"):
        main(["logits", "--model", str(tiny_dir), "--ids", str(tmp_path / "ids.json"), "--out",
              str(tmp_path / f"{runtime}.safetensors"), "--runtime", runtime, "--chunk-sizes", "3,1,29,7"])
    ref = load_file(tmp_path / "reference.safetensors")
    paged = load_file(tmp_path / "paged.safetensors")
    direct = ReferenceModel(load_model_params(tiny_dir)[0])
    for name, seq in ids.items():
        assert ref[name].dtype == torch.float32 and ref[name].shape == (len(seq), direct.config.vocab_size)
        torch.testing.assert_close(ref[name], direct.forward(seq).logits)
        torch.testing.assert_close(paged[name], ref[name], rtol=1e-4, atol=1e-4)


def test_generate_json_prints_the_engines_greedy_tokens(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dsv41 generate --ids --json` prints {name: token ids}, the engine's greedy run."""
    ids = {"p": [7, 8, 9, 10, 11]}
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    main(["generate", "--model", str(tiny_dir), "--ids", str(tmp_path / "ids.json"), "--max-tokens", "5", "--json"])
    printed = json.loads(capsys.readouterr().out)
    engine = Engine.from_pretrained(tiny_dir)
    want = engine.generate([ids["p"]], SamplingParams(max_tokens=5, temperature=0.0))[0].token_ids
    assert printed == {"p": list(want)}


def _config_only(model_dir: Path, tmp_path: Path) -> Path:
    """``model_dir``'s config and tokenizer without its weights."""
    bare = tmp_path / "no-weights"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(model_dir / name, bare / name)
    return bare


def test_generate_with_prefill_tbo(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dsv41 generate --dp 2 --enable-tbo prefill` prints the tokens the same DP2 run
    prints without it; on one rank it exits with the reason before loading anything
    (a model directory with its config and tokenizer only)."""
    ids = {"p": list(range(3, 90)), "q": list(range(100, 140))}
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    args = ["generate", "--model", str(tiny_dir), "--ids", str(tmp_path / "ids.json"), "--max-tokens", "4", "--json"]
    printed = []
    for extra in ([], ["--enable-tbo", "prefill", "--tbo-prefill-min-tokens", "8"]):
        main([*args, "--dp", "2", *extra])
        printed.append(json.loads(capsys.readouterr().out))
    assert printed[0] == printed[1] and len(printed[0]["p"]) == 4
    with pytest.raises(SystemExit, match="enable_tbo_prefill.*1 DP rank"):
        main(["generate", "--model", str(_config_only(tiny_dir, tmp_path)), "--prompt", "x", "--max-tokens", "1",
              "--enable-tbo", "prefill"])


def test_every_command_works_on_a_transformers_written_checkpoint(
    hf_written_dir: Path, tiny_quantized_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the quantised tiny checkpoint whose config.json transformers wrote (every
    PretrainedConfig field at the top level and in text_config): `dsv41 logits` gives
    the released config's logits bit for bit on both runtimes, `dsv41 generate` its
    tokens, `dsv41 validate` passes, and the serve application builds and its replica's
    engine generates the same tokens."""
    from ray import serve

    from dsv41.deploy.app import build_app
    from dsv41.deploy.app_args import AppArgs
    from dsv41.deploy.llm_server import make_engine

    ids = {"p": list(range(3, 60))}
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    for runtime in ("reference", "paged"):
        for name, model in (("written", hf_written_dir), ("released", tiny_quantized_dir)):
            main(["logits", "--model", str(model), "--ids", str(tmp_path / "ids.json"), "--out",
                  str(tmp_path / f"{name}-{runtime}.safetensors"), "--runtime", runtime, "--chunk-sizes", "3,1,29,7"])
        written = load_file(tmp_path / f"written-{runtime}.safetensors")["p"]
        assert torch.equal(written, load_file(tmp_path / f"released-{runtime}.safetensors")["p"])
    tokens = {}
    for name, model in (("written", hf_written_dir), ("released", tiny_quantized_dir)):
        capsys.readouterr()
        main(["generate", "--model", str(model), "--ids", str(tmp_path / "ids.json"), "--max-tokens", "5", "--json"])
        tokens[name] = json.loads(capsys.readouterr().out)
    assert tokens["written"] == tokens["released"] and len(tokens["written"]["p"]) == 5
    main(["validate", "--model", str(hf_written_dir), "--output", str(tmp_path / "report.json"), "--scenarios", "slot_recycle"])
    assert json.loads((tmp_path / "report.json").read_text())["passed"]
    app_args = AppArgs.from_dict({"model": str(hf_written_dir)})
    assert isinstance(build_app(app_args), serve.Application)
    engine = make_engine(app_args)
    served = engine.generate([ids["p"]], SamplingParams(max_tokens=5, temperature=0.0))[0].token_ids
    assert list(served) == tokens["written"]["p"]


def test_geometry_prints_the_plane_table_for_flash(capsys: pytest.CaptureFixture[str]) -> None:
    """`dsv41 geometry` on the V4.1-Flash config shows the owners' planes and the
    PAGE/STATE byte sizes derived in tests/cache/test_geometry.py."""
    main(["geometry", "--model", str(FLASH), "--block-size", "128"])
    out = capsys.readouterr().out
    assert "369,920" in out or "369920" in out
    main(["geometry", "--model", str(FLASH), "--block-size", "128", "--kv-cache-dtype", "fp4", "--index-cache-dtype", "fp4"])
    out = capsys.readouterr().out
    assert "113,920" in out or "113920" in out


def test_make_tiny_writes_a_loadable_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dsv41 make-tiny DIR --quantized --seed 3` writes the official layout."""
    main(["make-tiny", str(tmp_path / "t"), "--quantized", "--seed", "3"])
    assert Path(capsys.readouterr().out.strip()) == tmp_path / "t"
    params, checkpoint = load_model_params(tmp_path / "t")
    assert checkpoint.config.quantization is not None and params.layers


def test_train_tiny_writes_a_loadable_checkpoint_and_the_default_is_the_shipped_one(
    trained_tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dsv41 train-tiny DIR --minutes 0.02` runs both phases (a few steps) and writes
    a checkpoint the loader reads with its DSpark stages; commands without --model use
    the shipped trained checkpoint."""
    main(["train-tiny", str(tmp_path / "t"), "--minutes", "0.02"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("target: ") and lines[1].startswith("DSpark: ") and Path(lines[2]) == tmp_path / "t"
    params, checkpoint = load_model_params(tmp_path / "t")
    assert checkpoint.has_dspark and params.dspark is not None
    assert default_model_dir() == trained_tiny_dir
    with pytest.raises(SystemExit):
        main(["train-tiny", str(tmp_path / "u"), "--minutes", "0"])


def test_bad_config_is_a_clean_error(tmp_path: Path) -> None:
    """A refused config exits with the field named, not a traceback."""
    raw = json.loads((FLASH / "config.json").read_text())
    raw["text_config"]["scoring_func"] = "softmax"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(SystemExit, match="scoring_func"):
        main(["geometry", "--model", str(tmp_path), "--block-size", "128"])
