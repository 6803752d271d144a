"""The package roof and its layering, read from the source of every module.

Imports go one way, ``deploy -> actors -> cluster -> (model, cache)``; ``model``
imports no other package of the project; ``cache`` imports only ``model.formats`` of
it; ``model``, ``cache`` and ``cluster`` never import ray. Every import counts, also one
inside a function (a lazy import hides a cycle, it does not remove it), and no module
imports itself through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "cache", "cluster", "actors", "deploy")
MAY_IMPORT = {
    "deploy": {"deploy", "actors", "cluster", "model", "cache"},
    "actors": {"actors", "cluster", "model", "cache"},
    "cluster": {"cluster", "model", "cache"},
    "model": {"model"},
    "cache": {"cache", "model"},
}
CACHE_MAY_IMPORT_FROM_MODEL = {"dsv41.model.formats"}
NO_RAY = {"model", "cache", "cluster"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("dsv41", *parts))


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def imported_names(path: Path) -> list[str]:
    """Every module a file imports, anywhere in it; ``from a import b`` counts as a.b
    when a.b is a module of the project, else as a."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.append("<relative>")
                continue
            module = node.module or ""
            names.extend(f"{module}.{alias.name}" for alias in node.names)
            names.append(module)
    return names


def _project_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    for name in imported_names(path):
        if name.split(".")[0] in PACKAGES:
            found.add("<unrooted>")
        if name in modules:
            found.add(name)
    return found


@pytest.mark.parametrize("module", sorted(_modules()))
def test_every_import_follows_the_layers(module: str) -> None:
    """A module imports the project only as dsv41.*, only packages at or below its
    own layer (cache: only model.formats of model), no relative imports, and ray only
    above cluster."""
    modules = _modules()
    path = modules[module]
    package = module.split(".")[1]
    names = imported_names(path)
    assert "<relative>" not in names, f"{module}: a relative import"
    for name in names:
        top = name.split(".")[0]
        assert top not in PACKAGES, f"{module} imports {name} outside the dsv41 roof"
        if top == "ray":
            assert package not in NO_RAY, f"{module} imports ray"
    for name in _project_imports(path, modules) - {"<unrooted>"}:
        target = name.split(".")[1]
        assert target in MAY_IMPORT[package], f"{module} ({package}) imports {name} ({target})"
        if package == "cache" and target == "model":
            assert name in CACHE_MAY_IMPORT_FROM_MODEL, f"{module} imports {name}"


def test_no_module_imports_itself_through_others() -> None:
    """The project's module import graph (every import, lazy ones too) has no cycle."""
    modules = _modules()
    graph = {m: sorted(_project_imports(p, modules) - {"<unrooted>", m}) for m, p in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = iter(range(10**9))

    def visit(node: str) -> None:
        index[node] = low[node] = next(counter)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checks_see_every_import_form(tmp_path: Path) -> None:
    """The AST reader names each import form, inside functions too, and the cycle
    finder finds a cycle and only that."""
    source = tmp_path / "sample.py"
    source.write_text(
        "import ray.serve\nfrom dsv41.cluster.scheduler import Scheduler\nfrom dsv41.model import formats\n"
        "def f():\n    from dsv41.deploy.cli import main\nfrom .pools import V41Pools\nimport model\n"
    )
    names = imported_names(source)
    for expected in ("ray.serve", "dsv41.cluster.scheduler", "dsv41.model.formats", "dsv41.deploy.cli", "<relative>", "model"):
        assert expected in names
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _cycles({"a": ["b"], "b": []}) == []
