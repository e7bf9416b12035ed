"""The TPU path (starters/xla.py) against tests/xla_standin, a torch_xla stand-in whose xmp.spawn
starts CPU processes the way the real one does (`fn(index, *args)` per device, nothing returned).
Every rank goes through the same worker as other launches: results per rank, captured output,
events, failures with the rank's traceback, timeout and stop."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import launch_targets as targets
import pytest

from notebook_accel.launch import (
    LaunchFailedError,
    LaunchFinished,
    LaunchStarted,
    ListSink,
    RankFailed,
    RankFinished,
    RankStarted,
    RankStopped,
    notebook_launcher,
)
from notebook_accel.launch.errors import LaunchTimeoutError
from notebook_accel.launch.plan import make_plan
from notebook_accel.utils import imports

STANDIN = Path(__file__).resolve().parent / "xla_standin"


@pytest.fixture
def tpu(monkeypatch):
    """This process looks like a TPU host whose torch_xla is the stand-in, with 4 devices."""
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setenv("STANDIN_XLA_DEVICES", "4")
    imports._has.cache_clear()
    yield
    imports._has.cache_clear()
    for name in [m for m in sys.modules if m == "torch_xla" or m.startswith("torch_xla.")]:
        del sys.modules[name]


def launch(function, args=(), sink=None, **kwargs):
    return notebook_launcher(function, args, sinks=[sink if sink is not None else ListSink()], **kwargs)


def _events(sink, kind) -> list:
    return [e for e in sink.events if isinstance(e, kind)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method, devices", [("fork", 4), ("spawn", 2)])
def test_each_rank_returns_its_result_and_its_output_is_captured(tpu, monkeypatch, start_method, devices, no_orphans):
    monkeypatch.setenv("STANDIN_XLA_DEVICES", str(devices))
    assert make_plan().engine == "xla"
    sink = ListSink()
    results = launch(targets.xla_rank, ("hi",), sink, start_method=start_method)
    assert [ordinal for ordinal, _ in results] == list(range(devices))  # one per device, in rank order
    pids = [pid for _, pid in results]
    assert len(set(pids)) == devices and os.getpid() not in pids
    assert {e.rank: e.pid for e in _events(sink, RankStarted)} == dict(enumerate(pids))
    for rank in range(devices):
        assert sink.lines(rank) == [f"ordinal {rank} hi"]
        assert sink.lines(rank, "stderr") == [f"to stderr {rank}"]
    assert sorted(e.rank for e in _events(sink, RankFinished)) == list(range(devices))
    assert _events(sink, LaunchStarted)[0].start_method == start_method
    assert _events(sink, LaunchFinished)[-1].ok is True
    no_orphans()


@pytest.mark.timeout(90)
def test_a_failing_rank_shows_its_traceback_and_the_others_are_stopped(tpu, tmp_path, no_orphans):
    marker = str(tmp_path / "ran")
    sink = ListSink()
    with pytest.raises(LaunchFailedError) as caught:
        launch(targets.xla_fail_on, (2, marker), sink)
    (failure,) = _events(sink, RankFailed)
    assert (failure.rank, failure.exc_type, failure.message) == (2, "ValueError", "ordinal 2 gives up")
    assert 'raise ValueError(f"ordinal {failing} gives up")' in failure.traceback  # the rank's own frame
    assert "ordinal 2 gives up" in str(caught.value)
    assert sorted(e.rank for e in _events(sink, RankStopped)) == [0, 1, 3]
    assert not [p for p in tmp_path.iterdir()], "a rank ran on after another failed"
    assert _events(sink, LaunchFinished)[-1].failed_ranks == (2,)
    no_orphans()


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


@pytest.mark.timeout(90)
def test_timeout_stops_every_rank(tpu, no_orphans):
    sink = ListSink()
    with pytest.raises(LaunchTimeoutError, match="timeout=3"):
        launch(_sleep, (60.0,), sink, timeout=3)
    assert sorted(e.rank for e in _events(sink, RankStopped)) == [0, 1, 2, 3]
    assert _events(sink, LaunchFinished)[-1].stopped.startswith("timed out")
    no_orphans()


def _kill_self_on(ordinal: int) -> int:
    import torch_xla.runtime as xr

    if xr.global_ordinal() == ordinal:
        os.kill(os.getpid(), signal.SIGKILL)
    import time

    time.sleep(20.0)
    return 0


@pytest.mark.timeout(90)
def test_a_rank_killed_by_a_signal_is_reported(tpu, no_orphans):
    sink = ListSink()
    with pytest.raises(LaunchFailedError):
        launch(_kill_self_on, (1,), sink)
    (failure,) = _events(sink, RankFailed)
    assert failure.rank == 1 and failure.exc_type is None
    # Its exit status is read before xmp's process reaps it, or it is said to have gone to xmp.
    assert failure.signal_name == "SIGKILL" or "exit status went to xmp.spawn" in failure.message
    no_orphans()


@pytest.mark.timeout(90)
def test_devices_run_as_threads_of_one_process(tpu, monkeypatch, no_orphans):
    """TPU v2/v3: xmp runs two devices as threads of each process. Each is still a rank with its
    own result; a process's output is shown under the first of its ranks to start."""
    monkeypatch.setenv("STANDIN_XLA_THREADS", "2")
    sink = ListSink()
    results = launch(targets.xla_rank, ("t",), sink)
    assert [ordinal for ordinal, _ in results] == [0, 1, 2, 3]
    pids = [pid for _, pid in results]
    assert pids[0] == pids[1] != pids[2] == pids[3]
    lines = sorted(line for rank in range(4) for line in sink.lines(rank))
    assert lines == [f"ordinal {rank} t" for rank in range(4)]
    no_orphans()


@pytest.mark.timeout(60)
def test_xmp_starting_no_process_is_an_error(tpu, monkeypatch, no_orphans):
    monkeypatch.setenv("STANDIN_XLA_DEVICES", "0")
    with pytest.raises(RuntimeError, match="xmp.spawn started no rank"):
        launch(targets.xla_rank, ("none",))
    no_orphans()


@pytest.mark.timeout(60)
def test_a_process_forked_after_the_tpu_starter_loaded_can_fork_again():
    """xla.py's fork hooks take a lock around every fork: a child (an elastic agent, say) must get a
    fresh lock for its own forks, not the copy of ours it inherited held (it hung on it)."""
    import time

    import notebook_accel.launch.starters.xla  # noqa: F401  (registers the hooks)

    pid = os.fork()
    if pid == 0:  # the child forks a grandchild and waits for it
        code = 1
        try:
            grandchild = os.fork()
            if grandchild == 0:
                os._exit(0)
            os.waitpid(grandchild, 0)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("a process forked after starters/xla.py was imported hung in its own fork")
    assert os.waitstatus_to_exitcode(status) == 0
