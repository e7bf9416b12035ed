"""Import the launch path while the kernel is idle, so the first launch does not pay for it.

`import notebook_accel` stays light: the launcher, the hardware probe, psutil, the panel and
ipywidgets are imported by the first launch, about 0.1 s of it (benchmarks/launch.py). In a
kernel, once the cell that imported notebook_accel has finished, they are imported on the kernel's
own event loop, in its main thread, and then what a training function's ranks import
(launch/rank_imports.py), which forked ranks inherit: never inside a cell's synchronous code (an async cell that
awaits lets the loop run it), and never on a thread of ours (a fork launch while such a thread
held an import lock could hang its ranks). Part of the early start
of launch/prewarm.py: NOTEBOOK_ACCEL_PREWARM=0 turns it all off.
"""

from __future__ import annotations

import importlib

DELAY_S = 0.5  # after the cell that imported us ended: its reply is long sent

# What the first launch imports that `import notebook_accel` does not (found by diffing
# sys.modules around a kernel's first launch). A name missing here is only imported later.
LAUNCH_PATH = (
    "notebook_accel.config",
    "notebook_accel.device_probes",
    "notebook_accel.hardware",
    "notebook_accel.launch.launcher",
    "notebook_accel.launch.channel",
    "notebook_accel.launch.child",
    "notebook_accel.launch.leave_kernel",
    "notebook_accel.launch.monitor",
    "notebook_accel.launch.oom",
    "notebook_accel.launch.procs",
    "notebook_accel.launch.resources",
    "notebook_accel.launch.starters.local",
    "notebook_accel.jupyter.busy",
    "notebook_accel.jupyter.comm",
)
PANEL = (
    "notebook_accel.jupyter.launch_model",
    "notebook_accel.jupyter.panel",
    "notebook_accel.jupyter.panel_html",
    "notebook_accel.jupyter.progress",
    "notebook_accel.jupyter.style",
)

_scheduled = False
imported: list = []  # what the idle import did, in order, and on which thread (read by tests)
imported_on = None
rank_modules_on = None


def schedule(shell) -> bool:
    """Once per kernel: when the running cell ends, import the launch path DELAY_S later on the
    kernel's event loop. False where there is no running cell and loop to wait for."""
    global _scheduled
    if _scheduled or shell is None:
        return False
    import asyncio

    try:
        loop = asyncio.get_running_loop()  # ipykernel runs cells inside its loop, main thread
    except RuntimeError:
        return False

    def after_cell(*_):
        shell.events.unregister("post_run_cell", after_cell)
        loop.call_later(DELAY_S, import_launch_path)
        # A callback of its own: a cell asked for meanwhile runs between the two.
        loop.call_later(DELAY_S, import_rank_modules)

    shell.events.register("post_run_cell", after_cell)
    _scheduled = True
    return True


def import_launch_path() -> None:
    import threading

    from .kernel_env import widgets_enabled

    global imported_on
    imported_on = threading.current_thread().name
    for name in LAUNCH_PATH + (PANEL if widgets_enabled() else ()):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the first launch imports it again and says what failed
            return
        imported.append(name)


def import_rank_modules() -> None:
    """What ranks import (launch/rank_imports.py: torch._dynamo, about 1.7 s and 70 MB, and the
    training modules), so that forked ranks and fork session workers inherit them."""
    import threading

    from ..launch import rank_imports

    global rank_modules_on
    rank_modules_on = threading.current_thread().name
    if rank_imports.import_all(blocking=False) is None:  # a launch on another thread imports them now
        import asyncio

        asyncio.get_running_loop().call_later(DELAY_S, import_rank_modules)  # never block the loop
