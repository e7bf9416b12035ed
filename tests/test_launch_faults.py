"""Faults that used to hang a launch or kill ranks behind the user's back (issue #15, items 1-3),
on real processes: the forkserver dying mid-launch, launches from several threads at once, and
workers started from a thread that then ends."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
from launch_targets import rank_of_this_process, sleep_and_return, start_a_sleeper

from notebook_accel.launch import (
    LaunchFailedError,
    LaunchTimeoutError,
    ListSink,
    RankStarted,
    notebook_launcher,
)
from notebook_accel.launch.warm import WarmServer
from notebook_accel.session import Session


@pytest.fixture(autouse=True)
def _fresh_server():
    WarmServer.shutdown()
    yield
    WarmServer.shutdown()


class _StartedRanks(ListSink):
    def __init__(self, count: int):
        super().__init__()
        self.count = count
        self.all_started = threading.Event()

    def handle(self, event):
        super().handle(event)
        if sum(isinstance(e, RankStarted) for e in self.events) >= self.count:
            self.all_started.set()


@pytest.mark.timeout(120)
def test_the_forkserver_dying_fails_the_launch_at_once_and_the_next_one_works(no_orphans):
    sink = _StartedRanks(2)
    outcome = {}

    def launch():
        try:
            notebook_launcher(
                sleep_and_return, (60,), num_processes=2, start_method="forkserver", sinks=[sink], timeout=90
            )
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    assert sink.all_started.wait(60), "the ranks did not start"
    pids = [e.pid for e in sink.events if isinstance(e, RankStarted)]
    server = WarmServer._instance
    server.proc.send_signal(signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive(), "the launch hangs after its forkserver died"
    error = outcome.get("error")
    assert isinstance(error, LaunchFailedError), repr(error)
    assert "forkserver" in str(error) and "SIGKILL" in str(error), str(error)
    deadline = time.monotonic() + 10  # SIGKILLed with their server; gone a moment later
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)]
    # a new server for the next launch
    assert notebook_launcher(rank_of_this_process, num_processes=2, start_method="forkserver") == [0, 1]
    assert WarmServer._instance is not server
    no_orphans()


@pytest.mark.timeout(180)
def test_launches_from_three_threads_share_the_forkserver():
    results, errors = {}, {}

    def launch(i):
        try:
            results[i] = notebook_launcher(
                rank_of_this_process, num_processes=2, start_method="forkserver", timeout=120
            )
        except BaseException as exc:
            errors[i] = exc

    threads = [threading.Thread(target=launch, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a launch hangs"
    assert errors == {}
    assert results == {0: [0, 1], 1: [0, 1], 2: [0, 1]}


@pytest.mark.timeout(60)
def test_the_timeout_covers_waiting_to_start():
    server = WarmServer.get()
    server._starting.acquire()  # another launch's start that never ends
    try:
        with pytest.raises(LaunchTimeoutError):
            notebook_launcher(rank_of_this_process, num_processes=2, start_method="forkserver", timeout=1.0)
    finally:
        server._starting.release()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_started_from_a_thread_outlive_that_thread(start_method):
    session = Session(2, start_method=start_method, cpu=True)
    thread = threading.Thread(target=session.start, daemon=True)
    thread.start()
    thread.join(90)
    assert session.started
    pids = dict(session.pids())
    time.sleep(1.0)  # PR_SET_PDEATHSIG, had it fired on the thread's end, has killed them by now
    try:
        assert all(psutil.pid_exists(pid) for pid in pids.values())
        replies = session.run_cell("import os\nos.getpid()")
        assert {rank: r.ok for rank, r in replies.items()} == {0: True, 1: True}
        assert {rank: int(r.result_repr) for rank, r in replies.items()} == pids
    finally:
        session.stop()
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        for pid in pids.values()
    )


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_what_a_rank_started_ends_with_it_after_a_successful_launch(tmp_path, start_method):
    marker = str(tmp_path / "sleeper")
    pids = notebook_launcher(start_a_sleeper, (marker,), num_processes=2, start_method=start_method)
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], "a rank's subprocess outlived the launch"


@pytest.mark.timeout(120)
def test_a_session_workers_subprocess_ends_with_the_session():
    with Session(2, cpu=True) as session:
        replies = session.run_cell("import subprocess\nsubprocess.Popen(['sleep', '300']).pid")
        pids = [int(r.result_repr) for r in replies.values()]
        assert all(_alive(p) for p in pids)  # a worker's children live while the worker does
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)]


def test_a_process_count_that_is_not_an_int_is_named():
    from notebook_accel.launch import LaunchConfigError

    for bad in ("2", 2.0, True):
        with pytest.raises(LaunchConfigError, match=rf"num_processes={bad!r} must be an integer"):
            notebook_launcher(rank_of_this_process, num_processes=bad)


@pytest.mark.timeout(60)
def test_an_absurd_process_count_fails_before_anything_starts(no_orphans):
    from notebook_accel.launch import LaunchConfigError

    with pytest.raises(
        LaunchConfigError,
        match=r"num_processes=10000 is more than 64 per CPU core.*NOTEBOOK_ACCEL_MANY_PROCESSES=1",
    ):
        notebook_launcher(rank_of_this_process, num_processes=10000, cpu=True)
    no_orphans()


@pytest.mark.timeout(60)
def test_a_count_over_the_open_file_limit_is_named_with_the_fix():
    import subprocess
    import sys

    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "from notebook_accel.launch import notebook_launcher, LaunchConfigError\n"
        "try:\n"
        "    notebook_launcher(print, num_processes=30, cpu=True)\n"
        "except LaunchConfigError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    env = {**os.environ, "NOTEBOOK_ACCEL_MANY_PROCESSES": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "needs about 214 open files" in result.stdout and "limit is 100" in result.stdout
    assert "ulimit -n 214" in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method, skip", [("fork", 0), ("forkserver", 1), ("spawn", 0)])
def test_a_rank_joining_after_another_returned_without_the_state_fails_the_launch_at_once(no_orphans, method, skip):
    # Rank `skip` returns without PartialState(); the other's init_process_group would wait its
    # 30-minute timeout for it (rank 0 hosts the store; without it rank 1 cannot even connect).
    from launch_targets import join_unless_rank

    started = time.monotonic()
    with pytest.raises(LaunchFailedError) as caught:
        notebook_launcher(join_unless_rank, (skip,), num_processes=2, start_method=method, timeout=100)
    other = 1 - skip
    assert list(caught.value.reports) == [other], caught.value.reports
    failure = caught.value.reports[other]
    assert f"rank {skip} returned from the function without creating the state" in failure.message
    assert "it waits to join the process group" in str(caught.value)
    assert time.monotonic() - started < 60  # seconds, not init_process_group's 30 minutes


@pytest.mark.timeout(120)
def test_ranks_that_all_join_or_none_are_not_stopped(no_orphans):
    from launch_targets import join_unless_rank

    assert notebook_launcher(join_unless_rank, (-1,), num_processes=2) == [0, 1]  # all join
    assert notebook_launcher(rank_of_this_process, num_processes=2) == [0, 1]  # none joins
