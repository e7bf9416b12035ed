"""The kernel end of the JupyterLab extension: the "notebook_accel" comm, driven from a real kernel's
client as the front end would (open, hello, launch events, stop, refresh)."""

from __future__ import annotations

import time
import uuid

import pytest
from kernels import run

# %load_ext registers the comm target; launches then feed open comms.
SETUP = "%load_ext notebook_accel\nfrom notebook_accel.jupyter import comm as _nacc_comm"
CELL = """%%accelerate -n 2 --port auto
import os
for i in range(30):
    print("rank", os.environ["RANK"], "line", i)
"""
LONG_CELL = """%%accelerate -n 2 --port auto
import os, time
open(os.path.join({folder!r}, "started-" + os.environ["RANK"]), "w").close()
time.sleep(60)
"""


def open_comm(kc, timeout: float = 30.0) -> tuple:
    """Open a comm to the kernel's target like the extension does; returns (comm_id, hello)."""
    comm_id = uuid.uuid4().hex
    kc.shell_channel.send(
        kc.session.msg("comm_open", {"comm_id": comm_id, "target_name": "notebook_accel", "data": {}})
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == comm_id:
            return comm_id, msg["content"]["data"]
    raise AssertionError("no hello from the kernel")


def send(kc, comm_id: str, data: dict) -> None:
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data}))


def execute(kc, code: str, comm_id: str, timeout: float = 90.0, on_data=None) -> tuple:
    """Run `code`; returns (execute_reply content, [comm data sent to `comm_id` meanwhile])."""
    msg_id = kc.execute(code)
    received: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.2)
        except Exception:
            msg = None
        if msg is not None:
            content = msg["content"]
            if msg["msg_type"] == "comm_msg" and content["comm_id"] == comm_id:
                received.append(content["data"])
            elif (
                msg["msg_type"] == "status"
                and content["execution_state"] == "idle"
                and msg["parent_header"].get("msg_id") == msg_id
            ):
                return kc.get_shell_msg(timeout=10)["content"], received
        if on_data is not None:
            on_data(received)
    raise AssertionError(f"cell did not finish in {timeout} s; comm got {received[-5:]}")


def wired(kc) -> str:
    assert run(kc, SETUP)["reply"]["status"] == "ok"
    comm_id, hello = open_comm(kc)
    assert hello["type"] == "hello"
    return comm_id, hello


@pytest.mark.timeout(180)
def test_hello_then_every_launch_event_reaches_the_comm(kernel):
    km, kc = kernel
    comm_id, hello = wired(kc)
    assert hello["hardware"]["logical_cores"] >= 1
    assert "accelerators" in hello["hardware"]
    assert hello["preview"]["error"] or dict(hello["preview"]["rows"])["Distributed type"]

    reply, received = execute(kc, CELL, comm_id)
    assert reply["status"] == "ok", reply
    events = [m for m in received if m["type"] == "event"]
    names = [m["event"] for m in events]
    assert names[0] == "LaunchStarted" and names[-1] == "LaunchFinished", names
    assert len({m["launch"] for m in events}) == 1
    assert sorted(m["rank"] for m in events if m["event"] == "RankStarted") == [0, 1]
    assert sorted(m["rank"] for m in events if m["event"] == "RankFinished") == [0, 1]
    assert events[-1]["ok"] is True and events[-1]["seconds"] > 0
    for rank in (0, 1):
        batches = [m for m in events if m["event"] == "RankOutput" and m["rank"] == rank]
        lines = [text for m in batches for _stream, text, _transient in m["lines"]]
        dropped = sum(m["dropped"] for m in batches)
        assert len(lines) + dropped == 30  # every line is either sent or counted as dropped
        assert lines[-1] == f"rank {rank} line 29"
        assert len(batches) < 30  # batched, not one message a line
        done = next(i for i, m in enumerate(events) if m["event"] == "RankFinished" and m["rank"] == rank)
        assert events.index(batches[-1]) < done  # a rank's lines arrive before its end

    # A second launch gets a new id; a refresh answers with a new hello.
    _, again = execute(kc, CELL, comm_id)
    assert {m["launch"] for m in again if m["type"] == "event"} == {events[0]["launch"] + 1}
    send(kc, comm_id, {"type": "refresh"})
    _, after = execute(kc, "1", comm_id, timeout=30)
    deadline = time.monotonic() + 10
    while not any(m["type"] == "hello" for m in after) and time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=10)
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == comm_id:
            after.append(msg["content"]["data"])
    assert any(m["type"] == "hello" for m in after)


@pytest.mark.timeout(180)
def test_stop_from_the_comm_reaches_the_busy_kernel_and_stops_the_cell(kernel, tmp_path):
    km, kc = kernel
    comm_id, _ = wired(kc)
    stopped = []

    def stop_once_started(received):
        if not stopped and all((tmp_path / f"started-{r}").exists() for r in (0, 1)):
            send(kc, comm_id, {"type": "stop"})
            stopped.append(time.monotonic())

    reply, received = execute(kc, LONG_CELL.format(folder=str(tmp_path)), comm_id, on_data=stop_once_started)
    assert stopped, "the ranks never started"
    assert reply["status"] == "error" and "stopped from the JupyterLab extension" in reply["evalue"], reply
    assert time.monotonic() - stopped[0] < 15  # far below the ranks' 60 s sleep
    finished = [m for m in received if m.get("event") == "LaunchFinished"]
    assert finished and finished[0]["ok"] is False
    assert finished[0]["stopped"] == "stopped from the JupyterLab extension"
    assert "4" in run(kc, "print(2 + 2)")["text"]


@pytest.mark.timeout(120)
def test_no_comm_no_sink_and_closed_comms_are_forgotten(kernel):
    km, kc = kernel
    assert run(kc, SETUP)["reply"]["status"] == "ok"
    assert "[]" in run(kc, "print(_nacc_comm.active_sinks())")["text"]
    comm_id, _ = open_comm(kc)
    assert "CommSink" in run(kc, "print(_nacc_comm.active_sinks())")["text"]
    kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": comm_id, "data": {}}))
    deadline = time.monotonic() + 10
    while "[]" not in run(kc, "print(_nacc_comm.active_sinks())")["text"]:
        assert time.monotonic() < deadline, "the closed comm is still listed"
        time.sleep(0.1)
