"""Shared fixtures: tiny checkpoints made once per test session, the SIGKILL of a Ray
actor by its pid (the fault tests' crash), and Engram tables over read-only file maps.

The directories are shared by every test of the session: treat them as read-only
(copy one before tampering with it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import os
import signal
import warnings

import numpy as np
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

from dsv41.model.tiny import TINY_ALT, TRAINED_TINY_DIR, make_tiny

# One intra-op thread: results then do not depend on how a matmul of a given shape is
# split across threads, so equivalence tests compare arithmetic, not scheduling noise
# (a 1e-6 difference can flip a near-tied top-k entry), and the 2-core CI box is not
# oversubscribed when tests start worker processes.
torch.set_num_threads(1)

# The pytest-xdist groups (`--dist loadgroup`, set in pyproject.toml) of the modules that
# share a Ray cluster: one worker runs a group's modules one after another, so its
# cluster starts once, as in a run in one process. SHARED_SERVE_GROUP: the modules that
# serve on tests/deploy's shared Serve cluster (the tiny application is deployed once);
# SHARED_RAY_GROUP: the modules on tests/actors' one Ray cluster (its ``ray_cluster``
# fixture; apart, each module's worker started and stopped a Ray of its own, ~6 s each
# on the 2-core box). Every other module is a group of its own, so its module fixtures
# start once.
SHARED_SERVE_GROUP = "deploy-shared-serve-cluster"
SHARED_RAY_GROUP = "actors-shared-ray-cluster"

# The longest groups' seconds in a parallel run of the suite on the 2-core box (the
# mean of two runs on 2026-12-07, `--durations=0` summed per group), longest first.
# xdist hands a free worker the next group in the order the workers collected them
# (`--no-loadscope-reorder` in pyproject.toml: its default order is by number of
# tests, which hands out last the modules of one test that takes a minute, such as
# tests/deploy/test_handles.py), so the workers take these first, the many short
# groups fill in at the end, and the two finish together. Groups not named here keep their collection order after
# these. The figures only order the queue: a stale one costs balance, never a test.
GROUP_SECONDS = {
    SHARED_SERVE_GROUP: 420,
    SHARED_RAY_GROUP: 171,
    "tests/cluster/test_cuda_graphs.py": 97,
    "tests/cluster/test_validate_runtime.py": 77,
    "tests/cluster/test_liveness.py": 56,
    "tests/model/test_kernels_triton.py": 54,
    "tests/deploy/test_handles.py": 52,
    "tests/cluster/test_runtime_parity.py": 46,
    "tests/deploy/test_serve_cli.py": 39,
    "tests/cluster/test_speculative.py": 38,
    "tests/deploy/test_metrics_replicas.py": 36,
    "tests/cluster/test_isa_parity.py": 35,
    "tests/deploy/test_metrics.py": 33,
    "tests/cluster/test_async_scheduling.py": 32,
    "tests/cluster/test_structured_output.py": 31,
    "tests/model/test_kernels_mhc.py": 30,
    "tests/cluster/test_tbo.py": 24,
    "tests/deploy/test_cli.py": 23,
    "tests/deploy/test_engine_process.py": 20,
    "tests/model/test_kernels_moe.py": 20,
    "tests/cluster/test_decoder_replay.py": 15,
    "tests/cluster/test_persistent_batch.py": 14,
    "tests/cluster/test_offload_restore.py": 10,
}


def _group(item: pytest.Item, serving: set[Path], on_ray: set[Path]) -> str:
    """The xdist group of ``item``: a shared cluster's, if its module is among
    ``serving`` or ``on_ray``, else its file's."""
    if item.path in serving:
        return SHARED_SERVE_GROUP
    if item.path in on_ray:
        return SHARED_RAY_GROUP
    return item.nodeid.partition("::")[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test with its xdist group (SHARED_SERVE_GROUP, SHARED_RAY_GROUP or its
    file), before xdist reads the marks."""
    serving = {item.path for item in items if "serve_app" in item.fixturenames}
    on_ray = {item.path for item in items if "ray_cluster" in item.fixturenames}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item, serving, on_ray)))


class _LongestGroupsFirst:
    """Puts the groups of GROUP_SECONDS first, longest first, each group's tests in the
    order they had; last among the hooks, after tests/deploy's own ordering."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        def seconds(item: pytest.Item) -> int:
            mark = item.get_closest_marker("xdist_group")
            return GROUP_SECONDS.get(mark.args[0], 0) if mark is not None else 0

        items.sort(key=lambda item: -seconds(item))  # stable: a group's order is kept


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker (the workers' collection order is the queue's), registers
    _LongestGroupsFirst; a run in one process keeps the collection order."""
    if hasattr(config, "workerinput"):
        config.pluginmanager.register(_LongestGroupsFirst(), "dsv41-longest-groups-first")


@pytest.fixture(scope="session")
def worker_env() -> dict[str, dict[str, str]]:
    """The runtime_env a test's Ray cluster gives its workers: they import dsv41 as the
    test process does, from the installed package or from what the caller's PYTHONPATH
    puts first (a worktree's roof of links, say)."""
    path = os.environ.get("PYTHONPATH")
    return {"env_vars": {"PYTHONPATH": path}} if path else {}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default checkpoint (TINY, plain BF16/FP32 weights, seed 0)."""
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def cuda_engine_options() -> dict[str, object]:
    """The tiny engines of the GPU graph tests: Triton kernels on the GPU,
    batch-invariant, 64 PAGEs of 32 tokens, 6 requests of at most 128 tokens."""
    return dict(
        block_size=32,
        max_num_seqs=6,
        enable_prefix_caching=False,
        kernel_backend="triton",
        device="cuda",
        batch_invariant=True,
        num_pages=64,
        max_model_len=128,
    )


@pytest.fixture(scope="session")
def tiny_quantized_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY quantised (FP8 / FP4 / FP8 Engram rows with E8M0 scales), same weights as tiny_dir."""
    return make_tiny(tmp_path_factory.mktemp("tiny-quantized"), quantized=True)


@pytest.fixture(scope="session")
def trained_tiny_dir() -> Path:
    """The shipped trained TINY checkpoint (model/assets/tiny-trained): the CLI's default
    model. Package data: never write into it."""
    return TRAINED_TINY_DIR


# A prompt in the style of the corpus the shipped trained model was trained on (it is not in it).
CODE_PROMPT = '''class Registry:
    """A mapping of names to handlers."""

    def __init__(self):
        self._handlers = {}

    def register(self, name, handler):
        """Register handler under name."""
        if name in self._handlers:
            raise ValueError("duplicate name: %r" % (name,))
        self._handlers[name] = handler

    def get(self, name):
'''


@pytest.fixture(scope="session")
def code_prompt() -> str:
    """CODE_PROMPT: Python source like the trained checkpoint's corpus."""
    return CODE_PROMPT


@pytest.fixture(scope="session")
def tiny_alt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY_ALT: other sizes and weights with the same layer-mode pattern (plain)."""
    return make_tiny(tmp_path_factory.mktemp("tiny-alt"), spec=TINY_ALT)


# What transformers writes into every config it saves: PretrainedConfig().to_dict() of
# transformers 4.48.3, 4.57.6 and 5.24.0, and 5.24.0's
# GenerationConfig._get_default_generation_params(), recorded on 2026-12-01 by running
# each version (pip install --no-deps into a scratch directory, not a dependency).
TRANSFORMERS_RECORD = json.loads((Path(__file__).parent / "model" / "data" / "transformers_pretrained_config.json").read_text())
TRANSFORMERS_VERSIONS = tuple(sorted(TRANSFORMERS_RECORD["to_dict"]))


def _transformers_written(raw: dict[str, Any], version: str, layout: str = "nested") -> dict[str, Any]:
    """``raw`` (the released nested layout) as transformers ``version`` writes it:
    ``nested``, with PretrainedConfig's fields at the top level and in text_config and
    vision_config (the model's own values win over the defaults); or ``flat``, the text
    config as one PretrainedConfig with the top level's architectures, model_type and
    quantization_config."""
    defaults = TRANSFORMERS_RECORD["to_dict"][version]
    text = {**defaults, **raw["text_config"]}
    if layout == "flat":
        top = {k: raw[k] for k in ("architectures", "model_type", "quantization_config") if k in raw}
        return {**text, **top, "transformers_version": version}
    out = {**defaults, **{k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}}
    out["text_config"] = text
    out["vision_config"] = {**defaults, **raw["vision_config"]}
    out["transformers_version"] = version
    return out


@pytest.fixture(params=TRANSFORMERS_VERSIONS)
def transformers_version(request: pytest.FixtureRequest) -> str:
    """Each recorded transformers version in turn."""
    return request.param


@pytest.fixture(scope="session")
def transformers_written() -> Callable[..., dict[str, Any]]:
    """``transformers_written(raw, version, layout="nested")``: a config.json dict as
    transformers ``version`` writes it (see _transformers_written)."""
    return _transformers_written


@pytest.fixture(scope="session")
def hf_written_dir(tiny_quantized_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_quantized_dir (the released nested layout with quantization_config) with
    its config.json as transformers 4.57.6 writes it; the weights are the same files."""
    out = Path(shutil.copytree(tiny_quantized_dir, tmp_path_factory.mktemp("hf-written") / "ckpt"))
    raw = json.loads((tiny_quantized_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(_transformers_written(raw, "4.57.6"), indent=2))
    return out


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


def _file_mapped_table(
    directory: Path, values: torch.Tensor, scales: torch.Tensor, file_mapped: bool
) -> tuple[Any, dict[str, np.memmap]]:
    """An FP8 Engram table over read-only numpy memmaps of ``values`` and ``scales``
    written as files in ``directory`` (as the loader maps a checkpoint's), and the
    maps."""
    from dsv41.model.engram import EngramTable

    arrays = {}
    for name, tensor in (("values", values.contiguous()), ("scales", scales.contiguous())):
        path = directory / f"{name}.bin"
        writer = np.memmap(path, dtype=np.uint8, mode="w+", shape=tuple(tensor.shape))
        writer[:] = tensor.numpy()
        writer.flush()
        del writer
        arrays[name] = np.memmap(path, dtype=np.uint8, mode="r", shape=tuple(tensor.shape))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        table = EngramTable(
            torch.from_numpy(arrays["values"]), torch.from_numpy(arrays["scales"]), file_mapped=file_mapped
        )
    return table, arrays


@pytest.fixture(name="file_mapped_table")
def file_mapped_table_fixture(tmp_path: Path) -> Callable[..., tuple[Any, dict[str, np.memmap]]]:
    """``(values, scales, file_mapped=False) -> (EngramTable, its memmaps)``, the files
    in the test's temporary directory."""
    return lambda values, scales, file_mapped=False: _file_mapped_table(tmp_path, values, scales, file_mapped)
