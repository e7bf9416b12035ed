"""Run a test function on N real gloo processes, with a hard timeout.

Used by foundation tests that must not depend on the launcher under test. Children come from a
forkserver that preloaded torch, so each run costs milliseconds and the parent's OpenMP pool
(see shared/MACHINE-NOTES.md, "fork hang") is never inherited.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback

_ctx = mp.get_context("forkserver")
# pytest too: each child unpickles a test function, which imports its test module and so pytest.
_ctx.set_forkserver_preload(["torch", "torch.distributed", "pytest"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, env, args, results):
    os.environ.update(
        {
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            **env,
        }
    )  # fmt: skip
    import torch

    torch.set_num_threads(1)
    try:
        # Plain pickle: multiprocessing's would share tensors through fds that die with this process.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException as exc:  # report everything, including SystemExit
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, env=None, timeout: float = 60.0):
    """fn(*args) on each of `world_size` ranks; returns results by rank, raises on any failure."""
    results = _ctx.Queue()
    port = free_port()
    procs = [
        _ctx.Process(target=_child, args=(fn, r, world_size, port, env or {}, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size and not errors:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                if dead:
                    errors.append(f"ranks died without a result (rank, exit code): {dead}")
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size}-rank run of {fn.__name__} gave no result within {timeout}s") from None
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}: {value}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]
