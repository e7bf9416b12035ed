"""notebook_launcher / debug_launcher in real processes on gloo: results, failures, output, ports.

Every test has a timeout, so a hang is a failure. Nothing asserts on speed; where a test must know
that a rank was stopped rather than left to finish, that rank would leave a file behind when it
finishes, and the test checks that no process that could still write it survives.
"""

from __future__ import annotations

import contextlib
import linecache
import multiprocessing
import os
import queue
import signal
import socket
import threading

import launch_targets as targets
import pytest
import torch
from orphans import children, long_lived_helpers
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from notebook_accel.launch import (
    ConsoleSink,
    LaunchConfigError,
    LaunchFailedError,
    LaunchFinished,
    LaunchNotice,
    LaunchStarted,
    ListSink,
    RankFailed,
    RankFinished,
    RankOutput,
    RankStarted,
    RankStopped,
    UnpicklableError,
    debug_launcher,
    notebook_launcher,
)
from notebook_accel.launch.ports import held as held_ports
from notebook_accel.utils.dataclasses import DistributedType

SLOW_RANK_S = 20.0  # a rank that is not stopped sleeps this long, then leaves its marker file


# -- helpers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _stop_the_warm_server_afterwards():
    # Later test modules count the test process's children; leave them none of ours.
    yield
    from notebook_accel.launch.warm import WarmServer

    WarmServer.shutdown()


def launch(function, args=(), *, num_processes=2, sink=None, **kwargs):
    kwargs.setdefault("use_port", "auto")
    return notebook_launcher(
        function,
        args,
        num_processes=num_processes,
        sinks=[sink if sink is not None else ListSink()],
        **kwargs,
    )


def _events(sink, kind) -> list:
    return [e for e in sink.events if isinstance(e, kind)]


def _assert_markers_absent(marker, ranks) -> None:
    for rank in ranks:
        assert not os.path.exists(f"{marker}.{rank}"), f"rank {rank} was not stopped: it ran to completion"


# A notebook cell, compiled the way a kernel does: module __main__, a file name that is not on
# disk, the source only in linecache. cloudpickle must send all of this by value.
CELL_FILE = "<notebook-cell-launcher-tests>"
CELL = """\
import os


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def norm2(self):
        return self.x * self.x + self.y * self.y


def make_scaler(factor):
    def scale(point):
        return Point(point.x * factor, point.y * factor)

    return scale


def train(point, scale):
    from launch_targets import rank_info

    info = rank_info(rank0_delay=0.2)
    moved = scale(Point(point.x + info["rank"], point.y))
    return info, moved, moved.norm2(), type(moved).__name__


def fail_in_cell(rank_to_fail):
    if int(os.environ["RANK"]) == rank_to_fail:
        raise KeyError("raised inside the notebook cell")
    return "fine"
"""


@pytest.fixture
def cell():
    namespace = {"__name__": "__main__"}
    linecache.cache[CELL_FILE] = (len(CELL), None, CELL.splitlines(True), CELL_FILE)
    exec(compile(CELL, CELL_FILE, "exec"), namespace)
    yield namespace
    linecache.cache.pop(CELL_FILE, None)


# -- results -----------------------------------------------------------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "start_method, n",
    [("fork", 2), ("fork", 4), ("forkserver", 2), ("forkserver", 4), ("spawn", 2), ("spawn", 4)],
)
def test_results_are_indexed_by_local_rank(start_method, n, no_orphans):
    sink = ListSink()
    results = launch(
        targets.rank_info,
        ("tag",),
        num_processes=n,
        sink=sink,
        start_method=start_method,
        mixed_precision="bf16",
    )
    assert isinstance(results, list) and len(results) == n
    for local_rank, info in enumerate(results):
        assert info["local_rank"] == info["env_local_rank"] == local_rank
        assert info["rank"] == info["env_rank"] == local_rank
        assert (info["world"], info["local_world"]) == (n, n)
        assert info["type"] == DistributedType.MULTI_CPU
        assert info["mixed_precision"] == "bf16"
        assert info["rank_sum"] == sum(range(n))  # the process group really spans all ranks
        assert info["tag"] == "tag"
    pids = [info["pid"] for info in results]
    assert len(set(pids)) == n and os.getpid() not in pids
    assert {e.rank: e.pid for e in _events(sink, RankStarted)} == dict(enumerate(pids))
    assert sorted(e.rank for e in _events(sink, RankFinished)) == list(range(n))
    assert _events(sink, LaunchStarted)[0].start_method == start_method
    assert _events(sink, LaunchFinished)[-1].ok is True
    assert not _events(sink, RankFailed)
    no_orphans()


@pytest.mark.timeout(30)
def test_one_process_runs_in_the_caller(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    lock = threading.Lock()  # unpicklable, and fine: nothing is pickled

    def here(x):
        with lock:
            return os.getpid(), threading.get_ident(), os.environ.get("ACCELERATE_MIXED_PRECISION"), x * 3

    sink = ListSink()
    result = notebook_launcher(here, (2,), num_processes=1, mixed_precision="bf16", sinks=[sink])
    assert result == [(os.getpid(), threading.get_ident(), "bf16", 6)]
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ  # the setting does not leak out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_notebook_defined_class_function_and_closure_travel(start_method, cell, no_orphans):
    Point = cell["Point"]
    assert Point.__module__ == "__main__" and cell["train"].__module__ == "__main__"
    scale = cell["make_scaler"](10)
    results = launch(cell["train"], (Point(1, 2), scale), start_method=start_method, mixed_precision="bf16")
    assert len(results) == 2
    for rank, (info, moved, norm2, class_name) in enumerate(results):
        assert info["rank"] == info["local_rank"] == rank
        assert info["type"] == DistributedType.MULTI_CPU and info["world"] == 2
        assert info["mixed_precision"] == "bf16"
        assert class_name == "Point"
        assert (moved.x, moved.y) == ((1 + rank) * 10, 20)
        assert norm2 == moved.norm2() == ((1 + rank) * 10) ** 2 + 400
    no_orphans()


@pytest.mark.timeout(60)
def test_debug_launcher_gives_multi_cpu_with_distinct_ranks(no_orphans):
    results = debug_launcher(targets.rank_info)
    assert [(r["rank"], r["local_rank"]) for r in results] == [(0, 0), (1, 1)]
    assert all(r["type"] == DistributedType.MULTI_CPU and r["world"] == 2 for r in results)
    results = debug_launcher(targets.rank_info, num_processes=4)
    assert [(r["rank"], r["local_rank"]) for r in results] == [(i, i) for i in range(4)]
    no_orphans()


@pytest.mark.timeout(60)
def test_fork_passes_a_fork_context_queue_by_inheritance(no_orphans):
    # accelerate users hand a multiprocessing.Queue to their function; with fork it is inherited,
    # and what a rank put in it must arrive although the rank exits right after putting. (Small
    # items: what does not fit in the pipe blocks the rank until the parent reads, as with any
    # multiprocessing child.)
    for attempt in range(10):
        q = multiprocessing.get_context("fork").Queue()
        if attempt % 2:  # the parent used the queue first: its feeder thread is not the ranks'
            q.put("from the parent")
            assert q.get(timeout=5) == "from the parent"
        assert launch(targets.put_in_queue, (q, 2, 1000), num_processes=4) == [0, 1, 2, 3]
        got = []
        try:
            while len(got) < 8:
                got.append(q.get(timeout=2))
        except queue.Empty:
            pass
        assert sorted((rank, i) for rank, i, _ in got) == [(r, i) for r in range(4) for i in range(2)]
        assert all(len(text) == 1000 for _, _, text in got)
        q.close()
    no_orphans()


# -- arguments that cannot travel ------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_unpicklable_argument_fails_before_any_process_starts(start_method, no_orphans):
    sink = ListSink()
    before = set(children())
    with pytest.raises(UnpicklableError) as info:
        launch(targets.rank_info, (42, threading.Lock()), sink=sink, start_method=start_method)
    message = str(info.value)
    assert "argument 1 (lock" in message and "argument 0" not in message
    assert isinstance(info.value, LaunchConfigError)
    assert sink.events == []  # not even LaunchStarted
    assert set(children()) <= before | long_lived_helpers()
    no_orphans(wait_s=0)


@pytest.mark.timeout(30)
def test_unpicklable_global_and_closure_variable_are_named():
    namespace = {"__name__": "__main__"}
    exec(
        "import threading\nLOCK = threading.Lock()\n\ndef uses_lock():\n    with LOCK:\n        return 1\n",
        namespace,
    )
    with pytest.raises(UnpicklableError) as info:
        launch(namespace["uses_lock"], start_method="spawn")
    assert "global 'LOCK'" in str(info.value) and "uses_lock()" in str(info.value)

    guard = threading.Lock()

    def uses_guard():
        with guard:
            return 1

    with pytest.raises(UnpicklableError) as info:
        launch(uses_guard, start_method="spawn")
    assert "closure variable 'guard'" in str(info.value) and "uses_guard()" in str(info.value)


# -- failures ----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_failing_rank_raises_child_failed_error_and_stops_the_others(start_method, tmp_path, no_orphans):
    marker = str(tmp_path / "finished")
    sink = ListSink()
    with pytest.raises(LaunchFailedError) as info:
        launch(targets.raise_on_rank, (1, marker, SLOW_RANK_S), sink=sink, start_method=start_method)
    err = info.value
    assert isinstance(err, ChildFailedError)
    message = str(err)
    assert "rank 1 raised ValueError: boom on rank 1" in message
    assert 'raise ValueError(f"boom on rank {rank}")' in message  # the source line of the raise
    assert "launch_targets.py" in message and "raise_on_rank" in message
    assert set(err.failures) == {1}
    assert [e.rank for e in _events(sink, RankFailed)] == [1]
    assert [e.rank for e in _events(sink, RankStopped)] == [0]
    assert _events(sink, LaunchFinished)[-1].ok is False
    no_orphans()
    _assert_markers_absent(marker, [0])
    # The same process launches again at once.
    assert [r["rank"] for r in launch(targets.rank_info, start_method=start_method)] == [0, 1]
    no_orphans()


@pytest.mark.timeout(60)
def test_root_cause_comes_first_when_peers_fail_in_a_collective(no_orphans):
    with pytest.raises(LaunchFailedError) as info:
        launch(targets.raise_after_group_is_up, (1,), num_processes=2)
    message = str(info.value)
    assert message.startswith("rank 1 raised RuntimeError: root cause on this rank"), message
    assert 'raise RuntimeError("root cause on this rank")' in message
    assert 1 in info.value.failures
    no_orphans()


@pytest.mark.timeout(60)
def test_failure_in_notebook_cell_code_shows_the_cell_line(cell, no_orphans):
    # forkserver children get the cell's source through the payload, not by inheritance.
    with pytest.raises(LaunchFailedError) as info:
        launch(cell["fail_in_cell"], (0,), start_method="forkserver")
    message = str(info.value)
    assert "rank 0 raised KeyError" in message and "raised inside the notebook cell" in message
    assert CELL_FILE in message
    assert 'raise KeyError("raised inside the notebook cell")' in message
    no_orphans()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "target, signal_name",
    [(targets.kill_self_on_rank, "SIGKILL"), (targets.segfault_on_rank, "SIGSEGV")],
)
def test_rank_killed_by_a_signal_is_named(target, signal_name, tmp_path, no_orphans):
    marker = str(tmp_path / "finished")
    sink = ListSink()
    with pytest.raises(LaunchFailedError) as info:
        launch(target, (1, marker), sink=sink)
    assert f"rank 1 died with {signal_name}" in str(info.value)
    assert isinstance(info.value, ChildFailedError)
    failed = _events(sink, RankFailed)
    assert [(e.rank, e.signal_name) for e in failed] == [(1, signal_name)]
    assert failed[0].exitcode == -getattr(signal, signal_name)
    no_orphans()
    _assert_markers_absent(marker, [0])
    assert launch(targets.rank_info)[1]["rank"] == 1


class _InterruptWhenStarted(ListSink):
    """Deliver SIGINT to this process once every rank has started (as a kernel interrupt does)."""

    def __init__(self, ranks: int):
        super().__init__()
        self.ranks = ranks
        self.timer = None

    def handle(self, event) -> None:
        super().handle(event)
        if isinstance(event, RankStarted) and len(_events(self, RankStarted)) == self.ranks:
            self.timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
            self.timer.start()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_keyboard_interrupt_stops_every_rank_and_propagates(start_method, tmp_path, no_orphans):
    assert threading.current_thread() is threading.main_thread()
    marker = str(tmp_path / "finished")
    sink = _InterruptWhenStarted(2)
    with pytest.raises(KeyboardInterrupt):
        launch(targets.sleep_then_touch, (marker, SLOW_RANK_S), sink=sink, start_method=start_method)
    assert sink.timer is not None
    sink.timer.join()
    assert _events(sink, LaunchFinished)[-1].ok is False
    no_orphans()
    _assert_markers_absent(marker, [0, 1])
    assert [r["rank"] for r in launch(targets.rank_info, start_method=start_method)] == [0, 1]


# -- rank output -------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_output_from_python_fds_and_c_arrives_tagged(start_method, no_orphans):
    sink = ListSink()
    assert launch(targets.write_every_way, sink=sink, start_method=start_method) == [0, 1]
    for r in (0, 1):
        assert sink.lines(r, "stdout") == [
            f"print from rank {r}",
            f"fd1 from rank {r}",
            f"from C on rank {r}",
            f"unterminated from rank {r}",
        ]
        assert sink.lines(r, "stderr") == [f"fd2 from rank {r}", f"stderr print from rank {r}"]
    assert {e.stream for e in _events(sink, RankOutput)} == {"stdout", "stderr"}
    no_orphans()


@pytest.mark.timeout(90)
def test_per_rank_order_is_kept_for_many_lines(no_orphans):
    count = 20_000
    sink = ListSink()
    assert launch(targets.many_lines, (count,), num_processes=4, sink=sink) == [count] * 4
    for r in range(4):
        lines = sink.lines(r)
        assert len(lines) == count, f"rank {r}: {len(lines)} of {count} lines"
        assert lines == [f"{r} {i}" for i in range(count)]
    no_orphans()


@pytest.mark.timeout(60)
def test_megabytes_on_stderr_do_not_deadlock(no_orphans):
    sink = ListSink()
    assert launch(targets.big_stderr, (8,), sink=sink) == ["done", "done"]
    for r in (0, 1):
        lines = sink.lines(r, "stderr")
        assert len(lines) == 8 * 1024 and set(lines) == {"e" * 1023}
    no_orphans()


@pytest.mark.timeout(60)
def test_console_sink_prefixes_lines_through_sys_stdout(capsys):
    assert notebook_launcher(targets.write_every_way, num_processes=2, use_port="auto") == [0, 1]
    captured = capsys.readouterr()
    for r in (0, 1):
        out = [line for line in captured.out.splitlines() if line.startswith(f"[rank {r}] ")]
        assert out == [
            f"[rank {r}] print from rank {r}",
            f"[rank {r}] fd1 from rank {r}",
            f"[rank {r}] from C on rank {r}",
            f"[rank {r}] unterminated from rank {r}",
        ]
        assert f"[rank {r}] fd2 from rank {r}" in captured.err.splitlines()
        assert f"[rank {r}] fd2 from rank {r}" not in captured.out
    # The console sink is also the default: an explicit one behaves the same.
    notebook_launcher(targets.write_every_way, num_processes=2, use_port="auto", sinks=[ConsoleSink()])
    assert "[rank 1] from C on rank 1" in capsys.readouterr().out


def test_console_sink_prints_a_notice_on_stderr(capsys):
    from notebook_accel.launch import LaunchNotice

    ConsoleSink().handle(LaunchNotice("node 1 of 2: waiting for the other nodes"))
    captured = capsys.readouterr()
    assert captured.err == "notebook_accel: node 1 of 2: waiting for the other nodes\n" and captured.out == ""


# -- ports ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_auto_and_explicit_ports_reach_the_ranks(no_orphans):
    auto = launch(targets.rank_info, use_port="auto")
    assert auto[0]["master_port"] == auto[1]["master_port"] > 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    explicit = launch(targets.rank_info, use_port=str(port))
    assert [r["master_port"] for r in explicit] == [port, port]
    no_orphans()


@pytest.mark.timeout(30)
def test_busy_explicit_port_is_named_before_any_process_starts(no_orphans):
    sink = ListSink()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchConfigError) as info:
            launch(targets.rank_info, sink=sink, use_port=str(port))
    assert str(port) in str(info.value) and "use_port='auto'" in str(info.value)
    assert sink.events == []
    no_orphans(wait_s=0)


@pytest.mark.timeout(60)
def test_a_launch_without_a_port_runs_while_29500_is_held(no_orphans):
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", 29500))
            held.listen()
        except OSError:  # something else on this machine holds it already: the same situation
            pass
        results = notebook_launcher(targets.rank_info, num_processes=2, cpu=True, sinks=[ListSink()])
    ports = {r["master_port"] for r in results}
    assert len(ports) == 1 and 29500 not in ports
    assert [r["rank"] for r in results] == [0, 1]
    assert not ports & held_ports()  # the launch let go of the port it picked
    no_orphans()


@contextlib.contextmanager
def _squatted_first(monkeypatch, times: int):
    """ports.reserve hands out the port a real listener squats on `times` times (another program
    took the picked port before rank 0 could listen on it), then free ones. Yields the ports given."""
    from notebook_accel.launch import ports as ports_module

    real, given = ports_module.reserve, []
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()

        def reserve(addr="127.0.0.1"):
            port = squatter.getsockname()[1] if len(given) < times else real(addr)
            given.append(port)
            return port

        monkeypatch.setattr(ports_module, "reserve", reserve)
        yield given


@pytest.mark.timeout(120)
def test_a_picked_port_taken_before_rank_0_listens_is_retried_with_another(monkeypatch, no_orphans):
    sink = ListSink()
    with _squatted_first(monkeypatch, times=1) as given:
        results = notebook_launcher(targets.rank_info, num_processes=2, cpu=True, sinks=[sink])
    assert len(given) == 2 and given[0] != given[1]
    assert [r["master_port"] for r in results] == [given[1], given[1]] and [r["rank"] for r in results] == [0, 1]
    (notice,) = [e for e in sink.events if isinstance(e, LaunchNotice) and "was taken" in e.text]  # not plan notes
    assert f"port {given[0]} was taken" in notice.text and f"again on port {given[1]}" in notice.text
    assert [e.ok for e in _events(sink, LaunchFinished)] == [False, True]
    assert not set(given) & held_ports()
    no_orphans()


@pytest.mark.timeout(180)
def test_port_retries_end_with_the_ranks_own_error(monkeypatch, no_orphans):
    sink = ListSink()
    with _squatted_first(monkeypatch, times=10) as given:
        with pytest.raises(LaunchFailedError, match="EADDRINUSE"):
            notebook_launcher(targets.rank_info, num_processes=2, cpu=True, sinks=[sink])
    assert len(given) == 3  # the pick and two retries
    assert len(_events(sink, LaunchStarted)) == 3
    no_orphans()


TWO_AT_ONCE = """\
import os, sys, time
from notebook_accel import notebook_launcher
from notebook_accel.launch import ListSink

def meet(mine, other):
    import torch, torch.distributed as dist
    from notebook_accel.state import PartialState

    state = PartialState()
    open(f"{mine}.{state.process_index}", "w").close()  # this launch's ranks are up
    deadline = time.monotonic() + 40
    while not os.path.exists(f"{other}.{state.process_index}"):  # ... and so are the other's
        assert time.monotonic() < deadline, "the other launch never came up"
        time.sleep(0.05)
    total = torch.ones(1)
    dist.all_reduce(total)
    return int(os.environ["MASTER_PORT"]), total.item()

print("RESULT", notebook_launcher(meet, args=(sys.argv[1], sys.argv[2]), num_processes=2, cpu=True,
                                  sinks=[ListSink()]))
"""


@pytest.mark.timeout(120)
def test_two_launches_at_once_without_a_port_both_run(tmp_path):
    import ast
    import subprocess
    import sys

    script = tmp_path / "launch.py"
    script.write_text(TWO_AT_ONCE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    procs = [
        subprocess.Popen([sys.executable, str(script), mine, other], env=env, stdout=subprocess.PIPE, text=True)
        for mine, other in ((a, b), (b, a))
    ]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    results = [ast.literal_eval(out.split("RESULT ", 1)[1]) for out in outs]
    assert all(r[0] == r[1] and r[0][1] == 2.0 for r in results), results  # each launch is one world
    assert results[0][0][0] != results[1][0][0]  # on two ports


# -- the fork hang -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_default_launch_after_parallel_torch_in_the_parent_completes(monkeypatch, no_orphans):
    from notebook_accel.launch import plan as plan_module

    # Say the machine has 8 cores, so each of 2 ranks would want 4 threads: the case that hangs.
    monkeypatch.setattr(plan_module, "_physical_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        # The parent computes first, as a notebook does: GNU OpenMP's pool now exists here.
        assert float((torch.randn(256, 256) @ torch.randn(256, 256)).abs().sum()) > 0
        assert float(torch.ones(1_000_000).sum()) == 1_000_000
        sink = ListSink()
        results = notebook_launcher(targets.parallel_math, num_processes=2, use_port="auto", sinks=[sink])
    finally:
        torch.set_num_threads(before)
    assert results == [(256.0, 1_000_000.0, 1)] * 2  # the ranks computed, on one thread each
    note = " ".join(e.text for e in sink.events if isinstance(e, LaunchNotice))  # to the sink, not stderr
    assert "1 intra-op thread each, not 4" in note and "start_method='forkserver'" in note
    no_orphans()
