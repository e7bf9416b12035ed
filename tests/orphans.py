"""Which child processes a test left behind."""

from __future__ import annotations

import psutil


def children() -> dict:
    found = {}
    for p in psutil.Process().children(recursive=True):
        try:
            found[p.pid] = " ".join(p.cmdline()) or p.name()
        except psutil.Error:
            found[p.pid] = "?"
    return found


def long_lived_helpers() -> set:
    # The warm forkserver stays up between launches by design, with its idle spares; its ranks must
    # not. So do the resource tracker multiprocessing starts with its first spawned process
    # (xmp.spawn's, TPU tests) and multiprocessing's forkserver (an elastic forkserver launch's).
    from multiprocessing import forkserver, resource_tracker

    from notebook_accel.launch.warm import WarmServer

    server = WarmServer._instance
    helpers = set()
    if server is not None and server.proc.poll() is None:
        helpers = {server.proc.pid, *idle_spares(server.proc.pid)}
    others = {
        getattr(resource_tracker._resource_tracker, "_pid", None),
        getattr(forkserver._forkserver, "_forkserver_pid", None),
    }
    return helpers | {pid for pid in others if pid}


def idle_spares(server_pid: int) -> set:
    """The pids of the ranks a forkserver forked ahead and has not handed a launch yet."""
    from notebook_accel.launch.spares import SPARE_NAME

    found = set()
    try:
        for p in psutil.Process(server_pid).children():
            try:
                if p.name() == SPARE_NAME:
                    found.add(p.pid)
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return found
