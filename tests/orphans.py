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
    # The warm forkserver stays up between launches by design; its ranks must not.
    from notebook_accel.launch.warm import WarmServer

    server = WarmServer._instance
    return {server.proc.pid} if server is not None and server.proc.poll() is None else set()
