"""`dsv41 serve`: the tiny-cpu YAML loads and serves, on loopback only and behind the
API key of $DSV41_API_KEY, printing what it really listens on, and Ctrl-C shuts
everything down, leaving no process of the Ray it started behind (a real Ray, in a
subprocess); how the listeners' addresses and the key are chosen from the flags, the
environment and the config; the start deadline and the start's failure paths (timeout,
a signal while starting), driven in process against a stand-in for Ray and Serve, since
a real cluster that cannot place a replica costs a minute to start, time out and tear
down on the 2-core box."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
import ray
from ray import serve

import dsv41.deploy.app
from dsv41.deploy.app import AppStartTimeout
from dsv41.deploy.cli import API_KEY_ENV, DEFAULT_GRPC_PORT, DEFAULT_START_TIMEOUT_S, _serve_settings, build_parser, main
from dsv41.deploy.procfs import descendants, process_title
from dsv41.deploy.proxy_heap import PROXY_CALLBACK_ENV, PROXY_IDLE_ENV, proxy_middlewares
from dsv41.deploy.proto.generate_pb2 import GenerateRequest
from dsv41.deploy.proto.generate_pb2_grpc import GenerateServiceStub

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_serve_cli_serves_the_tiny_yaml_and_ctrl_c_leaves_nothing(
    tiny_dir: Path, free_port: Callable[[], int], non_loopback_ip: str | None
) -> None:
    """The tiny-cpu YAML serves completions over HTTP and the token stream over gRPC
    through `dsv41 serve`, both on 127.0.0.1 only (the banner says so, read back from
    the kernel's sockets, and the machine's other address refuses both ports) and both
    behind the key of $DSV41_API_KEY; Serve's proxy starts with the environment that
    makes it trim its heap when idle (deploy/proxy_heap.py), and it and both replicas start
    with the Python allocator python_allocator names; after Ctrl-C pressed twice (SIGINT, SIGINT: the
    handler must not deadlock on the second) the command exits 0 and every process it
    started (Ray's included) is gone. SIGTERM takes the same handler."""
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "dsv41.deploy.cli", "serve", "--config", "deploy/configs/tiny-cpu.yaml",
               "--port", str(port), "--grpc-port", str(grpc_port), "--model", str(tiny_dir)]
    key = "serve-cli-key"
    env = {**os.environ, API_KEY_ENV: key}
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        banner = [server.stdout.readline() for _ in range(5)]
        assert f"127.0.0.1:{port}/v1" in banner[0] and banner[0].rstrip().endswith(f"HTTP listening on 127.0.0.1:{port}"), banner
        assert f"gRPC (dsv41.GenerateService/Generate) listening on 127.0.0.1:{grpc_port};" in banner[2], banner
        assert key not in "".join(banner)
        for listener in (port, grpc_port) if non_loopback_ip is not None else ():
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((non_loopback_ip, listener), timeout=5).close()
        body = json.dumps({"model": "dsv41-tiny", "prompt": "hello", "max_tokens": 3}).encode()
        url = f"http://127.0.0.1:{port}/v1/completions"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}), timeout=120)
        assert refused.value.code == 401
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 3
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            metadata = (("authorization", f"Bearer {key}"),)
            chunks = list(GenerateServiceStub(channel).Generate(GenerateRequest(text="hello", max_tokens=3), metadata=metadata))
        assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finish_reason == "length"
        started = descendants(server.pid)
        assert started, "no Ray process was started"
        proxies = [pid for pid in started if (process_title(pid) or "").startswith("ray::ProxyActor")]
        assert len(proxies) == 1, [process_title(pid) for pid in started]
        proxy_env = set((Path("/proc") / str(proxies[0]) / "environ").read_bytes().split(b"\0"))
        callback = f"{proxy_middlewares.__module__}.{proxy_middlewares.__name__}"
        assert {f"{PROXY_CALLBACK_ENV}={callback}".encode(), f"{PROXY_IDLE_ENV}=5.0".encode()} <= proxy_env
        # The proxy and both replicas start with the Python allocator (python_allocator's default).
        replicas = [pid for pid in started if (process_title(pid) or "").startswith("ray::ServeReplica")]
        assert len(replicas) == 2, [process_title(pid) for pid in started]
        for pid in (*proxies, *replicas):
            assert b"PYTHONMALLOC=pymalloc" in (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0"), pid
        server.send_signal(signal.SIGINT)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=120) == 0
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [pid for pid in started if _alive(pid)]
    finally:
        if server.poll() is None:
            server.kill()


@pytest.fixture()
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The Ray and Serve calls `dsv41 serve` makes, recorded instead of run; the signal
    handlers it installs are put back afterwards."""
    recorded: list[str] = []
    for module, name in ((ray, "init"), (ray, "shutdown"), (serve, "start"), (serve, "shutdown")):
        label = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
        monkeypatch.setattr(module, name, lambda *_args, _label=label, **_kwargs: recorded.append(_label))
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield recorded
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def _serve(tiny_dir: Path, *options: str) -> str:
    """Runs `dsv41 serve` on the tiny YAML, which must fail to start; its exit message."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", str(ROOT / "deploy/configs/tiny-cpu.yaml"), "--model", str(tiny_dir), *options])
    return str(exited.value.code)


@pytest.mark.parametrize(("options", "deadline"), [((), DEFAULT_START_TIMEOUT_S), (("--start-timeout", "7.5"), 7.5)])
def test_a_start_past_the_deadline_exits_with_the_reason(
    tiny_dir: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch, options: tuple[str, ...], deadline: float
) -> None:
    """`--start-timeout` (default DEFAULT_START_TIMEOUT_S) is the deadline `run_app` gets
    for the application; when it passes, `dsv41 serve` exits with AppStartTimeout's
    message (the deployments not running, and why) after shutting Serve and Ray down."""

    def run_app(application: Any, *, name: str, route_prefix: str | None, timeout_s: float) -> None:
        calls.append(f"run_app {name} {route_prefix} {timeout_s}")
        raise AppStartTimeout(f"application {name!r} not running after {timeout_s} s: LLMServer pending")

    monkeypatch.setattr(dsv41.deploy.app, "run_app", run_app)
    message = _serve(tiny_dir, *options)
    assert message == f"dsv41 serve: application 'dsv41' not running after {deadline} s: LLMServer pending"
    assert calls == ["ray.init", "serve.start", f"run_app dsv41 / {deadline}", "serve.shutdown", "ray.shutdown"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_starting_stops_the_start_and_shuts_down(
    tiny_dir: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch, signum: signal.Signals
) -> None:
    """Ctrl-C (or SIGTERM) while the application is starting ends the wait at once
    instead of after the deadline, and a second signal during the shutdown that follows
    does not cut it short: Serve and then Ray are shut down, and the command exits
    naming the signal."""

    def run_app(application: Any, *, name: str, route_prefix: str | None, timeout_s: float) -> None:
        calls.append("run_app")
        os.kill(os.getpid(), signum)
        time.sleep(timeout_s)
        calls.append("run_app timed out")

    def serve_shutdown() -> None:
        os.kill(os.getpid(), signum)
        calls.append("serve.shutdown")

    monkeypatch.setattr(dsv41.deploy.app, "run_app", run_app)
    monkeypatch.setattr(serve, "shutdown", serve_shutdown)
    message = _serve(tiny_dir, "--start-timeout", "60")
    assert message == f"dsv41 serve: {signum.name} before the application was running"
    assert calls == ["ray.init", "serve.start", "run_app", "serve.shutdown", "ray.shutdown"]


def _settings(tmp_path: Path, config: dict[str, Any] | None, *flags: str) -> tuple[str, int, str, dict]:
    argv = ["serve", "--model", str(tmp_path), *flags]
    if config is not None:
        (tmp_path / "serve.yaml").write_text(json.dumps(config))
        argv += ["--config", str(tmp_path / "serve.yaml")]
    args = build_parser().parse_args(argv)
    return _serve_settings(args)


def _config(http: dict[str, Any] | None = None, **app: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"applications": [{"name": "a", "import_path": "dsv41.deploy.app:build_app", "args": app}]}
    if http is not None:
        config["http_options"] = http
    return config


def test_listeners_bind_loopback_unless_told_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP and gRPC listen on 127.0.0.1 by default, also with a config that names no
    host (Serve's own default would be every interface); a config's explicit host is
    honoured and --host overrides both listeners."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    for config in (None, _config(), _config({"port": 8100})):
        host, _, _, app = _settings(tmp_path, config)
        assert (host, app["grpc_host"], app["grpc_port"]) == ("127.0.0.1", "127.0.0.1", DEFAULT_GRPC_PORT)
    host, port, _, app = _settings(tmp_path, _config({"host": "0.0.0.0", "port": 8100}, grpc_host="::1", grpc_port=9100))
    assert (host, port, app["grpc_host"], app["grpc_port"]) == ("0.0.0.0", 8100, "::1", 9100)
    host, _, _, app = _settings(tmp_path, _config({"host": "0.0.0.0"}, grpc_host="::1"), "--host", "10.1.2.3")
    assert (host, app["grpc_host"]) == ("10.1.2.3", "10.1.2.3")


def test_the_api_key_comes_from_the_flag_then_the_environment_then_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--api-key wins over $DSV41_API_KEY, which wins over the config's api_key; with
    none the application has no key. --auth-all-routes closes /health and /metrics, and
    --max-body-bytes sets the body limit over the config's other limits."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = _config(api_key="from-config", limits={"max_tools": 4})
    assert "api_key" not in _settings(tmp_path, None)[3]
    assert _settings(tmp_path, config)[3]["api_key"] == "from-config"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _settings(tmp_path, config)[3]["api_key"] == "from-env"
    app = _settings(tmp_path, config, "--api-key", "from-flag", "--auth-all-routes", "--max-body-bytes", "1024")[3]
    assert (app["api_key"], app["public_routes"], app["limits"]) == ("from-flag", [], {"max_tools": 4, "max_body_bytes": 1024})


def test_a_config_asking_for_serves_grpc_proxy_is_refused(tmp_path: Path) -> None:
    """Serve's gRPC proxy listens on every interface, so a config that registers
    servicer functions with it is refused, pointing at the application's grpc_port."""
    config = {**_config(), "grpc_options": {"port": 9000, "grpc_servicer_functions": ["x.y"]}}
    with pytest.raises(SystemExit, match="grpc_port"):
        _settings(tmp_path, config)
