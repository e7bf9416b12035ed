"""TPU launch through torch_xla's xmp.spawn: one process per TPU core, no num_processes needed.

torch_xla cannot run where its wheel does not pair with the installed torch; this file is the only
place that calls into it, so the rest of the launcher is testable without it.
"""

from __future__ import annotations

from ..errors import LaunchConfigError


def _xla_entry(index: int, function, args):
    return function(*args)


def run(plan, payload, sink, control) -> list:
    if control.timeout is not None:
        raise LaunchConfigError(
            "timeout is not supported on TPU (xmp.spawn has no way to stop its processes)"
        )
    import torch_xla.distributed.xla_multiprocessing as xmp

    # xmp.spawn decides the process count from the TPU topology; it returns nothing per rank.
    xmp.spawn(_xla_entry, args=(payload.function, payload.args), start_method=plan.start_method)
    return [None]
