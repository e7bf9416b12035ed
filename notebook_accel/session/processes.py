"""Session workers as processes: started by the launch's local starter, and made sure to be gone."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext

from .ranks import WorkerState


def start_workers(plan, port: int, key: bytes):
    """One WorkerState per local rank, each running serve.serve(port, key); and the warm forkserver
    used (or None). The starter leaves nothing behind when one rank fails to start."""
    from ..launch.payload import Payload
    from ..launch.starters import local
    from .serve import serve

    # With spawn or forkserver the key travels pickled inside a private socket pair.
    handles, warm = local.start(plan, Payload(serve, (port, key)))
    return [WorkerState(int(plan.rank_env(h.local_rank)["RANK"]), h) for h in handles], warm


def gone(worker: WorkerState, warm) -> bool:
    """True once the process has exited and been reaped (by us, or by the forkserver)."""
    if worker.proc.poll() is not None:
        worker.exitcode = worker.proc.exitcode
        return True
    if warm is None:
        return False
    try:  # a forkserver rank: the server reaps it and tells us the exit code later
        os.kill(worker.pid, 0)
    except ProcessLookupError:
        return True
    return False


def reap(workers: list, warm, seconds: float, lock=None) -> bool:
    """Wait up to `seconds` until every worker is gone; forkserver exit codes are read too."""
    deadline = time.monotonic() + seconds
    while True:
        if warm is not None:
            warm.pump()
        with lock if lock is not None else nullcontext():
            # a forkserver rank's exit code comes later through the server, unless the server is gone
            late = warm is not None and not warm.lost
            left = [w for w in workers if not gone(w, warm) or (late and w.exitcode is None)]
        if not left:
            return True
        if time.monotonic() >= deadline:
            return all(gone(w, warm) for w in left)
        time.sleep(0.01)
