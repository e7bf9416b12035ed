"""Errors a launch raises. A rank failure is torch's ChildFailedError, with a readable message."""

from __future__ import annotations

import time

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from .events import RankFailed


class _ShownByFrontEnd:
    """IPython shows an exception's `_render_traceback_()` when it has one. Where a front end
    registered a renderer (a kernel: jupyter/tracebacks.py), a launch error has one, which leaves
    the library's frames out: the user's call, then the message (a failed rank's own traceback).
    Elsewhere the attribute does not exist and the usual traceback is shown."""

    @property
    def _render_traceback_(self):
        from . import frontend

        render = frontend.traceback_renderer()
        if render is None:
            raise AttributeError("_render_traceback_")
        return lambda: render(self)


class LaunchConfigError(_ShownByFrontEnd, ValueError):
    """A launch argument or environment cannot work; raised before any process starts."""


class UnpicklableError(LaunchConfigError):
    """The function or an argument cannot travel to spawn / forkserver children."""


class LaunchFailedError(_ShownByFrontEnd, ChildFailedError):
    """One or more ranks failed. `failures` maps rank -> torch ProcessFailure, `reports` -> RankFailed."""

    def __init__(self, reports: list, name: str = "notebook_launcher"):
        self.reports = {r.rank: r for r in reports}
        failures = {}
        for report in reports:
            code = report.exitcode if report.exitcode is not None else 1
            failure = ProcessFailure(report.rank, report.pid or -1, code, error_file="")
            failure.message = report.summary()
            failure.timestamp = int(time.time())
            failures[report.rank] = failure
        super().__init__(name, failures)
        self._made_from = (list(reports), name)
        self.args = (format_failures(reports),)

    def __reduce__(self):  # args holds the message: pickle and copy rebuild from the reports
        return (type(self), self._made_from, self.__dict__)

    def __str__(self) -> str:
        return self.args[0]


class NodesMissingError(_ShownByFrontEnd, TimeoutError):
    """A multi-node launch gave up waiting at the rendezvous: not every node joined in time."""


class LaunchStoppedError(_ShownByFrontEnd, RuntimeError):
    """The launch was ended from outside (Stop button, `timeout`); every rank was stopped."""

    def __init__(self, reason: str, reports: list = (), stall=None):
        self.reason = reason
        self.reports = {r.rank: r for r in reports}
        self.stall = stall  # the last stall report (launch/stall.py) of the launch, if it stalled
        text = f"launch stopped: {reason}; every rank was stopped"
        if reports:
            text += "\n" + format_failures(list(reports))
        if stall is not None:
            text += f"\nwhat the watch saw before: {stall.sentence}"
        super().__init__(text)
        self._made_from = (reason, list(reports), stall)

    def __reduce__(self):
        return (type(self), self._made_from, self.__dict__)


class LaunchTimeoutError(LaunchStoppedError, TimeoutError):
    """The launch ran past its `timeout`."""


def format_failures(reports: list) -> str:
    """The first failure in full (type, message, traceback with source lines), others in one line."""
    if not reports:
        return "launch failed"
    first = reports[0]
    lines = [first.summary()]
    if first.traceback:
        lines += ["", f"Traceback from rank {first.rank}:", first.traceback.rstrip()]
    for other in reports[1:]:
        lines.append(f"also: {other.summary()}")
    return "\n".join(lines)


def failure_from_exit(rank: int, pid, exitcode) -> RankFailed:
    import signal

    name = None
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
    return RankFailed(rank=rank, pid=pid, exitcode=exitcode, signal_name=name)
