"""One local Ray cluster for every actor test module, shut down once the last test of
this folder has run, so the Serve tests of other packages can start their own
(starting Ray takes ~10 s on the 2-core box, and eight modules need one). Each test
closes the groups and actors it starts (context managers, fixtures), so a module
leaves the cluster as it found it. A Ray another folder's tests left up is shut down
before the first test here that needs one.

The folder is no Python package (no ``__init__.py``), so a ``scope="package"``
fixture would live to the end of the session: the shutdown is tied to the first test
outside the folder instead (``pytest_runtest_teardown`` sees it as ``nextitem``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

HERE = Path(__file__).parent


# Whether the Ray that is up was started by ray_cluster: a cluster another folder's
# tests left running (tests/deploy's shared Serve cluster, when a run takes a module
# there before this folder) holds its CPUs for its own applications, and the groups
# here would wait for them forever.
_started_here = False


@pytest.fixture
def ray_cluster(worker_env: dict[str, dict[str, str]]) -> Iterator[None]:
    global _started_here
    ray = pytest.importorskip("ray")
    if ray.is_initialized() and not _started_here:
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    if not ray.is_initialized():
        ray.init(num_cpus=4, runtime_env=worker_env, include_dashboard=False)
        _started_here = True
    yield


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    global _started_here
    if nextitem is not None and nextitem.path.parent == HERE:
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and _started_here:
        ray.shutdown()
    _started_here = False
