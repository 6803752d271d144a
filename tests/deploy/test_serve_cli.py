"""`dsv41 serve`: the tiny-cpu YAML loads and serves, and Ctrl-C shuts everything down,
leaving no process of the Ray it started behind (a real Ray, in a subprocess); the start
deadline and the start's failure paths (timeout, a signal while starting), driven in
process against a stand-in for Ray and Serve, since a real cluster that cannot place a
replica costs a minute to start, time out and tear down on the 2-core box."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
import ray
from ray import serve

import deploy.app
from deploy.app import AppStartTimeout
from deploy.cli import DEFAULT_START_TIMEOUT_S, main
from deploy.proto.generate_pb2 import GenerateRequest
from deploy.proto.generate_pb2_grpc import GenerateServiceStub

ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_serve_cli_serves_the_tiny_yaml_and_ctrl_c_leaves_nothing(tiny_dir: Path, free_port: Callable[[], int]) -> None:
    """The tiny-cpu YAML serves completions over HTTP and the token stream over gRPC
    through `dsv41 serve`; after Ctrl-C pressed twice (SIGINT, SIGINT: the handler must
    not deadlock on the second) the command exits 0 and every process it started
    (Ray's included) is gone. SIGTERM takes the same handler."""
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "deploy.cli", "serve", "--config", "deploy/configs/tiny-cpu.yaml",
               "--port", str(port), "--grpc-port", str(grpc_port), "--model", str(tiny_dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        banner = server.stdout.readline()
        assert f"127.0.0.1:{port}/v1" in banner, banner
        body = json.dumps({"model": "dsv41-tiny", "prompt": "hello", "max_tokens": 3}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 3
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            chunks = list(GenerateServiceStub(channel).Generate(GenerateRequest(text="hello", max_tokens=3)))
        assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finish_reason == "length"
        started = _descendants(server.pid)
        assert started, "no Ray process was started"
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

    monkeypatch.setattr(deploy.app, "run_app", run_app)
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

    monkeypatch.setattr(deploy.app, "run_app", run_app)
    monkeypatch.setattr(serve, "shutdown", serve_shutdown)
    message = _serve(tiny_dir, "--start-timeout", "60")
    assert message == f"dsv41 serve: {signum.name} before the application was running"
    assert calls == ["ray.init", "serve.start", "run_app", "serve.shutdown", "ray.shutdown"]
