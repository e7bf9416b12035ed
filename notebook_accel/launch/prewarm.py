"""Start the warm forkserver before the first launch asks for it (issue #19).

A kernel that imports notebook_accel is about to launch, and the server's boot (an interpreter
importing torch) takes seconds. Started early, in the background, the first `forkserver` launch
or session finds it ready, or waits for that same server. The kernel starts no thread for this:
a Popen, and nothing read until a launch needs the server.
"""

from __future__ import annotations

import os
import warnings

from ..utils.environment import LAUNCHER_ENV
from .prewarm_setting import ENV, wanted  # noqa: F401  (read here by the tests and jupyter/)


def start():
    """Start the forkserver now unless NOTEBOOK_ACCEL_PREWARM=0 or this process is a rank; returns
    the WarmServer (not yet ready) or None. Never waits for the server."""
    if os.environ.get(LAUNCHER_ENV):  # a rank (one that imports IPython too) starts no server
        return None
    if not wanted():
        return None
    from .warm import WarmServer

    try:
        return WarmServer.prewarm()
    except OSError as exc:  # no interpreter to run, no fds left: the first launch will say why
        warnings.warn(
            f"notebook_accel could not start its forkserver early ({exc}); it starts at the first "
            f"forkserver launch instead. Set {ENV}=0 to stop trying.",
            stacklevel=2,
        )
        return None
