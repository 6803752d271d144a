"""Helpers shared by the serving tests, as fixtures: calls made at once, a free TCP port
for a server to listen on, this machine's address other than loopback, a metric's value
read from Prometheus text or from a live ``/metrics``, live applications on this
package's one shared local Ray cluster (the tiny application several modules serve alike
among them), and a live application on a local Ray cluster of its own.

They are fixtures rather than importable functions because ``tests/`` is not a package:
every directory's ``conftest`` is the same module name, so ``from conftest import ...``
would get whichever one pytest loaded last.

Must not import at module level: Ray, Serve or ``deploy`` (the tests of this folder that
start no server do not pay for them).
"""

from __future__ import annotations

import functools
import json
import re
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pytest

METRICS_TIMEOUT_S = 60
# The CPUs of a served module's Ray: room for two one-CPU LLM server replicas (the
# autoscaling module scales to two; the overload module checks one stays free).
SERVE_CLUSTER_CPUS = 2
# An application on the tiny model runs well within this; past it the start fails,
# naming what is not running, instead of the module hanging.
APP_START_TIMEOUT_S = 120
# A withdrawn application's replicas and placement groups are gone well within this.
APP_WITHDRAW_TIMEOUT_S = 60
# The tiny application (the tiny_app fixture): the tiny model served as "tiny" by one
# one-CPU replica, with room for a prompt that declares tools (the tools section alone is
# ~750 tiny-tokenizer tokens), and the ingress's gRPC listener on a port of its own. The
# modules that need nothing else of an application serve on it alike, so the shared
# cluster deploys it once for all of them (an application deployed again cost 15-35 s
# of a run on the 2-core box).
TINY_APP_ENGINE = {"block_size": 32, "max_model_len": 2048, "cache_memory_bytes": 64 << 20}


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


def _start_serve(worker_env: Mapping[str, Any], ray_options: Mapping[str, Any] | None = None) -> str:
    """A fresh local Ray of SERVE_CLUSTER_CPUS CPUs (and ``ray_options``, more
    ``ray.init`` arguments) with Serve's HTTP proxy on a free loopback port; returns the
    proxy's base URL. Shut down with ``_stop_serve``, also when this fails."""
    import ray
    from ray import serve

    ray.init(num_cpus=SERVE_CLUSTER_CPUS, include_dashboard=False, runtime_env=worker_env, **(ray_options or {}))
    http_port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    return f"http://127.0.0.1:{http_port}"


def _stop_serve() -> None:
    """Shuts Serve and Ray down, if Ray is up (Serve's shutdown would start a Ray)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def _deploy(app_args: Mapping[str, Any], name: str, grpc_port: int | None) -> None:
    """``build_app(app_args)`` run as ``name`` at ``/`` (with the ingress's gRPC listener
    on ``grpc_port``), running within APP_START_TIMEOUT_S or raising."""
    from dsv41.deploy.app import build_app, run_app

    if grpc_port is not None:
        app_args = {**app_args, "grpc_port": grpc_port}
    run_app(build_app(app_args), name=name, route_prefix="/", timeout_s=APP_START_TIMEOUT_S)


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
    try:
        base_url = _start_serve(worker_env, ray_options)
        _deploy(app_args, name, grpc_port)
        yield base_url
    finally:
        _stop_serve()


class _SharedServeCluster:
    """This package's one local Ray cluster (SERVE_CLUSTER_CPUS CPUs, Serve's HTTP proxy
    on a free port), started by the first application asked of it, so that the modules
    serving on it pay Ray's and Serve's start once. It runs one application at a time,
    at ``/``: asking for another withdraws the running one and waits until the cluster
    is as the new one would find it on a cluster of its own (every CPU free, no
    placement group held); asking again for the running one (the same arguments, name
    and gRPC port) answers it as it is."""

    def __init__(self, worker_env: Mapping[str, Any]) -> None:
        self._worker_env = worker_env
        self._base_url: str | None = None
        self._running: tuple[str, str] | None = None  # (name, its arguments as JSON)
        self._gcs_address: str | None = None  # the cluster's, to know it is still the one up

    def serve(self, app_args: Mapping[str, Any], *, name: str, grpc_port: int | None = None) -> str:
        """The HTTP base URL of ``build_app(app_args)`` running as ``name`` (and the
        ingress's gRPC listener on ``grpc_port``)."""
        import ray

        self._forget_if_gone()
        key = json.dumps({"args": app_args, "grpc_port": grpc_port}, sort_keys=True)
        if self._running == (name, key):
            assert self._base_url is not None
            return self._base_url
        self.withdraw()
        if self._base_url is None:
            try:
                self._base_url = _start_serve(self._worker_env)
                self._gcs_address = ray.get_runtime_context().gcs_address
            except BaseException:
                _stop_serve()
                raise
        try:
            _deploy(app_args, name, grpc_port)
        except BaseException:
            self._delete(name)
            raise
        self._running = (name, key)
        return self._base_url

    def _forget_if_gone(self) -> None:
        """Forgets the cluster if it is no longer the Ray up in this process: another
        folder's tests ran in between and shut it down (a run that orders folders
        otherwise, e.g. tests/actors after a module here, or a worker of a parallel run
        that takes the files in its own order)."""
        import ray

        if self._base_url is not None and not (
            ray.is_initialized() and ray.get_runtime_context().gcs_address == self._gcs_address
        ):
            self._base_url, self._running = None, None

    def withdraw(self) -> None:
        """Deletes the running application, if any, and waits for what it held."""
        if self._running is not None:
            name, _ = self._running
            self._running = None
            self._delete(name)

    @staticmethod
    def _delete(name: str) -> None:
        """Deletes the application ``name`` and waits until every CPU is free and no
        placement group is held."""
        import ray
        from ray import serve
        from ray.util import placement_group_table

        serve.delete(name)

        def held() -> str:
            free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources()["CPU"]
            groups = [pg["name"] for pg in placement_group_table().values() if pg["state"] != "REMOVED"]
            return "" if free == total and not groups else f"CPUs free: {free} of {total}; placement groups: {groups}"

        deadline = time.monotonic() + APP_WITHDRAW_TIMEOUT_S
        while left := held():
            assert time.monotonic() < deadline, f"application {name!r} withdrawn {APP_WITHDRAW_TIMEOUT_S} s ago, still held: {left}"
            time.sleep(0.2)

    def stop(self) -> None:
        """Withdraws the running application and shuts Serve and Ray down, if started
        and still up."""
        self._forget_if_gone()
        if self._base_url is None:
            return
        try:
            self.withdraw()
        finally:
            self._base_url = None
            _stop_serve()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This package's modules that serve on the shared cluster run one after another,
    where the first of them is, those on the tiny application first, so that the
    cluster starts once and the tiny application is deployed once; the rest keep their
    order. (Run in any order, every module passes alone: the order only saves starts.)"""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if item.path.parent == here]
    modules: dict[Path, list[pytest.Item]] = {}
    for i in slots:
        modules.setdefault(items[i].path, []).append(items[i])

    def uses(fixture: str, module: list[pytest.Item]) -> bool:
        return any(fixture in item.fixturenames for item in module)

    order = list(modules)
    shared = [path for path in order if uses("serve_app", modules[path])]
    if shared:
        block = sorted(shared, key=lambda path: not uses("tiny_app", modules[path]))
        start = order.index(shared[0])
        rest = [path for path in order if path not in shared]
        order = rest[:start] + block + rest[start:]
    reordered = [item for path in order for item in modules[path]]
    for i, item in zip(slots, reordered):
        items[i] = item


def _concurrently(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call's result, in order, the calls made at once: requests to a replica,
    which decodes them in one batch (a seeded or greedy request's tokens do not depend
    on its batch), and an in-process reference run beside them."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


@pytest.fixture(name="concurrently", scope="session")
def concurrently_fixture() -> Callable[[list[Callable[[], Any]]], list[Any]]:
    """``concurrently(calls)``: each call's result, in order, the calls made at once."""
    return _concurrently


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


@pytest.fixture(scope="package")
def shared_serve_cluster(worker_env: dict[str, dict[str, str]]) -> Iterator[_SharedServeCluster]:
    """The package's shared cluster (not started until an application is asked of it),
    shut down after the package's last test."""
    cluster = _SharedServeCluster(worker_env)
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True, scope="module")
def _shared_cluster_only_under_its_modules(request: pytest.FixtureRequest, shared_serve_cluster: _SharedServeCluster) -> None:
    """Shuts the shared cluster down before a module that does not serve on it: such a
    module may start a Ray of its own (in process or in a ``dsv41 serve``), and the two
    cores are its alone."""
    if not any("serve_app" in item.fixturenames for item in request.session.items if item.module is request.module):
        shared_serve_cluster.stop()


@pytest.fixture(name="serve_app", scope="package")
def serve_app_fixture(shared_serve_cluster: _SharedServeCluster) -> Callable[..., str]:
    """``serve_app(app_args, name=..., grpc_port=None)``: the HTTP base URL of
    ``build_app(app_args)`` running as ``name`` at ``/`` on the shared cluster, the only
    application there (the one running before is withdrawn first, unless it is this
    one: the same arguments, name and gRPC port get it as it is)."""
    return shared_serve_cluster.serve


@pytest.fixture(scope="session")
def tiny_app_engine() -> Mapping[str, Any]:
    """The engine options the tiny application serves with (TINY_APP_ENGINE)."""
    return TINY_APP_ENGINE


@pytest.fixture(scope="package")
def tiny_app_grpc_port() -> int:
    """The port of the tiny application's gRPC listener: one for the package, so that
    every module asks for the same application."""
    return _free_port()


@pytest.fixture(scope="module")
def tiny_app(
    tiny_dir: Path, tiny_app_engine: Mapping[str, Any], tiny_app_grpc_port: int, serve_app: Callable[..., str]
) -> str:
    """The HTTP base URL of the tiny application (named "tiny"; its gRPC listener on
    ``tiny_app_grpc_port``), deployed once for the modules that use it (they run one
    after another). Its counters count every such module's requests: compare them before
    and after."""
    args = {"model": str(tiny_dir), "served_model_name": "tiny", "engine": tiny_app_engine, "ray_actor_options": {"num_cpus": 1}}
    return serve_app(args, name="tiny", grpc_port=tiny_app_grpc_port)


@pytest.fixture(name="local_serve", scope="session")
def local_serve_fixture(worker_env: dict[str, dict[str, str]]) -> Callable[..., AbstractContextManager[str]]:
    """``with local_serve(app_args, name=..., grpc_port=None, ray_options=None) as base_url``: a live
    application on a local Ray cluster of its own (``ray_options`` such as a metrics export
    port, or a Ray no other application has touched), torn down on exit."""
    return functools.partial(_local_serve, worker_env=worker_env)
