"""The distribution installs one top-level package, dsv41, whatever the repository's
top-level folders are called: no `model` or `cache` lands in a user's environment.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("model", "cache", "cluster", "actors", "deploy")


def test_the_wheel_holds_only_the_dsv41_package(tmp_path: Path) -> None:
    """Every file of the built wheel is under dsv41/ (with the trained checkpoint and
    the configs as package data) or its dist-info."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("dsv41-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"dsv41", next(t for t in tops if t.endswith(".dist-info"))}, sorted(tops)
    assert {f"dsv41/{folder}/__init__.py" for folder in FOLDERS} <= set(names)
    assert "dsv41/model/assets/tiny-trained/config.json" in names
    assert "dsv41/model/configs/v41_flash/config.json" in names
    assert "dsv41/deploy/configs/tiny-cpu.yaml" in names


def test_the_installed_project_exposes_dsv41_alone(tmp_path: Path) -> None:
    """From outside the repository (so the working directory adds nothing), the
    installed project imports as dsv41.*, and none of its folders is a top-level
    module."""
    probe = (
        "import importlib.util, dsv41.model, dsv41.deploy.cli;"
        f"print([n for n in {FOLDERS!r} if importlib.util.find_spec(n) is not None])"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
