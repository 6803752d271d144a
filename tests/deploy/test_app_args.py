"""AppArgs' Python allocator: the replicas' Ray actor options carry it in their runtime
environment next to what the user's options hold, and a value outside the allowed ones,
or a PYTHONMALLOC set by hand in either actor options' runtime_env, is refused by name."""

from __future__ import annotations

import pytest

from dsv41.deploy.app_args import INGRESS_NUM_CPUS, AppArgs
from dsv41.deploy.heap import DEFAULT_PYTHON_ALLOCATOR, PYTHON_ALLOCATOR_ENV


def test_the_replicas_start_with_the_python_allocator_beside_the_users_environment() -> None:
    args = AppArgs.from_dict(
        {
            "python_allocator": "malloc",
            "ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": {"A": "1"}, "pip": ["x"]}},
            "ingress_ray_actor_options": {"memory": 2**30},
        }
    )
    assert args.llm_server_actor_options() == {
        "num_cpus": 1,
        "runtime_env": {"env_vars": {"A": "1", PYTHON_ALLOCATOR_ENV: "malloc"}, "pip": ["x"]},
    }
    assert args.ingress_actor_options() == {
        "num_cpus": INGRESS_NUM_CPUS,
        "memory": 2**30,
        "runtime_env": {"env_vars": {PYTHON_ALLOCATOR_ENV: "malloc"}},
    }
    default = AppArgs.from_dict({})
    assert default.python_allocator == DEFAULT_PYTHON_ALLOCATOR == "pymalloc"
    assert default.llm_server_actor_options()["runtime_env"]["env_vars"] == {PYTHON_ALLOCATOR_ENV: "pymalloc"}


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"python_allocator": "jemalloc"}, "python_allocator: 'jemalloc' (allowed: malloc, pymalloc)"),
        ({"ray_actor_options": {"runtime_env": {"env_vars": {PYTHON_ALLOCATOR_ENV: "malloc"}}}}, "ray_actor_options: sets"),
        (
            {"ingress_ray_actor_options": {"runtime_env": {"env_vars": {PYTHON_ALLOCATOR_ENV: "debug"}}}},
            "ingress_ray_actor_options: sets",
        ),
    ],
)
def test_a_bad_allocator_or_one_set_by_hand_is_refused_by_name(args: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        AppArgs.from_dict(args)
