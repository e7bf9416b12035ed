"""Starting session workers with the launch machinery, and making sure they are gone."""

from __future__ import annotations

import os
import signal
import time
from contextlib import nullcontext

from .ranks import WorkerState


def start_workers(plan, port: int, key: bytes):
    """One WorkerState per local rank, each running worker.serve(port, key); and the warm
    forkserver used (or None). If one rank fails to start, those already started are killed."""
    from ..launch import procs
    from .worker import serve

    handles, warm = [], None
    try:
        if plan.start_method == "fork":
            from .. import state  # noqa: F401  (imported once here rather than in every child)

            for local_rank in range(plan.num_processes):
                env = plan.rank_env(local_rank)
                handles.append(
                    procs.start_fork(
                        local_rank, int(env["RANK"]), env, plan.threads_per_process, serve, (port, key)
                    )
                )
        else:
            from ..launch.payload import dumps

            payload = dumps(serve, (port, key))  # the key travels inside a private socket pair
            requests = []
            for local_rank in range(plan.num_processes):
                env = plan.rank_env(local_rank)
                request = (local_rank, int(env["RANK"]), env, plan.threads_per_process, payload)
                if plan.start_method == "spawn":
                    handles.append(procs.start_spawn(*request))
                else:
                    requests.append(request)
            if requests:
                from ..launch.warm import WarmServer

                warm = WarmServer.get()
                handles = warm.start_ranks(requests)
    except BaseException:
        for h in handles:
            h.send_signal(signal.SIGKILL)
        reap([WorkerState(0, h, None, False) for h in handles], warm, 5.0)
        for h in handles:
            h.close()
        raise
    workers = []
    for h in handles:
        exit_fd, own = h.exit_fd, False
        if exit_fd is None and warm is not None and hasattr(os, "pidfd_open"):
            try:  # a forkserver rank is not our child, yet a pidfd still says when it exits
                exit_fd, own = os.pidfd_open(h.pid), True
            except OSError:
                exit_fd = None
        workers.append(WorkerState(int(plan.rank_env(h.local_rank)["RANK"]), h, exit_fd, own))
    return workers, warm


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
            left = [w for w in workers if not gone(w, warm) or (warm is not None and w.exitcode is None)]
        if not left:
            return True
        if time.monotonic() >= deadline:
            return all(gone(w, warm) for w in left)
        time.sleep(0.01)
