"""Output with no newline, very long lines and output between session cells stay bounded: in the
launch model (panel and comm sink), the console sink and the kernel session's queue."""

from __future__ import annotations

import io
import json
import re
import time
from contextlib import redirect_stdout

import pytest
from panel_targets import FakeComm, flood

from notebook_accel.jupyter import comm
from notebook_accel.jupyter.launch_model import SHOWN_LINE, VIEW_BYTES
from notebook_accel.jupyter.panel import LaunchPanel
from notebook_accel.launch import events as ev
from notebook_accel.launch.sinks import CONSOLE_LINE, ConsoleSink

MB = 20  # per rank, with no newline: lines.py cuts it into 80 lines of 256 KiB
CUT = re.compile(r" … ([\d,]+) bytes cut$")


@pytest.fixture
def fake_comm(monkeypatch):
    fake = FakeComm()
    monkeypatch.setitem(comm._comms, "test", fake)
    return fake


@pytest.mark.timeout(120)
def test_a_launch_without_newlines_stays_bounded_in_the_panel_and_the_comm(fake_comm):
    from notebook_accel import notebook_launcher

    panel = LaunchPanel(autoflush=False, show=False)
    sink = comm.CommSink()
    results = notebook_launcher(
        flood, args=(MB,), num_processes=2, use_port="auto", cpu=True, sinks=[panel, sink]
    )
    sink.close()
    panel.flush()
    assert results == [0, 0]
    # The panel: each view keeps at most VIEW_BYTES of text, each line cut to SHOWN_LINE with a note.
    for view in ("all", 0, 1):
        text = panel.text(view)
        assert len(text) <= VIEW_BYTES + 2 * SHOWN_LINE, (view, len(text))
        lines = text.splitlines()
        assert lines and all(len(line) <= SHOWN_LINE + 40 for line in lines)
        # every line is cut with its note, but a stream's last piece may be short (and whole)
        assert all(CUT.search(line) or len(line) <= SHOWN_LINE + 12 for line in lines)
        assert sum(bool(CUT.search(line)) for line in lines) >= len(lines) - 2
    first = panel.text(0).splitlines()[0]
    assert first.startswith("x" * SHOWN_LINE + " … ")
    assert int(CUT.search(first).group(1).replace(",", "")) >= (1 << 18) - SHOWN_LINE
    for name, view in panel.views.items():
        assert len(view.value) <= VIEW_BYTES + 4 * SHOWN_LINE, name
        assert "earlier lines dropped" in view.value and "bytes cut" in view.value
    # The comm: batches of cut lines; everything sent is a small fraction of what the ranks wrote.
    batches = [m for m in fake_comm.messages if '"event": "RankOutput"' in m]
    assert batches
    assert all(len(m) <= 20 * (SHOWN_LINE + 100) for m in batches)
    sent = [line for m in batches for line in json.loads(m)["lines"]]
    assert sent and all(CUT.search(text) or len(text) <= SHOWN_LINE for _, text, _ in sent)
    assert sum(bool(CUT.search(text)) for _, text, _ in sent) >= len(sent) - 2
    assert sum(map(len, fake_comm.messages)) < (2 * MB << 20) // 20


def test_transient_lines_are_cut_too(fake_comm):
    panel = LaunchPanel(autoflush=False, show=False)
    sink = comm.CommSink()
    for s in (panel, sink):
        s.handle(ev.LaunchStarted(1, "fork", 1))
        s.handle(ev.RankStarted(0, 1))
        s.handle(ev.RankOutput(0, "stderr", "y" * 100_000, transient=True))
    panel.flush()
    sink.flush()
    text = panel.text(0)
    assert len(text) <= SHOWN_LINE + 40 and text.endswith(f" … {100_000 - SHOWN_LINE:,} bytes cut")
    assert len(panel.views["rank-0"].value) <= 2 * SHOWN_LINE
    [batch] = [json.loads(m) for m in fake_comm.messages if '"event": "RankOutput"' in m]
    [(stream, sent, transient)] = batch["lines"]
    assert transient and len(sent) <= SHOWN_LINE + 40 and CUT.search(sent)


def test_many_long_lines_fill_a_view_by_bytes_before_lines():
    panel = LaunchPanel(autoflush=False, show=False, max_lines=1000)
    panel.handle(ev.LaunchStarted(1, "fork", 1))
    for i in range(500):
        panel.handle(ev.RankOutput(0, "stdout", f"{i:04d}" + "z" * 2000))
    panel.flush()
    lines = panel.text(0).splitlines()
    assert sum(map(len, lines)) <= VIEW_BYTES < 500 * 2004
    assert lines[-1].startswith("0499")  # the newest kept, the oldest dropped
    dropped = 500 - len(lines)
    assert dropped > 0 and f"… {dropped} earlier lines dropped" in panel.views["rank-0"].value
    # Short lines are still kept by count, as before.
    for i in range(1500):
        panel.handle(ev.RankOutput(0, "stdout", f"short {i}"))
    assert len(panel.text(0).splitlines()) == 1000


def test_console_sink_cuts_a_long_line():
    out = io.StringIO()
    with redirect_stdout(out):
        sink = ConsoleSink()
        sink.handle(ev.RankOutput(1, "stdout", "é" * (CONSOLE_LINE + 10)))
        sink.handle(ev.RankOutput(1, "stdout", "short"))
    long, short = out.getvalue().splitlines()
    assert long == "[rank 1] " + "é" * CONSOLE_LINE + " … 20 bytes cut"
    assert short == "[rank 1] short"
    out = io.StringIO()
    with redirect_stdout(out):
        ConsoleSink(max_line=None).handle(ev.RankOutput(0, "stdout", "w" * (CONSOLE_LINE + 10)))
    assert out.getvalue() == "[rank 0] " + "w" * (CONSOLE_LINE + 10) + "\n"


# -- the kernel session's queue between cells -----------------------------------------------------
class Shell:
    """What KernelSession.run_cell reads from IPython's shell."""

    def __init__(self):
        from IPython.core.compilerop import CachingCompiler

        self.execution_count, self.compile, self.user_ns = 1, CachingCompiler(), {}


BACKGROUND = """
import os, threading, time
def _spam():
    while not os.path.exists({go!r}):  # the test says go once this cell has ended
        time.sleep(0.01)
    for i in range({n}):
        print("bg", i)
    print("bg done", flush=True)
threading.Thread(target=_spam).start()
"""


@pytest.mark.timeout(120)
def test_a_worker_printing_between_cells_does_not_grow_the_queue(capsys, tmp_path):
    from notebook_accel.jupyter import kernel_session as ks_mod

    lines, n = ks_mod.QUEUE_LINES, 3 * ks_mod.QUEUE_LINES
    ks = ks_mod.KernelSession(Shell(), 1, "fork", "no", True)
    ks.session.start()
    try:
        ks.run_cell("print('first cell')")
        ks.session.run_cell(BACKGROUND.format(n=n, go=str(tmp_path / "go")))
        (tmp_path / "go").touch()
        deadline = time.monotonic() + 60
        while not any(line[2] == "bg done" for line in list(ks.queue.lines)):
            assert time.monotonic() < deadline, "the background output never arrived"
            time.sleep(0.05)
        assert len(ks.queue.lines) <= lines and ks.queue.bytes <= ks_mod.QUEUE_BYTES
        capsys.readouterr()
        ks.run_cell("print('next cell')")
        shown = capsys.readouterr()
    finally:
        ks.stop()
    out = shown.out.splitlines()
    notes = [i for i, line in enumerate(out) if "dropped" in line]
    assert [out[i] for i in notes] == [
        f"[rank 0] … {n + 1 - lines:,} lines dropped while no cell was running"
    ]
    background = [line for line in out if line.startswith("[rank 0] bg")]
    assert len(background) == lines and background[-1] == "[rank 0] bg done"
    assert out[notes[0] + 1] == background[0] and out[-1] == "[rank 0] next cell"  # in order


WAIT_FOR_QUEUE = """
import time
from notebook_accel.jupyter import kernel_session as _ks
_deadline = time.monotonic() + 60
while not any(line[2] == "bg done" for line in list(_ks.current().queue.lines)):
    assert time.monotonic() < _deadline, "the background output never arrived"
    time.sleep(0.05)
print("queued", len(_ks.current().queue.lines))
"""


@pytest.mark.timeout(180)
def test_in_a_real_kernel_the_next_cell_shows_what_came_between_cells(kernel, tmp_path):
    from kernels import run

    from notebook_accel.jupyter.kernel_session import QUEUE_LINES

    km, kc = kernel  # widgets off: session output arrives as `[rank N] line` text
    for code in ("%load_ext notebook_accel", "%accelerate start -n 1"):
        assert run(kc, code)["reply"]["status"] == "ok"
    started = run(kc, "%%accelerate\n" + BACKGROUND.format(n=3 * QUEUE_LINES, go=str(tmp_path / "go")))
    assert started["reply"]["status"] == "ok"
    (tmp_path / "go").touch()
    waited = run(kc, WAIT_FOR_QUEUE, timeout=90)
    assert waited["reply"]["status"] == "ok" and f"queued {QUEUE_LINES}\n" in waited["text"], waited["text"]
    seen = run(kc, "%%accelerate\nprint('next cell')")
    run(kc, "%accelerate stop")
    text = seen["text"].splitlines()
    [note] = [i for i, line in enumerate(text) if "dropped" in line]
    assert text[note] == f"[rank 0] … {2 * QUEUE_LINES + 1:,} lines dropped while no cell was running"
    background = [line for line in text if line.startswith("[rank 0] bg")]
    assert len(background) == QUEUE_LINES and background[-1] == "[rank 0] bg done"
    assert text[note + 1] == background[0] and text[-1] == "[rank 0] next cell"  # in order
