"""Handles that work as written: `dsv41 serve` (a real one, in a subprocess, on the
embedded model) prints the Ray address and a one-line Python handle; that line, and the
README's handle and Ray Data example with the printed address put in, each run in a
driver process of their own against it and get their completions."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
README_SECTION = "### Python handles and Ray Data batch jobs"
README_ADDRESS = '"127.0.0.1:6379"'
BANNER_LINES = 7
DRIVER_TIMEOUT_S = 300


def _readme_example() -> str:
    """The first Python block of the README's handles section."""
    section = (ROOT / "README.md").read_text().split(README_SECTION, 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _driver_env() -> dict[str, str]:
    """This process's environment for a driver: no RAY_ADDRESS, token auth as the
    README says."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "RAY_AUTH_MODE": "token"}


def test_the_printed_handle_and_the_readme_example_run_against_dsv41_serve(free_port: Callable[[], int]) -> None:
    """The banner names the served model `dsv41-tiny` and the Ray cluster's address;
    the printed handle line run by a shell prints an 8-token completion; the README's
    example (its address replaced by the printed one, nothing else changed) prints a
    16-token completion and three Ray Data rows with their prompts and usage."""
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "dsv41.deploy.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_port)]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        banner = [server.stdout.readline() for _ in range(BANNER_LINES)]
        assert banner[0].startswith(f"serving dsv41-tiny at http://127.0.0.1:{port}/v1"), banner
        found = re.match(r"Ray cluster at (\S+) ", banner[4])
        assert found, banner
        address = found.group(1)
        handle_line = banner[5].strip()
        assert handle_line.startswith("RAY_AUTH_MODE=token python3 -c") and repr(address) in handle_line, banner
        assert "~/.ray/auth_token" in banner[6], banner

        printed = subprocess.run(
            ["bash", "-c", handle_line], cwd=ROOT, env=_driver_env(), capture_output=True, text=True,
            timeout=DRIVER_TIMEOUT_S,
        )  # fmt: skip
        assert printed.returncode == 0, printed.stderr[-3000:]
        completion = ast.literal_eval(printed.stdout.strip().splitlines()[-1])
        assert len(completion["token_ids"]) == 8 and completion["finish_reason"] == "length"

        example = _readme_example()
        assert example.count(README_ADDRESS) == 1, example
        code = example.replace(README_ADDRESS, repr(address))
        ran = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=_driver_env(), capture_output=True, text=True,
            timeout=DRIVER_TIMEOUT_S,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr[-3000:]
        lines = ran.stdout.strip().splitlines()
        completion = ast.literal_eval(lines[0])
        assert len(completion["token_ids"]) == 16 and completion["finish_reason"] == "length"
        rows = lines[1:]
        assert len(rows) == 3 and all(re.match(r"Question \d+:", row) for row in rows), lines
        assert all("'completion_tokens': 16" in row for row in rows), rows
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=120)
        finally:
            if server.poll() is None:
                server.kill()
