"""What a launch from this process may start: how many processes (counted together with the launches
this process runs inside, when a rank launches again), and whether it may fork while this process
is part of a torch.distributed process group."""

from __future__ import annotations

import os
import sys

from .errors import LaunchConfigError

MANY_PROCESSES_ENV = "NOTEBOOK_ACCEL_MANY_PROCESSES"  # "1": launch more than PROCESSES_PER_CORE
PROCESSES_PER_CORE = 64  # past this a launch is a typo (10000 for 100), not a plan
FDS_PER_RANK = 5  # the parent holds three sockets and a pidfd per rank, a session one more
# Set in every rank: the local process counts of the launches it runs inside, outermost first ("2,4"),
# so a launch from inside a rank counts the processes already running for them.
OUTER_LAUNCHES_ENV = "NOTEBOOK_ACCEL_OUTER_LAUNCHES"


def outer_launches() -> list:
    """This machine's process counts of the launches this process runs inside ([] in a notebook)."""
    try:
        counts = [int(part) for part in os.environ.get(OUTER_LAUNCHES_ENV, "").split(",") if part.strip()]
    except ValueError:  # not ours to trust: count nothing rather than refuse every launch
        return []
    return [n for n in counts if n > 0]


def for_ranks(num_processes: int) -> str:
    """The OUTER_LAUNCHES_ENV value this launch's ranks get."""
    return ",".join(str(n) for n in [*outer_launches(), num_processes])


def processes_here(num_processes: int, outer: list) -> int:
    """Processes on this machine once every rank of the enclosing launches starts `num_processes`
    (a launched function normally runs the same code on every rank)."""
    total, width = 0, 1
    for count in outer:
        width *= count
        total += width
    return total + width * num_processes


def check_process_count(num_processes: int, cores: int) -> None:
    """Refuse a count this process cannot start, before forking a few thousand processes."""
    ceiling = PROCESSES_PER_CORE * cores
    outer = outer_launches()
    total = processes_here(num_processes, outer)
    if total > ceiling and os.environ.get(MANY_PROCESSES_ENV) != "1":
        what = f"num_processes={num_processes}"
        if outer:
            sizes = " inside ".join(f"a {n}-process launch" for n in reversed(outer))
            what += (
                f" inside a rank of {sizes} ({OUTER_LAUNCHES_ENV}={','.join(map(str, outer))}): with "
                f"every rank starting as many, {total} processes, which"
            )
        raise LaunchConfigError(
            f"{what} is more than {PROCESSES_PER_CORE} per CPU core here ({cores} cores, so at most "
            f"{ceiling}). Check the number; to launch that many anyway, set {MANY_PROCESSES_ENV}=1."
        )
    try:
        import resource
    except ImportError:  # Windows: no such limit to check
        return
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = FDS_PER_RANK * num_processes + 64  # this process's own ranks only: the fds are its
    if soft != resource.RLIM_INFINITY and needed > soft:
        raise LaunchConfigError(
            f"num_processes={num_processes} needs about {needed} open files in this process, and its limit "
            f"is {soft}: raise it (`ulimit -n {needed}` before starting Python or Jupyter, or "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ...)), or launch fewer processes."
        )


def group_here():
    """(rank, world size) of this process's torch.distributed process group, or None."""
    dist = sys.modules.get("torch.distributed")  # not imported: no group can exist
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        return dist.get_rank(), dist.get_world_size()
    except Exception:
        return None


def check_no_group_to_fork() -> None:
    """A forked rank would inherit this process's group: its connections, without the threads that
    serve them. It could neither use that group nor tear it down (both hang), so refuse."""
    group = group_here()
    if group is None:
        return
    rank, size = group
    raise LaunchConfigError(
        f"This process is rank {rank} of a {size}-process torch.distributed group (PartialState() or "
        "Accelerator() in a launched function creates one), and ranks forked from it would inherit that "
        "group, which they can neither use nor close. Pass start_method='forkserver' (or 'spawn') to this "
        "launch: its ranks start fresh and form a group of their own. Or launch before the group exists "
        "(before PartialState() in the function)."
    )
