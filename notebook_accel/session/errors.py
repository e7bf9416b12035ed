"""Errors an interactive session raises."""

from __future__ import annotations


class SessionError(RuntimeError):
    """Base class of every session error."""


class SessionNotStarted(SessionError):
    """The session has no workers: call start() (or restart() after a failure)."""


class WorkerDied(SessionError):
    """A worker process exited. `deaths` maps rank -> (exitcode, signal name or None);
    `replies` holds what the other ranks answered before this was raised."""

    def __init__(self, deaths: dict, replies: dict = None, detail: str = ""):
        self.deaths = dict(deaths)
        self.replies = dict(replies or {})
        parts = [
            f"rank {rank} {describe_exit(code, sig)}" for rank, (code, sig) in sorted(self.deaths.items())
        ]
        text = "worker died: " + "; ".join(parts) + ". Call restart() to bring the session back."
        if detail:
            text += "\n" + detail
        super().__init__(text)


class SessionTimeout(SessionError, TimeoutError):
    """run_cell(timeout=...) ran out: the ranks were interrupted; `replies` holds their answers."""

    def __init__(self, timeout: float, replies: dict, killed: list = (), stall=None):
        self.timeout = timeout
        self.replies = dict(replies)
        self.killed = list(killed)
        self.stall = stall  # the stall watch's last report of the cell, if it stalled (launch/stall.py)
        text = f"cell timed out after {timeout:g} s; the ranks were interrupted"
        if self.killed:
            text += f", and ranks {self.killed} did not stop and were killed"
        if stall is not None:
            text += f"\nwhat the watch saw before: {stall.sentence}"
        super().__init__(text)


class CellError(SessionError):
    """A cell (or push / pull) raised on one or more ranks. `errors` maps rank ->
    {exc_type, message, traceback}."""

    def __init__(self, errors: dict, what: str = "cell"):
        self.errors = dict(errors)
        first = min(self.errors)
        err = self.errors[first]
        lines = [f"{what} failed on rank(s) {sorted(self.errors)}: {err['exc_type']}: {err['message']}"]
        if err.get("traceback"):
            lines += ["", f"Traceback from rank {first}:", err["traceback"].rstrip()]
        super().__init__("\n".join(lines))


def describe_exit(code, signal_name) -> str:
    if signal_name:
        return f"was killed by {signal_name}"
    if code is None:
        return "exited (exit code unknown)"
    return f"exited with code {code}"
