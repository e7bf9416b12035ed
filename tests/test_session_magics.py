"""Interactive sessions from a real kernel: %accelerate start/status/push/pull/auto/restart/stop and
%%accelerate cells on live workers, driven over the kernel's own protocol (jupyter_client)."""

from __future__ import annotations

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


@pytest.mark.timeout(120)
def test_workers_die_with_the_kernel(kernel):
    km, kc = kernel
    ok(kc, "%load_ext notebook_accel\n%accelerate start -n 2")
    pids = worker_pids(kc)
    assert len(pids) == 2
    km.shutdown_kernel(now=True)  # the kernel is killed, not asked
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"workers outlived their kernel: {pids}"
        time.sleep(0.05)


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
