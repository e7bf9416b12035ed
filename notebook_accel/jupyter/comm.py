"""The kernel end of the JupyterLab extension (extension/): a comm target named "notebook_accel".

When the front end opens a comm, the kernel answers with a hello (hardware report, launch preview,
and the config file's launch defaults: {"config": {"file", "num_processes", "mixed_precision"}},
each null without a config file, so "Run cell on N processes" can default to the config's N);
then every launch's events go to all open comms through `CommSink`, and every change of the
kernel's interactive session (start, restart, stop; `notify_session` listens to jupyter/kernel_session.py) goes
as {"type": "session", "id", "state", "workers", "start_method", "ranks": [{rank, pid, state, device}]}.

A stall (launch/watch.py) goes as the LaunchStalled event with "stall": {"sentence", "stalled",
"seconds", "ranks": [{rank, state, doing}], "text"} ("text", the whole report, only when it differs
from the last one sent), and LaunchResumed with "stall": null.

The front end may send {"type": "stop"} (stop the running launch), {"type": "refresh"} (a new
hello), {"type": "restart"} (restart the session's workers) or {"type": "stop_session"}. These
arrive on busy.py's side shell thread; the two session ones are refused with a
{"type": "notice"} while a cell runs, since that cell may be using the session's workers.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
from typing import Optional

from ..launch import events as ev
from ..launch.frontend import label_traceback
from ..launch.lines import cut
from ..launch.sinks import Sink
from .launch_model import LaunchModel

TARGET = "notebook_accel"
STOP_REASON = "stopped from the JupyterLab extension"

_lock = threading.Lock()
_comms: dict = {}  # comm_id -> open comm
_launch_ids = itertools.count(1)
_control = None  # the running launch's control, set by CommSink.attach
_session_op = threading.Lock()  # held while the sidebar restarts or stops the session
_cells_running = 0  # cells on the kernel's shell between pre_execute and post_execute
_last_ranks: dict = {}  # session id -> the ranks last sent, to show who was stopped
# A stall report's text is cut to this: many ranks' stacks must not make one huge comm message.
STALL_TEXT = 32 << 10


def register_comm_target(ipython) -> bool:
    """Let the front end open comms to TARGET; False outside an ipykernel (nothing to register with)."""
    manager = getattr(getattr(ipython, "kernel", None), "comm_manager", None)
    if manager is None:
        return False
    manager.register_target(TARGET, _on_open)
    from . import kernel_session

    kernel_session.on_change(notify_session)
    # pre/post_run_cell, not pre/post_execute: the comm package fires those around every comm
    # message too (this one's included). Silent executions go uncounted.
    events = getattr(ipython, "events", None)
    if events is not None:
        if _cell_started not in events.callbacks.get("pre_run_cell", []):
            events.register("pre_run_cell", _cell_started)
        if _cell_ended not in events.callbacks.get("post_run_cell", []):
            events.register("post_run_cell", _cell_ended)
    return True


def _cell_started(info=None) -> None:
    global _cells_running
    with _session_op:  # a cell that starts during a restart from the sidebar waits for its end
        _cells_running += 1


def _cell_ended(result=None) -> None:
    global _cells_running
    with _lock:  # post_run_cell also follows cells without pre_run_cell (empty ones): never below 0
        _cells_running = max(0, _cells_running - 1)


def active_sinks() -> list:
    """[CommSink()] while a front end listens, else []: for the sinks jupyter/ registers with launch."""
    with _lock:
        return [CommSink()] if _comms else []


def hello() -> dict:
    message = {
        "type": "hello",
        "version": _version(),
        "hardware": None,
        "preview": None,
        "session": None,
        "config": launch_defaults(),
    }
    if message["config"].get("error"):
        message["config_error"] = message["config"].pop("error")
    try:
        from . import kernel_session as session

        ks = session.current()
        if ks is not None:
            message["session"] = session_message(ks)
    except Exception as exc:
        message["session_error"] = str(exc) or type(exc).__name__
    try:
        from ..hardware import report

        message["hardware"] = report().to_dict()
    except Exception as exc:  # a broken probe still says hello
        message["hardware_error"] = str(exc) or type(exc).__name__
    try:
        from ..launch.preview import launch_preview

        preview = launch_preview()
        message["preview"] = {
            "rows": [list(r) for r in preview.rows],
            "notes": preview.notes,
            "error": preview.error,
        }
    except Exception as exc:
        message["preview"] = {"rows": [], "notes": [], "error": str(exc) or type(exc).__name__}
    return message


def launch_defaults() -> dict:
    """What the config file (config.default_config_file()) gives a launch that names no values:
    {"file", "num_processes" (per machine, as `-n` means), "mixed_precision"}, null where it gives
    none or there is no file; plus "error" for a file that cannot be used."""
    out = {"file": None, "num_processes": None, "mixed_precision": None}
    try:
        from .. import config

        found = config.load_default()
    except Exception as exc:  # a broken file still says hello; a launch would report it too
        return {**out, "error": str(exc) or type(exc).__name__}
    if found is None:
        return out
    defaults = found.launch_defaults()
    return {
        "file": found.path,
        "num_processes": defaults.get("num_processes"),
        "mixed_precision": defaults.get("mixed_precision"),
    }


def _version() -> str:
    from ..utils.version import __version__

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
    try:
        _handle(msg)
    except Exception as exc:  # the comm package skips post_execute when a handler raises
        notice(f"{type(exc).__name__}: {exc}", "error")


def _handle(msg) -> None:
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
    elif kind in ("restart", "stop_session"):
        _session_request(kind)


def session_message(ks, state: Optional[str] = None) -> dict:
    """The session message for KernelSession `ks` (its workers' status, read now)."""
    started = ks.session.started
    ranks = []
    if started:
        ranks = [
            {"rank": r["rank"], "pid": r["pid"], "state": r["state"], "device": r["device"]}
            for r in ks.session.status()
        ]
    if not ranks:  # stopped, or its start failed: the workers it had, stopped
        ranks = [dict(r, state="stopped") for r in _last_ranks.get(ks.id, [])]
    if state is None:
        state = "running" if started else "stopped"
    if state == "running":
        _last_ranks[ks.id] = ranks
    elif state == "stopped":
        _last_ranks.pop(ks.id, None)
    return {
        "type": "session",
        "id": ks.id,
        "state": state,
        "workers": ks.session.num_processes or len(ranks),
        "start_method": ks.session.start_method,
        "ranks": ranks,
        "time": time.time(),
    }


def notify_session(ks, state: Optional[str] = None) -> None:
    """Tell the open comms about `ks`: nothing to do (and no status read) while none is open."""
    with _lock:
        if not _comms:
            return
    try:
        message = session_message(ks, state)
    except Exception as exc:  # a session notice must never break the session itself
        sys.__stderr__.write(f"notebook_accel: session notice failed: {exc!r}\n")
        return
    _broadcast(message)


def notice(text: str, level: str = "info") -> None:
    _broadcast({"type": "notice", "level": level, "text": text})


def _session_request(kind: str) -> None:
    """Restart or stop the kernel's session for the sidebar; refused while a cell runs (it may be
    using the workers, and the session is not made for two threads at once)."""
    from . import kernel_session as session

    what = "restart the session" if kind == "restart" else "stop the session"
    if not _session_op.acquire(blocking=False):
        notice(f"cannot {what}: the session is already being restarted or stopped", "warning")
        return
    try:
        if _cells_running:
            notice(f"cannot {what} while a cell runs: wait for it or interrupt it, then try again", "warning")
            return
        ks = session.current()
        if ks is None:
            notice("no session is running (%accelerate start -n N starts one)", "warning")
            notify_session_none()
            return
        if kind == "stop_session":
            session.stop()
            notice("session stopped")
            return
        notify_session(ks, "restarting")
        try:
            ks.session.restart()  # kernel_session.py sends the new workers' message
        except Exception as exc:
            notice(f"session restart failed: {exc}", "error")
            return
        notice(f"session restarted: {ks.world} workers, fresh namespaces")
    finally:
        _session_op.release()


def notify_session_none() -> None:
    """A hello again, so front ends that still show a session learn there is none."""
    _broadcast(hello())


def _broadcast(message: dict) -> None:
    with _lock:
        comms = list(_comms.values())
    for comm in comms:
        try:
            comm.send(message)
        except Exception as exc:  # one closed page must not break the others or the launch
            sys.__stderr__.write(f"notebook_accel: comm send failed: {exc!r}\n")


def stall_fields(report) -> dict:
    """A stall report (launch/stall.py) for the sidebar, without its text: the sentence, and what
    each rank does ("waits in all_reduce #3 (float32[4]) at Cell In[5], line 3, in f")."""
    return {
        "sentence": report.sentence,
        "stalled": bool(report.stalled),
        "seconds": report.seconds,
        "ranks": [
            {"rank": r.rank, "state": r.state, "doing": r.doing(label_traceback)} for r in report.ranks
        ],
    }


class CommSink(Sink):
    """Forwards one launch's events to the open comms as {"type": "event", "launch": id, "event": name, ...}.

    Output is folded into a LaunchModel (the panel's) and sent as batches per rank, at most `rate`
    times a second: the whole lines added since the last batch, newest `max_lines` kept (the batch
    says how many it dropped), then a redraw in progress (a progress bar) as one transient line;
    every line cut as the model cuts it (launch_model.SHOWN_LINE), so a batch stays small.
    """

    def __init__(self, rate: float = 10.0, max_lines: int = 20):
        self.launch = next(_launch_ids)
        self.interval = 1.0 / rate
        self.model = LaunchModel(max_lines)
        self._sent: dict = {}  # rank -> (lines counted so far, the transient lines last sent)
        self._control = None
        self._stall_sent = (None, frozenset())  # (the report text last sent, the comms it went to)
        self._send_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def attach(self, control) -> None:
        global _control
        self._control = _control = control

    def handle(self, event) -> None:
        self.model.handle(event)
        if isinstance(event, ev.RankOutput):
            self._start_flusher()
            return
        if isinstance(event, ev.LaunchStalled):
            fields = {"stall": self._stall(event.report)}
        elif isinstance(event, ev.LaunchResumed):
            fields = {"stall": None}
        else:
            fields = dataclasses.asdict(event)
        if isinstance(event, ev.RankFailed):
            fields["summary"] = event.summary()
        with self._send_lock:  # lines before a rank's end must arrive before it, even mid-flush
            self.flush()
            self._send(type(event).__name__, fields)

    def _stall(self, report) -> dict:
        fields = stall_fields(report)
        text = cut(report.text(), STALL_TEXT)
        with _lock:
            listening = frozenset(_comms)
        last, told = self._stall_sent
        # A repeated report's text is known to every page that got it; a page opened since needs it.
        if text != last or not listening <= told:
            fields["text"] = text
            self._stall_sent = (text, listening)
        return fields

    def flush(self) -> None:
        # _send_lock spans take-and-send, so the flusher thread cannot send lines after an event
        # that handle() sent meanwhile; the model's lock alone keeps handle()'s output path short.
        with self._send_lock:
            batches = []
            with self.model.lock:
                for r in self.model.sorted_ranks():
                    seen, shown = self._sent.get(r.rank, (0, ()))
                    if seen > r.log.added:  # a new launch started over
                        seen, shown = 0, ()
                    items, dropped = r.log.since(seen)
                    current = tuple(sorted(r.current.items()))
                    if not items and not dropped and current == shown:
                        continue
                    self._sent[r.rank] = (r.log.added, current)
                    lines = [[stream, text, False] for stream, text in items]
                    lines += [[stream, text, True] for stream, text in current if (stream, text) not in shown]
                    batches.append((r.rank, lines, dropped))
            for rank, lines, dropped in batches:
                self._send("RankOutput", {"rank": rank, "lines": lines, "dropped": dropped})

    def _start_flusher(self) -> None:
        if self._thread is None and not self._stop.is_set():
            with self._send_lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._flush_loop, name="notebook_accel-comm", daemon=True
                    )
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
