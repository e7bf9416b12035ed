"""xmp.spawn's documented signature and behaviour, on CPU processes: `fn(index, *args)` runs once per
device, in a pool of processes made with `start_method`; nprocs=None means every device and nprocs=1
runs `fn` here, in the caller. It returns None. Where the runtime gives a process more than one
device (TPU v2/v3), each device runs as a thread of that process.

STANDIN_XLA_DEVICES (default 4) is the device count; STANDIN_XLA_THREADS (default 1) the devices per
process."""

from __future__ import annotations

import multiprocessing
import os
import threading

from .. import runtime


def _run(index: int, fn, args) -> None:
    runtime._here.ordinal = index
    fn(index, *args)


def _process(first: int, count: int, fn, args) -> None:
    if count == 1:
        _run(first, fn, args)
        return
    errors = []

    def one(index):
        try:
            _run(index, fn, args)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(first + i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def spawn(fn, args=(), nprocs=None, join=True, daemon=False, start_method="spawn"):
    devices = int(os.environ.get("STANDIN_XLA_DEVICES", "4"))
    per_process = int(os.environ.get("STANDIN_XLA_THREADS", "1"))
    if nprocs == 1:
        _run(0, fn, args)
        return None
    if nprocs is not None and nprocs != devices:
        raise ValueError(f"Unsupported nprocs ({nprocs}): use 1 or None")
    ctx = multiprocessing.get_context(start_method)
    procs = [
        ctx.Process(target=_process, args=(first, per_process, fn, args), daemon=daemon)
        for first in range(0, devices, per_process)
    ]
    for p in procs:
        p.start()
    if not join:
        return procs
    for p in procs:
        p.join()
    failed = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode]
    if failed:
        raise RuntimeError(f"process(es) {failed} exited with a non-zero code")
    return None
