"""Stopping a %%accelerate cell from outside, in a real kernel driven over its own protocol:
the kernel's interrupt, and the launch panel's Stop button clicked while the cell is busy."""

from __future__ import annotations

import os
import time

import psutil
import pytest
from jupyter_client.manager import KernelManager

from notebook_accel.demo import _kernel_manager_class

LONG_CELL = """%%accelerate -n 2 --port auto
import os, time
open(os.path.join({folder!r}, "started-" + os.environ["RANK"]), "w").close()
time.sleep(60)
open(os.path.join({folder!r}, "finished-" + os.environ["RANK"]), "w").close()
"""


@pytest.fixture
def kernel(tmp_path, request):
    widgets = getattr(request, "param", "0")
    km: KernelManager = _kernel_manager_class()(kernel_name="python3")
    env = {**os.environ, "NOTEBOOK_ACCEL_WIDGETS": widgets, "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    km.start_kernel(env=env, extra_arguments=["--IPKernelApp.log_level=ERROR"], cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _run(kc, code: str, timeout: float = 60.0, on_message=None) -> dict:
    """Execute `code`; returns {"reply": content, "errors": [...], "comms": {id: data}, "text": str}."""
    msg_id = kc.execute(code)
    seen = {"errors": [], "comms": {}, "text": ""}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.2)
        except Exception:
            msg = None
        if msg is not None and msg["parent_header"].get("msg_id") == msg_id:
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                seen["text"] += content["text"]
            elif kind == "error":
                seen["errors"].append(content)
            elif kind == "comm_open":
                seen["comms"][content["comm_id"]] = content["data"].get("state", {})
            elif kind == "comm_msg" and content["data"].get("method") == "update":
                seen["comms"].setdefault(content["comm_id"], {}).update(content["data"].get("state", {}))
            elif kind == "status" and content["execution_state"] == "idle":
                seen["reply"] = kc.get_shell_msg(timeout=10)["content"]
                return seen
        if on_message is not None:
            on_message(seen)
    raise AssertionError(f"cell did not finish in {timeout} s: {seen}")


def _kernel_children(km) -> list:
    return [p for p in psutil.Process(km.provisioner.pid).children(recursive=True) if p.status() != "zombie"]


def _wait_for_files(folder, names, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all((folder / n).exists() for n in names):
        assert time.monotonic() < deadline, f"ranks did not start: {list(folder.iterdir())}"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_interrupting_the_kernel_stops_every_rank_and_the_kernel_goes_on(kernel, tmp_path):
    km, kc = kernel
    assert _run(kc, "%load_ext notebook_accel")["reply"]["status"] == "ok"
    interrupted = []

    def interrupt_once_started(seen):
        if not interrupted and all((tmp_path / f"started-{r}").exists() for r in (0, 1)):
            km.interrupt_kernel()
            interrupted.append(time.monotonic())

    seen = _run(kc, LONG_CELL.format(folder=str(tmp_path)), on_message=interrupt_once_started)
    assert interrupted, "the ranks never started"
    assert seen["reply"]["status"] == "error" and seen["reply"]["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - interrupted[0] < 15  # far below the ranks' 60 s sleep
    deadline = time.monotonic() + 5
    while _kernel_children(km) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kernel_children(km) == []
    assert not list(tmp_path.glob("finished-*"))
    assert "4" in _run(kc, "print(2 + 2)")["text"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kernel", ["1"], indirect=True)
def test_stop_button_click_reaches_the_busy_kernel_and_stops_the_cell(kernel, tmp_path):
    km, kc = kernel
    assert _run(kc, "%load_ext notebook_accel")["reply"]["status"] == "ok"
    clicked = []

    def click_stop_once_started(seen):
        if clicked or not all((tmp_path / f"started-{r}").exists() for r in (0, 1)):
            return
        stops = [cid for cid, state in seen["comms"].items() if "nacc-stop" in state.get("_dom_classes", ())]
        assert stops, "the launch panel has no Stop button"
        click = {"comm_id": stops[0], "data": {"method": "custom", "content": {"event": "click"}}}
        kc.shell_channel.send(kc.session.msg("comm_msg", click))
        clicked.append(time.monotonic())

    seen = _run(kc, LONG_CELL.format(folder=str(tmp_path)), on_message=click_stop_once_started)
    assert clicked, "the ranks never started"
    assert seen["reply"]["status"] == "error" and seen["reply"]["ename"] == "CellStoppedError", seen["reply"]
    assert "stopped from the launch panel" in seen["reply"]["evalue"]
    assert time.monotonic() - clicked[0] < 15
    statuses = " ".join(str(s.get("value", "")) for s in seen["comms"].values())
    assert 'data-status="stopped"' in statuses  # the panel shows it
    assert not list(tmp_path.glob("finished-*"))
    assert "4" in _run(kc, "print(2 + 2)")["text"]
