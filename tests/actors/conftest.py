"""A local Ray cluster per actor test module, shut down after it, so the Serve tests
of other packages can start their own (starting Ray takes ~10 s on the 2-core box)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    # Workers import the project from the checkout, like the driver.
    ray.init(num_cpus=4, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}, include_dashboard=False)
    yield
    ray.shutdown()
