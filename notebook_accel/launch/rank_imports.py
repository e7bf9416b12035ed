"""What a training function's ranks import, imported once by the process that forks them.

The first optimizer or DDP wrap in a process imports `torch._dynamo` (about 1.7 s here), and the
first `Accelerator` our training modules (about 0.07 s). A forked rank that finds them missing pays
that on every launch, on every rank at once. Imported in the parent, they are inherited instead: a
script pays once at its first fork launch, a kernel while idle (jupyter/ready.py), the forkserver
when it boots (warm.py). Found by diffing a rank's sys.modules around a typical function (model,
optimizer, scheduler, loader, DDP through `prepare`, autocast, gather, save_state and load_state).

Names only: launch/ uses nothing of these modules. The package's own are lent by the composition
root (`lend`), so this layer names no module above it. Off, in the parent, with
NOTEBOOK_ACCEL_PREWARM=0 (each rank then imports what its function needs).
"""

from __future__ import annotations

import importlib
import sys
import threading
import time

# torch's own, lazily imported by torch.optim (its step decorator), DDP's constructor and the
# profiler's record_function; private names, so a torch without one is skipped.
TORCH_MODULES = ("torch._dynamo", "torch.profiler._cupti_monitor")

_lent: tuple = ()
done: list = []  # (name, seconds) for each module this process imported here, in order (tests read it)
_tried = False
_lock = threading.Lock()


def lend(names) -> None:
    """The package's training modules, named by the composition root."""
    global _lent
    _lent = tuple(names)


def names() -> tuple:
    return TORCH_MODULES + _lent


def import_all(respect_opt_out: bool = True, blocking: bool = True) -> list:
    """Import every module in `names()` once per process, on the calling thread; returns `done`.
    Call it only where a fork may follow on this thread (never from a thread of ours: a fork while
    it held an import lock would hang the child). A second caller waits for the first to finish:
    forking while another thread is inside `import torch._dynamo` would leave the child a module
    half imported, its lock held by a thread the child does not have. `blocking=False` returns None
    at once instead of waiting. A module that fails to import is skipped: the rank that needs it
    imports it again and says what failed."""
    global _tried
    if respect_opt_out:
        from .prewarm_setting import wanted

        if not wanted():
            return done
    if not _lock.acquire(blocking):
        return None
    try:
        if _tried:
            return done
        present = set(sys.modules)  # a name imported by an earlier one's import is still this call's
        for name in names():
            began = time.perf_counter()
            fresh = name not in present
            try:
                importlib.import_module(name)  # waits for another thread's import of it, unlike a look
            except Exception:  # noqa: BLE001 - see the docstring
                continue
            if fresh:
                done.append((name, time.perf_counter() - began))
        _tried = True
    finally:
        _lock.release()
    return done
