"""notebook_launcher(..., pdb=True) and `%%accelerate --pdb`: the first failing rank stays in pdb, the
others stopped, its commands read with input() on the launching thread; in a real kernel the front end
answers them (jupyter_client's stdin channel), elsewhere a replaced input() or a terminal does."""

from __future__ import annotations

import builtins
import os
import re
import subprocess
import sys
import textwrap
import time

import pdb_targets
import pytest
from kernels import converse, kernel_children, run
from orphans import children, long_lived_helpers

from notebook_accel.launch import (
    LaunchConfigError,
    LaunchFailedError,
    ListSink,
    RankStopped,
    notebook_launcher,
    pdb_relay,
)


@pytest.fixture(scope="module", autouse=True)
def _stop_the_warm_server_afterwards():
    yield  # later modules count this process's children
    from notebook_accel.launch.warm import WarmServer

    WarmServer.shutdown()


def answering(monkeypatch, *answers, before=None):
    """input() answers with `answers`, then the end of input; returns the prompts it was asked."""
    pending, prompts = list(answers), []

    def fake(prompt=""):
        prompts.append(prompt)
        if before is not None:
            before()
        if not pending:
            raise EOFError
        return pending.pop(0)

    monkeypatch.setattr(builtins, "input", fake)
    return prompts


def launch(num_processes=2, args=(), **kwargs):
    sink = ListSink()
    with pytest.raises(LaunchFailedError) as failed:
        notebook_launcher(
            pdb_targets.nested_failure,
            args,
            num_processes=num_processes,
            pdb=True,
            cpu=True,
            use_port="auto",
            sinks=[sink],
            **kwargs,
        )
    return failed.value, sink


def without_sink_lines(text: str) -> str:
    # The console sink's `[rank N] ...` lines come on stderr, interleaved anywhere with pdb's stdout.
    return "".join(line for line in text.splitlines(True) if not line.startswith("[rank "))


def no_ranks_left() -> None:
    left = set(children()) - long_lived_helpers()
    assert not left, {pid: children().get(pid) for pid in left}


# -- in this process ---------------------------------------------------------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_each_start_method_keeps_the_failed_rank_in_pdb(monkeypatch, capsys, start_method):
    prompts = answering(monkeypatch, "p y", "up", "p x", "q")
    started = time.monotonic()
    error, sink = launch(start_method=start_method)
    out = capsys.readouterr().out
    assert prompts == ["(Pdb) "] * 4, out
    assert "rank 1 raised ValueError: rank 1 broke at 42\npdb on rank 1's frames" in out, out
    assert re.search(r"^> .*pdb_targets\.py\(\d+\)inner\(\)\n-> +raise ValueError", out, re.M), out
    assert "(Pdb)" not in out and "\n42\n" in out and "\n41\n" in out, out  # the prompts went to input()
    assert re.search(r"^> .*pdb_targets\.py\(\d+\)nested_failure\(\)\n-> inner\(x \+ 1\)", out, re.M), out
    assert list(error.reports) == [1] and "rank 1 broke at 42" in str(error)
    assert "no debugger" not in str(error)
    assert [e.rank for e in sink.events if isinstance(e, RankStopped)] == [0]  # stopped, not left to sleep
    assert time.monotonic() - started < 40
    no_ranks_left()


@pytest.mark.timeout(60)
def test_one_rank_runs_in_a_child_and_the_timeout_waits_for_the_debugger(monkeypatch, capsys):
    # The user takes longer than the launch's timeout to type: the debugger is not cut off.
    prompts = answering(monkeypatch, "p y", "c", before=lambda: time.sleep(0.8))
    error, _ = launch(num_processes=1, args=((0,),), timeout=1.0)
    out = capsys.readouterr().out
    assert type(error) is LaunchFailedError and prompts == ["(Pdb) "] * 2, out
    assert "rank 0 broke at 42" in str(error) and "\n42\n" in out, out
    no_ranks_left()


@pytest.mark.timeout(60)
def test_when_every_rank_fails_only_the_first_is_debugged(monkeypatch, capsys):
    prompts = answering(monkeypatch, "q")
    error, _ = launch(args=((0, 1),))
    out = capsys.readouterr().out
    assert prompts == ["(Pdb) "] and out.count("pdb on rank") == 1, out
    debugged = int(re.search(r"pdb on rank (\d)", out).group(1))
    assert str(error).startswith(f"rank {debugged} raised ValueError"), str(error)
    # The other rank is stopped with the launch: reported too if its error came first (a race).
    other = 1 - debugged
    assert (other in error.reports) == (f"also: rank {other} raised ValueError" in str(error)), str(error)
    no_ranks_left()


def test_bad_pdb_arguments_are_refused_before_anything_starts():
    with pytest.raises(LaunchConfigError, match=r"pdb='yes' must be True or False"):
        notebook_launcher(pdb_targets.nested_failure, num_processes=2, pdb="yes", cpu=True)
    with pytest.raises(LaunchConfigError, match=r"pdb=True needs a launch on this machine.*max_restarts=0"):
        notebook_launcher(pdb_targets.nested_failure, num_processes=2, pdb=True, cpu=True, max_restarts=1)
    with pytest.raises(LaunchConfigError, match=r"cannot keep a TPU rank in the debugger"):
        pdb_relay.check(True, "xla")


SCRIPT = textwrap.dedent(
    """
    import time
    import pdb_targets
    from notebook_accel import notebook_launcher
    from notebook_accel.launch import LaunchFailedError

    started = time.monotonic()
    try:
        notebook_launcher(pdb_targets.nested_failure, num_processes=2, pdb=True, cpu=True, use_port="auto")
    except LaunchFailedError as error:
        print(error)
    print(f"took {time.monotonic() - started:.1f} s")
    """
)


@pytest.mark.timeout(60)
def test_a_script_whose_stdin_is_not_a_terminal_ends_the_rank_and_says_why(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=50,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.path.dirname(pdb_targets.__file__)},
    )
    assert done.returncode == 0, done.stderr
    assert "rank 1 raised ValueError: rank 1 broke at 42" in done.stdout, done.stdout
    assert (
        "pdb=True, but no debugger was opened on rank 1: stdin is not a terminal, so the debugger could not "
        "read a command" in done.stdout
    ), done.stdout
    assert "(Pdb)" not in done.stdout + done.stderr, done.stdout
    assert float(re.search(r"took ([\d.]+) s", done.stdout).group(1)) < 30, done.stdout


# -- through a real kernel ---------------------------------------------------------------------------
DEFINE = """import os, time
def train():
    rank = int(os.environ["RANK"])
    x = 41
    def inner(y):
        if rank == 1:
            raise ValueError(f"rank one broke at {y}")
        time.sleep(60)
    inner(x + 1)
"""

LAUNCH = "from notebook_accel import notebook_launcher\nnotebook_launcher(train, num_processes=2, pdb=True, cpu=True)"


@pytest.mark.timeout(180)
def test_a_kernel_front_end_answers_pdb_then_the_launch_fails_as_usual(kernel):
    km, kc = kernel
    assert run(kc, DEFINE)["reply"]["status"] == "ok"
    in_pdb = {}

    def look(n):  # at the first prompt: the failed rank waits in pdb, its sibling is gone
        if n == 1:
            in_pdb["ranks"] = kernel_children(km)
        return False  # and answer it

    started = time.monotonic()
    seen = converse(kc, LAUNCH, ["p y", "up", "p x", "where", "q"], on_prompt=look)
    seconds = time.monotonic() - started
    text = without_sink_lines(seen["text"])
    assert seen["prompts"] == ["(Pdb) "] * 5, seen
    assert re.search(r"^> Cell In\[\d+\]\(7\)inner\(\)\n-> +raise ValueError", text, re.M), text
    assert "(Pdb) " not in text  # the prompts are the front end's input boxes
    assert "\n42\n" in text and re.search(
        r"^> Cell In\[\d+\]\(9\)train\(\)\n-> inner\(x \+ 1\)\n41\n", text, re.M
    )
    assert re.search(r"^  Cell In\[\d+\]\(7\)inner\(\)\n-> +raise", text, re.M), text  # where: both frames
    assert "/tmp/ipykernel" not in text, text
    assert len(in_pdb["ranks"]) == 1, in_pdb  # rank 0 was stopped before pdb opened
    reply = seen["reply"]
    assert reply["status"] == "error" and reply["ename"] == "LaunchFailedError", reply
    assert "rank one broke at 42" in reply["evalue"] and "no debugger" not in reply["evalue"], reply
    assert kernel_children(km) == []
    assert seconds < 30, seconds

    # A front end that does not answer input requests: no hang, the rank ends, the error says why.
    started = time.monotonic()
    seen = converse(kc, LAUNCH, [], allow_stdin=False)
    reply = seen["reply"]
    assert reply["ename"] == "LaunchFailedError" and not seen["prompts"], seen
    assert re.search(
        r"pdb=True, but no debugger was opened on rank 1: this front end does not answer input requests "
        r"\(StdinNotImplementedError",
        reply["evalue"],
    ), reply["evalue"]
    assert kernel_children(km) == []
    assert time.monotonic() - started < 30

    # Interrupting the kernel at pdb's prompt ends the launch, every rank with it.
    def interrupt(n):
        km.interrupt_kernel()
        return True

    seen = converse(kc, LAUNCH, [], on_prompt=interrupt)
    assert seen["reply"]["ename"] == "KeyboardInterrupt" and len(seen["prompts"]) == 1, seen
    assert kernel_children(km) == []


@pytest.mark.timeout(180)
def test_the_cell_magic_takes_pdb_and_a_session_points_to_its_own_debugger(kernel):
    km, kc = kernel
    assert run(kc, "%load_ext notebook_accel")["reply"]["status"] == "ok"
    cell = "%%accelerate --pdb -n 2 --cpu\nimport os\nx = 41\nif os.environ['RANK'] == '1':\n    y = x + 1\n    raise ValueError(y)\n"
    seen = converse(kc, cell, ["p y", "q"])
    assert seen["prompts"] == ["(Pdb) "] * 2, seen
    text = without_sink_lines(seen["text"])
    assert re.search(r"^> Cell In\[\d+\]\(5\)<module>\(\)\n-> +raise ValueError\(y\)\n42\n", text, re.M), seen
    assert seen["reply"]["ename"] == "CellFailedError", seen["reply"]
    assert kernel_children(km) == []

    assert run(kc, "%accelerate start -n 2 --cpu", timeout=120)["reply"]["status"] == "ok"
    reply = run(kc, "%%accelerate --pdb\nx = 1")["reply"]
    assert reply["ename"] == "UsageError" and "%accelerate debug RANK" in reply["evalue"], reply
    assert run(kc, "%accelerate stop")["reply"]["status"] == "ok"
