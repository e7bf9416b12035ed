"""Ending a launch from outside (timeout, a Stop request from another thread) and progress-bar
output: real ranks on gloo, with a timeout on every test."""

from __future__ import annotations

import threading
import time

import launch_targets as targets
import pytest

from notebook_accel.launch import (
    LaunchConfigError,
    LaunchControl,
    LaunchFinished,
    LaunchStoppedError,
    LaunchTimeoutError,
    ListSink,
    RankOutput,
    RankStopped,
    notebook_launcher,
)
from notebook_accel.launch.lines import MAX_LINE, LineSplitter


def launch(function, args=(), *, sink, num_processes=2, **kwargs):
    kwargs.setdefault("use_port", "auto")
    return notebook_launcher(function, args, num_processes=num_processes, sinks=[sink], **kwargs)


def _markers_absent(marker, ranks):
    import os

    return all(not os.path.exists(f"{marker}.{r}") for r in ranks)


# -- line splitting ----------------------------------------------------------------------------
def test_newlines_end_lines_and_the_rest_waits():
    s = LineSplitter()
    assert s.feed(b"a 1\nb") == [("a 1", False)]
    assert s.feed(b"c\n\n") == [("bc", False), ("", False)]
    assert s.finish() == []


def test_carriage_returns_make_transient_segments_and_crlf_is_one_line_end():
    s = LineSplitter()
    # The last '\r' may start a '\r\n': "20%" is shown (transient) but kept until that is known.
    assert s.feed(b"\r10%\r20%\r") == [("10%", True), ("20%", True)]
    assert s.feed(b"\n") == [("20%", False)]
    assert s.feed(b"\r30%\rdone\r\nnext\r") == [("30%", True), ("done", False), ("next", True)]
    assert s.feed(b"x\n") == [("next", True), ("x", False)]
    assert s.feed(b"\r45%") == [("45%", True)]  # a redraw not yet ended shows at once


def test_a_line_that_never_ends_is_cut_rather_than_held():
    s = LineSplitter()
    out = s.feed(b"x" * (MAX_LINE + 10))
    assert out == [("x" * (MAX_LINE + 10), False)] and s.rest == b""


def test_finish_flushes_an_unterminated_line():
    s = LineSplitter()
    assert s.feed(b"tail") == []
    assert s.finish() == [("tail", False)]


def test_bad_timeouts_are_named():
    for bad in (0, -1, "10", True):
        with pytest.raises(LaunchConfigError, match="timeout"):
            LaunchControl(bad)


# -- real launches -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_timeout_stops_every_rank_and_raises(start_method, tmp_path, no_orphans):
    marker = str(tmp_path / "finished")
    sink = ListSink()
    with pytest.raises(LaunchTimeoutError, match=r"timed out after 2 s") as info:
        launch(targets.sleep_then_touch, (marker, 20.0), sink=sink, start_method=start_method, timeout=2)
    assert isinstance(info.value, TimeoutError)
    stopped = sorted(e.rank for e in sink.events if isinstance(e, RankStopped))
    assert stopped == [0, 1]
    assert [e for e in sink.events if isinstance(e, LaunchFinished)][-1].stopped.startswith("timed out")
    no_orphans()
    assert _markers_absent(marker, [0, 1])


@pytest.mark.timeout(60)
def test_a_fast_launch_is_not_stopped_by_its_timeout(no_orphans):
    assert launch(targets.rank_of_this_process, sink=ListSink(), timeout=30) == [0, 1]
    no_orphans()


class _StopFromAnotherThread(ListSink):
    """Like a Stop button: asks to stop from another thread once both ranks have started."""

    def __init__(self):
        super().__init__()
        self.control = None
        self.thread = None

    def attach(self, control):
        self.control = control

    def handle(self, event):
        super().handle(event)
        started = [e for e in self.events if type(e).__name__ == "RankStarted"]
        if len(started) == 2 and self.thread is None:
            self.thread = threading.Timer(0.5, self.control.request_stop, ("stopped by the test",))
            self.thread.start()


@pytest.mark.timeout(60)
def test_stop_request_from_another_thread_ends_the_launch(tmp_path, no_orphans):
    marker = str(tmp_path / "finished")
    sink = _StopFromAnotherThread()
    with pytest.raises(LaunchStoppedError, match="stopped by the test") as info:
        launch(targets.sleep_then_touch, (marker, 20.0), sink=sink)
    assert not isinstance(info.value, LaunchTimeoutError)
    assert {e.reason for e in sink.events if isinstance(e, RankStopped)} == {"stopped by the test"}
    no_orphans()
    assert _markers_absent(marker, [0, 1])


@pytest.mark.timeout(30)
def test_timeout_with_one_process_interrupts_the_caller():
    with pytest.raises(LaunchTimeoutError):
        notebook_launcher(time.sleep, (10,), num_processes=1, timeout=0.5, sinks=[ListSink()])


@pytest.mark.timeout(60)
def test_progress_redraws_arrive_as_transient_lines(no_orphans):
    sink = ListSink()
    assert launch(targets.progress_bar, (50,), sink=sink) == [50, 50]
    for rank in (0, 1):
        outs = [e for e in sink.events if isinstance(e, RankOutput) and e.rank == rank and e.stream == "stderr"]
        transient = [e.text for e in outs if e.transient]
        states = {f"step: {100 * i // 50:3d}%| {i}/50" for i in range(51)}
        assert transient[0] == "step:   0%| 0/50" and set(transient) <= states
        assert sink.lines(rank, "stderr") == ["step: 100%| 50/50"]  # the bar's last state, once
        assert sink.lines(rank) == ["after the bar"]
    no_orphans()
