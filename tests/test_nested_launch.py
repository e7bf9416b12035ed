"""A launched function that calls notebook_launcher again (issue 29), in real processes on gloo.

A rank in a process group may launch again only with ranks that start fresh (spawn / forkserver): a
forked rank would inherit the group, so a fork launch there is refused before anything starts. A rank
without a group may fork a pool of its own. Process counts add up over the outer and inner launches.
Every test has a pytest timeout and every inner launch a `timeout=`, so a hang is a failure.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from notebook_accel import PartialState
from notebook_accel.launch import (
    LaunchConfigError,
    LaunchFailedError,
    ListSink,
    limits,
    make_plan,
    notebook_launcher,
)
from notebook_accel.launch.launcher import run_plan

INNER_TIMEOUT_S = 60.0


@pytest.fixture(scope="module", autouse=True)
def _stop_the_warm_server_afterwards():
    yield
    from notebook_accel.launch.warm import WarmServer

    WarmServer.shutdown()


def launch(function, args=(), **kwargs):
    kwargs.setdefault("num_processes", 2)
    return notebook_launcher(
        function, args, use_port="auto", cpu=True, sinks=[ListSink()], timeout=INNER_TIMEOUT_S * 2, **kwargs
    )


# -- what the ranks run ------------------------------------------------------------------------------
def inner_rank(tag):
    state = PartialState()
    total = torch.tensor([float(state.process_index + 1)])
    dist.all_reduce(total)
    return {
        "tag": tag,
        "rank": state.process_index,
        "world": state.num_processes,
        "sum": total.item(),
        "outer_launches": os.environ.get(limits.OUTER_LAUNCHES_ENV),
    }


def outer_rank(with_state: bool, inner_method: str):
    """Launch again from this rank (before or after joining the outer group), then reduce over the
    outer group; returns (the inner launch's results or error, the outer sum, seconds it took)."""
    if with_state:
        PartialState()
    tag = int(os.environ["RANK"])
    started = time.monotonic()
    try:
        inner = notebook_launcher(
            inner_rank,
            (tag,),
            num_processes=2,
            start_method=inner_method,
            use_port="auto",
            sinks=[ListSink()],
            timeout=INNER_TIMEOUT_S,
        )
    except LaunchConfigError as exc:
        inner = f"LaunchConfigError: {exc}"
    took = time.monotonic() - started
    state = PartialState()  # the outer group: joined now if it was not before
    total = torch.ones(1)
    dist.all_reduce(total)
    return inner, total.item(), took, os.environ.get(limits.OUTER_LAUNCHES_ENV), state.num_processes


def launch_too_many_inside():
    """Ask for half the ceiling from each of 2 outer ranks: alone it fits, together with them not."""
    from notebook_accel import hardware

    half = limits.PROCESSES_PER_CORE * hardware.physical_cores() // 2
    try:
        notebook_launcher(
            inner_rank, (0,), num_processes=half, use_port="auto", sinks=[ListSink()], timeout=10
        )
    except LaunchConfigError as exc:
        return half, str(exc)
    return half, None


# -- nested launches -----------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_a_fork_launch_from_a_rank_in_a_group_fails_at_once_and_the_group_still_works(no_orphans):
    results = launch(outer_rank, (True, "fork"))
    for rank, (inner, outer_sum, took, _outer, world) in enumerate(results):
        assert inner.startswith("LaunchConfigError: This process is rank ")
        assert f"rank {rank} of a 2-process torch.distributed group" in inner
        assert "start_method='forkserver' (or 'spawn')" in inner and "before PartialState()" in inner
        assert took < 10, "refused before anything started"
        assert (outer_sum, world) == (2.0, 2)  # the outer group is intact
    no_orphans()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "in_a_group, start_method",
    [(True, "spawn"), (False, "fork")],  # spawn ranks form a group of their own; without a group, fork runs
)
def test_an_inner_launch_runs_and_its_results_come_back_through_both(no_orphans, in_a_group, start_method):
    results = launch(outer_rank, (in_a_group, start_method))
    assert len(results) == 2
    for outer_rank_index, (inner, outer_sum, _took, outer_launches, world) in enumerate(results):
        assert [(r["tag"], r["rank"], r["world"], r["sum"]) for r in inner] == [
            (outer_rank_index, 0, 2, 3.0),
            (outer_rank_index, 1, 2, 3.0),
        ]
        assert all(r["outer_launches"] == "2,2" for r in inner)
        assert (outer_sum, world, outer_launches) == (2.0, 2, "2")  # the outer group intact, or formed after
    no_orphans()


@pytest.mark.timeout(90)
def test_a_launch_inside_a_rank_counts_the_outer_launch_in_the_process_ceiling(monkeypatch, no_orphans):
    monkeypatch.delenv(limits.MANY_PROCESSES_ENV, raising=False)
    for half, message in launch(launch_too_many_inside):
        assert message is not None, f"num_processes={half} from each of 2 ranks was allowed"
        assert f"num_processes={half} inside a rank of a 2-process launch" in message
        assert f"{limits.OUTER_LAUNCHES_ENV}=2" in message and f"{2 + 2 * half} processes" in message
        assert f"{limits.MANY_PROCESSES_ENV}=1" in message
    no_orphans()


# -- the count, as the plan sees it ------------------------------------------------------------------
def test_processes_here_adds_every_level_of_the_enclosing_launches():
    assert limits.processes_here(5, []) == 5
    assert limits.processes_here(3, [2]) == 2 + 2 * 3
    assert limits.processes_here(2, [2, 2]) == 2 + 4 + 8


def test_the_count_check_adds_the_inherited_outer_launches(monkeypatch):
    monkeypatch.delenv(limits.MANY_PROCESSES_ENV, raising=False)
    monkeypatch.delenv(limits.OUTER_LAUNCHES_ENV, raising=False)
    limits.check_process_count(64, cores=1)  # exactly the ceiling: allowed
    monkeypatch.setenv(limits.OUTER_LAUNCHES_ENV, "2")
    limits.check_process_count(31, cores=1)  # 2 + 62
    with pytest.raises(LaunchConfigError, match=r"num_processes=32 inside a rank of a 2-process launch"):
        limits.check_process_count(32, cores=1)  # 2 + 64
    monkeypatch.setenv(limits.OUTER_LAUNCHES_ENV, "2,4")
    with pytest.raises(
        LaunchConfigError,
        match=r"inside a rank of a 4-process launch inside a 2-process launch "
        r"\(NOTEBOOK_ACCEL_OUTER_LAUNCHES=2,4\): with every rank starting as many, 74 processes",
    ):
        limits.check_process_count(8, cores=1)  # 2 + 8 + 8 * 8
    monkeypatch.setenv(limits.MANY_PROCESSES_ENV, "1")
    limits.check_process_count(8, cores=1)  # meant: allowed
    monkeypatch.delenv(limits.MANY_PROCESSES_ENV)
    monkeypatch.setenv(limits.OUTER_LAUNCHES_ENV, "two")  # not ours to trust: counts nothing
    limits.check_process_count(64, cores=1)


def test_a_plan_tells_its_ranks_the_launches_they_run_inside(monkeypatch):
    monkeypatch.delenv(limits.OUTER_LAUNCHES_ENV, raising=False)
    assert make_plan(num_processes=3, cpu=True, use_port="auto").env[limits.OUTER_LAUNCHES_ENV] == "3"
    monkeypatch.setenv(limits.OUTER_LAUNCHES_ENV, "2")
    assert make_plan(num_processes=3, cpu=True, use_port="auto").env[limits.OUTER_LAUNCHES_ENV] == "2,3"


# -- a process that is in a group --------------------------------------------------------------------
@pytest.fixture
def group_here(tmp_path):
    """This process as rank 0 of a 1-process gloo group, torn down afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def destroy_recorder(path):
    def destroy(group=None):
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")

    return destroy


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("group_here")
def test_make_plan_refuses_a_fork_launch_from_a_process_in_a_group():
    with pytest.raises(LaunchConfigError, match=r"rank 0 of a 1-process torch.distributed group.*forkserver"):
        make_plan(num_processes=2, cpu=True, use_port="auto")
    for method in ("spawn", "forkserver"):
        assert (
            make_plan(num_processes=2, cpu=True, use_port="auto", start_method=method).start_method == method
        )
    one = make_plan(num_processes=1, cpu=True, use_port="auto")  # runs here, forks nothing
    assert one.num_processes == 1


@pytest.mark.timeout(60)
def test_a_forked_rank_never_destroys_a_group_it_inherited(tmp_path, monkeypatch, no_orphans):
    plan = make_plan(num_processes=2, cpu=True, use_port="auto")  # planned before the group existed
    marker = tmp_path / "destroyed-by"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # The ranks inherit this stand-in: a call to it in a rank leaves that rank's pid behind.
        monkeypatch.setattr(dist, "destroy_process_group", destroy_recorder(marker))
        from notebook_accel.launch.control import LaunchControl

        started = time.monotonic()
        try:  # os.getpid: a rank that ran it would reach its teardown at once
            run_plan(plan, os.getpid, (), ListSink(), LaunchControl(INNER_TIMEOUT_S))
            outcome = "the launch ran"
        except LaunchFailedError as exc:
            outcome = str(exc)
        assert not marker.exists(), f"a rank tore down the group it inherited: pids {marker.read_text()}"
        assert "forked from a process in a torch.distributed process group" in outcome
        assert time.monotonic() - started < 20
        total = torch.ones(1)
        dist.all_reduce(total)  # this process's group still works
        assert total.item() == 1.0
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    no_orphans()
