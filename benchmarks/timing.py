"""What several benchmarks time with: a call's seconds, a hang turned into a failed sample."""

from __future__ import annotations

import signal
import time


class Timeout(Exception):
    """A timed call ran past its limit."""


def _alarm(_signum, _frame):
    raise Timeout()


def timed(call, limit: int) -> float:
    """Seconds `call()` took, or the seconds it returns (a sample it measured itself); raises
    Timeout after `limit` seconds, so a hang becomes a failed sample, not a stuck benchmark."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    try:
        start = time.perf_counter()
        measured = call()
        return measured if isinstance(measured, float) else time.perf_counter() - start
    finally:
        signal.alarm(0)
