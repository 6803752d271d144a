"""Shared fixtures: tiny checkpoints made once per test session, and the SIGKILL of a
Ray actor by its pid (the fault tests' crash).

The directories are shared by every test of the session: treat them as read-only
(copy one before tampering with it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import os
import signal

import pytest
import torch

# Every test that uses Ray starts its own cluster and shuts it down. A Ray call after a
# shutdown (a library's background thread, say) must fail where it is made instead of
# starting a stray cluster that nothing stops: its death later exits the test process.
# Read by Ray when it is imported.
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

# Triton kernels run in its interpreter where no GPU is present; the variable must be
# set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model.tiny import TINY_ALT, make_tiny

# One intra-op thread: results then do not depend on how a matmul of a given shape is
# split across threads, so equivalence tests compare arithmetic, not scheduling noise
# (a 1e-6 difference can flip a near-tied top-k entry), and the 2-core CI box is not
# oversubscribed when tests start worker processes.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default checkpoint (TINY, plain BF16/FP32 weights, seed 0)."""
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_quantized_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY quantised (FP8 / FP4 / FP8 Engram rows with E8M0 scales), same weights as tiny_dir."""
    return make_tiny(tmp_path_factory.mktemp("tiny-quantized"), quantized=True)


@pytest.fixture(scope="session")
def tiny_alt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY_ALT: other sizes and weights with the same layer-mode pattern (plain)."""
    return make_tiny(tmp_path_factory.mktemp("tiny-alt"), spec=TINY_ALT)


def _sigkill_actor(name: str) -> int:
    """SIGKILLs the live Ray actor called ``name`` (in any namespace) by the pid Ray
    records for it, as a crash would end it; returns the pid. Reads the GCS actor
    table (the state API would need a dashboard, which the test clusters do not run)."""
    from ray._private import state

    pids = [a["Pid"] for a in state.actors().values() if a["Name"] == name and a["State"] == "ALIVE"]
    assert len(pids) == 1, f"live actors named {name!r}: pids {pids}"
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


@pytest.fixture(name="sigkill_actor", scope="session")
def sigkill_actor_fixture() -> Callable[[str], int]:
    """``sigkill_actor(name)``: SIGKILLs the live Ray actor ``name``; returns its pid."""
    return _sigkill_actor
