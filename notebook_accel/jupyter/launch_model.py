"""One launch as state, folded from its events: what the launch panel draws and what the
JupyterLab extension's sink sends. No widgets here; `handle()` only records, under a lock, so the
thread that reads the ranks (perhaps 100k lines a second) never waits on a view."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional

from ..launch import events as ev
from ..launch.lines import cut

STALLED = "stalled: "  # a rank's detail while the watch reports a stall

# A line, whole or transient, is kept and shown cut to this: a data dump (lines.py passes up to
# 256 KiB of a stream with no newline) is not read in a log, and a view resends its text per draw.
SHOWN_LINE = 4 << 10
# Each view (a rank's log, all ranks' log) keeps at most this much text, dropping its oldest lines:
# 1000 lines of normal output fit, 64 cut lines do, and a redraw of a view stays this small.
VIEW_BYTES = 256 << 10


class Log:
    """The newest items of a view, at most `max_lines` of them and `max_bytes` of text (the last
    element of an item; the newest item is always kept), and how many were ever added (its version)."""

    __slots__ = ("items", "added", "max_lines", "max_bytes", "bytes")

    def __init__(self, max_lines: int, max_bytes: int = VIEW_BYTES):
        self.items: deque = deque(maxlen=max_lines)  # append drops the oldest line when full
        self.added = 0
        self.max_lines, self.max_bytes = max_lines, max_bytes
        self.bytes = 0  # characters, really: bytes for ASCII, and cheap to count

    def add(self, item, size: int) -> None:
        """Keep `item`, whose text (its last element) is `size` characters long."""
        # The hot path of a chatty launch (two calls per line): as few operations as possible.
        items = self.items
        if len(items) == self.max_lines:
            self.bytes -= len(items[0][-1])
        items.append(item)
        self.added += 1
        self.bytes += size
        if self.bytes > self.max_bytes:
            while self.bytes > self.max_bytes and len(items) > 1:
                self.bytes -= len(items.popleft()[-1])

    @property
    def dropped(self) -> int:
        return self.added - len(self.items)

    def since(self, seen: int) -> tuple:
        """(items added after the first `seen` that are still kept, how many of those were dropped)."""
        new = self.added - seen
        kept = min(new, len(self.items))
        return list(self.items)[len(self.items) - kept :] if kept else [], new - kept


class RankState:
    __slots__ = (
        "rank",
        "pid",
        "state",
        "detail",
        "started",
        "seconds",
        "log",
        "current",
        "bar_text",
        "bar_final",
        "usage",
        "node",
    )

    def __init__(self, rank: int, max_lines: int, view_bytes: int = VIEW_BYTES):
        self.rank = rank
        self.pid: Optional[int] = None
        self.node = ""  # the rank's machine, where the launch names it (Ray)
        self.state = "pending"
        self.detail = ""
        self.started: Optional[float] = None  # time.monotonic()
        self.seconds: Optional[float] = None  # once it ended
        self.log = Log(max_lines, view_bytes)  # (stream, text) of whole lines
        self.current: dict = {}  # stream -> the redraw in progress (transient text)
        self.bar_text: Optional[str] = None  # the newest line that may be a tqdm bar
        self.bar_final = False
        # The launcher's newest sample while it runs (RankResources), its peaks once it ended.
        self.usage: dict = {}

    def end(self, state: str, detail: str = "", seconds: Optional[float] = None) -> None:
        self.state, self.detail = state, detail
        if seconds is None and self.started is not None:
            seconds = time.monotonic() - self.started
        self.seconds = seconds

    def elapsed(self, now: float) -> Optional[float]:
        if self.seconds is not None:
            return self.seconds
        return None if self.started is None else now - self.started


def _peaks(event, last: dict) -> dict:
    """A finished rank's row: its peaks (the last sample's limit kept, to say "of")."""
    return {
        "peak_rss": event.peak_rss,
        "peak_device_memory": event.peak_device_memory,
        "limit": last.get("limit"),
    }


def failure_detail(event: ev.RankFailed) -> str:
    parts = [event.exc_type] if event.exc_type else []
    if event.oom:
        parts.append("out of memory" if event.oom == "certain" else "most likely out of memory")
    if event.signal_name:
        parts.append(event.signal_name)
    elif event.exitcode is not None:
        parts.append(f"exit code {event.exitcode}")
    return ", ".join(parts)


class LaunchModel:
    """The launch's state ("pending", "running", "done", "failed", "stopped"), its ranks, the log of
    all ranks and of each (`max_lines` and `view_bytes` each, lines cut to SHOWN_LINE), and its
    failures. Read its fields under `lock`."""

    def __init__(self, max_lines: int = 1000, view_bytes: int = VIEW_BYTES):
        self.max_lines, self.view_bytes = int(max_lines), int(view_bytes)
        self.lock = threading.Lock()
        self.launches = 0  # a panel may show several launches in turn
        self.layout = 0  # bumped when the set of ranks changes
        self.reset(None)

    def reset(self, started: Optional[ev.LaunchStarted]) -> None:
        self.state = "running" if started else "pending"
        self.began = time.monotonic()
        self.seconds: Optional[float] = None
        self.note = self.notice = ""
        self.stop_requested = False
        self.fsdp = bool(started and started.fsdp)
        self.failures: list = []
        self.stall = None  # the stall going on (launch/stall.py StallReport), until a rank moves
        self.all = Log(self.max_lines, self.view_bytes)  # (rank, stream, text)
        self.ranks: dict = {}
        self.layout += 1
        self.launches += 1
        if started is not None:
            first = started.node_rank * started.num_processes
            for rank in started.ranks or range(first, first + started.num_processes):
                self.ranks[rank] = RankState(rank, self.max_lines, self.view_bytes)

    def handle(self, event) -> None:
        with self.lock:
            if isinstance(event, ev.RankOutput):
                self._output(event)
            else:
                self._lifecycle(event)

    def output(self, event: ev.RankOutput) -> None:
        """handle() for a line, without the dispatch (the panel has already looked)."""
        with self.lock:
            self._output(event)

    def rank(self, rank: int) -> RankState:
        r = self.ranks.get(rank)
        if r is None:  # a rank LaunchStarted did not announce: show it anyway
            r = self.ranks[rank] = RankState(rank, self.max_lines, self.view_bytes)
            self.layout += 1
        return r

    def sorted_ranks(self) -> list:
        return [self.ranks[k] for k in sorted(self.ranks)]

    def elapsed(self, now: float) -> float:
        return self.seconds if self.seconds is not None else now - self.began

    def _output(self, e: ev.RankOutput) -> None:
        r = self.ranks.get(e.rank) or self.rank(e.rank)
        text = e.text
        size = len(text)
        if size > SHOWN_LINE:
            text = cut(text, SHOWN_LINE)
            size = len(text)
        if e.transient:
            if text.strip():
                r.current[e.stream] = text
                if text.rstrip().endswith("]"):  # cheap test; a view parses
                    r.bar_text, r.bar_final = text, False
            else:  # a bar erased itself (tqdm leave=False)
                r.current.pop(e.stream, None)
            return
        r.current.pop(e.stream, None)
        if text.rstrip().endswith("]"):
            r.bar_text, r.bar_final = text, True
        r.log.add((e.stream, text), size)
        self.all.add((e.rank, e.stream, text), size)

    def _lifecycle(self, event) -> None:
        if isinstance(event, ev.LaunchStarted):
            self.reset(event)
        elif isinstance(event, ev.RankStarted):
            r = self.rank(event.rank)
            r.pid, r.state, r.started, r.node = event.pid, "running", time.monotonic(), event.node
            if self.note == self.notice:  # "waiting for the other nodes" is over
                self.note = ""
        elif isinstance(event, ev.RankResources):
            r = self.rank(event.rank)
            if r.state == "running":  # a late sample must not replace a rank's peaks
                r.usage = {
                    "rss": event.rss,
                    "cpu": event.cpu_percent,
                    "limit": event.memory_limit,
                    "device_memory": event.device_memory,
                    "device_util": event.device_util,
                }
        elif isinstance(event, ev.RankFinished):
            r = self.rank(event.rank)
            r.end("done", seconds=event.seconds)
            r.usage = _peaks(event, r.usage)
        elif isinstance(event, ev.RankFailed):
            r = self.rank(event.rank)
            r.pid = r.pid or event.pid
            r.end("failed", failure_detail(event))
            r.usage = _peaks(event, r.usage)
            self.failures.append(event)
        elif isinstance(event, ev.RankStopped):
            r = self.rank(event.rank)
            if r.state in ("pending", "running"):
                r.end("stopped", event.reason)
        elif isinstance(event, ev.LaunchNotice):
            self.note = self.notice = event.text
        elif isinstance(event, ev.LaunchStalled):
            self._stalled(event.report)
        elif isinstance(event, ev.LaunchResumed):
            self._stalled(None)
        elif isinstance(event, ev.LaunchFinished):
            self._finished(event)

    def _stalled(self, report) -> None:
        """Mark the ranks of a stall (`detail` "stalled: ..."), its head ("stalled for 61 s") as the
        note; None clears."""
        if self.stall is not None and self.note == self.stall.sentence.split(":", 1)[0]:
            self.note = ""
        for r in self.ranks.values():
            if r.state == "running" and r.detail.startswith(STALLED):
                r.detail = ""
        self.stall = report
        if report is None:
            return
        self.note = report.sentence.split(":", 1)[0]  # "stalled for 61 s": the sentence is drawn below
        for where in report.ranks:
            r = self.ranks.get(where.rank)
            if r is not None and r.state == "running":
                r.detail = f"{STALLED}{where.doing().split(' at ', 1)[0]}"

    def _finished(self, event: ev.LaunchFinished) -> None:
        self.seconds = event.seconds
        if self.stall is not None and self.note == self.stall.sentence.split(":", 1)[0]:
            self.note = ""  # the failure or the stop says what ended it; the report stays in `stall`
        if event.stopped:
            self.state, self.note = "stopped", event.stopped
        elif event.ok:
            self.state, self.note = "done", ""
        else:
            self.state = "failed"
            if self.failures:
                self.note = self.failures[0].summary()
            elif event.failed_ranks:
                self.note = f"rank(s) {', '.join(map(str, event.failed_ranks))} failed"
        for r in self.ranks.values():  # ranks the launcher ended without a word
            if r.state in ("pending", "running") and not event.ok:
                r.end("stopped", event.stopped or "the launch ended")
