"""A real kernel driven over its own protocol (jupyter_client), for tests that interrupt it,
click its widgets or watch its processes."""

from __future__ import annotations

import os
import queue
import time

import psutil
import pytest
from jupyter_client.manager import KernelManager

from notebook_accel.demo import _kernel_manager_class


@pytest.fixture
def kernel(tmp_path, request):
    # indirect parameter: NOTEBOOK_ACCEL_WIDGETS's value, or a dict of variables for the kernel
    param = getattr(request, "param", "0")
    extra = param if isinstance(param, dict) else {"NOTEBOOK_ACCEL_WIDGETS": param}
    km: KernelManager = _kernel_manager_class()(kernel_name="python3")
    env = {**os.environ, "NOTEBOOK_ACCEL_WIDGETS": "0", "PYDEVD_DISABLE_FILE_VALIDATION": "1", **extra}
    km.start_kernel(env=env, extra_arguments=["--IPKernelApp.log_level=ERROR"], cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def run(kc, code: str, timeout: float = 60.0, on_message=None) -> dict:
    """Execute `code`; returns {"reply": content, "errors": [...], "comms": {id: data}, "text": str}."""
    msg_id = kc.execute(code)
    seen = {"errors": [], "comms": {}, "text": "", "displays": []}
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
            elif kind in ("display_data", "execute_result"):
                seen["displays"].append(content["data"])
            elif kind == "comm_open":
                seen["comms"][content["comm_id"]] = content["data"].get("state", {})
            elif kind == "comm_msg" and content["data"].get("method") == "update":
                seen["comms"].setdefault(content["comm_id"], {}).update(content["data"].get("state", {}))
            elif kind == "status" and content["execution_state"] == "idle":
                seen["reply"] = reply_to(kc, msg_id)
                return seen
        if on_message is not None:
            on_message(seen)
    raise AssertionError(f"cell did not finish in {timeout} s: {seen}")


def converse(
    kc, code: str, answers: list, timeout: float = 60.0, allow_stdin: bool = True, on_prompt=None
) -> dict:
    """Execute `code`, answering each input request with the next of `answers`; returns the output
    text, the prompts asked, the error (if any) and the reply. `on_prompt(n)` may act instead of an
    answer (then it returns True)."""
    msg_id = kc.execute(code, allow_stdin=allow_stdin)
    answers = list(answers)
    seen = {"text": "", "prompts": [], "errors": []}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            request = kc.get_stdin_msg(timeout=0.05)
        except queue.Empty:
            request = None
        if request is not None and request["msg_type"] == "input_request":
            seen["prompts"].append(request["content"]["prompt"])
            if on_prompt is None or not on_prompt(len(seen["prompts"])):
                kc.input(answers.pop(0) if answers else "q")
        try:
            msg = kc.get_iopub_msg(timeout=0.05)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            seen["text"] += content["text"]
        elif kind == "error":
            seen["errors"].append(content)
        elif kind == "status" and content["execution_state"] == "idle":
            seen["reply"] = reply_to(kc, msg_id)
            return seen
    raise AssertionError(f"cell did not finish in {timeout} s: {seen}")


def reply_to(kc, msg_id: str) -> dict:
    """The shell reply to `msg_id`; wait_for_ready may leave kernel_info replies behind: skipped."""
    deadline = time.monotonic() + 10.0
    while True:
        msg = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg["content"]


def alive(process) -> bool:
    """A psutil.Process or pid that runs and is not a zombie; False if it went away while we looked."""
    try:
        if not isinstance(process, psutil.Process):
            process = psutil.Process(process)
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kernel_children(km, helpers: bool = False) -> list:
    """The kernel's live descendants; without `helpers`, less its warm forkserver (the process
    itself and its idle spares, not its ranks), which a kernel keeps up by design once
    notebook_accel is imported."""
    from orphans import idle_spares

    found = [p for p in psutil.Process(km.provisioner.pid).children(recursive=True) if alive(p)]
    if helpers:
        return found
    servers = [p.pid for p in found if p.ppid() == km.provisioner.pid and _is_forkserver(p)]
    spares = set().union(*(idle_spares(pid) for pid in servers))
    return [p for p in found if p.pid not in {*servers, *spares}]


def _is_forkserver(process) -> bool:
    try:
        return "notebook_accel.launch.warm" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def wait_for_files(folder, names, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all((folder / n).exists() for n in names):
        assert time.monotonic() < deadline, f"ranks did not start: {list(folder.iterdir())}"
        time.sleep(0.05)
