"""`%accelerate debug RANK`: pdb on a session rank's failed cell, inside the notebook, driven through a
real kernel whose input() requests are answered on the stdin channel (as a front end does)."""

from __future__ import annotations

import re
import time

import pytest
from kernels import converse, run

FAILING_CELL = """%%accelerate
import os
rank = int(os.environ["RANK"])
x = 41
def inner():
    if rank == 1:
        y = x + 1
        raise ValueError(f"rank one broke at {y}")
inner()
"""


def ok(kc, code: str, **kw) -> dict:
    seen = run(kc, code, **kw)
    assert seen["reply"]["status"] == "ok", (code, seen["reply"], seen["text"])
    return seen


def usage_error(kc, code: str) -> str:
    seen = converse(kc, code, [])
    assert seen["reply"]["status"] == "error" and seen["reply"]["ename"] == "UsageError", seen
    assert not seen["prompts"], seen
    return seen["reply"]["evalue"]


@pytest.mark.timeout(180)
def test_debug_a_failed_rank_then_the_session_goes_on(kernel):
    km, kc = kernel
    ok(kc, "%load_ext notebook_accel")
    assert "no session is running" in usage_error(kc, "%accelerate debug 1")
    ok(kc, "%accelerate start -n 2 --cpu", timeout=120)
    assert "rank 0 has no failed cell to debug (it has run no cell yet)" in usage_error(
        kc, "%accelerate debug 0"
    )
    assert "rank one broke at 42" in run(kc, FAILING_CELL)["reply"]["evalue"]

    started = time.monotonic()
    seen = converse(kc, "%accelerate debug 1", ["p y", "pp locals()", "up", "p x", "where", "q"])
    seconds = time.monotonic() - started
    assert seen["reply"]["status"] == "ok", seen
    assert seen["prompts"] == ["(Pdb) "] * 6, seen
    text = seen["text"]
    # The frame pdb opens on: the cell's, labelled as IPython labels it, with its source line.
    assert re.search(r"^> Cell In\[\d+\]\(7\)inner\(\)\n-> +raise ValueError", text, re.M), text
    assert "\n42\n{'y': 42}\n" in text, text  # p y and pp locals() in inner()
    assert re.search(r"^> Cell In\[\d+\]\(8\)<module>\(\)\n-> inner\(\)\n41\n", text, re.M), text  # up, p x
    where = text[text.rindex("> Cell In") :]
    assert re.search(r"^  Cell In\[\d+\]\(7\)inner\(\)\n-> +raise", where, re.M), text  # where: both frames
    assert "/tmp/ipykernel" not in text, text
    assert seconds < 20, seconds

    # The worker kept its state; the next cell runs on every rank.
    text = ok(kc, "%%accelerate\nprint('x is', x)")["text"]
    assert "[rank 0] x is 41" in text and "[rank 1] x is 41" in text, text
    # That cell ran without error everywhere: nothing to debug. Bad ranks are named with the range.
    assert "rank 1 has no failed cell to debug (its last cell ran without error)" in usage_error(
        kc, "%accelerate debug 1"
    )
    assert "rank 7 does not exist; the session's ranks are 0..1" in usage_error(kc, "%accelerate debug 7")
    assert "one rank number" in usage_error(kc, "%accelerate debug one")
    assert "name one" in usage_error(kc, "%accelerate debug")
    ok(kc, "%accelerate stop")


@pytest.mark.timeout(180)
def test_an_interrupt_or_a_front_end_without_input_ends_the_debugger(kernel):
    km, kc = kernel
    ok(kc, "%load_ext notebook_accel\n%accelerate start -n 2 --cpu", timeout=120)
    run(kc, FAILING_CELL)

    def interrupt(n):
        km.interrupt_kernel()
        return True

    # No rank named: the first rank the last cell failed on. An interrupt at the prompt ends pdb.
    seen = converse(kc, "%accelerate debug", [], on_prompt=interrupt)
    assert seen["reply"]["ename"] == "DebuggerInterrupted", seen
    assert seen["reply"]["traceback"] == [
        "DebuggerInterrupted: the debugger on rank 1 ended; the worker keeps its state"
    ]
    assert "rank 1, the first rank" in seen["text"] and "rank one broke" in seen["text"], seen

    # An interrupt while pdb runs a command: the command stops, then pdb ends.
    def sleep_then_interrupt(n):
        kc.input("import time; time.sleep(60)")
        time.sleep(1.5)
        km.interrupt_kernel()
        return True

    started = time.monotonic()
    seen = converse(kc, "%accelerate debug 1", [], on_prompt=sleep_then_interrupt)
    assert seen["reply"]["ename"] == "DebuggerInterrupted" and len(seen["prompts"]) == 1, seen
    assert time.monotonic() - started < 20
    # A front end that does not answer input() (nbclient): said, and the worker leaves pdb.
    seen = converse(kc, "%accelerate debug 1", [], allow_stdin=False)
    assert seen["reply"]["ename"] == "UsageError" and "does not answer input()" in seen["reply"]["evalue"], (
        seen
    )
    # Each time the worker left pdb: it debugs the same failure again, then runs cells as usual.
    seen = converse(kc, "%accelerate debug 1", ["p x", "c"])
    assert seen["reply"]["status"] == "ok" and "\n41\n" in seen["text"], seen
    text = ok(kc, "%%accelerate\nprint('last', x)")["text"]
    assert "[rank 0] last 41" in text and "[rank 1] last 41" in text, text
    ok(kc, "%accelerate stop")


@pytest.mark.timeout(120)
def test_session_debug_api_ends_pdb_whatever_happens():
    from notebook_accel.session import Session, SessionError

    source = FAILING_CELL.split("\n", 1)[1]
    with Session(2, cpu=True) as session:
        assert not session.run_cell(source)[1].ok
        out = []

        def lines(*answers):
            pending = list(answers)

            def read_line(prompt):
                assert prompt == "(Pdb) "
                if not pending:
                    raise EOFError  # the end of input quits pdb
                answer = pending.pop(0)
                return answer() if callable(answer) else answer

            return read_line

        session.debug(1, lines("p y"), out.append)
        assert "42\n" in out

        # Whatever the reader raises ends the worker's pdb first: the same failure can be debugged again.
        def front_end_gone():
            raise RuntimeError("front end gone")

        with pytest.raises(RuntimeError, match="front end gone"):
            session.debug(1, lines(front_end_gone), out.append)
        out.clear()
        session.debug(1, lines("p x"), out.append)
        assert "41\n" in out
        # A cell sent to a rank waiting in pdb ends pdb, then runs (its failure is gone with it).
        with pytest.raises(SessionError, match="rank 1 is not in the debugger"):
            session.debug(1, lines(lambda: session.run_cell("z = x + 1", ranks=[1]) and "p z"), out.append)
        assert session.pull("z", rank=1) == 42
        with pytest.raises(SessionError, match="its last cell ran without error"):
            session.debug(1, lines(), out.append)
        # A cell that did not compile has no frame to debug; a rank that does not exist is named.
        assert not session.run_cell("def broken(:", ranks=[1])[1].ok
        with pytest.raises(SessionError, match=r"rank 1's last cell failed before it ran \(SyntaxError"):
            session.debug(1, lines(), out.append)
        with pytest.raises(ValueError, match=r"rank 5 does not exist; the session's ranks are 0\.\.1"):
            session.debug(5, lines(), out.append)
