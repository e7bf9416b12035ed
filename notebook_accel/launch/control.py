"""Ending a launch from outside the loop that watches it: a Stop button, or a time limit.

The watching loop sleeps in select(); `request_stop` writes a byte to a pipe it watches, so a stop
from any thread wakes it at once.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Optional

from .errors import LaunchConfigError


class Wakeup:
    """A pipe a selector watches, so that any thread can wake the loop sleeping in select()."""

    def __init__(self):
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def wake(self) -> None:
        try:
            os.write(self._write, b"w")
        except OSError:  # pipe full (already woken) or closed (the loop is over)
            pass

    def fileno(self) -> int:
        return self._read

    def drain(self) -> None:
        try:
            while os.read(self._read, 512):
                pass
        except OSError:
            pass

    def close(self) -> None:
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass


class LaunchControl:
    def __init__(self, timeout: Optional[float] = None):
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
                raise LaunchConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")
            if math.isinf(timeout):
                timeout = None
        self.timeout = timeout
        self.deadline: Optional[float] = None
        self.reason = ""
        self.timed_out = False
        # Set by an engine whose ranks the launcher cannot ask by pid (Ray): label -> a StallReport of
        # where the ranks are now, for the panel's Stacks button. Safe to call from any thread.
        self.where_now = None
        self._lock = threading.Lock()
        self._wakeup = Wakeup()

    def start(self) -> None:
        """The clock starts when the ranks do."""
        if self.timeout is not None:
            self.deadline = time.monotonic() + self.timeout

    def request_stop(self, reason: str) -> None:
        """Safe from any thread; the first reason given is the one reported."""
        with self._lock:
            if not self.reason:
                self.reason = reason
        self._wakeup.wake()

    def fileno(self) -> int:
        return self._wakeup.fileno()

    def drain(self) -> None:
        self._wakeup.drain()

    def check(self, now: float) -> str:
        """The stop reason, if any; passing the deadline is one."""
        if self.deadline is not None and now >= self.deadline and not self.reason:
            self.timed_out = True
            self.request_stop(f"timed out after {self.timeout:g} s (timeout={self.timeout:g})")
        return self.reason

    def wait_limit(self, now: float, default: float) -> float:
        """How long the loop may sleep without missing the deadline."""
        if self.deadline is None:
            return default
        return max(0.0, min(default, self.deadline - now))

    def close(self) -> None:
        self._wakeup.close()
