"""The stall watch on real gloo ranks (issue #29, part 1): a launch whose ranks stop making progress
is explained (where each rank is, which collective, the disagreement in one sentence) without being
stopped; the explanation clears when they move; a timeout's error carries it; a peer that returned
is said to have returned, never to have crashed. stall_after is 2 s here (60 by default)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import watch_targets as targets

from notebook_accel.launch import ListSink, notebook_launcher, watch_rank
from notebook_accel.launch import events as ev
from notebook_accel.launch.errors import LaunchFailedError, LaunchStoppedError, LaunchTimeoutError

STALL = 2.0


@pytest.fixture(autouse=True)
def no_stall_setting(monkeypatch):
    monkeypatch.delenv("NOTEBOOK_ACCEL_STALL_AFTER", raising=False)
    # As a user's launch does (conftest.py turns it off): ranks inherit torch._dynamo instead of each
    # spending seconds importing it, silently, which the watch would rightly call no progress.
    monkeypatch.delenv("NOTEBOOK_ACCEL_PREWARM", raising=False)


def starting(report) -> bool:
    return any(r.state == "starting" for r in report.ranks)


def stalls(sink: ListSink) -> list:
    """The watch's reports, less those it made while a rank was still starting: a loaded machine can
    take longer than STALL to start a rank (spawn imports torch), and the watch rightly says so
    (test_a_rank_still_starting_is_said_to_be_starting); each such report cleared when the ranks moved."""
    kinds = [type(e).__name__ for e in sink.events if isinstance(e, (ev.LaunchStalled, ev.LaunchResumed))]
    early = [e.report for e in sink.events if isinstance(e, ev.LaunchStalled) and starting(e.report)]
    assert kinds[: 2 * len(early)] == ["LaunchStalled", "LaunchResumed"] * len(early), kinds
    return [e.report for e in sink.events if isinstance(e, ev.LaunchStalled) and not starting(e.report)]


class StopOnStall(ListSink):
    """Keeps every event and stops the launch once the watch spoke of ranks past their start, so a
    test does not wait for its timeout (the timeout is only the safety net)."""

    def attach(self, control) -> None:
        self.control = control

    def handle(self, event) -> None:
        super().handle(event)
        if isinstance(event, ev.LaunchStalled) and not starting(event.report):
            self.control.request_stop("the test saw the stall")


def launch_until_stopped(function, sink, timeout=60.0, **kw):
    with pytest.raises(LaunchStoppedError) as caught:
        notebook_launcher(function, use_port="auto", stall_after=STALL, timeout=timeout, sinks=[sink], **kw)
    return caught.value


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_ranks_in_different_collectives_are_named_with_the_collective_and_the_line(start_method):
    sink = StopOnStall()
    error = launch_until_stopped(targets.mismatch, sink, num_processes=2, start_method=start_method)
    (report,) = stalls(sink)
    assert report.stalled and report.seconds >= STALL
    # The ranks were killed: their worker servers' sockets are gone all the same.
    pids = [e.pid for e in sink.events if isinstance(e, ev.RankStarted)]
    assert len(pids) == 2 and not any(os.path.exists(watch_rank.socket_path(pid)) for pid in pids), pids
    assert [r.state for r in report.ranks] == ["waiting", "waiting"], report
    sentence = report.sentence
    assert "rank 0 waits in all_reduce #" in sentence and "(float32[4])" in sentence, sentence
    assert "rank 1 waits in barrier #" in sentence, sentence
    assert "watch_targets.py, line 19, in mismatch" in sentence, sentence  # the all_reduce line
    assert "watch_targets.py, line 21, in mismatch" in sentence, sentence  # the barrier line
    text = report.text()
    assert "dist.all_reduce(t)" in text and "dist.barrier()" in text, text  # the source of each stack
    # What ended the run carries the report (a timeout's error too: the kernel and session tests).
    assert error.stall is report and sentence in str(error), str(error)
    last = [type(e).__name__ for e in sink.events if isinstance(e, (ev.LaunchStalled, ev.LaunchResumed))][-1]
    assert last == "LaunchStalled"  # it never cleared


@pytest.mark.timeout(120)
def test_four_ranks_one_odd_one_out():
    sink = StopOnStall()
    launch_until_stopped(targets.mismatch, sink, args=(2,), num_processes=4)
    (report,) = stalls(sink)
    assert "ranks 0, 1, 3 wait in barrier #" in report.sentence, report.sentence
    assert "rank 2 waits in all_reduce #" in report.sentence, report.sentence


@pytest.mark.timeout(120)
def test_a_collective_ddp_issues_from_cpp_is_named():
    sink = StopOnStall()
    launch_until_stopped(targets.ddp_mismatch, sink, num_processes=2)
    (report,) = stalls(sink)
    rank0 = report.ranks[0]
    # The gradient bucket of Linear(8, 2): 16 weights and 2 biases, all-reduced by DDP's reducer.
    assert [c.op for c in rank0.waiting] == ["all_reduce"] and rank0.waiting[0].shapes == ((18,),), rank0
    assert "accelerator.backward(loss)" in report.text(), report.text()


@pytest.mark.timeout(120)
def test_a_peer_that_returned_is_reported_as_returned_not_as_a_crash():
    sink = ListSink()
    with pytest.raises(LaunchFailedError) as caught:
        notebook_launcher(targets.one_more_all_reduce, num_processes=2, use_port="auto", stall_after=STALL,
                          timeout=30, sinks=[sink])  # fmt: skip
    text = str(caught.value)
    assert "rank 0 failed: it was still in all_reduce when rank 1 returned from the function" in text, text
    assert "No rank crashed" in text, text
    assert [e.rank for e in sink.events if isinstance(e, ev.RankFinished)] == [1]


@pytest.mark.timeout(120)
def test_quiet_ranks_outside_a_collective_are_no_progress_and_it_clears_when_they_move():
    sink = ListSink()
    results = notebook_launcher(
        targets.quiet_then_talk, args=(STALL + 2.5,), num_processes=2, use_port="auto", stall_after=STALL, sinks=[sink]
    )
    assert results == [0, 1]
    (report,) = stalls(sink)
    assert not report.stalled
    assert re.match(r"no progress for \d+ s: no rank is in a collective", report.sentence), report.sentence
    assert report.seconds >= STALL
    assert "watch_targets.py, line" in report.sentence and "in quiet_then_talk" in report.sentence, report.sentence
    at = next(i for i, e in enumerate(sink.events) if isinstance(e, ev.LaunchStalled) and e.report is report)
    kinds = [type(e).__name__ for e in sink.events[at:]]
    first_output = next(i for i, e in enumerate(sink.events[at:]) if isinstance(e, ev.RankOutput))
    assert kinds.index("LaunchResumed") <= first_output + 1, kinds  # cleared by the first line after it


@pytest.mark.timeout(120)
def test_a_rank_still_starting_is_said_to_be_starting():
    """A rank not yet in its function (here its argument takes seconds to unpickle) has no worker
    server to ask: the report says it is starting, not that it did not answer, and clears once the
    function begins, though it prints nothing."""
    sink = ListSink()
    slow = targets.SlowToLoad(STALL + 2.5)
    kw = dict(num_processes=2, start_method="forkserver", use_port="auto", stall_after=STALL, sinks=[sink])
    results = notebook_launcher(targets.identity, args=(slow,), **kw)
    assert results == [STALL + 2.5] * 2
    reports = [e.report for e in sink.events if isinstance(e, ev.LaunchStalled)]
    assert reports, [type(e).__name__ for e in sink.events]
    report = reports[0]
    assert [r.state for r in report.ranks] == ["starting", "starting"] and not report.stalled, report
    assert re.match(r"no progress for \d+ s: ranks 0, 1 are still starting \(not yet in the function", report.sentence)
    kinds = [type(e).__name__ for e in sink.events]
    assert "LaunchResumed" in kinds[kinds.index("LaunchStalled"):], kinds
    assert "is still starting" in report.text()


@pytest.mark.timeout(120)
def test_stall_after_zero_turns_the_watch_off():
    sink = ListSink()
    with pytest.raises(LaunchTimeoutError) as caught:
        notebook_launcher(targets.mismatch, num_processes=2, use_port="auto", stall_after=0, timeout=5, sinks=[sink])
    assert stalls(sink) == [] and caught.value.stall is None
    # Nor do the ranks serve anything to it then; by default they do.
    assert notebook_launcher(targets.serves_the_watch, num_processes=2, use_port="auto", stall_after=0) == [False] * 2
    assert notebook_launcher(targets.serves_the_watch, num_processes=2, use_port="auto") == [True] * 2


@pytest.mark.timeout(180)
def test_an_elastic_launch_is_watched_too():
    sink = StopOnStall()
    launch_until_stopped(targets.mismatch, sink, num_processes=2, max_restarts=1)
    (report,) = stalls(sink)
    assert "waits in all_reduce #" in report.sentence and "waits in barrier #" in report.sentence, report.sentence


@pytest.mark.timeout(90)
def test_a_rank_sweeps_the_sockets_of_processes_that_are_gone():
    """Ranks killed where no launcher could remove their socket (a Ray node, an elastic worker)."""
    os.makedirs(watch_rank.socket_dir(), mode=0o700, exist_ok=True)
    stale = watch_rank.socket_path(999_999_999)  # above any pid_max: no such process
    open(stale, "w").close()
    assert notebook_launcher(targets.serves_the_watch, num_processes=2, use_port="auto") == [True] * 2
    assert not os.path.exists(stale)


@pytest.mark.timeout(90)
def test_a_second_start_in_a_process_keeps_its_server(tmp_path):
    """xmp runs a process's devices as threads, and one may start after another ended: the second
    start keeps the process's one server (replacing it freed the old one, whose destructor hung)."""
    script = (
        "import os\n"
        "from notebook_accel.launch import watch_rank, watch_probe\n"
        "print(watch_rank.start(), watch_rank.start(), bool(watch_probe.stacks(os.getpid())), flush=True)\n"
        "os._exit(0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NOTEBOOK_ACCEL_STALL_AFTER"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.stdout.split() == ["True", "True", "True"], (done.stdout, done.stderr)


MISMATCH_CELL = """\
import torch, torch.distributed as dist
from notebook_accel import PartialState
state = PartialState()
t = torch.ones(3)
if state.process_index == 0:
    dist.all_reduce(t)
else:
    dist.barrier()
"""


@pytest.mark.timeout(180)
def test_a_session_cell_is_watched_and_its_timeout_carries_the_report():
    from notebook_accel.session import Session, SessionTimeout

    seen = []
    with Session(2, cpu=True, stall_after=STALL) as session:
        session.on_stall = seen.append
        session.run_cell("x = 1", check=True)  # a quick cell: nothing to report
        assert seen == []
        with pytest.raises(SessionTimeout) as caught:
            session.run_cell(MISMATCH_CELL, timeout=6)
    assert [type(e).__name__ for e in seen] == ["LaunchStalled"], seen
    report = seen[0].report
    assert "rank 0 waits in all_reduce #" in report.sentence and "rank 1 waits in barrier #" in report.sentence
    assert caught.value.stall is report and report.sentence in str(caught.value)


NOTEBOOK = [
    "import torch, torch.distributed as dist\n"
    "from notebook_accel import PartialState, notebook_launcher\n"
    "\n"
    "def mismatch():\n"
    "    state = PartialState()\n"
    "    t = torch.ones(4)\n"
    "    if state.process_index == 0:\n"
    "        dist.all_reduce(t)\n"
    "    else:\n"
    "        dist.barrier()",
    "notebook_launcher(mismatch, num_processes=2, use_port='auto', stall_after=2, timeout=7)",
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("widgets", [False, True])
def test_in_a_kernel_the_report_names_notebook_cells(tmp_path, widgets):
    import json

    import nbformat

    from notebook_accel.demo import run_notebook

    cells = [nbformat.v4.new_code_cell(source) for source in NOTEBOOK]
    cells[1].metadata["tags"] = ["raises-exception"]
    path = tmp_path / "stall.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    nb, error = run_notebook(str(path), timeout=120, widgets=widgets)
    assert error is None, error
    launch = nb.cells[1]
    (failure,) = [o for o in launch.outputs if o.output_type == "error"]
    assert failure.ename == "LaunchTimeoutError", failure
    said = "what the watch saw before: stalled for"
    assert said in failure.evalue and "Cell In[1], line 8, in mismatch" in failure.evalue, failure.evalue
    if not widgets:  # the console sink printed the report as it happened
        printed = "".join(o.get("text", "") for o in launch.outputs if o.output_type == "stream")
        assert "notebook_accel: stalled for" in printed and "dist.barrier()" in printed, printed
        return
    state = json.dumps(nb.metadata["widgets"])
    assert "nacc-stall-sentence" in state and "Cell In[1], line 10, in mismatch" in state, state[:3000]
    (panel,) = [o for o in launch.outputs if o.output_type == "display_data"]
    assert "stalled for" in panel.data["text/plain"], panel.data["text/plain"]  # the saved transcript


CELLS = [
    "%load_ext notebook_accel",
    "%%accelerate -n 2 --cpu --port auto --stall-after 2 --timeout 8\n" + MISMATCH_CELL,
    "%accelerate start -n 2 --cpu --stall-after 2",
    "%%accelerate --timeout 8\n" + MISMATCH_CELL,
    "%accelerate stop",
]


@pytest.mark.timeout(300)
def test_a_cell_and_a_session_cell_are_watched_in_a_kernel(tmp_path):
    import nbformat

    from notebook_accel.demo import run_notebook

    cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    for i in (1, 3):
        cells[i].metadata["tags"] = ["raises-exception"]  # each ends with its timeout
    path = tmp_path / "cells.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    nb, error = run_notebook(str(path), timeout=120, widgets=False)
    assert error is None, error
    for cell, line in ((nb.cells[1], 6), (nb.cells[3], 6)):
        printed = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        assert "notebook_accel: stalled for" in printed, cell.outputs
        assert "rank 0 waits in all_reduce #" in printed and f"Cell In[{cell.execution_count}], line {line}" in printed, (
            printed
        )
        assert "rank 1 waits in barrier #" in printed, printed
        (failure,) = [o for o in cell.outputs if o.output_type == "error"]
        assert "what the watch saw before: stalled for" in failure.evalue, failure.evalue
