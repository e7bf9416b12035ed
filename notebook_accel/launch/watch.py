"""The launcher's watch over a launch's progress (issue #29): when for `stall_after` seconds no rank
has written output, returned or got past a collective (a new one enqueued), the sinks get a LaunchStalled event with a
report of where every rank is (stall.py); LaunchResumed once one moves again. The run goes on.

Cheap while ranks talk: nothing is asked of them until they have been quiet for a third of
`stall_after`; then each rank's collective counters are read every third of it (watch_probe.py),
and only a stall takes their stacks. A probe asks by a key: a local rank's pid, or whatever an
engine whose ranks the launcher cannot reach by pid asks through (Ray: the rank, via its actor).
"""

from __future__ import annotations

from typing import Optional

from . import events as ev
from . import stall, watch_probe

MIN_PROBE_S = 1.0
# A rank still joining the group this long after another returned without ever joining is failed:
# the group can never form. The wait covers a rank that joined by its own init_process_group (it
# sends nothing) and a peer whose "joined" is still on its way.
JOIN_GRACE_S = 2.0


class Watch:
    def __init__(self, stall_after: float, now: float, label=None, probe=watch_probe):
        self.stall_after = float(stall_after or 0.0)
        self.label = label  # names notebook files `Cell In[N]` (launch/frontend.py)
        self.probe = probe  # collectives(key) and stacks(key): watch_probe's, by pid, or an engine's
        self.last_progress = now
        self.next_probe = 0.0
        self.issued: dict = {}  # rank -> {group: the last sequence number it enqueued}
        self.report: Optional[stall.StallReport] = None  # the stall going on, if any
        self.last_report: Optional[stall.StallReport] = None  # the latest, for a timeout's error
        self.doomed_since: Optional[float] = None  # when group_cannot_form first saw such a group

    @property
    def on(self) -> bool:
        return self.stall_after > 0

    def progress(self, now: float) -> list:
        """A rank wrote, returned or got past a collective: clears a stall (the event to send)."""
        self.last_progress = now
        if self.report is None:
            return []
        self.report = None
        return [ev.LaunchResumed()]

    def due(self, now: float) -> bool:
        """Whether `tick(now)` asks the ranks (an engine may gather their answers at once first)."""
        return self.on and now - self.last_progress >= self.stall_after / 3 and now >= self.next_probe

    def tick(self, now: float, ranks: list) -> list:
        """`ranks`: (rank, key, rank_state(...)) of every rank not failed. The events to send now."""
        if not self.due(now):
            return []
        self.next_probe = now + max(MIN_PROBE_S, self.stall_after / 3)
        seen = {rank: self.probe.collectives(key) for rank, key, returned in ranks if not returned}
        events = []
        for rank, found in seen.items():
            if found is None:
                continue
            if rank in self.issued and found.issued != self.issued[rank]:
                events += self.progress(now)  # it got past a collective and into another one
            self.issued[rank] = found.issued
        if self.report is None and now - self.last_progress >= self.stall_after:
            self.report = self.last_report = self.snapshot(now - self.last_progress, ranks, seen)
            events.append(ev.LaunchStalled(self.report))
        return events

    def group_cannot_form(self, now: float, ranks: list) -> Optional[tuple]:
        """(stuck ranks, ranks that left) once ranks have waited JOIN_GRACE_S to join a process group
        that a rank which returned without ever joining made impossible (init_process_group would
        wait its whole 30 minutes). `ranks`: (rank, "joining" / "joined" / None, returned, running)."""
        left = sorted(rank for rank, group, returned, _ in ranks if returned and not group)
        stuck = sorted(rank for rank, group, _, running in ranks if running and group == "joining")
        if not (left and stuck):
            self.doomed_since = None
            return None
        if self.doomed_since is None:
            self.doomed_since = now
        return (stuck, left) if now - self.doomed_since >= JOIN_GRACE_S else None

    def snapshot(self, seconds: float, ranks: list, seen: Optional[dict] = None) -> stall.StallReport:
        return snapshot(seconds, ranks, self.label, seen, probe=self.probe)


def rank_state(returned: bool, channel):
    """What tick and snapshot take for a rank: True once it returned, "starting" until its function
    began (it imports, or unpickles the function: it has no worker server to ask yet), else False."""
    if returned:
        return True
    return "starting" if channel is not None and not channel.calling else False


def snapshot(seconds: float, ranks: list, label=None, seen: Optional[dict] = None, asked: bool = False, probe=None):
    """Where every rank is now: its stacks and collectives. `ranks`: (rank, key, returned), or
    (rank, key, state) with a state of stall.RankWhere's; `asked`: on demand (a Stacks button,
    Session.stacks()), not because of a stall; `probe`: what asks by key (watch_probe: by pid)."""
    probe = probe or watch_probe
    seen = seen or {}
    where = []
    for rank, key, returned in ranks:
        if returned is True or returned in ("returned", "idle", "failed", "starting"):
            where.append(stall.RankWhere(rank, "returned" if returned is True else returned))
            continue
        found = seen.get(rank) or probe.collectives(key)
        text = probe.stacks(key)
        threads = stall.frames_of(text) if text else ()
        if found is None and not threads:
            where.append(stall.RankWhere(rank, "unknown"))
            continue
        waiting = found.waiting if found else ()
        state = "waiting" if waiting else "running"
        where.append(stall.RankWhere(rank, state, waiting, found.last if found else (), threads))
    return stall.build(seconds, where, label, asked=asked)
