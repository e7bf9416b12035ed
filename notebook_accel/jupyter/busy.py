"""Let a widget's clicks reach the kernel while a cell is running.

A kernel handles comm messages (a button click) on the same thread that runs the cell, so while
a launch blocks that thread a Stop button would be heard only after the run. ipykernel 7 can run
a second shell ("subshell", JEP 91) on its own thread and route a comm's messages to it; we open
one per kernel and send the chosen widgets' messages there. On older kernels this reports False
and the caller offers the kernel's interrupt instead.
"""

from __future__ import annotations

import sys
import threading
from typing import Optional

_lock = threading.Lock()
_side_shell: Optional[str] = None


def deliver_while_busy(widget) -> bool:
    """Route `widget`'s front-end messages to a side shell; True when that worked."""
    comm = getattr(widget, "comm", None)
    if comm is None or not hasattr(comm, "_reply_subshell_for"):
        return False
    shell_id = _side_shell_id()
    if shell_id is None:
        return False
    # The kernel asks the comm where each incoming message goes (ipykernel >= 7.4).
    comm._reply_subshell_for = lambda data, default: shell_id
    return True


def _side_shell_id() -> Optional[str]:
    global _side_shell
    with _lock:
        if _side_shell is None:
            _side_shell = _open_side_shell()
        return _side_shell


def _open_side_shell() -> Optional[str]:
    if "ipykernel" not in sys.modules:
        return None
    try:
        from ipykernel.kernelbase import Kernel
    except ImportError:
        return None
    if not Kernel.initialized():
        return None
    kernel = Kernel.instance()
    channel = getattr(kernel, "shell_channel_thread", None)
    if channel is None or not getattr(kernel, "_supports_kernel_subshells", False):
        return None
    manager = channel.manager
    create = getattr(manager, "_create_subshell", None)
    if create is None:
        return None
    made: dict = {}
    done = threading.Event()

    def on_channel_thread():  # subshells are made on the shell channel's own thread
        try:
            made["id"] = create()
        except Exception as exc:  # a kernel version whose internals moved
            made["error"] = exc
        finally:
            done.set()

    channel.io_loop.add_callback(on_channel_thread)
    if not done.wait(5.0):
        return None
    return made.get("id")
