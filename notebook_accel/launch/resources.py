"""Each local rank's resources, sampled from the parent by pid (never by code in the rank): RSS and
CPU % through psutil, device memory and utilisation through NVML where it is present
(device_probes.NvmlProcesses: ctypes, no pynvml, CUDA never initialised), each rank's sampled
peaks, and its memory cgroup for an OOM diagnosis.

One psutil.Process is kept per rank: cpu_percent() measures since that object's previous call.
"""

from __future__ import annotations

import time
from typing import Optional

import psutil

from ..device_probes import NvmlProcesses
from . import events as ev
from . import oom

INTERVAL_S = 1.0  # at most one sample per rank per second


class _Rank:
    __slots__ = ("rank", "pid", "proc", "peak_rss", "peak_device", "cgroup", "counters", "limit")

    def __init__(self, rank: int, pid: int):
        self.rank, self.pid = rank, pid
        self.peak_rss = 0
        self.peak_device: Optional[int] = None
        self.cgroup: Optional[oom.MemoryCgroup] = None
        self.counters: dict = {}  # its cgroup's OOM counters when first seen there
        self.limit: Optional[int] = None
        try:
            self.proc: Optional[psutil.Process] = psutil.Process(pid)
            self.proc.cpu_percent(None)  # the first call only starts the measure
        except psutil.Error:
            self.proc = None


class ResourceSampler:
    """`due(now)` / `sample(now)` from the monitor's loop; `peaks(rank)` and `oom(...)` at a rank's end."""

    def __init__(self, pids: dict, interval: Optional[float] = None):
        self.interval = INTERVAL_S if interval is None else interval  # read now: a benchmark turns it off
        self.machine_total = psutil.virtual_memory().total
        self.ranks = {rank: _Rank(rank, pid) for rank, pid in pids.items()}
        self.nvml = _Nvml.get()
        self.next_at = time.monotonic()  # the first tick learns every rank's cgroup at once

    def add(self, rank: int, pid: int) -> None:
        """A rank that appeared after the start (xmp.spawn's through the monitor's gate, an elastic
        worker through the hub); a restarted rank's new process replaces the old, peaks and all."""
        self.ranks[rank] = _Rank(rank, pid)

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def sample(self, now: float, live: list) -> list:
        """RankResources for each rank in `live` that still runs."""
        self.next_at = now + self.interval
        device = self.nvml.by_pid() if self.nvml is not None else {}
        out = []
        for rank in live:
            r = self.ranks.get(rank)
            if r is None or r.proc is None:
                continue
            try:
                with r.proc.oneshot():
                    rss = r.proc.memory_info().rss
                    cpu = r.proc.cpu_percent(None)
            except psutil.Error:  # it ended between ticks
                continue
            self._watch_cgroup(r)
            r.peak_rss = max(r.peak_rss, rss)
            used, util = device.get(r.pid, (None, None))
            if used is not None:
                r.peak_device = max(r.peak_device or 0, used)
            out.append(ev.RankResources(rank, rss, round(cpu, 1), r.limit, used, util))
        return out

    def _watch_cgroup(self, r: _Rank) -> None:
        cgroup = oom.cgroup_of(r.pid)
        if cgroup is None or (r.cgroup is not None and cgroup.name == r.cgroup.name):
            return
        r.cgroup, r.counters = cgroup, cgroup.counters()  # moved (or first seen): a new baseline
        r.limit = oom.effective_limit(cgroup, self.machine_total)

    def peaks(self, rank: int) -> tuple:
        """(sampled peak RSS or None, sampled peak device memory or None)."""
        r = self.ranks.get(rank)
        if r is None:
            return None, None
        return (r.peak_rss or None), r.peak_device

    def oom(self, rank: int, peak_rss: Optional[int]) -> tuple:
        """(oom, memory_note) for a rank that died by SIGKILL (see oom.diagnose)."""
        r = self.ranks.get(rank)
        if r is None:
            return "", ""
        counted = oom.counted_kill(r.cgroup, r.counters) if r.cgroup is not None else ""
        limit = r.limit if r.limit is not None else self.machine_total
        return oom.diagnose(peak_rss, limit, counted)


class _Nvml:
    """The one NVML reader of this process (device_probes.NvmlProcesses), opened on first use;
    None where NVML or a device is missing."""

    _instance = None
    _tried = False

    @classmethod
    def get(cls):
        if not cls._tried:
            cls._tried = True
            try:
                cls._instance = NvmlProcesses.open()
            except Exception:  # a driver that answers oddly: no device columns rather than no launch
                cls._instance = None
        return cls._instance
