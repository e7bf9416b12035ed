"""Interactive sessions from a real kernel: %accelerate start/status/push/pull/auto/restart/stop and
%%accelerate cells on live workers, driven over the kernel's own protocol (jupyter_client)."""

from __future__ import annotations

import queue
import re
import time

import psutil
import pytest
from kernels import alive, kernel_children, run


def ok(kc, code: str, **kw) -> dict:
    seen = run(kc, code, **kw)
    assert seen["reply"]["status"] == "ok", (code, seen["reply"], seen["text"])
    return seen


def failed(kc, code: str, ename: str, **kw) -> dict:
    seen = run(kc, code, **kw)
    assert seen["reply"]["status"] == "error" and seen["reply"]["ename"] == ename, (code, seen["reply"])
    return seen


def worker_pids(kc) -> list:
    text = ok(kc, "%accelerate status")["text"]
    return [int(line.split()[1]) for line in text.splitlines()[1:] if line.split() and line.split()[0].isdigit()]


@pytest.mark.timeout(180)
def test_state_subsets_push_pull_errors_auto_and_stop(kernel):
    km, kc = kernel
    ok(kc, "%load_ext notebook_accel\nbase = 100")
    assert "2 workers" in ok(kc, "%accelerate start -n 2")["text"]
    # The first cell right after start; the process group is up; state persists.
    text = ok(kc, "%%accelerate\nimport os, torch, torch.distributed as dist\nx = torch.tensor([float(dist.get_rank())])\n"
                  "dist.all_reduce(x)\nprint('a', 1)\nprint('sum', x.item())")["text"]  # fmt: skip
    assert "[rank 0] a 1\n" in text and "[rank 1] sum 1.0" in text
    text = ok(kc, "%%accelerate --ranks 1:\nprint('kept', x.item(), 'on', os.environ['RANK'])")["text"]
    assert "[rank 1] kept 1.0 on 1" in text and "[rank 0]" not in text
    ok(kc, "%accelerate push base --ranks 0")
    assert "[rank 0] base 100" in ok(kc, "%%accelerate --ranks 0\nprint('base', base)")["text"]
    ok(kc, "%%accelerate\nmine = [dist.get_rank()] * 3")
    ok(kc, "%accelerate pull mine --rank 1")
    assert "PULLED [1, 1, 1]" in ok(kc, "print('PULLED', mine)")["text"]
    assert "nowhere" in failed(kc, "%accelerate pull nowhere", "UsageError")["reply"]["evalue"]
    # An error on one rank: its traceback with the cell's line; the other rank ran; the session goes on.
    seen = failed(kc, "%%accelerate\nif dist.get_rank() == 1:\n    raise ValueError('rank one broke')\nprint('fine')",
                  "SessionCellError")  # fmt: skip
    assert "rank 1 raised ValueError: rank one broke" in seen["reply"]["evalue"]
    assert "Cell In[" in seen["reply"]["evalue"] and "raise ValueError('rank one broke')" in seen["reply"]["evalue"]
    assert "[rank 0] fine" in seen["text"]
    assert "[rank 1] again" in ok(kc, "%%accelerate\nprint('again')")["text"]
    # Rank 0's value and figure come back as rich output in the cell.
    displays = ok(kc, "%%accelerate\nimport matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\n"
                      "dist.get_rank() + 41")["displays"]  # fmt: skip
    assert any("image/png" in d for d in displays), displays
    assert any(d.get("text/plain") == "41" for d in displays), displays
    # Auto mode routes plain cells to the workers, magics stay in the kernel.
    ok(kc, "%accelerate auto on")
    assert "[rank 1] auto 2" in ok(kc, "y = dist.get_rank() + 1\nprint('auto', y)")["text"]
    ok(kc, "%accelerate auto off")
    assert ok(kc, "print('local', 'y' in globals())")["text"] == "local False\n"
    # A launch option while a session runs is refused with the way out.
    assert "stop first" in run(kc, "%%accelerate -n 2\npass")["text"]
    pids = worker_pids(kc)
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    assert "session stopped" in ok(kc, "%accelerate stop")["text"]
    assert kernel_children(km) == []
    assert "no session" in ok(kc, "%accelerate status")["text"]


@pytest.mark.timeout(180)
def test_interrupt_and_timeout_stop_the_cell_not_the_session(kernel):
    km, kc = kernel
    ok(kc, "%load_ext notebook_accel\n%accelerate start -n 2")
    ok(kc, "%%accelerate\nkept = 7")
    interrupted = []

    def interrupt_when_running(seen):
        if not interrupted and "sleeping" in seen["text"]:
            km.interrupt_kernel()
            interrupted.append(time.monotonic())

    seen = failed(kc, "%%accelerate\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)", "KeyboardInterrupt",
                  on_message=interrupt_when_running)  # fmt: skip
    assert interrupted, "the cell never started"
    assert "[rank 1] kept 7" in ok(kc, "%%accelerate\nprint('kept', kept)")["text"]
    seen = failed(kc, "%%accelerate --timeout 1\nimport time\ntime.sleep(60)", "SessionCellTimeout")
    assert "timed out after 1 s" in seen["reply"]["evalue"]
    assert "[rank 0] still 7" in ok(kc, "%%accelerate\nprint('still', kept)")["text"]
    ok(kc, "%accelerate stop")


@pytest.mark.timeout(180)
def test_a_killed_worker_is_reported_and_restart_brings_the_session_back(kernel):
    km, kc = kernel
    ok(kc, "%load_ext notebook_accel\n%accelerate start -n 2")
    seen = failed(kc, "%%accelerate --ranks 1\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "SessionCellError")
    assert "rank 1 was killed by SIGKILL" in seen["reply"]["evalue"]
    assert "dead (SIGKILL)" in ok(kc, "%accelerate status")["text"]
    ok(kc, "%accelerate restart")
    text = ok(kc, "%%accelerate\nimport torch.distributed as dist\nprint('back', dist.get_world_size())")["text"]
    assert "[rank 1] back 2" in text
    ok(kc, "%accelerate stop")


def warm_server(processes: list, pids: list) -> psutil.Process:
    """The warm forkserver (launch/warm.py) among `processes`: the parent of forkserver ranks."""
    parents = {psutil.Process(pid).ppid() for pid in pids}
    found = [p for p in processes if p.pid in parents and p.pid not in pids]
    assert len(found) == 1 and "notebook_accel.launch.warm" in " ".join(found[0].cmdline()), (parents, processes)
    return found[0]


def start_a_busy_cell(kc, timeout: float = 60.0) -> None:
    """Send a cell that keeps both workers busy; return once both said they are (the cell goes on)."""
    msg_id = kc.execute("%%accelerate\nimport time\nprint('busy', flush=True)\ntime.sleep(600)")
    text, deadline = "", time.monotonic() + timeout
    while not ("[rank 0] busy" in text and "[rank 1] busy" in text):
        assert time.monotonic() < deadline, f"the cell did not start: {text!r}"
        try:
            msg = kc.get_iopub_msg(timeout=0.2)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            text += msg["content"]["text"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
@pytest.mark.parametrize("end", ["kill", "shutdown", "restart"])
def test_workers_die_with_the_kernel(kernel, end, start_method):
    """Killed in the middle of a cell (a crash: the workers are busy, their channel is no lifeline),
    or asked to shut down or restart while idle: no worker, and no warm server, is left."""
    km, kc = kernel
    ok(kc, f"%load_ext notebook_accel\n%accelerate start -n 2 --start-method {start_method}", timeout=180)
    pids = worker_pids(kc)
    assert len(pids) == 2 and all(alive(p) for p in pids)
    processes = kernel_children(km, helpers=True)  # the workers, the warm server, whatever they started
    assert set(pids) <= {p.pid for p in processes}, (pids, processes)
    if start_method == "forkserver":
        assert warm_server(processes, pids) in processes
    old_kernel = km.provisioner.pid
    if end == "kill":
        start_a_busy_cell(kc)
        km.shutdown_kernel(now=True)  # the kernel is killed, not asked
    elif end == "shutdown":
        km.shutdown_kernel(now=False)  # asked: a shutdown request, the kernel exits by itself
    else:
        km.restart_kernel(now=False)  # asked to shut down, then a new kernel starts
        assert km.provisioner.pid != old_kernel
    deadline = time.monotonic() + 15
    while any(alive(p) for p in processes):
        left = [p.pid for p in processes if alive(p)]
        assert time.monotonic() < deadline, f"processes outlived their kernel ({end}, {start_method}): {left}"
        time.sleep(0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kernel", ["1"], indirect=True)
def test_session_cell_output_goes_to_its_own_launch_panel(kernel):
    km, kc = kernel
    ok(kc, "%load_ext notebook_accel\n%accelerate start -n 2")
    seen = ok(kc, "%%accelerate --ranks 1\nprint('into the panel')")
    assert "[rank" not in seen["text"]  # no console text: the panel has it
    values = " ".join(str(state.get("value", "")) for state in seen["comms"].values())
    assert "into the panel" in values and 'data-rank="1" data-status="done"' in values
    assert 'data-rank="0"' not in values  # only the ranks the cell ran on
    ok(kc, "%accelerate stop")


@pytest.mark.timeout(180)
def test_each_failing_rank_shows_its_own_traceback(kernel):
    km, kc = kernel
    ok(kc, "%load_ext notebook_accel\n%accelerate start -n 2")
    cell = ("%%accelerate\nimport torch.distributed as dist\nrank = dist.get_rank()\nif rank == 0:\n"
            "    raise KeyError('zero went wrong')\nif rank == 1:\n    {}.pop('one went wrong')\n")  # fmt: skip
    evalue = failed(kc, cell, "SessionCellError")["reply"]["evalue"]
    assert "rank 0 raised KeyError: 'zero went wrong'" in evalue
    assert "rank 1 raised KeyError: 'one went wrong'" in evalue
    # Each rank's traceback under its own header, with its own line of the cell, labelled as IPython does.
    assert evalue.count("Traceback from rank 0:") == 1 and evalue.count("Traceback from rank 1:") == 1
    zero, one = evalue.split("Traceback from rank 0:")[1].split("Traceback from rank 1:")
    assert "Cell In[" in zero and ", line 4" in zero and "raise KeyError('zero went wrong')" in zero
    assert "{}.pop('one went wrong')" not in zero
    assert "Cell In[" in one and ", line 6" in one and "{}.pop('one went wrong')" in one
    assert "raise KeyError('zero went wrong')" not in one
    # The same error on both ranks: one traceback, both ranks named.
    evalue = failed(kc, "%%accelerate\nraise ValueError('everyone')", "SessionCellError")["reply"]["evalue"]
    assert "rank 0 raised ValueError: everyone" in evalue and "rank 1 raised ValueError: everyone" in evalue
    assert "Traceback from ranks 0, 1:" in evalue and evalue.count("raise ValueError('everyone')") == 1
    assert "[rank 1] still here 1" in ok(kc, "%%accelerate\nprint('still here', rank)")["text"]
    ok(kc, "%accelerate stop")


def status_rows(kc) -> dict:
    """rank -> its `%accelerate status` line."""
    lines = ok(kc, "%accelerate status")["text"].splitlines()
    assert lines[0].split() == ["rank", "pid", "state", "device", "memory"], lines
    return {int(line.split()[0]): line for line in lines[1:] if line.split() and line.split()[0].isdigit()}


@pytest.mark.timeout(240)
def test_start_with_forkserver_and_bf16(kernel):
    km, kc = kernel
    ok(kc, "%load_ext notebook_accel")
    text = ok(kc, "%accelerate start -n 2 --start-method forkserver --mixed-precision bf16", timeout=180)["text"]
    assert "session started: 2 workers (forkserver)" in text
    text = ok(kc, "%%accelerate\nfrom notebook_accel import Accelerator, PartialState\n"
                  "print('precision', Accelerator().mixed_precision, 'of', PartialState().num_processes)")["text"]  # fmt: skip
    assert "[rank 0] precision bf16 of 2\n" in text and "[rank 1] precision bf16 of 2\n" in text
    rows = status_rows(kc)
    assert sorted(rows) == [0, 1]
    for rank, line in rows.items():  # rank, pid, state, device, memory ("123 MiB")
        assert re.fullmatch(rf"\s*{rank}\s+\d+\s+idle\s+cpu\s+[1-9]\d* MiB", line), line
    assert "session stopped" in ok(kc, "%accelerate stop")["text"]


@pytest.mark.timeout(180)
def test_start_with_fsdp_shards_in_the_workers(kernel):
    km, kc = kernel
    ok(kc, "%load_ext notebook_accel")
    text = ok(kc, "%accelerate start -n 2 --fsdp", timeout=120)["text"]
    assert "session started: 2 workers (fork, FSDP on)" in text
    text = ok(kc, "%%accelerate\nimport torch\nfrom notebook_accel import Accelerator\nacc = Accelerator()\n"
                  "m = acc.prepare(torch.nn.Linear(4, 6))\n"
                  "print('kind', acc.distributed_type, tuple(m.weight.to_local().shape))")["text"]  # fmt: skip
    assert "[rank 0] kind FSDP (3, 4)\n" in text and "[rank 1] kind FSDP (3, 4)\n" in text, text
    # A fresh launch's option while the session runs is refused, naming it.
    seen = failed(kc, "%%accelerate --fsdp\npass", "UsageError")
    assert "--fsdp" in str(seen["reply"]["evalue"]) and "%accelerate stop first" in str(seen["reply"]["evalue"])
    assert "session stopped" in ok(kc, "%accelerate stop")["text"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_worker_that_exits_is_reported_with_its_exit_code(kernel, start_method):
    km, kc = kernel
    ok(kc, f"%load_ext notebook_accel\n%accelerate start -n 2 --start-method {start_method}", timeout=180)
    seen = failed(kc, "%%accelerate\nimport os, torch.distributed as dist\nif dist.get_rank() == 1:\n"
                      "    os._exit(3)\nprint('rank 0 went on')", "SessionCellError")  # fmt: skip
    evalue = seen["reply"]["evalue"]
    assert "worker died: rank 1 exited with code 3." in evalue and "rank 0 exited" not in evalue
    rows = status_rows(kc)
    assert re.fullmatch(r"\s*1\s+\d+\s+dead \(exit code 3\)\s+cpu\s+-", rows[1]), rows[1]
    assert "dead" not in rows[0]
    ok(kc, "%accelerate restart", timeout=180)
    assert "[rank 1] back" in ok(kc, "%%accelerate\nprint('back')")["text"]
    ok(kc, "%accelerate stop")


@pytest.mark.timeout(180)
def test_a_cell_longer_than_the_interrupt_grace_and_fd_level_output(kernel):
    from notebook_accel.session.manager import INTERRUPT_GRACE_S

    km, kc = kernel
    ok(kc, "%load_ext notebook_accel\n%accelerate start -n 2")
    # No reply has a time limit: a cell that outlasts every internal wait still answers, with its output.
    seen = ok(kc, f"%%accelerate\nimport time\nprint('going to sleep')\ntime.sleep({INTERRUPT_GRACE_S + 2:g})\n"
                  "print('awake again')", timeout=150)  # fmt: skip
    for rank in (0, 1):
        assert f"[rank {rank}] going to sleep\n" in seen["text"] and f"[rank {rank}] awake again\n" in seen["text"]
    # Writes to the fds and C-level stdio arrive, the last one without a newline (flushed at the cell's end).
    # libc's stdout gets a real buffer first (_IOFBF), as it has where PYTHONUNBUFFERED is not set,
    # so the tail stays in it until the worker flushes libc.
    seen = ok(kc, "%%accelerate --ranks 1\nimport os, ctypes\nos.write(1, b'fd one\\n')\nos.write(2, b'fd two\\n')\n"
                  "libc, c_buffer = ctypes.CDLL(None), ctypes.create_string_buffer(1 << 16)\n"
                  "libc.setvbuf(ctypes.c_void_p.in_dll(libc, 'stdout'), c_buffer, 0, len(c_buffer))\n"
                  "libc.printf(b'c-level tail')\nNone")  # fmt: skip
    for line in ("[rank 1] fd one\n", "[rank 1] fd two\n", "[rank 1] c-level tail"):
        assert line in seen["text"], seen["text"]
    assert "[rank 0]" not in seen["text"]
    ok(kc, "%accelerate stop")
