"""What a launch reports, as typed events tagged with the rank (see shared/DESIGN.md, step 4).

Sinks (console, widget, JupyterLab extension) consume these and know nothing of processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class LaunchStarted:
    """`ranks` names the ranks taking part when they are not this node's block of num_processes
    (a session cell sent to some workers only); `fsdp`: the ranks shard models with FSDP."""

    num_processes: int
    start_method: str
    world_size: int
    node_rank: int = 0
    ranks: tuple = ()
    fsdp: bool = False


@dataclass(frozen=True)
class RankStarted:
    """A rank's process is up (its pid) and about to run the function; `node` names its machine
    where a launch spans several (a Ray launch), else ""."""

    rank: int
    pid: int
    node: str = ""


@dataclass(frozen=True)
class RankOutput:
    """One line of a rank's fd 1 ("stdout") or fd 2 ("stderr"), without its newline.

    `transient` marks text ended by a bare carriage return (a progress bar redrawing itself): the
    next line from the same rank and stream replaces it.
    """

    rank: int
    stream: str
    text: str
    transient: bool = False


@dataclass(frozen=True)
class RankResources:
    """A rank's resources, sampled by the launcher (at most once a second), never by the rank.

    `rss` in bytes and `cpu_percent` (100 = one core busy) of the rank's process; `memory_limit`:
    the bytes its memory cgroup, else the machine, allows; `device_memory` (bytes) and `device_util`
    (%) of its accelerator where NVML is present, else None."""

    rank: int
    rss: int
    cpu_percent: float
    memory_limit: Optional[int] = None
    device_memory: Optional[int] = None
    device_util: Optional[float] = None


@dataclass(frozen=True)
class RankFinished:
    """A rank returned; its result reached the launcher `seconds` after the rank started.

    `peak_rss` (bytes): exact (the kernel's ru_maxrss) for ranks the launcher reaps, sampled for
    forkserver ranks; None where unknown. Likewise `peak_device_memory`, sampled through NVML."""

    rank: int
    seconds: float
    peak_rss: Optional[int] = None
    peak_device_memory: Optional[int] = None


@dataclass(frozen=True)
class RankFailed:
    """A rank raised (exc_type set), died by a signal (signal_name set) or exited non-zero.

    Peaks as in RankFinished. `oom` is "certain" (its memory cgroup counted an OOM kill during the
    launch) or "likely" (killed by SIGKILL with its RSS near its limit), and `memory_note` says why."""

    rank: int
    pid: Optional[int]
    exitcode: Optional[int]
    exc_type: Optional[str] = None
    message: str = ""
    traceback: str = ""
    signal_name: Optional[str] = None
    peak_rss: Optional[int] = None
    peak_device_memory: Optional[int] = None
    oom: str = ""
    memory_note: str = ""
    node: str = ""  # the rank's machine, where the launch spans several (a Ray launch)

    def summary(self) -> str:
        who = f"rank {self.rank} on node {self.node}" if self.node else f"rank {self.rank}"
        if self.oom and self.signal_name:
            return f"{who} was killed ({self.signal_name}), {self.memory_note}"
        if self.message and not self.exc_type:  # the launcher's own word on it (forkserver lost)
            return f"{who} failed: {self.message}"
        if self.exc_type:
            return f"{who} raised {self.exc_type}: {self.message}"
        if self.signal_name:
            return f"{who} died with {self.signal_name}"
        return f"{who} exited with code {self.exitcode} without a result"


@dataclass(frozen=True)
class RankStopped:
    """A rank the launcher stopped because another failed or the launch was interrupted."""

    rank: int
    reason: str


@dataclass(frozen=True)
class LaunchNotice:
    """Something the person running the launch should know while it runs (a node still missing)."""

    text: str


@dataclass(frozen=True)
class LaunchFinished:
    """`stopped` says why a launch was ended from outside (Stop button, timeout, interrupt)."""

    ok: bool
    seconds: float
    failed_ranks: tuple = field(default_factory=tuple)
    stopped: str = ""


@dataclass(frozen=True)
class LaunchStalled:
    """No rank made progress (output, a return, a completed collective) for `report.seconds`:
    `report` (launch/stall.py StallReport) says where each rank is. The launch goes on."""

    report: object


@dataclass(frozen=True)
class LaunchResumed:
    """A rank moved again after a LaunchStalled."""
