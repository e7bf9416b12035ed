"""Starters: one way per file to turn a LaunchPlan into running ranks and their results.

Every starter is called the same way, `run(plan, payload, sink, control) -> list` (one result per
local rank), and reports through the sink the events of events.py. Which one runs is a pure
function of the plan: `starter_for(plan)`. Adding a starter: a module here with a `run` of that
signature, a loader and a row in `STARTERS`, and a line in `starter_for`.
"""

from __future__ import annotations

import dataclasses

PORT_RETRIES = 2  # a picked port that another program took before rank 0 bound it: pick again, twice


# Each starter is imported when a plan first needs it: elastic's and xla's imports are costly, and
# a kernel that never launches should not pay for them.
def _xla():
    from . import xla

    return xla


def _elastic():
    from . import elastic

    return elastic


def _here():
    from . import here

    return here


def _local():
    from . import local

    return local


def _ray():
    from . import ray_engine

    return ray_engine


STARTERS = {"xla": _xla, "elastic": _elastic, "here": _here, "local": _local, "ray": _ray}


def starter_name(plan) -> str:
    """Which starter runs `plan`: xla (xmp.spawn on a TPU host), elastic (torch's agent for several
    nodes, restarts or a dynamic rendezvous), here (one process, in the caller, unless gpu_ids chose
    its device or pdb is on), or local (fork / spawn / forkserver, watched by our own monitor)."""
    if plan.engine in ("xla", "elastic", "ray"):
        return plan.engine
    if plan.num_processes == 1 and plan.num_nodes == 1 and not plan.chooses_devices and not plan.pdb:
        return "here"
    return "local"


def starter_for(plan):
    """The starter module (one `run`) for `plan`, from the table."""
    return STARTERS[starter_name(plan)]()


def run(plan, payload, sink, control) -> list:
    from .. import events as ev
    from ..errors import LaunchFailedError

    for attempt in range(PORT_RETRIES + 1):
        try:
            return starter_for(plan).run(plan, payload, sink, control)
        except LaunchFailedError as exc:
            if attempt == PORT_RETRIES or not _port_was_taken(plan, exc):
                raise
            old, plan = plan.master_port, _with_new_port(plan)
            sink.handle(
                ev.LaunchNotice(
                    f"port {old} was taken by another program before rank 0 could listen on it "
                    f"(EADDRINUSE); launching again on port {plan.master_port}"
                )
            )
        finally:
            if plan.port_held:  # the ranks are gone: the port the plan picked is free for others again
                from ..ports import release

                release(plan.master_port)


def _port_was_taken(plan, exc) -> bool:
    """Rank 0 of a local launch on a port we picked could not listen there: someone else does."""
    if not plan.port_held or plan.engine != "local":
        return False
    report = exc.reports.get(plan.node_rank * plan.num_processes)
    text = f"{report.exc_type} {report.message}" if report is not None else ""
    return "EADDRINUSE" in text and f"port: {plan.master_port}" in text


def _with_new_port(plan):
    import weakref

    from .. import ports

    port = ports.reserve(plan.master_addr)
    fresh = dataclasses.replace(plan, master_port=port)
    weakref.finalize(fresh, ports.release, port)
    return fresh
