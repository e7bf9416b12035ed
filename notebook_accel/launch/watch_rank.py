"""Inside a rank: what lets the launcher see where the rank is, without the rank's Python.

torch's worker server (a C++ thread serving HTTP on a Unix socket) answers `dump_traceback` (every
thread's Python stack, taken like faulthandler's, so a rank blocked in C++ inside gloo or NCCL still
answers) and `fr_trace_json` (torch's flight recorder: each collective of each process group with
its sequence number, shapes and dtypes, those DDP and FSDP issue from C++ included; gloo and NCCL
record by default). The socket's path follows from the rank's pid, so the launcher needs nothing
from the rank to find it (`socket_path`).
"""

from __future__ import annotations

import os
import tempfile

# Entries torch's flight recorder keeps per process (unless the user set it): what a stall report
# needs is the last few; a dump of torch's default 2000 takes ~85 ms and ~1 MB of JSON.
FR_BUFFER_SIZE = "256"
_server = None
_at_fork = False


def socket_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"notebook_accel-{os.getuid()}")


def socket_path(pid: int) -> str:
    return os.path.join(socket_dir(), f"watch-{pid}.sock")


def start() -> bool:
    """Serve this rank's stacks and collectives on socket_path(os.getpid()); False where the launch
    turned the watch off (stall_after 0, in the rank's environment) or it cannot (no
    torch.distributed, an old torch): the launcher then reports without them."""
    global _server
    if os.environ.get("NOTEBOOK_ACCEL_STALL_AFTER", "").strip() in ("0", "0.0"):  # the plan's: watch off
        return False
    if _server is not None:
        # One per process serves every rank in it (xmp runs a process's devices as threads, one
        # after another too). Replacing it would free it, whose destructor joins its thread: a hang.
        return True
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER_SIZE)  # read when the first group is made
    try:
        from torch._C._distributed_c10d import _WorkerServer
    except ImportError:
        return False
    global _at_fork
    if not _at_fork:
        os.register_at_fork(after_in_child=_forget_in_child)
        _at_fork = True
    path = socket_path(os.getpid())
    try:
        os.makedirs(socket_dir(), mode=0o700, exist_ok=True)
        _sweep()
        if os.path.exists(path):  # a pid reused after a rank that was killed
            os.unlink(path)
        with _quiet_fd2():  # it logs "Server listening to UNIX ..." on stderr: rank output otherwise
            _server = _WorkerServer(path)
    except Exception:  # noqa: BLE001 - the watch is a diagnosis: never fail the rank over it
        return False
    return True


def _sweep() -> None:
    """Remove the sockets of processes that are gone: ranks killed where no launcher could (a Ray
    actor on another node, an elastic worker) would leave them, launch after launch."""
    for name in os.listdir(socket_dir()):
        pid = name[len("watch-") : -len(".sock")]
        if name.startswith("watch-") and name.endswith(".sock") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(os.path.join(socket_dir(), name))
            except OSError:
                pass


def _forget_in_child() -> None:
    """In a process forked from a rank (a nested launch's rank, a loader worker): the server's thread
    stayed in the parent, and destroying the inherited object would join it and abort. Keep it."""
    global _server
    if _server is not None:
        import ctypes

        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_server))  # never freed here, never joined
        _server = None


def stop() -> None:
    """Remove the socket, for good: the server thread ends with the process (shutting it down logs
    too), and a later `start` here keeps it, so call this only when the process's ranks are over."""
    if _server is not None:
        try:
            os.unlink(socket_path(os.getpid()))
        except OSError:
            pass


class _quiet_fd2:
    def __enter__(self):
        import sys

        try:
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        self.saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
