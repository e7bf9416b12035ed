"""Why a rank was killed by SIGKILL: its memory cgroup's limit and OOM counters (cgroup v1 and v2),
read by the launcher from the cgroup filesystem, and the words for it.

A rank's cgroup must be read while it lives: once dead, /proc/PID/cgroup names the root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

NEAR_LIMIT = 0.8  # a SIGKILLed rank whose RSS peaked above this share of its limit was most likely OOM-killed


@dataclass(frozen=True)
class MemoryCgroup:
    """A rank's memory cgroup: `name` as /proc/PID/cgroup gives it, `dirs` its folder in the cgroup
    filesystem and its ancestors' (nearest first), `version` 1 or 2."""

    name: str
    dirs: tuple
    version: int

    def _limits(self) -> list:
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        return [_read_int(os.path.join(d, name)) for d in self.dirs]  # None: "max", or no file (root)

    def limit(self) -> Optional[int]:
        """The smallest limit on the way to the root (limits are hierarchical), None if there is none."""
        limits = [v for v in self._limits() if v]
        return min(limits) if limits else None

    def counters(self) -> dict:
        """{folder: (oom kills, or None where the kernel does not count them; limit hits)} for its
        own folder and those up to the one whose limit binds: a kill in a wider cgroup (a sibling's
        OOM under a shared parent) says nothing about this one."""
        limits = self._limits()
        known = [v for v in limits if v]
        upto = limits.index(min(known)) if known else 0
        out = {}
        for d in self.dirs[: upto + 1]:
            if self.version == 1:
                out[d] = (
                    _field(os.path.join(d, "memory.oom_control"), "oom_kill"),
                    _read_int(os.path.join(d, "memory.failcnt")),
                )
            else:
                out[d] = (
                    _field(os.path.join(d, "memory.events"), "oom_kill"),
                    _field(os.path.join(d, "memory.events"), "max"),
                )
        return out


def cgroup_of(pid: int) -> Optional[MemoryCgroup]:
    """The memory cgroup of a live process, or None (no memory controller mounted, no such process)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    for version, path in ((1, v1), (2, v2)):
        mount = _mounts().get(version)
        if path is None or mount is None:
            continue
        root, point = mount
        rel = path[len(root) :] if root != "/" and path.startswith(root) else path
        folder = os.path.normpath(point + "/" + rel.lstrip("/"))
        if os.path.isdir(folder):
            dirs = []
            while folder.startswith(point):
                dirs.append(folder)
                if folder == point:
                    break
                folder = os.path.dirname(folder)
            if version == 2 and not os.path.exists(os.path.join(dirs[0], "memory.events")):
                continue  # a v2 hierarchy without the memory controller
            return MemoryCgroup(path, tuple(dirs), version)
    return None


_mount_cache: Optional[dict] = None


def _mounts() -> dict:
    """{1: (root, mount point) of the v1 memory hierarchy, 2: (root, mount point) of cgroup2}."""
    global _mount_cache
    if _mount_cache is None:
        found = {}
        try:
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    left, _, right = line.partition(" - ")
                    fields, kind = left.split(), right.split()
                    if kind and kind[0] == "cgroup" and "memory" in kind[-1].split(","):
                        found.setdefault(1, (fields[3], fields[4]))
                    elif kind and kind[0] == "cgroup2":
                        found.setdefault(2, (fields[3], fields[4]))
        except OSError:
            pass
        _mount_cache = found
    return _mount_cache


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # "max" (v2's no limit) included
        return None


def _field(path: str, name: str) -> Optional[int]:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == name:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def effective_limit(cgroup: Optional[MemoryCgroup], machine_total: int) -> int:
    """What a rank may use: its cgroup's limit if one is below the machine's memory, else the machine's."""
    limit = cgroup.limit() if cgroup is not None else None
    return limit if limit is not None and limit < machine_total else machine_total


def counted_kill(cgroup: MemoryCgroup, before: dict) -> str:
    """Words for an OOM kill its cgroup counted since `before` (its counters() then), else ""."""
    for folder, (kills, hits) in cgroup.counters().items():
        was_kills, was_hits = before.get(folder, (None, None))
        if kills is not None and was_kills is not None:
            if kills > was_kills:
                return f"its memory cgroup {_shown(folder, cgroup)} counted an OOM kill"
        elif hits is not None and was_hits is not None and hits > was_hits:  # v1 before oom_kill existed
            return f"its memory cgroup {_shown(folder, cgroup)} hit its limit"
    return ""


def _shown(folder: str, cgroup: MemoryCgroup) -> str:
    up = cgroup.dirs.index(folder)
    name = cgroup.name
    for _ in range(up):
        name = os.path.dirname(name)
    return name


def diagnose(peak_rss: Optional[int], limit: Optional[int], counted: str) -> tuple:
    """(oom, memory_note) for a rank killed by SIGKILL: ("certain", ...) when its cgroup counted
    it, ("likely", ...) when its RSS peaked near `limit`, else ("", "")."""
    peak = f"its RSS peaked at {human_bytes(peak_rss)}" if peak_rss else ""
    if counted:
        of = f" (limit {human_bytes(limit)})" if limit else ""
        return "certain", f"out of memory: {counted}{of}" + (f"; {peak}" if peak else "")
    if peak_rss and limit and peak_rss >= NEAR_LIMIT * limit:
        return "likely", f"most likely out of memory: {peak} of {human_bytes(limit)}"
    return "", ""


def human_bytes(n: Optional[int]) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
