"""The cache layer's import boundary, read from the source of every cache/*.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CACHE = Path(__file__).resolve().parents[2] / "cache"
FORBIDDEN_TOP_LEVEL = {"cluster", "actors", "deploy", "ray"}
ALLOWED_FROM_MODEL = {"model.formats"}
ABOVE_CACHE = "<relative import above cache/>"


def _imported_modules(path: Path) -> list[str]:
    """Absolute names of the modules a file imports; ``from package import name``
    counts as package.name, so ``from model import formats`` reads model.formats."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1:
                names.append(ABOVE_CACHE)
                continue
            module = ".".join(part for part in ("cache" if node.level else "", node.module or "") if part)
            if module in ("model", "cache"):
                names.extend(f"{module}.{alias.name}" for alias in node.names)
            else:
                names.append(module)
    return names


@pytest.mark.parametrize("path", sorted(CACHE.glob("*.py")), ids=lambda p: p.name)
def test_cache_imports_only_model_formats_from_the_project(path: Path) -> None:
    """No cache module imports cluster, actors, deploy or ray, anything of model but
    model.formats, or reaches above cache/ with a relative import."""
    for name in _imported_modules(path):
        top = name.split(".")[0]
        assert top not in FORBIDDEN_TOP_LEVEL and name != ABOVE_CACHE, f"{path.name} imports {name}"
        assert top != "model" or name in ALLOWED_FROM_MODEL, f"{path.name} imports {name}"


def test_the_check_sees_every_import_form(tmp_path: Path) -> None:
    """The AST reader names each import form the boundary test must judge."""
    source = tmp_path / "sample.py"
    source.write_text(
        "import ray.serve\nfrom cluster.scheduler import Scheduler\nfrom model import config, formats\n"
        "import model\nfrom model.formats import quantize_fp8\nfrom .. import actors\nfrom .pools import V41Pools\n"
    )
    assert _imported_modules(source) == [
        "ray.serve",
        "cluster.scheduler",
        "model.config",
        "model.formats",
        "model",
        "model.formats",
        ABOVE_CACHE,
        "cache.pools",
    ]
