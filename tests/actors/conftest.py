"""One local Ray cluster for every actor test module, shut down after the package, so
the Serve tests of other packages can start their own (starting Ray takes ~10 s on the
2-core box, and eight modules need one). Each test closes the groups and actors it
starts (context managers, fixtures), so a module leaves the cluster as it found it."""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture(scope="package")
def ray_cluster(worker_env: dict[str, dict[str, str]]) -> Iterator[None]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, runtime_env=worker_env, include_dashboard=False)
    yield
    ray.shutdown()
