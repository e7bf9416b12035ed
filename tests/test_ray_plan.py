"""engine="ray" in the plan: every bad argument fails before Ray is touched (launch/ray_plan.py)."""

import sys

import pytest

from notebook_accel.launch.errors import LaunchConfigError
from notebook_accel.launch.plan import make_plan


def test_a_ray_plan_holds_the_world_size_and_the_ranks_resources():
    plan = make_plan(num_processes=3, engine="ray", resources_per_rank={"CPU": 2}, placement="spread")
    assert (plan.engine, plan.start_method, plan.num_processes, plan.world_size) == ("ray", "ray", 3, 3)
    assert plan.ray.resources == {"CPU": 2} and plan.ray.placement == "SPREAD"
    assert plan.env["OMP_NUM_THREADS"] == "2" and plan.env["ACCELERATE_USE_CPU"] == "1"
    assert "RANK" not in plan.env  # each rank's own variables are set where Ray placed it


def test_a_gpu_bundle_leaves_the_ranks_off_the_cpu():
    plan = make_plan(num_processes=2, engine="ray", resources_per_rank={"CPU": 1, "GPU": 1})
    assert "ACCELERATE_USE_CPU" not in plan.env


def test_an_unknown_engine_names_the_choices():
    with pytest.raises(LaunchConfigError, match=r"engine='rya' is not a launch engine: use None .* or 'ray'"):
        make_plan(num_processes=2, engine="rya")


@pytest.mark.parametrize(
    "given, named",
    [
        ({"num_nodes": 2}, "num_nodes"),
        ({"use_port": "29501"}, "use_port"),
        ({"master_addr": "10.0.0.1", "node_rank": 1, "num_nodes": 2}, "num_nodes, node_rank, master_addr"),
        ({"start_method": "spawn"}, "start_method"),
        ({"rdzv_endpoint": "h:1"}, "rdzv_endpoint"),
        ({"gpu_ids": "0"}, "gpu_ids"),
        ({"max_restarts": 1}, "max_restarts"),
        ({"pdb": True}, "pdb"),
    ],
)
def test_what_ray_places_itself_is_refused(given, named):
    with pytest.raises(LaunchConfigError, match=f"engine='ray' places the ranks itself, so {named} cannot"):
        make_plan(num_processes=2, engine="ray", **given)


@pytest.mark.parametrize(
    "given, says",
    [
        ({"placement": "scatter"}, r"placement='scatter' is not one of \('pack', 'spread'"),
        ({"resources_per_rank": 2}, r"resources_per_rank=2 must be a dict of Ray resources"),
        ({"resources_per_rank": {"CPU": -1}}, r"CPU must be 0 or more, not -1"),
        ({"resources_per_rank": {"CPU": 0}}, r"asks for nothing"),
        ({"resources_per_rank": {"CPU": "1"}}, r"each entry is a name and a number"),
        ({"ray_address": ""}, r"ray_address='' must be a Ray address"),
        ({"runtime_env": "pip"}, r"runtime_env='pip' must be a dict"),
        ({"resources_per_rank": {"GPU": 1}, "cpu": True}, r"asks for GPUs but cpu=True"),
        ({"num_processes": None}, r"engine='ray' needs num_processes"),
        ({"num_processes": 0}, r"num_processes"),
    ],
)
def test_bad_ray_arguments_are_named(given, says):
    with pytest.raises(LaunchConfigError, match=says):
        make_plan(**{"num_processes": 2, "engine": "ray", **given})


def test_planning_a_ray_launch_does_not_import_ray():
    before = "ray" in sys.modules
    make_plan(num_processes=2, engine="ray")
    assert ("ray" in sys.modules) == before
