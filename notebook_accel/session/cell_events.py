"""A session cell told as launch events, so every sink that shows launches (the panel, the
JupyterLab extension, the console) shows session cells too, with no code of its own for them."""

from __future__ import annotations

import time

from ..launch import events as ev
from ..launch.resources import ResourceSampler


class CellEvents:
    """The events of one cell sent to `targets` of `world` ranks (`pids`: rank -> pid).

    `sample()`, called while the cell runs, adds each running rank's resources (RankResources at
    most once a second, from outside the worker); the sampled peaks go in the cell's RankFinished /
    RankFailed (a worker lives across cells: its peak during this cell)."""

    def __init__(self, sink, targets: list, world: int, pids: dict, fsdp: bool = False):
        self.sink = sink
        self.targets = list(targets)
        self.pids = pids
        self.started = time.monotonic()
        self.answered: set = set()
        self.resources = ResourceSampler({r: pids[r] for r in self.targets if pids.get(r)})
        sink.handle(ev.LaunchStarted(len(targets), "session", world, ranks=tuple(targets), fsdp=fsdp))
        for rank in targets:
            sink.handle(ev.RankStarted(rank, pids.get(rank, 0)))

    def sample(self) -> None:
        now = time.monotonic()
        if self.resources.due(now):
            running = [r for r in self.targets if r not in self.answered]
            for event in self.resources.sample(now, running):
                self.sink.handle(event)

    def _peaks(self, rank: int) -> dict:
        peak_rss, peak_device = self.resources.peaks(rank)
        return {"peak_rss": peak_rss, "peak_device_memory": peak_device}

    def output(self, rank: int, stream: str, text: str, transient: bool) -> None:
        self.sink.handle(ev.RankOutput(rank, stream, text, transient))

    def replies(self, replies: dict) -> tuple:
        """Each rank's answer as RankFinished or RankFailed; the ranks that failed."""
        failed = []
        for rank, reply in sorted(replies.items()):
            self.answered.add(rank)
            if reply.ok:
                self.sink.handle(ev.RankFinished(rank, time.monotonic() - self.started, **self._peaks(rank)))
                continue
            err = reply.error or {}
            self.sink.handle(
                ev.RankFailed(
                    rank,
                    self.pids.get(rank),
                    None,
                    err.get("exc_type"),
                    err.get("message", ""),
                    err.get("traceback", ""),
                    **self._peaks(rank),
                )
            )
            failed.append(rank)
        return tuple(failed)

    def died(self, deaths: dict) -> tuple:
        """Workers that exited mid-cell (`deaths`: rank -> (exit code, signal name))."""
        for rank, (code, sig) in deaths.items():
            self.answered.add(rank)
            self.sink.handle(ev.RankFailed(rank, self.pids.get(rank), code, signal_name=sig, **self._peaks(rank)))
        return tuple(sorted(deaths))

    def end(self, replies: dict, stopped: str = "", failed: tuple = ()) -> None:
        """The cell is over: ranks without an answer were `stopped` (if it was), then the end."""
        if stopped:
            for rank in self.targets:
                reply = replies.get(rank)
                if reply is None or not reply.ok:
                    self.sink.handle(ev.RankStopped(rank, stopped))
        seconds = time.monotonic() - self.started
        self.sink.handle(ev.LaunchFinished(not failed and not stopped, seconds, failed, stopped))
