"""notebook_launcher in a real Jupyter kernel (nbclient): cell-defined code with fork and spawn,
a failing rank whose error shows the cell's line, a relaunch, and no process left behind."""

from __future__ import annotations

import json
import re
import sys

import nbformat
import pytest
from nbclient import NotebookClient

SETUP = """\
import os, sys, time
import psutil
import torch
from notebook_accel import notebook_launcher
print("EXE", sys.executable)
# The kernel computes before it launches, as notebooks do (the fork-hang case).
print("PARENT", float((torch.ones(64, 64) @ torch.ones(64, 64)).sum()), float(torch.ones(1_000_000).sum()))
"""

DEFINE = """\
class Accumulator:
    def __init__(self, start):
        self.total = start

    def add(self, value):
        self.total += value
        return self


def work(acc, offset):
    import torch
    import torch.distributed as dist
    from notebook_accel.state import AcceleratorState

    state = AcceleratorState()
    total = torch.tensor([float(state.process_index + offset)])
    dist.all_reduce(total)
    print(f"hello from rank {state.process_index}")
    return acc.add(state.process_index).total, state.process_index, str(state.distributed_type), total.item()


def flaky(bad_rank):
    if int(os.environ["RANK"]) == bad_rank:
        raise ZeroDivisionError("rank gave up in the cell")
    time.sleep(20)
    with open(f"late-{os.environ['RANK']}.txt", "w") as f:  # only if this rank was not stopped
        f.write("ran to completion")
    return "late"
"""

FORK = 'print("FORK", notebook_launcher(work, args=(Accumulator(100), 1), num_processes=2, use_port="auto"))'
SPAWN = (
    'print("SPAWN", notebook_launcher(work, args=(Accumulator(200), 1), num_processes=2, use_port="auto",'
    ' start_method="spawn"))'
)
FAIL_FORK = 'notebook_launcher(flaky, args=(1,), num_processes=2, use_port="auto")'
FAIL_SPAWN = 'notebook_launcher(flaky, args=(0,), num_processes=2, use_port="auto", start_method="spawn")'
BAD_INPUT = 'notebook_launcher(work, args=(Accumulator(0), 0), num_processes=0)'
UNPICKLABLE = 'import threading\nnotebook_launcher(work, args=(threading.Lock(), 0), num_processes=2, start_method="spawn")'
WRAPPED = """\
def main():
    return notebook_launcher(flaky, args=(1,), num_processes=2, use_port="auto")
main()
"""
DETAIL = """\
try:
    notebook_launcher(flaky, args=(1,), num_processes=2, use_port="auto")
except Exception as exc:
    failed = exc
print("DETAIL", sorted(failed.reports), type(failed.reports[1]).__name__, sorted(failed.failures),
      type(failed.failures[1]).__name__, failed.failures[1].message)
print("WHOLE", repr(failed.reports[1].traceback))
"""
AGAIN = 'print("AGAIN", notebook_launcher(work, args=(Accumulator(0), 0), num_processes=2, use_port="auto"))'
ORPHANS = """\
def left():  # the warm forkserver, started by the import, stays up by design; its ranks may not
    return [p for p in psutil.Process().children(recursive=True)
            if not (p.ppid() == os.getpid() and "notebook_accel.launch.warm" in " ".join(p.cmdline()))]
deadline = time.monotonic() + 5
while left() and time.monotonic() < deadline:
    time.sleep(0.05)
print("CHILDREN", [(p.pid, p.name()) for p in left()])
"""

CELLS = [SETUP, DEFINE, FORK, SPAWN, FAIL_FORK, FAIL_SPAWN, BAD_INPUT, UNPICKLABLE, WRAPPED, DETAIL, AGAIN, ORPHANS]
LIBRARY_FRAME = re.compile(r"File .*notebook_accel|launcher\.py|monitor\.py|starters")


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A "python3" kernel spec that runs this interpreter, found before any other."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "test", "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    # These tests read the ranks' text in the cell's output: the console sink, not the widget panel.
    monkeypatch.setenv("NOTEBOOK_ACCEL_WIDGETS", "0")
    return tmp_path


def _stdout(cell) -> str:
    return "".join(
        o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"
    )


def _error(cell):
    errors = [o for o in cell.outputs if o.output_type == "error"]
    return errors[0] if errors else None


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@pytest.mark.timeout(180)
def test_launch_from_a_real_kernel(kernel_env):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=90,
        allow_errors=True,
        resources={"metadata": {"path": str(kernel_env)}},
    )
    client.execute()
    setup, define, fork, spawn, fail_fork, fail_spawn, bad_input, unpicklable, wrapped, detail, again, orphans = nb.cells

    assert _error(setup) is None, _error(setup)
    assert f"EXE {sys.executable}\n" in _stdout(setup)
    assert "PARENT 262144.0 1000000.0" in _stdout(setup)
    assert _error(define) is None

    # Cell-defined class and function, results indexed by rank, rank output shown in the cell.
    for cell, name, start in ((fork, "FORK", 100), (spawn, "SPAWN", 200)):
        assert _error(cell) is None, _error(cell)
        out = _stdout(cell)
        expected = [(start, 0, "MULTI_CPU", 3.0), (start + 1, 1, "MULTI_CPU", 3.0)]
        assert f"{name} {expected!r}" in out, out
        assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out

    # A failing rank: the cell raises the launcher's error, which shows the cell's line.
    for cell, rank in ((fail_fork, 1), (fail_spawn, 0)):
        error = _error(cell)
        assert error is not None, cell.outputs
        assert error.ename == "LaunchFailedError"
        assert f"rank {rank} raised ZeroDivisionError: rank gave up in the cell" in error.evalue
        assert 'raise ZeroDivisionError("rank gave up in the cell")' in error.evalue, error.evalue
        # The function was defined in the notebook's second cell, and is named as IPython names it.
        assert re.search(r"Cell In\[2\], line \d+, in flaky", error.evalue), error.evalue
        shown = _strip_ansi("\n".join(error.traceback))
        assert "LaunchFailedError" in shown
        # What the user sees: their call, then the rank's traceback; none of the library's frames.
        assert f"Cell In[{cell.execution_count}], line 1" in shown, shown
        assert re.search(r"Cell In\[2\], line \d+, in flaky", shown), shown
        assert not LIBRARY_FRAME.search(shown), shown

    # Bad input: the call and the message, no frame of the plan's checks.
    error = _error(bad_input)
    assert error is not None and error.ename == "LaunchConfigError", bad_input.outputs
    shown = _strip_ansi("\n".join(error.traceback))
    assert "num_processes" in shown and f"Cell In[{bad_input.execution_count}], line 1" in shown, shown
    assert not LIBRARY_FRAME.search(shown), shown
    # An error raised from a cause (pickling the lock): no library frame in either.
    error = _error(unpicklable)
    assert error is not None and error.ename == "UnpicklableError", unpicklable.outputs
    shown = _strip_ansi("\n".join(error.traceback))
    assert "The above exception was the direct cause" in shown and "lock" in shown.lower(), shown
    assert not LIBRARY_FRAME.search(shown), shown
    # The user's own function that called the launcher keeps its frame.
    error = _error(wrapped)
    shown = _strip_ansi("\n".join(error.traceback))
    assert f"Cell In[{wrapped.execution_count}], line 2, in main" in shown, shown
    assert not LIBRARY_FRAME.search(shown), shown
    # The full detail stays on the exception: rank -> RankFailed (the whole traceback) and torch's failures.
    assert _error(detail) is None, _error(detail)
    out = _stdout(detail)
    assert "DETAIL [1] RankFailed [1] ProcessFailure rank 1 raised ZeroDivisionError" in out, out
    assert "Traceback (most recent call last)" in out and "rank gave up in the cell" in out, out

    # The kernel launches again at once, and nothing is left running.
    assert _error(again) is None, _error(again)
    assert "AGAIN [(0, 0, 'MULTI_CPU', 1.0), (1, 1, 'MULTI_CPU', 1.0)]" in _stdout(again)
    assert _error(orphans) is None, _error(orphans)
    assert "CHILDREN []" in _stdout(orphans), _stdout(orphans)
    assert not list(kernel_env.glob("late-*.txt")), "a rank that should have been stopped ran to completion"
