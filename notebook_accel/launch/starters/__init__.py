"""Starters: one way per file to turn a LaunchPlan into running ranks and their results.

Every starter is called the same way, `run(plan, payload, sink, control) -> list` (one result per
local rank), and reports through the sink the events of events.py. Which one runs is a pure
function of the plan: `starter_for(plan)`. Adding a starter: a module here with a `run` of that
signature, and a line in `starter_for`.
"""

from __future__ import annotations

import importlib


def starter_for(plan):
    """The module that starts `plan`: xla (xmp.spawn on a TPU host), elastic (torch's agent for
    several nodes, restarts or a dynamic rendezvous), here (one process, in the caller,
    unless gpu_ids chose its device), or local
    (fork / spawn / forkserver, watched by our own monitor)."""
    if plan.engine == "xla":
        name = "xla"
    elif plan.engine == "elastic":
        name = "elastic"
    elif plan.num_processes == 1 and plan.num_nodes == 1 and not plan.chooses_devices:
        name = "here"
    else:
        name = "local"
    return importlib.import_module(f".{name}", __name__)


def run(plan, payload, sink, control) -> list:
    try:
        return starter_for(plan).run(plan, payload, sink, control)
    finally:
        if plan.port_held:  # the ranks are gone: the port the plan picked is free for others again
            from ..ports import release

            release(plan.master_port)
