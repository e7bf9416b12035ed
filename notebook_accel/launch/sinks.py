"""Where launch events go. The launcher knows only `Sink.handle(event)` and `Sink.close()`."""

from __future__ import annotations

import sys
from typing import Iterable, Optional

from . import events as ev
from .lines import cut

# ConsoleSink cuts a line longer than this (with a "… N bytes cut" note). In a kernel with widgets
# off each line is a stream message the notebook keeps and the browser draws; 16 KiB is 200 rows of
# 80 columns, more than anyone reads of one line, and a 16th of what lines.py passes as one.
CONSOLE_LINE = 16 << 10


class Sink:
    def handle(self, event) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def attach(self, control) -> None:
        """Called before ranks start; `control.request_stop(reason)` ends the launch (any thread)."""

    def poll(self) -> None:
        """Called now and then on the launching thread while a launch runs (session cells)."""

    def close(self) -> None:
        pass


class ConsoleSink(Sink):
    """`[rank N] line` on the parent's sys.stdout / sys.stderr, so a notebook shows it in the cell;
    a line longer than `max_line` characters is cut (None: never)."""

    def __init__(self, show_lifecycle: bool = False, max_line: Optional[int] = CONSOLE_LINE):
        self.show_lifecycle = show_lifecycle
        self.max_line = max_line

    def handle(self, event) -> None:
        if isinstance(event, ev.RankOutput):
            if event.transient:
                return  # a progress bar's redraws; its final state arrives as a whole line
            stream = sys.stderr if event.stream == "stderr" else sys.stdout
            text = event.text if self.max_line is None else cut(event.text, self.max_line)
            stream.write(f"[rank {event.rank}] {text}\n")
        elif isinstance(event, ev.RankFailed):
            sys.stderr.write(f"[rank {event.rank}] FAILED: {event.summary()}\n")
        elif isinstance(event, ev.LaunchNotice):
            sys.stderr.write(f"notebook_accel: {event.text}\n")
        elif isinstance(event, ev.LaunchStalled):
            sys.stderr.write(f"notebook_accel: {event.report.text()}\n")
        elif isinstance(event, ev.LaunchResumed):
            sys.stderr.write("notebook_accel: the ranks moved again\n")
        elif self.show_lifecycle and isinstance(event, ev.RankStarted):
            where = f" on node {event.node}" if event.node else ""
            sys.stdout.write(f"[rank {event.rank}] started (pid {event.pid}{where})\n")

    def close(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass


class ListSink(Sink):
    """Keeps every event; for tests and for code that inspects a launch afterwards."""

    def __init__(self):
        self.events: list = []

    def handle(self, event) -> None:
        self.events.append(event)

    def lines(self, rank: int, stream: str = "stdout") -> list:
        """Complete lines only: a progress bar's transient redraws are left out."""
        return [
            e.text
            for e in self.events
            if isinstance(e, ev.RankOutput) and e.rank == rank and e.stream == stream and not e.transient
        ]


class Fanout(Sink):
    """Deliver to several sinks; one sink's error must not stop the launch or the others."""

    def __init__(self, sinks: Iterable[Sink]):
        self.sinks = list(sinks)

    def handle(self, event) -> None:
        for sink in self.sinks:
            try:
                sink.handle(event)
            except Exception as exc:  # a display bug must never kill training
                sys.__stderr__.write(f"notebook_accel: sink {type(sink).__name__} failed: {exc!r}\n")

    def attach(self, control) -> None:
        for sink in self.sinks:
            sink.attach(control)

    def poll(self) -> None:
        for sink in self.sinks:
            try:
                sink.poll()
            except Exception as exc:  # as in handle(): never let a display kill the launch
                sys.__stderr__.write(f"notebook_accel: sink {type(sink).__name__} failed: {exc!r}\n")

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:
                pass
