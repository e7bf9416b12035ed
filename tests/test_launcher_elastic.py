"""Multi-node (two launchers on localhost) and restarts, through torch elastic, in real processes."""

import json
import os
import subprocess
import sys

import psutil
import pytest
from elastic_targets import (
    always_fail,
    fail_once,
    only_rank_1_creates_the_state,
    put_then_fail,
    ranks_and_sum,
    take_the_token,
)

from notebook_accel import notebook_launcher
from notebook_accel.launch import LaunchFailedError, ListSink, RankOutput
from notebook_accel.launch.plan import free_port, make_plan

HERE = os.path.dirname(__file__)


def _mp_helpers() -> set:
    # The first elastic launch starts multiprocessing's forkserver (and its resource tracker);
    # both stay up for later launches by design.
    from multiprocessing import forkserver, resource_tracker

    pids = {
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }
    return {p for p in pids if p}


@pytest.fixture
def no_new_children():
    """Fails the test if a process it started outlives it (older helpers, e.g. forkservers, are fine)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before | _mp_helpers()]
    psutil.wait_procs(new, timeout=5)
    left = [p for p in new if _alive(p)]
    assert not left, f"processes left behind: {left}"


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone between listing and looking
        return False


def test_restarts_choose_elastic_engine():
    assert make_plan(num_processes=2, max_restarts=1, use_port="auto").engine == "elastic"
    assert make_plan(num_processes=2, num_nodes=2, use_port="auto").engine == "elastic"
    assert make_plan(num_processes=2, rdzv_backend="c10d", use_port="auto").engine == "elastic"
    assert make_plan(num_processes=2, use_port="auto").engine == "local"


@pytest.mark.timeout(90)
def test_two_nodes_on_localhost_meet_and_sum():
    port = str(free_port())
    script = os.path.join(HERE, "elastic_targets.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    nodes = [
        subprocess.Popen(
            [sys.executable, script, str(i), port], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for i in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            out, err = node.communicate(timeout=80)
            assert node.returncode == 0, err.decode()[-3000:]
            outputs.append(out.decode())
    finally:
        for node in nodes:
            node.kill()
    results = []
    for text in outputs:
        line = [ln for ln in text.splitlines() if ln.startswith("RESULTS ")]
        assert line, text
        results += json.loads(line[0][len("RESULTS ") :])
        # each node printed its ranks' lines, prefixed with the global rank
        assert "of 4 on local rank" in text
    assert sorted(r[0] for r in results) == [0, 1, 2, 3]
    assert all(r[2] == 4 and r[3] == 6.0 and r[4] == "MULTI_CPU" for r in results)
    assert sorted(r[1] for r in results) == [0, 0, 1, 1]


@pytest.mark.timeout(90)
def test_restart_after_a_failure_returns_the_second_attempt(tmp_path, no_new_children):
    sink = ListSink()
    results = notebook_launcher(
        fail_once, (str(tmp_path),), num_processes=2, max_restarts=1, use_port="auto", sinks=[sink]
    )
    assert (tmp_path / "failed-once").exists()
    assert results == [(0, 1), (1, 1)]


@pytest.mark.timeout(90)
def test_fork_restarts_inherit_what_cannot_be_pickled(no_new_children):
    # accelerate's test_notebook passes a fork-context Queue with max_restarts: with the default
    # start_method="fork", every attempt inherits the arguments; output and results still arrive.
    import multiprocessing
    import threading

    queue = multiprocessing.get_context("fork").Queue()
    queue.put(1)
    sink = ListSink()
    results = notebook_launcher(
        take_the_token, (queue, threading.Lock()), num_processes=2, max_restarts=2, use_port="auto", sinks=[sink]
    )
    assert [rank for rank, _ in results] == [0, 1]
    assert all(attempt >= 1 for _, attempt in results), results  # the first attempt failed
    assert queue.empty()
    final = [e.text for e in sink.events if isinstance(e, RankOutput) and e.text.endswith("token None")]
    assert len(final) >= 2, final


@pytest.mark.timeout(90)
def test_a_rank_joining_after_a_peer_returned_without_the_state_fails_at_once(no_new_children):
    # torch's init waits 30 minutes for a rank that has already returned; ours says so at once,
    # on every attempt (the launch used to hang here: accelerate's test_notebook met it).
    with pytest.raises(LaunchFailedError) as info:
        notebook_launcher(only_rank_1_creates_the_state, num_processes=2, max_restarts=1, use_port="auto", sinks=[])
    text = str(info.value)
    assert "rank 1 is joining the process group" in text
    assert "rank(s) 0 already returned from the function without creating the state" in text


@pytest.mark.timeout(90)
def test_what_a_failing_elastic_rank_put_in_a_queue_arrives(no_new_children):
    import multiprocessing

    queue = multiprocessing.get_context("fork").Queue()
    with pytest.raises(LaunchFailedError, match="failing right after a put"):
        notebook_launcher(
            put_then_fail, (queue,), num_processes=2, max_restarts=0, rdzv_backend="c10d", use_port="auto", sinks=[]
        )
    assert queue.get(timeout=5) == "from rank 0"


@pytest.mark.timeout(90)
def test_a_spawn_restart_still_names_what_cannot_be_pickled(no_new_children):
    import threading

    from notebook_accel.launch import UnpicklableError

    with pytest.raises(UnpicklableError, match=r"argument 1 \(lock: .*use start_method=.fork"):
        notebook_launcher(
            take_the_token, (None, threading.Lock()), num_processes=2, max_restarts=1, use_port="auto",
            start_method="spawn", sinks=[],
        )


@pytest.mark.timeout(90)
def test_elastic_failure_without_restarts_names_rank_and_source(no_new_children):
    with pytest.raises(LaunchFailedError) as info:
        notebook_launcher(
            always_fail, num_processes=2, max_restarts=0, rdzv_backend="c10d", use_port="auto", sinks=[]
        )
    text = str(info.value)
    assert "rank 0 raised KeyError" in text
    assert 'raise KeyError("no such key on rank 0")' in text


@pytest.mark.timeout(90)
def test_elastic_output_is_captured_per_rank():
    sink = ListSink()
    results = notebook_launcher(ranks_and_sum, num_processes=2, max_restarts=1, use_port="auto", sinks=[sink])
    assert [r[0] for r in results] == [0, 1]
    lines = {e.rank: e.text for e in sink.events if isinstance(e, RankOutput)}
    assert lines == {0: "rank 0 of 2 on local rank 0", 1: "rank 1 of 2 on local rank 1"}


@pytest.mark.timeout(90)
def test_elastic_timeout_stops_the_workers_and_raises(tmp_path, no_new_children):
    from launch_targets import sleep_then_touch

    from notebook_accel.launch import LaunchTimeoutError, RankStarted, RankStopped

    sink = ListSink()
    marker = str(tmp_path / "finished")
    # 10 s: on a loaded 2-core machine the agent, rendezvous and rank start can take several seconds
    with pytest.raises(LaunchTimeoutError, match="timed out after 10 s"):
        notebook_launcher(
            sleep_then_touch,
            (marker, 30.0),
            num_processes=2,
            max_restarts=1,
            use_port="auto",
            sinks=[sink],
            timeout=10,
        )
    started = sorted(e.rank for e in sink.events if isinstance(e, RankStarted))
    assert started == [0, 1]
    assert sorted(e.rank for e in sink.events if isinstance(e, RankStopped)) == started
    assert not any(os.path.exists(f"{marker}.{r}") for r in (0, 1))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend, node_rank", [("static", 0), ("c10d", 0), ("static", 1)])
def test_a_missing_node_is_announced_then_named_when_the_wait_ends(monkeypatch, backend, node_rank, no_new_children):
    """Node 0 alone (or node 1 with no node 0 to reach): a notice says what it waits for, and after the
    rendezvous wait a NodesMissingError says what to do, instead of torch's bare timeout."""
    from notebook_accel.launch import LaunchFinished, LaunchNotice, NodesMissingError
    from notebook_accel.launch.starters import elastic

    monkeypatch.setattr(elastic, "NODE_WAIT_NOTICE_S", 1.0)
    sink, port = ListSink(), free_port()
    # join_timeout is c10d's name; static calls it timeout and takes either
    with pytest.raises(NodesMissingError) as caught:
        notebook_launcher(
            ranks_and_sum, num_processes=1, num_nodes=2, node_rank=node_rank, rdzv_backend=backend,
            use_port=port, rdzv_conf={"join_timeout": 4}, sinks=[sink],
        )  # fmt: skip
    text = str(caught.value)
    assert f"node {node_rank} of 2 waited 4 s at 127.0.0.1:{port}" in text, text
    assert "its own node_rank" in text and "sets the wait" in text
    # The plan's notes are notices too (e.g. the OpenMP thread note after a parallel region ran here).
    notices = [e.text for e in sink.events if isinstance(e, LaunchNotice) and "waiting for the other nodes" in e.text]
    assert len(notices) == 1 and f"node {node_rank} of 2: waiting for the other nodes at 127.0.0.1:{port}" in notices[0]
    assert f"rdzv_backend={backend!r}" in notices[0] and "Gives up after 4 s" in notices[0]
    assert isinstance(sink.events[-1], LaunchFinished) and not sink.events[-1].ok
