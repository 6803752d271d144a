"""The Serve YAMLs shipped in deploy/configs: each declares one dsv41 application whose
args are valid AppArgs (their engine options valid EngineOptions), so a config that
`dsv41 serve --config` or `serve deploy` would refuse cannot ship."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv41.deploy.app_args import AppArgs, read_serve_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "deploy" / "configs").glob("*.yaml"))


def test_the_configs_folder_is_found() -> None:
    assert {p.name for p in CONFIGS} >= {"tiny-cpu.yaml", "reference-slice-h200.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_shipped_config_declares_one_valid_application(path: Path) -> None:
    _, application = read_serve_config(path)
    assert application.import_path == "dsv41.deploy.app:build_app"
    args = AppArgs.from_dict(application.args or {})
    assert args.engine_options()["dtype"] is not None
