"""The session worker: a launched rank whose function serves cells until told to stop.

The launch machinery (launch/child.py) has already taken over fds 1 and 2, left the kernel's
shell (launch/leave_kernel.py) and set the launch environment; here
the process group comes up, the worker connects back to the parent, says hello, and then answers
exec / push / pull / debug messages one at a time. Returning ends the rank (its group is destroyed then).
"""

from __future__ import annotations

import io
import os
import signal
import socket
import sys

import cloudpickle

from ..launch.child import flush_output
from . import display, protocol
from .cell_runner import Cells, error_report


def serve(port: int, key: bytes) -> int:
    from ..state import PartialState

    state = PartialState()
    _line_buffered_stdio()
    display.use_backend()
    cells = Cells()
    signal.signal(signal.SIGINT, cells.on_sigint)
    sock = socket.create_connection(("127.0.0.1", port))
    protocol.no_delay(sock)
    channel = protocol.Channel(sock, key, protocol.TO_PARENT, protocol.TO_WORKER)
    rank = state.process_index
    channel.send({"type": "hello", "rank": rank, "pid": os.getpid(), "device": str(state.device)})
    pending = None  # a request that reached the debugger instead of a line: served next
    try:
        while True:
            message, pending = pending, None
            try:
                message = message or channel.recv()
            except protocol.BadFrame as exc:
                print(f"session worker {rank}: dropped the channel: {exc}", file=sys.stderr)
                return 1
            if message is None or message[0]["type"] == "stop":
                return 0
            header, payload = message
            if header["type"] == "debug":
                rid, reply, pending, lost = _debug(channel, cells, rank, header)
                if lost == "closed":
                    return 0
                if lost:
                    print(f"session worker {rank}: dropped the channel while debugging: {lost}", file=sys.stderr)
                    return 1
                if reply is None:
                    continue
                header, data = {**header, "id": rid}, b""
            else:
                reply, data = _handle(cells, rank, header, payload)
            flush_output()
            channel.send({"type": "done", "id": header.get("id"), "rank": rank, **reply}, data)
    finally:
        sock.close()


def _debug(channel, cells: Cells, rank: int, header: dict):
    """(id of the request the reply answers, reply or None, a request to serve next, why the channel
    was lost or None): pdb on the last failed cell, one request per prompt (post_mortem.py)."""
    from .post_mortem import PostMortem, refusal

    why = refusal(cells, rank)
    if why is not None:
        error = {"exc_type": "SessionError", "message": why, "traceback": ""}
        return header.get("id"), {"ok": False, "error": error}, None, None
    session = PostMortem(channel, cells, rank, header.get("id"))
    reply = session.run()
    return session.id, reply, session.next_message, session.lost


def _handle(cells: Cells, rank: int, header: dict, payload: bytes):
    kind = header["type"]
    if kind == "exec":
        return cells.run(header["source"], header["filename"]), b""
    if kind == "push":
        try:
            from ..launch.payload import loads

            function, args = loads(payload)
            cells.namespace.update(function(*args))
        except Exception as exc:
            return {"ok": False, "error": error_report(exc)}, b""
        return {"ok": True, "error": None}, b""
    if kind == "pull":
        return _pull(cells.namespace, rank, header["name"])
    if kind == "debug_line":  # the kernel ending a debugger that is already over
        message = f"rank {rank} is not in the debugger"
        return {"ok": False, "error": {"exc_type": "SessionError", "message": message, "traceback": ""}}, b""
    message = f"unknown message type {kind!r}"
    return {"ok": False, "error": {"exc_type": "ValueError", "message": message, "traceback": ""}}, b""


def _pull(namespace: dict, rank: int, name: str):
    if name not in namespace:
        message = f"name {name!r} is not defined on rank {rank}"
        return {"ok": False, "error": {"exc_type": "NameError", "message": message, "traceback": ""}}, b""
    value = namespace[name]
    try:
        buffer = io.BytesIO()
        _ToCpuPickler(buffer).dump(value)
    except Exception as exc:
        message = f"{name!r} on rank {rank} ({type(value).__name__}) cannot be pickled: {exc}"
        return {"ok": False, "error": {"exc_type": "PicklingError", "message": message, "traceback": ""}}, b""
    return {"ok": True, "error": None}, buffer.getvalue()


def _to_cpu(tensor):
    import torch

    moved = tensor.detach().to("cpu")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
    return moved.requires_grad_(tensor.requires_grad and tensor.is_leaf)


class _ToCpuPickler(cloudpickle.Pickler):
    """Pulled tensors arrive on the CPU: unpickling a CUDA tensor would initialise CUDA in the
    kernel, and forked ranks could not use it any more."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return _to_cpu(obj).__reduce_ex__(self.proto)
        return super().reducer_override(obj)


def _line_buffered_stdio() -> None:
    # One write per line (print("a", 1) arrives whole), and partial lines wait for the cell's end.
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
        )
        setattr(sys, name, stream)
