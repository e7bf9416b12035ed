"""The kernel end of the JupyterLab extension (extension/): a comm target named "notebook_accel".

When the front end opens a comm, the kernel answers with a hello (hardware report, launch preview);
then every launch's events go to all open comms through `CommSink`. The front end may send
{"type": "stop"} (stop the running launch) or {"type": "refresh"} (a new hello).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
from typing import Optional

from ..launch import events as ev
from ..launch.sinks import Sink

TARGET = "notebook_accel"
STOP_REASON = "stopped from the JupyterLab extension"

_lock = threading.Lock()
_comms: dict = {}  # comm_id -> open comm
_launch_ids = itertools.count(1)
_control = None  # the running launch's control, set by CommSink.attach


def register_comm_target(ipython) -> bool:
    """Let the front end open comms to TARGET; False outside an ipykernel (nothing to register with)."""
    manager = getattr(getattr(ipython, "kernel", None), "comm_manager", None)
    if manager is None:
        return False
    manager.register_target(TARGET, _on_open)
    return True


def active_sinks() -> list:
    """[CommSink()] while a front end listens, else []: for launch.launcher.default_sinks()."""
    with _lock:
        return [CommSink()] if _comms else []


def hello() -> dict:
    message = {"type": "hello", "version": _version(), "hardware": None, "preview": None}
    try:
        from ..hardware import report

        message["hardware"] = report().to_dict()
    except Exception as exc:  # a broken probe still says hello
        message["hardware_error"] = str(exc) or type(exc).__name__
    try:
        from .hardware_panel import launch_preview  # needs ipywidgets

        preview = launch_preview()
        message["preview"] = {
            "rows": [list(r) for r in preview.rows],
            "notes": preview.notes,
            "error": preview.error,
        }
    except Exception as exc:
        message["preview"] = {"rows": [], "notes": [], "error": str(exc) or type(exc).__name__}
    return message


def _version() -> str:
    from .. import __version__

    return __version__


def _on_open(comm, msg) -> None:
    with _lock:
        _comms[comm.comm_id] = comm
    comm.on_msg(_on_msg)
    comm.on_close(lambda msg, cid=comm.comm_id: _forget(cid))
    _route_while_busy(comm)
    comm.send(hello())


def _forget(comm_id: str) -> None:
    with _lock:
        _comms.pop(comm_id, None)


def _route_while_busy(comm) -> None:
    """Stop must arrive while a launch blocks the kernel's main thread: use busy.py's side shell."""
    if not hasattr(comm, "_reply_subshell_for"):
        return
    from .busy import _side_shell_id

    shell_id = _side_shell_id()
    if shell_id is not None:
        comm._reply_subshell_for = lambda data, default: shell_id


def _on_msg(msg) -> None:
    data = msg.get("content", {}).get("data") or {}
    kind = data.get("type")
    if kind == "stop":
        control = _control
        if control is not None:
            control.request_stop(STOP_REASON)
    elif kind == "refresh":
        from ..hardware import report

        report(refresh=True)
        _broadcast(hello())


def _broadcast(message: dict) -> None:
    with _lock:
        comms = list(_comms.values())
    for comm in comms:
        try:
            comm.send(message)
        except Exception as exc:  # one closed page must not break the others or the launch
            sys.__stderr__.write(f"notebook_accel: comm send failed: {exc!r}\n")


class CommSink(Sink):
    """Forwards one launch's events to the open comms as {"type": "event", "launch": id, "event": name, ...}.

    Output lines are batched per rank and sent at most `rate` times a second; a batch keeps only the
    last `max_lines` lines per rank (and says how many it dropped), so a chatty rank can't flood the page.
    """

    def __init__(self, rate: float = 10.0, max_lines: int = 20):
        self.launch = next(_launch_ids)
        self.interval = 1.0 / rate
        self.max_lines = max_lines
        self._lock = threading.Lock()
        self._pending: dict = {}  # rank -> [[stream, text, transient], ...]
        self._dropped: dict = {}
        self._control = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def attach(self, control) -> None:
        global _control
        self._control = _control = control

    def handle(self, event) -> None:
        if isinstance(event, ev.RankOutput):
            with self._lock:
                self._add_line(event)
                self._start_flusher()
            return
        self.flush()  # lines before a rank's end must arrive before it
        fields = dataclasses.asdict(event)
        if isinstance(event, ev.RankFailed):
            fields["summary"] = event.summary()
        self._send(type(event).__name__, fields)

    def _add_line(self, e: ev.RankOutput) -> None:
        lines = self._pending.setdefault(e.rank, [])
        if lines and lines[-1][2] and lines[-1][0] == e.stream:
            lines.pop()  # a progress bar's redraw replaces its previous state
        lines.append([e.stream, e.text, e.transient])
        if len(lines) > self.max_lines:
            del lines[0]
            self._dropped[e.rank] = self._dropped.get(e.rank, 0) + 1

    def flush(self) -> None:
        with self._lock:
            pending, dropped = self._pending, self._dropped
            self._pending, self._dropped = {}, {}
        for rank, lines in sorted(pending.items()):
            self._send("RankOutput", {"rank": rank, "lines": lines, "dropped": dropped.get(rank, 0)})

    def _start_flusher(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._flush_loop, name="notebook_accel-comm", daemon=True)
            self._thread.start()

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def _send(self, name: str, fields: dict) -> None:
        _broadcast({"type": "event", "launch": self.launch, "event": name, "time": time.time(), **fields})

    def close(self) -> None:
        global _control
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self.flush()
        if _control is self._control:
            _control = None
