"""`dsv41 serve --config deploy/configs/tiny-cpu.yaml`: the YAML loads and serves, and
SIGTERM shuts everything down, leaving no process of the Ray it started behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

from deploy.proto.generate_pb2 import GenerateRequest
from deploy.proto.generate_pb2_grpc import GenerateServiceStub

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_serve_cli_serves_the_tiny_yaml_and_ctrl_c_leaves_nothing(tiny_dir: Path) -> None:
    """The tiny-cpu YAML serves completions over HTTP and the token stream over gRPC
    through `dsv41 serve`; after Ctrl-C pressed twice (SIGINT, SIGINT: the handler must
    not deadlock on the second) the command exits 0 and every process it started
    (Ray's included) is gone. SIGTERM takes the same handler."""
    port, grpc_port = _free_port(), _free_port()
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
