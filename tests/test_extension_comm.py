"""The kernel end of the JupyterLab extension: the "notebook_accel" comm, driven from a real kernel's
client as the front end would (open, hello, launch events, stop, refresh)."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from kernels import reply_to, run
from panel_targets import FakeComm

from notebook_accel.jupyter import comm
from notebook_accel.launch import events as ev
from notebook_accel.launch import stall, watch_probe

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
                return reply_to(kc, msg_id), received
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
    # Each rank's peak RSS (the kernel's, from wait4) travels with its end, in bytes.
    assert all(m["peak_rss"] > 1 << 20 for m in events if m["event"] == "RankFinished"), events
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


@pytest.mark.timeout(120)
def test_hello_carries_the_config_files_launch_defaults(kernel, tmp_path):
    km, kc = kernel
    comm_id, hello = wired(kc)
    # conftest points NOTEBOOK_ACCEL_CONFIG_FILE at a missing file: no defaults, no error.
    assert hello["config"] == {"file": None, "num_processes": None, "mixed_precision": None}
    assert "config_error" not in hello

    config = tmp_path / "accel.yaml"
    config.write_text("num_processes: 3\nmixed_precision: bf16\n")
    code = f"import os; os.environ['NOTEBOOK_ACCEL_CONFIG_FILE'] = {str(config)!r}"
    assert run(kc, code)["reply"]["status"] == "ok"
    _, hello = open_comm(kc)  # a new comm's hello reads the file now
    assert hello["config"] == {"file": str(config), "num_processes": 3, "mixed_precision": "bf16"}
    assert dict(hello["preview"]["rows"])["Processes"] == "3"  # the preview reads the same file

    config.write_text("num_processes: 3\n")  # no mixed_precision: the config's default
    _, hello = open_comm(kc)
    assert hello["config"]["num_processes"] == 3 and hello["config"]["mixed_precision"] == "no"

    config.write_text("num_processes: many\n")  # a broken file: still a hello, and the reason
    _, hello = open_comm(kc)
    assert hello["config"] == {"file": None, "num_processes": None, "mixed_precision": None}
    assert "num_processes" in hello["config_error"] and str(config) in hello["config_error"]
    assert hello["hardware"]["logical_cores"] >= 1


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


def comm_data(kc, comm_id: str, until, timeout: float = 60.0) -> list:
    """Comm data sent to `comm_id` until `until(received)` is true."""
    received: list = []
    deadline = time.monotonic() + timeout
    while not until(received):
        assert time.monotonic() < deadline, f"timed out; comm got {received[-5:]}"
        try:
            msg = kc.get_iopub_msg(timeout=0.2)
        except Exception:
            continue
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == comm_id:
            received.append(msg["content"]["data"])
    return received


def sessions(received: list, state: str = None) -> list:
    return [m for m in received if m["type"] == "session" and state in (None, m["state"])]


def pids(message: dict) -> list:
    return [r["pid"] for r in message["ranks"]]


SESSION_CELL = """%%accelerate
import time
open({path!r}, "w").close()
time.sleep(60)
"""


@pytest.mark.timeout(240)
def test_session_messages_restart_and_stop_session_from_the_comm(kernel, tmp_path):
    km, kc = kernel
    comm_id, hello = wired(kc)
    assert hello["session"] is None

    # %accelerate start: a session message with each rank's pid and state.
    reply, received = execute(kc, "%accelerate start -n 2", comm_id, timeout=120)
    assert reply["status"] == "ok", reply
    started = sessions(received, "running")
    assert started, received
    first = started[-1]
    assert first["workers"] == 2 and [r["rank"] for r in first["ranks"]] == [0, 1]
    assert all(r["pid"] > 0 and r["state"] == "idle" for r in first["ranks"]), first
    assert all("device" in r for r in first["ranks"])

    # A new comm's hello names the running session.
    other_id, other_hello = open_comm(kc)
    assert other_hello["session"]["id"] == first["id"]
    assert pids(other_hello["session"]) == pids(first)

    # Restart from the sidebar while the kernel is idle: restarting, then new pids.
    send(kc, comm_id, {"type": "restart"})
    received = comm_data(kc, comm_id, lambda r: any(m["type"] == "notice" for m in r), timeout=120)
    assert [m["state"] for m in sessions(received)] == ["restarting", "running"], received
    restarted = sessions(received, "running")[-1]
    assert restarted["id"] == first["id"]
    assert set(pids(restarted)).isdisjoint(pids(first)), (restarted, first)
    assert "restarted" in [m for m in received if m["type"] == "notice"][-1]["text"]
    status = run(kc, "%accelerate status")["text"]
    assert all(str(pid) in status for pid in pids(restarted)), status

    # While a cell runs on the session, restart and stop_session are refused with a notice.
    flag = tmp_path / "running"
    asked: list = []

    def ask_once_running(received):
        if not asked and flag.exists():
            send(kc, comm_id, {"type": "restart"})
            send(kc, comm_id, {"type": "stop_session"})
            asked.append(True)
        if asked and len([m for m in received if m["type"] == "notice"]) == 2 and len(asked) == 1:
            send(kc, comm_id, {"type": "stop"})  # then stop the cell (the session goes on)
            asked.append(True)

    reply, received = execute(kc, SESSION_CELL.format(path=str(flag)), comm_id, timeout=90,
                              on_data=ask_once_running)  # fmt: skip
    notices = [m for m in received if m["type"] == "notice"]
    assert len(notices) == 2 and all("while a cell runs" in n["text"] for n in notices), notices
    assert reply["status"] == "error" and "stopped from the JupyterLab extension" in reply["evalue"], reply
    after_cell = sessions(received)
    assert after_cell and after_cell[-1]["state"] == "running"
    assert pids(after_cell[-1]) == pids(restarted)  # the refused restart did not happen

    # Stop the session from the sidebar: a stopped message with the ranks it had.
    send(kc, comm_id, {"type": "stop_session"})
    received = comm_data(kc, comm_id, lambda r: bool(sessions(r, "stopped")))
    stopped = sessions(received, "stopped")[-1]
    assert stopped["id"] == first["id"] and pids(stopped) == pids(restarted)
    assert all(r["state"] == "stopped" for r in stopped["ranks"])
    assert "no session is running" in run(kc, "%accelerate status")["text"]
    _, again = open_comm(kc)
    assert again["session"] is None

    # Stopping or restarting without a session: a notice, no error.
    send(kc, comm_id, {"type": "restart"})
    received = comm_data(kc, comm_id, lambda r: any(m["type"] == "notice" for m in r))
    assert "no session is running" in [m for m in received if m["type"] == "notice"][0]["text"]
    assert "4" in run(kc, "print(2 + 2)")["text"]


def stall_report(tmp_path, seconds: float = 2.0, line: int = 2) -> stall.StallReport:
    """Rank 0 in all_reduce at line `line` of a user's file, rank 1 in barrier (no stack read)."""
    source = tmp_path / "train.py"
    source.write_text("import torch.distributed as dist\ndist.all_reduce(t)\ndist.barrier()\n")
    frame = stall.Frame(str(source), line, "step")
    all_reduce = watch_probe.Collective("all_reduce", "default", 3, ((4,),), ("Float",))
    ranks = [
        stall.RankWhere(0, "waiting", (all_reduce,), threads=(stall.Thread("Thread 0x1", (frame,)),)),
        stall.RankWhere(1, "waiting", (watch_probe.Collective("barrier", "default", 3),)),
    ]
    return stall.build(seconds, ranks)


def sent(fake: FakeComm) -> list:
    return [json.loads(m) for m in fake.messages]


@pytest.mark.timeout(30)
def test_a_rank_s_node_goes_to_the_extension(monkeypatch):
    """A Ray rank's RankStarted names its node; the extension's panel shows it beside the pid
    (extension/test/render.test.ts)."""
    page = FakeComm()
    monkeypatch.setitem(comm._comms, "page", page)
    sink = comm.CommSink()
    sink.handle(ev.LaunchStarted(num_processes=1, start_method="ray", world_size=1))
    sink.handle(ev.RankStarted(0, 31, "10.0.0.7 (a1b2c3d4)"))
    (started,) = [m for m in sent(page) if m["event"] == "RankStarted"]
    assert (started["rank"], started["pid"], started["node"]) == (0, 31, "10.0.0.7 (a1b2c3d4)")


@pytest.mark.timeout(30)
def test_a_stall_goes_with_its_sentence_and_ranks_its_text_only_when_it_changed(tmp_path, monkeypatch):
    page = FakeComm()
    monkeypatch.setitem(comm._comms, "page", page)
    sink = comm.CommSink()
    sink.handle(ev.LaunchStarted(num_processes=2, start_method="fork", world_size=2))
    for rank in (0, 1):
        sink.handle(ev.RankStarted(rank, 100 + rank))
    sink.handle(ev.RankOutput(0, "stdout", "ready"))
    report = stall_report(tmp_path)
    sink.handle(ev.LaunchStalled(report))
    messages = sent(page)
    stalled = messages[-1]
    assert stalled["event"] == "LaunchStalled" and stalled["launch"] == sink.launch
    assert messages[-2]["event"] == "RankOutput"  # the lines before it arrive first
    fields = stalled["stall"]
    assert fields["sentence"] == report.sentence and report.sentence.startswith("stalled for 2 s: ")
    assert fields["stalled"] is True and fields["seconds"] == 2.0
    doing = f"waits in all_reduce #3 (float32[4]) at {tmp_path}/train.py, line 2, in step"
    assert fields["ranks"] == [
        {"rank": 0, "state": "waiting", "doing": doing},
        {"rank": 1, "state": "waiting", "doing": "waits in barrier #3"},
    ]
    assert fields["text"] == report.text() and "dist.all_reduce(t)" in fields["text"]
    assert set(stalled) == {"type", "launch", "event", "time", "stall"}  # not the report's frames and threads
    assert sink.model.stall is report  # the panel's model folds it too

    sink.handle(ev.LaunchResumed())
    assert sent(page)[-1]["event"] == "LaunchResumed" and sent(page)[-1]["stall"] is None
    assert sink.model.stall is None

    # The same report again: its text is not sent again, unless a page opened since needs it.
    sink.handle(ev.LaunchStalled(stall_report(tmp_path)))
    assert "text" not in sent(page)[-1]["stall"] and sent(page)[-1]["stall"]["sentence"] == report.sentence
    other = FakeComm()
    monkeypatch.setitem(comm._comms, "other", other)
    sink.handle(ev.LaunchStalled(stall_report(tmp_path)))
    assert sent(other)[-1]["stall"]["text"] == report.text()
    # Another report (a longer stall, another line): its text; a huge one is cut.
    monkeypatch.setattr(comm, "STALL_TEXT", 40)
    longer = stall_report(tmp_path, seconds=9.0, line=3)
    sink.handle(ev.LaunchStalled(longer))
    fields = sent(page)[-1]["stall"]
    assert fields["sentence"].startswith("stalled for 9 s: ") and fields["seconds"] == 9.0
    assert fields["text"].startswith(longer.text()[:40]) and fields["text"].endswith(" bytes cut")
    sink.close()
