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
    # The warm forkserver stays up between launches by design; its ranks must not. So does the
    # resource tracker multiprocessing starts with its first spawned process (xmp.spawn's, TPU tests).
    from multiprocessing import resource_tracker

    from notebook_accel.launch.warm import WarmServer

    server = WarmServer._instance
    helpers = {server.proc.pid} if server is not None and server.proc.poll() is None else set()
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return helpers | ({tracker} if tracker else set())
