"""One local Ray cluster for every actor test module, shut down once the last test of
this folder has run, so the Serve tests of other packages can start their own
(starting Ray takes ~10 s on the 2-core box, and eight modules need one). Each test
closes the groups and actors it starts (context managers, fixtures), so a module
leaves the cluster as it found it.

The folder is no Python package (no ``__init__.py``), so a ``scope="package"``
fixture would live to the end of the session: the shutdown is tied to the first test
outside the folder instead (``pytest_runtest_teardown`` sees it as ``nextitem``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

HERE = Path(__file__).parent


@pytest.fixture
def ray_cluster(worker_env: dict[str, dict[str, str]]) -> Iterator[None]:
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=4, runtime_env=worker_env, include_dashboard=False)
    yield


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is not None and nextitem.path.parent == HERE:
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
