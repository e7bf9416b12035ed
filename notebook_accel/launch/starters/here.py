"""One process: run in the caller, as accelerate does, with the plan's settings visible to it."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

from ...utils.env_flags import patch_environment
from ...utils.environment import DEBUG_ENV, MIXED_PRECISION_ENV, USE_CPU_ENV
from ..errors import LaunchConfigError, LaunchTimeoutError


def run(plan, payload, sink, control) -> list:
    keep = {k: plan.env[k] for k in (MIXED_PRECISION_ENV, USE_CPU_ENV, DEBUG_ENV) if k in plan.env}
    with patch_environment(**keep), _alarm(control):
        return [payload.function(*payload.args)]


@contextmanager
def _alarm(control):
    """A timeout for a function run in this process: SIGALRM raises in the main thread."""
    if control.timeout is None:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise LaunchConfigError("timeout with one process needs the main thread; use num_processes >= 2")

    def expire(signum, frame):
        control.timed_out = True
        raise LaunchTimeoutError(f"timed out after {control.timeout:g} s (timeout={control.timeout:g})")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, control.timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
