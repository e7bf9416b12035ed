"""Ranks the forkserver forks ahead (issue #19, part 2: a launch hands a request to a waiting
spare instead of forking from a 290 MiB server). Real server, real ranks."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from kernels import alive
from launch_targets import process_name
from orphans import idle_spares

from notebook_accel.launch import notebook_launcher, spares
from notebook_accel.launch.warm import WarmServer


@pytest.fixture
def fresh_server(monkeypatch):
    WarmServer.shutdown()
    yield monkeypatch
    WarmServer.shutdown()


def spares_of(server: WarmServer, count: int, timeout: float = 10.0) -> list:
    """The server's idle spares, once there are `count` of them (oldest first)."""
    deadline = time.monotonic() + timeout
    while True:
        found = sorted(idle_spares(server.proc.pid))
        if len(found) == count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def launch(n: int) -> list:
    return notebook_launcher(process_name, num_processes=n, start_method="forkserver")


@pytest.mark.timeout(120)
def test_a_launch_runs_on_the_spares_and_the_server_forks_as_many_again(fresh_server, no_orphans):
    server = WarmServer.get()
    waiting = spares_of(server, spares.FIRST)
    assert len(waiting) == spares.FIRST == 2
    assert all(psutil.Process(pid).ppid() == server.proc.pid for pid in waiting)

    ranks = launch(2)
    assert [r["pid"] for r in ranks] == waiting  # oldest spare is rank 0
    assert {r["ppid"] for r in ranks} == {server.proc.pid}
    assert all(r["name"] != spares.SPARE_NAME for r in ranks), ranks  # a rank is named as before

    refilled = spares_of(server, 2)
    assert len(refilled) == 2 and not set(refilled) & set(waiting)
    # a launch of 3: two spares and one rank forked then; the server keeps 3 for the next
    ranks = launch(3)
    assert [r["pid"] for r in ranks][:2] == refilled
    assert ranks[2]["pid"] not in refilled and ranks[2]["ppid"] == server.proc.pid
    assert len(spares_of(server, 3)) == 3
    # 5, then 2: three of the five left, and the server lets the one too many go
    launch(5)
    five = spares_of(server, 5)
    assert len(five) == 5
    launch(2)
    two = spares_of(server, 2)
    assert len(two) == 2 and set(two) <= set(five), (two, five)
    no_orphans()


def test_a_fork_that_fails_stops_spares_and_leaks_nothing(monkeypatch):
    def no_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    kept = spares.Spares(8)
    fds_before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "fork", no_fork)
    kept.fill(lambda sock, close: None, [])  # raises nothing: the server must not die of a spare
    assert (kept.most, kept.want, list(kept.idle)) == (0, 0, [])
    assert len(os.listdir("/proc/self/fd")) == fds_before
    kept.asked(4)
    assert kept.want == 0  # no more tries


@pytest.mark.timeout(120)
def test_spares_off(fresh_server, no_orphans):
    fresh_server.setenv(spares.ENV, "0")
    server = WarmServer.get()
    time.sleep(1.0)  # spares, were there any, are forked at once when the server is ready
    assert idle_spares(server.proc.pid) == set()
    ranks = launch(2)
    assert {r["ppid"] for r in ranks} == {server.proc.pid}
    time.sleep(1.0)
    assert idle_spares(server.proc.pid) == set()
    no_orphans()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["lots", "-1"])
def test_a_bad_spares_value_is_named_and_the_default_used(fresh_server, value):
    fresh_server.setenv(spares.ENV, value)
    with pytest.warns(UserWarning, match=rf"NOTEBOOK_ACCEL_SPARES='{value}' is not a whole number >= 0.*=0"):
        server = WarmServer.get()
    assert len(spares_of(server, spares.FIRST)) == spares.FIRST


@pytest.mark.timeout(120)
def test_a_spare_killed_while_idle_is_never_a_rank(fresh_server, no_orphans):
    server = WarmServer.get()
    first, second = spares_of(server, 2)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10  # gone (a zombie): a spare killed as it is handed a request fails that rank
    while alive(first):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ranks = launch(2)
    pids = [r["pid"] for r in ranks]
    assert first not in pids and pids[0] == second
    assert len(spares_of(server, 2)) == 2
    assert not psutil.pid_exists(first) or psutil.Process(first).ppid() != server.proc.pid  # reaped
    no_orphans()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["killed", "shut down"])
def test_spares_go_with_their_server(fresh_server, how):
    server = WarmServer.get()
    waiting = spares_of(server, 2)
    assert len(waiting) == 2
    if how == "killed":
        os.kill(server.proc.pid, signal.SIGKILL)
    else:
        WarmServer.shutdown()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in waiting):
        assert time.monotonic() < deadline, f"spares outlived their server ({how})"
        time.sleep(0.05)
