"""Interactive sessions in real processes on gloo: state across cells, interrupts, dead workers,
output, push / pull, and the channel's signatures. Every test has a timeout; none asserts speed."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time

import psutil
import pytest
from stranger import closed_by_parent, listening, start_with_stranger

from notebook_accel.session import (
    CellError,
    Session,
    SessionNotStarted,
    SessionTimeout,
    WorkerDied,
    parse_ranks,
    protocol,
)


class Lines:
    """An on_output handler that keeps every line and can wait for one."""

    def __init__(self):
        self.items = []
        self.cond = threading.Condition()

    def __call__(self, rank, stream, text, transient):
        with self.cond:
            self.items.append((rank, stream, text, transient))
            self.cond.notify_all()

    def of(self, rank, stream="stdout"):
        with self.cond:
            return [t for r, s, t, tr in self.items if r == rank and s == stream and not tr]

    def wait_for(self, text, count=1, timeout=30.0):
        with self.cond:
            return self.cond.wait_for(lambda: sum(t == text for *_, t, _tr in self.items) >= count, timeout)


@pytest.fixture(scope="module", autouse=True)
def _stop_the_warm_server_afterwards():
    yield
    from notebook_accel.launch.warm import WarmServer

    WarmServer.shutdown()


@pytest.fixture
def lines():
    return Lines()


@pytest.fixture
def session(lines):
    s = Session(2, cpu=True, on_output=lines).start()
    yield s
    s.stop()


def _all_ok(replies):
    assert all(r.ok for r in replies.values()), {k: r.error for k, r in replies.items() if not r.ok}
    return replies


def results(session, source, **kwargs):
    """rank -> the text/plain of the cell's result, asserting that every rank succeeded."""
    return {rank: reply.result_repr for rank, reply in _all_ok(session.run_cell(source, **kwargs)).items()}


# -- state and the process group -------------------------------------------------------------
DIST = "import torch, torch.distributed as dist\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_state_lives_across_cells(start_method, lines):
    with Session(2, start_method=start_method, cpu=True, on_output=lines) as s:
        results(s, DIST + "x = dist.get_rank()")
        assert results(s, "x * 10") == {0: "0", 1: "10"}


@pytest.mark.timeout(120)
def test_four_ranks_all_reduce_right_after_start(lines):
    s = Session(4, cpu=True, on_output=lines).start()
    try:
        # Sent the moment start() returns: every worker has said hello, so nothing is lost.
        cell = DIST + "t = torch.tensor([float(dist.get_rank())])\ndist.all_reduce(t)\nt.item()"
        assert results(s, cell) == {r: "6.0" for r in range(4)}
        rows = s.status()
        assert [row["rank"] for row in rows] == [0, 1, 2, 3]
        assert all(row["state"] == "idle" and row["device"] == "cpu" and row["rss"] > 0 for row in rows)
    finally:
        s.stop()


@pytest.mark.timeout(60)
def test_a_subset_of_ranks(session):
    assert results(session, "y = 5", ranks=[1]) == {1: None}
    assert results(session, "'y' in globals()") == {0: "False", 1: "True"}
    assert results(session, "1", ranks="1:") == {1: "1"}


# -- push / pull -------------------------------------------------------------------------------
POINT = """
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def norm2(self):
        return self.x ** 2 + self.y ** 2
"""


@pytest.mark.timeout(60)
def test_push_pull_round_trip_with_a_notebook_class(session):
    notebook = {"__name__": "__main__"}  # a class defined in a notebook cell: cloudpickled by value
    exec(POINT, notebook)
    Point = notebook["Point"]
    session.push({"p": Point(3, 4), "scale": 10})
    assert results(session, DIST + "q = type(p)(p.x * scale, dist.get_rank())\np.norm2()") == {
        0: "25",
        1: "25",
    }
    q = session.pull("q", rank=1)
    assert isinstance(q, Point) and (q.x, q.y) == (30, 1)
    session.push({"only_one": [1, 2]}, ranks=[0])
    assert session.pull("only_one", rank=0) == [1, 2]
    with pytest.raises(CellError, match="no_such_name"):
        session.pull("no_such_name", rank=1)
    results(session, "import threading\nlock = threading.Lock()")
    with pytest.raises(CellError, match="'lock'.*cannot be pickled"):
        session.pull("lock")


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_an_error_on_one_rank(session):
    results(session, DIST + "rank = dist.get_rank()")
    replies = session.run_cell("a = 1\nif rank == 1:\n    raise ValueError('boom')\n", filename="<cell-7>")
    assert replies[0].ok and replies[0].error is None
    error = replies[1].error
    assert not replies[1].ok and error["exc_type"] == "ValueError" and error["message"] == "boom"
    assert (
        'File "<cell-7>", line 3' in error["traceback"] and "raise ValueError('boom')" in error["traceback"]
    )
    with pytest.raises(CellError, match="boom"):
        session.run_cell("if rank == 1:\n    raise ValueError('boom')", check=True)
    assert results(session, "a + 1") == {0: "2", 1: "2"}
    assert session.run_cell("1 +")[0].error["exc_type"] == "SyntaxError"


# -- interrupts, timeouts, dead workers --------------------------------------------------------
SLEEP = "import time\nprint('sleeping')\ntime.sleep(60)"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["while sending", "as the wait begins"])
def test_an_interrupt_while_the_cell_is_being_sent_leaves_no_rank_busy(session, lines, monkeypatch, when):
    """A Ctrl-C can land before the wait starts (seen in CI under load): the ranks that got the
    cell are interrupted, the one that did not is not waited for, and the next cell runs."""
    pool = session._pool
    if when == "while sending":  # SIGINT once rank 0 got the cell, before rank 1 has it
        send = pool.send

        def send_then_interrupt(w, header, payload=b""):
            send(w, header, payload)
            if header.get("type") == "exec" and w.rank == 0:
                lines.wait_for("sleeping", count=1)
                signal.raise_signal(signal.SIGINT)

        monkeypatch.setattr(pool, "send", send_then_interrupt)
    else:  # both got it; the interrupt lands as the wait begins (the interrupt's own waits are real)
        wait_until, calls = pool.wait_until, []

        def interrupted_wait(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                lines.wait_for("sleeping", count=2)
                raise KeyboardInterrupt
            return wait_until(*args, **kwargs)

        monkeypatch.setattr(pool, "wait_until", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        session.run_cell(SLEEP)
    monkeypatch.undo()
    deadline = time.monotonic() + 30
    while [row["state"] for row in session.status()] != ["idle", "idle"]:
        assert time.monotonic() < deadline, session.status()
        time.sleep(0.05)
    assert results(session, "'alive'") == {0: "'alive'", 1: "'alive'"}


@pytest.mark.timeout(60)
def test_keyboard_interrupt_while_waiting(session, lines):
    main = threading.main_thread().ident

    def interrupt():
        lines.wait_for("sleeping", count=2)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        session.run_cell(SLEEP)
    assert [row["state"] for row in session.status()] == ["idle", "idle"]
    assert results(session, "'alive'") == {0: "'alive'", 1: "'alive'"}
    os.kill(session.status()[0]["pid"], signal.SIGINT)  # between cells: ignored
    assert results(session, "'still alive'") == {0: "'still alive'", 1: "'still alive'"}


@pytest.mark.timeout(60)
def test_timeout_interrupts_and_raises(session):
    with pytest.raises(SessionTimeout) as info:
        session.run_cell(SLEEP, timeout=1)
    assert info.value.killed == []
    assert {r: rep.error["exc_type"] for r, rep in info.value.replies.items()} == {
        0: "KeyboardInterrupt", 1: "KeyboardInterrupt",
    }  # fmt: skip
    assert results(session, "2 * 21") == {0: "42", 1: "42"}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_killed_worker_is_reported_and_restart_works(start_method, lines):
    session = Session(2, start_method=start_method, cpu=True, on_output=lines).start()
    try:
        pid1 = session.status()[1]["pid"]

        def kill():
            lines.wait_for("sleeping", count=2)
            os.kill(pid1, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        with pytest.raises(WorkerDied) as info:
            session.run_cell(SLEEP)
        assert info.value.deaths == {1: (-signal.SIGKILL, "SIGKILL")}
        assert "rank 1" in str(info.value) and "SIGKILL" in str(info.value)
        rows = session.status()
        assert rows[1]["state"] == "dead" and rows[1]["signal"] == "SIGKILL"
        assert rows[0]["state"] == "busy"  # still in its sleep
        with pytest.raises(WorkerDied, match="rank 1"):
            session.run_cell("1", ranks=[1])
        session.restart()
        assert results(session, DIST + "dist.get_world_size()") == {0: "2", 1: "2"}
    finally:
        session.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_stop_leaves_no_process_and_no_thread(start_method, lines, no_orphans):
    s = Session(2, start_method=start_method, cpu=True, on_output=lines).start()
    pids = [row["pid"] for row in s.status()]
    reader = s._pool.reader
    s.stop()
    assert not reader.is_alive()
    for pid in pids:
        assert not psutil.pid_exists(pid)  # exited and reaped: no zombie either
    no_orphans()
    with pytest.raises(SessionNotStarted):
        s.run_cell("1")


# -- output ------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_megabytes_of_stderr_all_arrive(session, lines):
    results(
        session, "import sys\nfor i in range(50000):\n    sys.stderr.write(f'{i:09d}' + 'x' * 90 + '\\n')\n"
    )
    for rank in (0, 1):  # 5 MB per rank
        got = lines.of(rank, "stderr")
        assert len(got) == 50000 and got[-1].startswith("000049999")


@pytest.mark.timeout(60)
def test_print_arrives_as_one_line_and_late_lines_arrive(session, lines):
    results(session, "print('a', 1)")
    assert lines.of(0) == ["a 1"] and lines.of(1) == ["a 1"]
    results(session, "import time\nprint('first')\ntime.sleep(1)\nprint('second')\nprint('tail', end='')")
    assert lines.of(1) == ["a 1", "first", "second", "tail"]


HTML_AND_FIGURE = """
import matplotlib.pyplot as plt
plt.plot([1, 2, 3])

class Html:
    def _repr_html_(self):
        return '<b>hi</b>'

Html()
"""


@pytest.mark.timeout(60)
def test_rich_output(session):
    reply = _all_ok(session.run_cell(HTML_AND_FIGURE, ranks=[0]))[0]
    assert reply.result["text/html"] == "<b>hi</b>"
    assert len(reply.displays) == 1 and reply.displays[0]["image/png"].startswith("iVBOR")  # base64 PNG
    assert results(session, "len(plt.get_fignums())", ranks=[0]) == {0: "0"}  # closed after the cell


# -- the channel -------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_badly_signed_frame_is_dropped_unread(tmp_path):
    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = pickle.dumps(Evil())
    wrong_key = protocol.encode(protocol.new_key(), protocol.TO_PARENT, {"type": "hello", "rank": 0}, payload)
    unsigned = wrong_key[: -protocol.MAC_SIZE] + bytes(protocol.MAC_SIZE)
    closed = []

    def stranger(address):  # while the workers start, when the channel listens
        for frame in (wrong_key, unsigned):
            with socket.create_connection(address) as raw:
                raw.sendall(frame)
                closed.append(closed_by_parent(raw, 10))

    session, _, error = start_with_stranger(stranger)
    try:
        assert error is None, error
        assert closed == [True, True]
        assert session.dropped_frames == 2
        assert not marker.exists()
        assert results(session, "'still fine'") == {0: "'still fine'", 1: "'still fine'"}
    finally:
        session.stop()


@pytest.mark.timeout(120)
def test_the_channel_listens_on_loopback_only():
    others = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    reached = []

    def stranger(address):
        socket.create_connection(address, timeout=5).close()
        reached.append("loopback")
        for other in others:  # this machine's other addresses must not reach the channel
            try:
                socket.create_connection((other, address[1]), timeout=5).close()
            except OSError:
                continue
            reached.append(other)

    session, addresses, error = start_with_stranger(stranger)
    try:
        assert error is None, error
        assert addresses == [("127.0.0.1", session.port)]  # the one socket we opened, on loopback
        assert reached == ["loopback"]
        # Every worker said hello: nothing listens any more.
        assert [a for a in listening() if a[1] == session.port] == []
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", session.port), timeout=5).close()
        assert results(session, "'reachable'") == {0: "'reachable'", 1: "'reachable'"}
    finally:
        session.stop()


@pytest.mark.timeout(10)
def test_frames_are_checked_before_they_are_read():
    key = protocol.new_key()
    frame = protocol.encode(key, protocol.TO_PARENT, {"type": "done", "id": 3}, b"payload")
    assert protocol.FrameReader(key, protocol.TO_PARENT).feed(frame[:5]) == []  # incomplete: wait
    assert protocol.FrameReader(key, protocol.TO_PARENT).feed(frame) == [
        ({"type": "done", "id": 3}, b"payload")
    ]
    tampered = frame.replace(b"payload", b"paYload")
    for reader, data in (
        (protocol.FrameReader(protocol.new_key(), protocol.TO_PARENT), frame),  # another session's key
        (protocol.FrameReader(key, protocol.TO_PARENT), tampered),
        (protocol.FrameReader(key, protocol.TO_WORKER), frame),  # reflected back the other way
        (protocol.FrameReader(key, protocol.TO_PARENT, limit=1024), frame[:4] + b"\xff" * 4),  # too big
    ):
        with pytest.raises(protocol.BadFrame):
            reader.feed(data)


# -- rank specs ----------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_parse_ranks():
    assert parse_ranks("all", 4) == [0, 1, 2, 3]
    assert parse_ranks(None, 2) == [0, 1]
    assert parse_ranks("0,2", 4) == [0, 2]
    assert parse_ranks("1:", 4) == [1, 2, 3]
    assert parse_ranks(":2", 4) == [0, 1]
    assert parse_ranks("0, 2:4", 4) == [0, 2, 3]
    assert parse_ranks([3, 1], 4) == [3, 1]
    assert parse_ranks(2, 4) == [2]
    for bad, words in (("4", "rank 4 does not exist; valid ranks are 0..3"), ("a", "'a' is not a rank number"),
                       ("3:1", "not a range"), ([5], "rank 5"), ("", "is not a rank number"), (True, "not a rank spec")):  # fmt: skip
        with pytest.raises(ValueError, match=words) as info:
            parse_ranks(bad, 4)
        assert repr(bad) in str(info.value)


@pytest.mark.timeout(120)
def test_ranks_left_running_after_a_failure_are_named(lines, monkeypatch):
    """Rank 1's cell raises while rank 0 waits in an all_reduce for it: rank 0 would wait for gloo's
    30 minutes. The session says so once, naming both, while the cell still waits."""
    from notebook_accel.session import manager

    monkeypatch.setattr(manager, "STRANDED_NOTICE_S", 1.0)
    told, reports = [], []
    with Session(2, cpu=True, on_output=lines) as s:
        s.on_stranded = lambda failed, running: told.append((failed, running))
        s.on_stall = lambda event: reports.append(event.report)
        cell = DIST + "if dist.get_rank() == 1:\n    raise ValueError('rank 1 gives up')\ndist.all_reduce(torch.ones(1))"
        with pytest.raises(SessionTimeout) as caught:
            s.run_cell(cell, timeout=6)
        assert told == [([1], [0])]
        assert caught.value.replies[1].error["exc_type"] == "ValueError"
    # Said as the stall watch says it: where the others wait, and what to do.
    (report,) = reports
    assert report.sentence.startswith("stalled 1 s after a failure: rank 1 failed this cell; rank 0 waits in all_reduce #")
    assert "(float32[1])" in report.sentence and "interrupt the cell" in report.sentence, report.sentence


@pytest.mark.timeout(60)
def test_no_notice_when_every_rank_fails_or_none_waits(lines, monkeypatch):
    from notebook_accel.session import manager

    monkeypatch.setattr(manager, "STRANDED_NOTICE_S", 0.5)
    told = []
    with Session(2, cpu=True, on_output=lines) as s:
        s.on_stranded = lambda failed, running: told.append((failed, running))
        s.on_stall = told.append
        s.run_cell("import time\nraise ValueError('all give up')")
        s.run_cell("import time, os\ntime.sleep(2 if os.environ['RANK'] == '0' else 0)")  # slow, nobody failed
    assert told == []


@pytest.mark.timeout(120)
def test_a_cells_ranks_are_sampled_while_it_runs_and_their_peaks_reported(lines):
    # What the kernel's session does for the panel: CellEvents.sample() from the waiting thread.
    from notebook_accel.launch import ListSink
    from notebook_accel.launch import events as ev
    from notebook_accel.session.cell_events import CellEvents

    held = 300 << 20
    with Session(2, cpu=True, on_output=lines) as s:
        sink = ListSink()
        cell = CellEvents(sink, [0, 1], 2, s.pids())
        s.tick = cell.sample
        source = (
            f"block = bytearray({held})\n"
            "for i in range(0, len(block), 4096):\n"
            "    block[i] = 1\n"
            "import time; time.sleep(2.5)\n"
        )
        replies = s.run_cell(source)
        assert cell.replies(replies) == ()
        s.tick = None
        samples = [e for e in sink.events if isinstance(e, ev.RankResources)]
        for rank in (0, 1):
            mine = [e for e in samples if e.rank == rank]
            assert any(e.rss >= held for e in mine), mine  # sampled while it held the block
            assert all(e.cpu_percent >= 0 and e.memory_limit for e in mine), mine
        finished = {e.rank: e for e in sink.events if isinstance(e, ev.RankFinished)}
        assert set(finished) == {0, 1}
        assert all(held <= e.peak_rss < 4 << 30 for e in finished.values()), finished
        assert s.run_cell("len(block)")[0].result_repr == str(held)  # the worker kept it: a session
