"""Helpers shared by the serving tests, as fixtures: a free TCP port for a server to
listen on, this machine's address other than loopback, a metric's value read from
Prometheus text or from a live ``/metrics``, and a live application on a local Ray
cluster of its own.

They are fixtures rather than importable functions because ``tests/`` is not a package:
every directory's ``conftest`` is the same module name, so ``from conftest import ...``
would get whichever one pytest loaded last.

Must not import at module level: Ray, Serve or ``deploy`` (the tests of this folder that
start no server do not pay for them).
"""

from __future__ import annotations

import functools

import re
import socket
import urllib.request
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, Mapping

import pytest

METRICS_TIMEOUT_S = 60
# The CPUs of a served module's Ray: room for two one-CPU LLM server replicas (the
# autoscaling module scales to two; the overload module checks one stays free).
SERVE_CLUSTER_CPUS = 2
# An application on the tiny model runs well within this; past it the start fails,
# naming what is not running, instead of the module hanging.
APP_START_TIMEOUT_S = 120


def _free_port() -> int:
    """A port no socket holds now (the kernel's pick; free until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _non_loopback_ip() -> str | None:
    """This machine's address on its default route (UDP connect sends no packet), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def _metric_value(exposition: str, name: str) -> float:
    """The sum of ``name``'s samples over all label sets in Prometheus text."""
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", exposition, re.M)]
    assert values, f"{name} not in the metrics"
    return sum(values)


def _scraped_metric(base_url: str, name: str) -> float:
    """``name``'s value (summed over label sets) in ``{base_url}/metrics`` now."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=METRICS_TIMEOUT_S) as response:
        return _metric_value(response.read().decode(), name)


@contextmanager
def _local_serve(
    app_args: Mapping[str, Any],
    *,
    name: str,
    worker_env: Mapping[str, Any],
    grpc_port: int | None = None,
    ray_options: Mapping[str, Any] | None = None,
) -> Iterator[str]:
    """``build_app(app_args)`` running as ``name`` at ``/`` on a fresh local Ray of
    SERVE_CLUSTER_CPUS CPUs (and ``ray_options``, more ``ray.init`` arguments), behind
    Serve's HTTP proxy on a free port (and the ingress's gRPC listener on
    ``grpc_port``); yields the HTTP base URL. Serve and Ray are shut down on exit, also
    when the start fails."""
    import ray
    from ray import serve

    from dsv41.deploy.app import build_app, run_app

    ray.init(num_cpus=SERVE_CLUSTER_CPUS, include_dashboard=False, runtime_env=worker_env, **(ray_options or {}))
    try:
        http_port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        if grpc_port is not None:
            app_args = {**app_args, "grpc_port": grpc_port}
        run_app(build_app(app_args), name=name, route_prefix="/", timeout_s=APP_START_TIMEOUT_S)
        yield f"http://127.0.0.1:{http_port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(name="free_port", scope="session")
def free_port_fixture() -> Callable[[], int]:
    """``free_port()``: a port no socket holds now."""
    return _free_port


@pytest.fixture(name="non_loopback_ip", scope="session")
def non_loopback_ip_fixture() -> str | None:
    """An address of this machine a listener bound to loopback must refuse (None when
    the machine has no other)."""
    return _non_loopback_ip()


@pytest.fixture(name="metric_value", scope="session")
def metric_value_fixture() -> Callable[[str, str], float]:
    """``metric_value(exposition_text, name)``: the sum of the metric's samples."""
    return _metric_value


@pytest.fixture(name="metric", scope="session")
def metric_fixture() -> Callable[[str, str], float]:
    """``metric(base_url, name)``: the metric's value in the server's ``/metrics`` now."""
    return _scraped_metric


@pytest.fixture(name="local_serve", scope="session")
def local_serve_fixture(worker_env: dict[str, dict[str, str]]) -> Callable[..., AbstractContextManager[str]]:
    """``with local_serve(app_args, name=..., grpc_port=None, ray_options=None) as base_url``: a live
    application on a local Ray cluster of its own, torn down on exit."""
    return functools.partial(_local_serve, worker_env=worker_env)
