"""A local Ray cluster per actor test module, shut down after it, so the Serve tests
of other packages can start their own (starting Ray takes ~10 s on the 2-core box)."""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_cluster(worker_env: dict[str, dict[str, str]]) -> Iterator[None]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, runtime_env=worker_env, include_dashboard=False)
    yield
    ray.shutdown()
