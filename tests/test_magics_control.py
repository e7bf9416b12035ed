"""Stopping a %%accelerate cell from outside, in a real kernel driven over its own protocol:
the kernel's interrupt, and the launch panel's Stop button clicked while the cell is busy."""

from __future__ import annotations

import time

import pytest
from kernels import kernel_children, run

LONG_CELL = """%%accelerate -n 2 --port auto
import os, time
open(os.path.join({folder!r}, "started-" + os.environ["RANK"]), "w").close()
time.sleep(60)
open(os.path.join({folder!r}, "finished-" + os.environ["RANK"]), "w").close()
"""


@pytest.mark.timeout(120)
def test_interrupting_the_kernel_stops_every_rank_and_the_kernel_goes_on(kernel, tmp_path):
    km, kc = kernel
    assert run(kc, "%load_ext notebook_accel")["reply"]["status"] == "ok"
    interrupted = []

    def interrupt_once_started(seen):
        if not interrupted and all((tmp_path / f"started-{r}").exists() for r in (0, 1)):
            km.interrupt_kernel()
            interrupted.append(time.monotonic())

    seen = run(kc, LONG_CELL.format(folder=str(tmp_path)), on_message=interrupt_once_started)
    assert interrupted, "the ranks never started"
    assert seen["reply"]["status"] == "error" and seen["reply"]["ename"] == "KeyboardInterrupt"
    deadline = time.monotonic() + 5
    while kernel_children(km) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kernel_children(km) == []
    assert not list(tmp_path.glob("finished-*"))
    assert "4" in run(kc, "print(2 + 2)")["text"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kernel", ["1"], indirect=True)
def test_stop_button_click_reaches_the_busy_kernel_and_stops_the_cell(kernel, tmp_path):
    km, kc = kernel
    assert run(kc, "%load_ext notebook_accel")["reply"]["status"] == "ok"
    clicked = []

    def click_stop_once_started(seen):
        if clicked or not all((tmp_path / f"started-{r}").exists() for r in (0, 1)):
            return
        stops = [cid for cid, state in seen["comms"].items() if "nacc-stop" in state.get("_dom_classes", ())]
        if not stops:  # its comm_open may still be on the way: look again at the next message
            return
        click = {"comm_id": stops[0], "data": {"method": "custom", "content": {"event": "click"}}}
        kc.shell_channel.send(kc.session.msg("comm_msg", click))
        clicked.append(time.monotonic())

    seen = run(kc, LONG_CELL.format(folder=str(tmp_path)), on_message=click_stop_once_started)
    assert clicked, f"the ranks never started, or the launch panel has no Stop button: {seen['comms']}"
    assert seen["reply"]["status"] == "error" and seen["reply"]["ename"] == "CellStoppedError", seen["reply"]
    assert "stopped from the launch panel" in seen["reply"]["evalue"]
    statuses = " ".join(str(s.get("value", "")) for s in seen["comms"].values())
    assert 'data-status="stopped"' in statuses  # the panel shows it
    assert not list(tmp_path.glob("finished-*"))
    assert "4" in run(kc, "print(2 + 2)")["text"]
