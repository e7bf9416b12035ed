"""A session cell told as launch events, so every sink that shows launches (the panel, the
JupyterLab extension, the console) shows session cells too, with no code of its own for them."""

from __future__ import annotations

import time

from ..launch import events as ev


class CellEvents:
    """The events of one cell sent to `targets` of `world` ranks (`pids`: rank -> pid)."""

    def __init__(self, sink, targets: list, world: int, pids: dict, fsdp: bool = False):
        self.sink = sink
        self.targets = list(targets)
        self.pids = pids
        self.started = time.monotonic()
        sink.handle(ev.LaunchStarted(len(targets), "session", world, ranks=tuple(targets), fsdp=fsdp))
        for rank in targets:
            sink.handle(ev.RankStarted(rank, pids.get(rank, 0)))

    def output(self, rank: int, stream: str, text: str, transient: bool) -> None:
        self.sink.handle(ev.RankOutput(rank, stream, text, transient))

    def replies(self, replies: dict) -> tuple:
        """Each rank's answer as RankFinished or RankFailed; the ranks that failed."""
        failed = []
        for rank, reply in sorted(replies.items()):
            if reply.ok:
                self.sink.handle(ev.RankFinished(rank, time.monotonic() - self.started))
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
                )
            )
            failed.append(rank)
        return tuple(failed)

    def died(self, deaths: dict) -> tuple:
        """Workers that exited mid-cell (`deaths`: rank -> (exit code, signal name))."""
        for rank, (code, sig) in deaths.items():
            self.sink.handle(ev.RankFailed(rank, self.pids.get(rank), code, signal_name=sig))
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
