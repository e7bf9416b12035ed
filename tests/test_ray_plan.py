"""engine="ray" in the plan: every bad argument fails before Ray is touched (launch/ray_plan.py)."""

import re
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
        ({"node_rank": 0}, "node_rank"),  # 0 is given too
        ({"max_restarts": 0}, "max_restarts"),
        ({"gpu_ids": 0}, "gpu_ids"),
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
        ({"resources_per_rank": {"CPU": 1, "GPU": 0.5}}, r"GPU must be a whole number"),
        ({"resources_per_rank": {"CPU": 0.00001}}, r"Ray counts CPU in steps of 0.0001"),
    ],
)
def test_bad_ray_arguments_are_named(given, says):
    with pytest.raises(LaunchConfigError, match=says):
        make_plan(**{"num_processes": 2, "engine": "ray", **given})


@pytest.mark.parametrize(
    "given, named",
    [
        ({"ray_address": "auto"}, "ray_address='auto'"),
        ({"placement": "spread"}, "placement='spread'"),
        ({"resources_per_rank": {"CPU": 1}}, "resources_per_rank={'CPU': 1}"),
        ({"runtime_env": {"pip": ["x"]}}, "runtime_env={'pip': ['x']}"),
    ],
)
def test_rays_arguments_without_the_ray_engine_are_refused(given, named):
    with pytest.raises(LaunchConfigError, match=rf"{re.escape(named)} only apply with engine='ray'"):
        make_plan(num_processes=2, use_port="auto", **given)


def test_planning_a_ray_launch_does_not_import_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # an import of it would fail
    assert make_plan(num_processes=2, engine="ray").engine == "ray"


def _where(node, versions):
    return {"node_id": node * 7, "ip": f"10.0.0.{len(node)}", "gpus": [], "pid": 1, "versions": versions}


def test_a_node_with_other_versions_is_named_with_both():
    from notebook_accel.launch.ray_rank import versions
    from notebook_accel.launch.starters.ray_engine import RayLaunch

    launch = RayLaunch(None, make_plan(num_processes=2, engine="ray"), sink=None, control=None)
    here = versions()
    launch._check_versions([_where("a", here), _where("bb", here)])  # the same everywhere: fine
    other = {**here, "torch": "2.9.1"}
    with pytest.raises(LaunchConfigError) as caught:
        launch._check_versions([_where("a", here), _where("bb", other)])
    text = str(caught.value)
    assert "Ray node 10.0.0.2 (bbbbbbbbbbbb) runs notebook_accel" in text
    assert "torch 2.9.1" in text and f"torch {here['torch']}" in text and "install the same versions" in text


def test_ranks_are_numbered_node_by_node_with_one_device_list_a_node():
    from notebook_accel.launch.starters.ray_engine import RayLaunch, order

    launch = RayLaunch(None, make_plan(num_processes=4, engine="ray"), sink=None, control=None)
    # Bundles 0..3 landed on nodes B, A, B, A: B is named first, so B's ranks come first.
    where = [{"node_id": n, "ip": ip, "gpus": g, "pid": i, "versions": {}}
             for i, (n, ip, g) in enumerate([("B", "10.0.0.2", ["1"]), ("A", "10.0.0.1", ["0"]),
                                             ("B", "10.0.0.2", ["0"]), ("A", "10.0.0.1", ["3"])])]  # fmt: skip
    launch.ranks, launch.nodes = order(where)
    assert (launch.ranks, launch.nodes) == ([0, 2, 1, 3], ["B", "A"])
    launch.where = [where[i] for i in launch.ranks]
    envs = launch.rank_envs(29555)
    assert [(e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "0", "2"), ("1", "1", "0", "2"), ("2", "0", "1", "2"), ("3", "1", "1", "2")]  # fmt: skip
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["1,0", "1,0", "0,3", "0,3"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) for e in envs} == {("10.0.0.2", "29555", "4")}


@pytest.mark.parametrize(
    "per_rank, visible",
    [
        ([["0"], ["1"]], "0,1"),
        ([["0", "1"], ["2", "3"]], "0,2,1,3"),  # cuda:LOCAL_RANK is each rank's first GPU
        ([["3"], ["1"]], "3,1"),
        ([[], []], ""),  # CPU ranks on a GPU node see no GPU
    ],
)
def test_a_nodes_device_list_puts_each_ranks_own_gpu_at_its_local_rank(per_rank, visible):
    from notebook_accel.launch.starters.ray_engine import _devices

    assert _devices(per_rank) == visible


def test_a_config_file_s_engine_ray_and_its_ray_keys_fill_in_what_the_caller_left_out(tmp_path):
    path = tmp_path / "ray.yaml"
    path.write_text("engine: ray\nray_address: ray://head:10001\nplacement: spread\nresources_per_rank: {CPU: 2}\n")
    plan = make_plan(num_processes=2, config_file=str(path))
    assert plan.engine == "ray" and plan.ray.address == "ray://head:10001" and plan.ray.placement == "SPREAD"
    assert plan.ray.resources == {"CPU": 2}
    assert any(str(path) in note and "engine='ray'" in note for note in plan.notes), plan.notes
    # What the caller says wins over the file.
    mine = make_plan(num_processes=2, config_file=str(path), placement="strict_spread", ray_address="auto")
    assert (mine.ray.placement, mine.ray.address) == ("STRICT_SPREAD", "auto")


def test_a_launch_that_places_its_own_ranks_is_not_turned_into_a_ray_launch_by_the_file(tmp_path):
    """An interactive session or a debug launch passes ONE_MACHINE: a file's engine: ray does not
    make it a Ray launch, and the plan says why the file's engine went unused."""
    from notebook_accel.launch.plan import ONE_MACHINE

    path = tmp_path / "ray.yaml"
    path.write_text("engine: ray\nplacement: spread\n")
    plan = make_plan(num_processes=2, config_file=str(path), **ONE_MACHINE)
    assert plan.engine == "local"
    assert any("says engine: ray, which this launch does not use" in note for note in plan.notes), plan.notes
    with pytest.raises(LaunchConfigError, match="engine='ray' places the ranks itself, so num_nodes"):
        make_plan(num_processes=2, config_file=str(path), engine="ray", num_nodes=2)


def test_on_ray_tells_the_cell_magic_what_to_prepare_for(tmp_path, monkeypatch):
    """The magic pickles the cell for a Ray launch (its namespace stays home), not for a fork one."""
    from notebook_accel.launch.plan_config import on_ray

    path = tmp_path / "c.yaml"
    monkeypatch.setenv("NOTEBOOK_ACCEL_CONFIG_FILE", str(path))
    path.write_text("engine: ray\n")
    assert on_ray({}) and on_ray({"engine": "ray"}) and on_ray({"num_processes": 2})
    assert not on_ray({"start_method": "spawn"}) and not on_ray({"use_port": "29501"})
    path.write_text("num_processes: 2\n")
    assert not on_ray({}) and on_ray({"engine": "ray"})


def test_the_preview_shows_a_config_file_s_ray_launch(tmp_path, monkeypatch):
    from notebook_accel.launch.preview import launch_preview

    path = tmp_path / "c.yaml"
    monkeypatch.setenv("NOTEBOOK_ACCEL_CONFIG_FILE", str(path))
    path.write_text("engine: ray\nnum_processes: 4\nplacement: spread\nresources_per_rank: {CPU: 2}\n")
    rows = dict(launch_preview().rows)
    assert rows["Start method"] == "ray (ray engine)" and rows["Processes"].startswith("4 on the Ray cluster")
    assert rows["Each rank"] == "CPU 2, placed spread" and rows["Distributed type"] == "MULTI_CPU"
    path.write_text("engine: ray\n")
    assert "engine='ray' needs num_processes" in launch_preview().error
