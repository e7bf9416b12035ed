"""Interactive sessions in the kernel: `%accelerate start|stop|restart|status|push|pull|auto` and
`%%accelerate` cells that run on live workers (notebook_accel.session) instead of a fresh launch.

Workers' output arrives on the session's reader thread; it is queued there and handed to the
running cell's sink (the launch panel, or rank-prefixed text) on the kernel's main thread, so it
lands in the cell that is running, not in the one that started the session.
"""

from __future__ import annotations

import atexit
import itertools
import threading
from collections import deque
from typing import Optional

from ..launch import frontend
from ..launch.sinks import Fanout
from ..session import Session, SessionTimeout, WorkerDied, parse_ranks
from ..session.cell_events import CellEvents
from . import cell_jobs

PANEL_AFTER_S = 0.5  # a silent session cell shows its launch panel (with Stop) after this long
# Workers' lines wait in OutputQueue until a cell shows them; between cells nobody does. A panel
# view keeps 1000 lines, so 10k lines or 8 MiB (32 of lines.py's longest lines) lose nothing it
# would show, while a worker printing in a background thread cannot grow the kernel without end.
QUEUE_LINES = 10_000
QUEUE_BYTES = 8 << 20
_current: Optional["KernelSession"] = None
_auto = False
_ids = itertools.count(1)


def current() -> Optional["KernelSession"]:
    return _current


class OutputQueue:
    """Workers' lines from the reader thread to the main thread, the newest `max_lines` lines and
    `max_bytes` of text; lines dropped beyond that are counted per rank and reported by `take()`."""

    def __init__(self, max_lines: int = QUEUE_LINES, max_bytes: int = QUEUE_BYTES):
        self.max_lines, self.max_bytes = max_lines, max_bytes
        self.lines: deque = deque()
        self.bytes = 0
        self.dropped: dict = {}  # (rank, a cell was running) -> lines dropped
        self._lock = threading.Lock()

    def put(self, line: tuple, cell_running: bool) -> None:
        with self._lock:
            self.lines.append(line)
            self.bytes += len(line[2])
            while len(self.lines) > self.max_lines or self.bytes > self.max_bytes:
                old = self.lines.popleft()
                self.bytes -= len(old[2])
                key = (old[0], cell_running)
                self.dropped[key] = self.dropped.get(key, 0) + 1

    def take(self) -> list:
        """Every queued line (rank, stream, text, transient), after a note per rank that lost lines."""
        with self._lock:
            lines, dropped = list(self.lines), self.dropped
            self.lines, self.bytes, self.dropped = deque(), 0, {}
        notes = [
            (rank, "stdout", _dropped_note(n, running), False)
            for (rank, running), n in sorted(dropped.items())
        ]
        return notes + lines


def _dropped_note(n: int, cell_running: bool) -> str:
    when = "faster than the cell could show them" if cell_running else "while no cell was running"
    return f"… {n:,} {'line' if n == 1 else 'lines'} dropped {when}"


class _Stop:
    """The panel's Stop button for a session cell: interrupt the cell's ranks, keep the workers."""

    def __init__(self, session: Session, ranks: list):
        self.session, self.ranks, self.reason = session, ranks, ""

    def request_stop(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.session.interrupt(self.ranks)


# Who hears of a session's changes: the extension's comm (comm.py) adds itself when its target is
# registered. A list, not an import of comm.py: the comm reads the session, not the other way round.
_listeners: list = []


def on_change(listener) -> None:
    """Call `listener(ks, state)` whenever a session starts, restarts, stops or loses a worker."""
    if listener not in _listeners:
        _listeners.append(listener)


def _notify(ks: "KernelSession", state: Optional[str] = None) -> None:
    """Tell the listeners (the JupyterLab extension's comms) that `ks` changed; cheap without any."""
    for listener in list(_listeners):
        try:
            listener(ks, state)
        except Exception:
            pass


class _Session(Session):
    """A Session whose restart (from `%accelerate restart` or the sidebar) is told to the comms."""

    owner: Optional["KernelSession"] = None

    def restart(self) -> Session:
        try:
            return super().restart()
        finally:
            if self.owner is not None:
                _notify(self.owner)


class KernelSession:
    def __init__(
        self,
        shell,
        num_processes: int,
        start_method: str,
        mixed_precision,
        cpu,
        fsdp=None,
        gpu_ids=None,
        stall_after=None,
    ):
        self.id = next(_ids)
        self.shell = shell
        self.queue = OutputQueue()
        self.session = _Session(
            num_processes,
            start_method,
            mixed_precision,
            cpu,
            on_output=self._on_output,
            fsdp=fsdp,
            gpu_ids=gpu_ids,
            stall_after=stall_after,
        )
        self.session.owner = self
        self.session.tick = self._pump
        self.session.on_stall = self._stall
        self.cell: Optional[CellEvents] = None  # the running cell's events; main thread only
        self.last_failed: tuple = ()  # the ranks the last session cell failed on: `%accelerate debug`'s default

    @property
    def world(self) -> int:
        return len(self.session.pids()) or (self.session.num_processes or 0)

    def _on_output(self, rank: int, stream: str, text: str, transient: bool) -> None:
        self.queue.put((rank, stream, text, transient), self.cell is not None)  # the reader thread: no I/O

    def _pump(self) -> None:
        cell = self.cell
        if cell is None:
            return  # between cells (status, push, pull): the lines wait for the next cell
        for line in self.queue.take():
            cell.output(*line)
        cell.sample()  # each rank's RSS and CPU, at most once a second
        cell.sink.poll()  # a quiet cell's panel appears once the cell has run a while

    def _stall(self, event) -> None:
        cell = self.cell
        if cell is not None:  # the waiting (main) thread: the cell's panel (or console) shows it
            cell.sink.handle(event)

    # -- a cell on the workers ------------------------------------------------------------------
    def run_cell(
        self, source: str, ranks=None, timeout: Optional[float] = None, out: tuple = (), stall_after=None
    ) -> None:
        pids = self.session.pids()
        world = len(pids) or (self.session.num_processes or 0)
        targets = parse_ranks(ranks, world)
        number = cell_jobs.cell_number(self.shell)
        filename = self.shell.compile.cache(source, number)
        label = f"Cell In[{number}]"
        # A panel only for cells that print, fail or take a while: a quick silent one draws nothing.
        sink = Fanout(frontend.default_sinks(show_after=PANEL_AFTER_S))
        stop = _Stop(self.session, targets)
        sink.attach(stop)
        cell = self.cell = CellEvents(sink, targets, world, pids, fsdp=self.session.fsdp_on)
        self.last_failed = ()
        self._pump()  # output that arrived between cells belongs to no cell: show it here
        try:
            replies = self.session.run_cell(
                source, filename, ranks=targets, timeout=timeout, stall_after=stall_after
            )
        except KeyboardInterrupt:
            self._end(cell, {}, "interrupted")
            raise
        except SessionTimeout as exc:
            self._end(cell, exc.replies, f"timed out after {timeout:g} s")
            raise SessionCellTimeout(f"{exc}; the session goes on") from None
        except WorkerDied as exc:
            self._end(cell, exc.replies, "", failed=cell.died(exc.deaths))
            raise SessionCellError(str(exc)) from None
        except BaseException:
            self._end(cell, {}, "failed")
            raise
        failed = self.last_failed = cell.replies(replies)
        self._end(cell, replies, stop.reason, failed=failed)
        if stop.reason:
            raise SessionCellStopped(f"{stop.reason}: the ranks were interrupted; the session goes on")
        if failed:
            raise SessionCellError(_failure_text(replies, failed, filename, label))
        self._show(replies[targets[0]])
        if out:
            for name in out:
                self.shell.user_ns[name] = self.session.pull(name, targets[0])

    def _end(self, cell: CellEvents, replies: dict, stopped: str, failed: tuple = ()) -> None:
        self._pump()
        cell.end(replies, stopped, failed)
        cell.sink.close()
        self.cell = None
        _notify(self)  # a worker may have died

    def _show(self, reply) -> None:
        """Rank 0's (the first target's) figures, displays and the cell's value, in the cell."""
        from IPython.display import publish_display_data

        for bundle in reply.displays:
            publish_display_data(bundle)
        if reply.result:
            publish_display_data(reply.result)

    # -- pdb on a failed rank -------------------------------------------------------------------
    def debug(self, rank: int) -> None:
        """`%accelerate debug RANK`: pdb on the rank's last failed cell, in the running cell. Its
        output is printed here; each prompt is the kernel's input(), which the front end answers."""
        import builtins

        def write(text: str) -> None:
            if text:
                print(cell_jobs.relabel_cell_paths(text), end="", flush=True)

        self.session.debug(rank, lambda prompt: builtins.input(prompt), write)

    # -- lifetime -------------------------------------------------------------------------------
    def stop(self) -> None:
        self.session.stop()


class SessionCellError(cell_jobs._ShownShort, RuntimeError):
    """A session cell raised on some ranks (or a worker died); the session goes on."""


class SessionCellTimeout(SessionCellError, TimeoutError):
    """A session cell ran past --timeout; its ranks were interrupted."""


class SessionCellStopped(SessionCellError):
    """A session cell was stopped from the panel; its ranks were interrupted."""


def _failure_text(replies: dict, failed: tuple, filename: str, label: str) -> str:
    """One line per failing rank (its exception), then each failing rank's traceback with the cell's
    lines labelled as IPython labels them (`Cell In[N]`) under a `Traceback from rank R:` header;
    ranks whose tracebacks read the same share one (`Traceback from ranks 0, 1:`)."""
    lines, tracebacks = [], {}  # traceback text -> the ranks that raised it
    for rank in failed:
        err = replies[rank].error or {}
        lines.append(f"rank {rank} raised {err.get('exc_type')}: {err.get('message', '')}")
        text = (err.get("traceback") or "").rstrip()
        if text:
            text = cell_jobs.relabel_cells(text.replace(f'File "{filename}"', label))
            tracebacks.setdefault(text, []).append(rank)
    for text, ranks in tracebacks.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines += ["", f"Traceback from {who}:", text]
    lines += ["", "The session goes on: the workers keep their state."]
    return "\n".join(lines)


# -- %accelerate start/stop/... -------------------------------------------------------------------
def start(shell, *args, **kwargs) -> KernelSession:
    """Start `KernelSession(shell, *args, **kwargs)` as this kernel's session (one at a time)."""
    global _current
    if _current is not None:
        raise RuntimeError(
            f"a session with {_current.world} workers is running: %accelerate restart, or %accelerate stop first"
        )
    ks = KernelSession(shell, *args, **kwargs)
    ks.session.start()
    _current = ks
    _notify(ks)
    return ks


def stop() -> bool:
    global _current, _auto
    ks, _current = _current, None
    _auto = False
    if ks is None:
        return False
    try:
        ks.stop()
    finally:
        _notify(ks, "stopped")
    return True


def set_auto(shell, on: bool) -> None:
    global _auto
    _auto = on
    transformers = shell.input_transformers_cleanup
    if on and route_cells not in transformers:
        transformers.append(route_cells)
    if not on and route_cells in transformers:
        transformers.remove(route_cells)


def auto() -> bool:
    return _auto


def route_cells(lines: list) -> list:
    """In auto mode, every cell that is not itself a magic or a shell command runs on the workers."""
    if not _auto or _current is None or not lines:
        return lines
    first = next((line.lstrip() for line in lines if line.strip()), "")
    if not first or first.startswith(("%", "!", "?")):
        return lines
    return ["%%accelerate\n", *lines]


@atexit.register
def _stop_at_exit() -> None:  # a kernel shutting down takes its workers along (they also die with it)
    try:
        stop()
    except Exception:
        pass
