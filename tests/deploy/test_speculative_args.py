"""The serving surface's decode options (speculation, the graph mode): YAML ``engine:``
and the CLI flags reach EngineOptions, and a Ray engine group with speculation is
refused before Serve starts."""

from __future__ import annotations

import argparse

import pytest

from dsv41.cluster.options import engine_options
from dsv41.deploy.app_args import AppArgs
from dsv41.deploy.cli import _runtime_options, build_parser, main


def test_yaml_engine_options_and_cli_flags_select_dspark() -> None:
    """``engine: {speculative_method: dspark}`` is DSpark 5 (the spec's count), and
    ``--method dspark --num-speculative-tokens 5`` gives the same engine options."""
    args = AppArgs.from_dict({"engine": {"speculative_method": "dspark"}})
    options = engine_options(args.engine_options())
    assert (options.speculative_method, options.num_speculative_tokens) == ("dspark", 5)
    parsed = build_parser().parse_args(["generate", "--prompt", "x", "--max-tokens", "3", "--method", "dspark", "--num-speculative-tokens", "5"])
    assert _runtime_options(parsed) == {"speculative_method": "dspark", "num_speculative_tokens": 5}
    unset = argparse.Namespace(
        method=None, num_speculative_tokens=None, cudagraph_mode=None, weight_storage=None, fp8_activations=False,
        async_scheduling=False,
    )
    assert _runtime_options(unset) == {}


def test_the_cli_flag_selects_the_graph_mode_and_its_refusal_names_why() -> None:
    """``--cudagraph-mode full`` reaches EngineOptions; on the CPU `dsv41 generate`
    exits with the engine's reason (Triton kernels on a CUDA device) before any weight
    is read."""
    parsed = build_parser().parse_args(["validate", "--output", "x.json", "--cudagraph-mode", "full"])
    assert _runtime_options(parsed) == {"cudagraph_mode": "full"}
    parsed = build_parser().parse_args(["serve", "--weight-storage", "decoded"])
    assert _runtime_options(parsed) == {"weight_storage": "decoded"}
    parsed = build_parser().parse_args(["generate", "--prompt", "x", "--max-tokens", "4", "--async-scheduling"])
    assert _runtime_options(parsed) == {"async_scheduling": True}
    parsed = build_parser().parse_args(["serve", "--fp8-activations"])
    assert _runtime_options(parsed) == {"fp8_activations": True}
    assert engine_options(AppArgs.from_dict({"engine": {"fp8_activations": True}}).engine_options()).fp8_activations
    with pytest.raises(SystemExit, match="dsv41 validate: --fp8-activations: validation holds the engine to the reference"):
        main(["validate", "--output", "x.json", "--fp8-activations"])
    with pytest.raises(SystemExit, match="dsv41 generate: cudagraph_mode: 'full' with kernel_backend 'torch' on 'cpu'"):
        main(["generate", "--prompt", "x", "--max-tokens", "4", "--cudagraph-mode", "full"])


def test_a_ray_group_with_speculation_is_refused_before_serve_starts() -> None:
    """The Ray engine group's wires carry no drafts yet: AppArgs refuses the pair,
    naming the backend that would work."""
    with pytest.raises(ValueError, match="allowed with speculation: backend 'local'"):
        AppArgs.from_dict({"backend": "ray", "engine": {"speculative_method": "dspark"}, "ray_actor_options": {"num_cpus": 1}})


def test_a_ray_group_with_async_scheduling_is_refused_before_serve_starts() -> None:
    """The Ray engine group's rank actors run each step to its result: AppArgs refuses
    async scheduling on it, naming the backends that run it."""
    with pytest.raises(ValueError, match="allowed with async scheduling: backend 'local' or 'process'"):
        AppArgs.from_dict({"backend": "ray", "engine": {"async_scheduling": True}, "ray_actor_options": {"num_cpus": 1}})
    AppArgs.from_dict({"backend": "process", "engine": {"async_scheduling": True}, "ray_actor_options": {"num_cpus": 1}})


def test_the_cli_names_a_refusal_instead_of_a_traceback() -> None:
    """`dsv41 generate --method dspark --dp 2`, and `--async-scheduling --backend ray`,
    exit with the engine's reason, before Ray starts or any weight is read."""
    with pytest.raises(SystemExit, match="dsv41 generate: speculative_method: 'dspark' with 2 DP ranks"):
        main(["generate", "--prompt", "x", "--max-tokens", "4", "--method", "dspark", "--dp", "2"])
    with pytest.raises(SystemExit, match="dsv41 generate: async_scheduling: True on the Ray engine group"):
        main(["generate", "--prompt", "x", "--max-tokens", "4", "--async-scheduling", "--backend", "ray", "--dp", "2"])
