"""The parent's event loop: read every rank's output and control messages, turn them into events,
stop the other ranks when one fails, and collect results. Single-threaded, driven by a selector.

In a pdb=True launch the first rank to fail stays in pdb (child.py): its failure is reported and the
other ranks stopped as usual, then this loop, on the launching thread, shows its pdb's output and reads
each command with input() until pdb ends (`_converse`); only then does that rank exit. The launch's
timeout no longer applies from then on: the person debugging is not cut off."""

from __future__ import annotations

import dataclasses
import re
import selectors
import signal
import time
from typing import Optional

from . import events as ev
from . import pdb_relay, stall, watch_probe
from .channel import RankChannel, send_frame
from .errors import LaunchFailedError, LaunchStoppedError, LaunchTimeoutError, failure_from_exit
from .resources import ResourceSampler
from .watch import Watch, rank_state

STOP_GRACE_S = 1.0  # SIGTERM, then SIGKILL after this long
DRAIN_GRACE_S = 2.0  # after a rank exits, wait this long for a grandchild that still holds its stdout
UNKNOWN_END = "its process ended without a result or an error, and its exit status went to xmp.spawn"
PDB_EXIT_GRACE_S = 10.0  # once its pdb ended, the debugged rank has this long to exit before SIGKILL
GATE_GRACE_S = 5.0  # once every rank is done, wait this long for a gate (xmp.spawn) to say it is done


class _Rank:
    def __init__(self, proc, rank: int):
        self.proc = proc
        self.rank = rank
        self.channel = RankChannel(rank)
        self.exited_at: Optional[float] = None
        self.done = False
        self.reported = False  # failed by the monitor itself (_check_group): its exit says nothing more
        self.started = time.monotonic()


class Monitor:
    def __init__(self, procs: list, plan, sink, warm=None, control=None, gate=None):
        self.plan = plan
        self.sink = sink
        self.warm = warm
        self.control = control
        self.stopped = ""  # why the launch was ended from outside, if it was
        self.ranks: list = []
        self.sel = selectors.DefaultSelector()
        self.failures: list = []
        self.stop_sent_at: Optional[float] = None
        self.killed = False
        self.server_lost = False
        self.resources = ResourceSampler({})
        self.debugged: Optional[_Rank] = None  # pdb=True: the first rank that failed, kept in pdb
        self.console: Optional[pdb_relay.Console] = None  # its user's side, once the others stopped
        self.pdb_ended_at: Optional[float] = None
        from . import frontend

        self.watch = Watch(getattr(plan, "stall_after", 0.0), time.monotonic(), frontend.label_traceback)
        for p in procs:
            self._add(p)
        # A gate hands over ranks as they appear (xmp.spawn's, starters/xla.py): `sock` is readable
        # when one waits for `accept()`, `ended_r` once no more will come.
        self.gate = gate
        self.gate_open = gate is not None
        self.all_done_at: Optional[float] = None
        if gate is not None:
            self.sel.register(gate.sock, selectors.EVENT_READ, (None, "gate"))
            self.sel.register(gate.ended_r, selectors.EVENT_READ, (None, "gate_end"))
        if warm is not None:
            self.sel.register(warm.sock, selectors.EVENT_READ, (None, "warm"))
        if control is not None:
            self.sel.register(control.fileno(), selectors.EVENT_READ, (None, "control"))

    def _add(self, proc) -> None:
        r = _Rank(proc, self.plan.node_rank * self.plan.num_processes + proc.local_rank)
        self.ranks.append(r)
        self.resources.add(r.rank, proc.pid)
        for sock, kind in ((r.proc.out, "stdout"), (r.proc.err, "stderr"), (r.proc.ctrl, "ctrl")):
            sock.setblocking(False)
            self.sel.register(sock, selectors.EVENT_READ, (r, kind))
        if r.proc.exit_fd is not None:
            self.sel.register(r.proc.exit_fd, selectors.EVENT_READ, (r, "exit"))
        if self.stop_sent_at is not None:  # came through the gate after the launch was stopped
            r.proc.send_signal(signal.SIGKILL if self.killed else signal.SIGTERM)

    def _running(self) -> bool:
        if not all(r.done for r in self.ranks):
            self.all_done_at = None
            return True
        if not self.gate_open or len(self.ranks) == self.gate.expected:
            return False
        # Every rank so far is done; more may still come through the gate, unless there were some
        # (or the launch was stopped) and it has not closed within GATE_GRACE_S.
        now = time.monotonic()
        if self.all_done_at is None:
            self.all_done_at = now
        return not ((self.ranks or self.stop_sent_at) and now - self.all_done_at > GATE_GRACE_S)

    # -- main loop ----------------------------------------------------------------------------
    def run(self) -> list:
        try:
            while self._running():
                self._step()
        finally:
            self.sel.close()
            for r in self.ranks:
                r.proc.close()
        if self.stopped and not self.failures:
            kind = LaunchTimeoutError if self.control.timed_out else LaunchStoppedError
            raise kind(self.stopped, stall=self.watch.last_report)
        if self.failures:
            # A transport error on a rank whose peer died is a symptom; put root causes first.
            ordered = sorted(
                self.failures,
                key=lambda f: _is_peer_fallout({"exc_type": f.exc_type or "", "message": f.message}),
            )
            error = LaunchFailedError(ordered)
            if self.console is not None and self.console.refused:
                why = f"no debugger was opened on rank {self.debugged.rank}: {self.console.refused}"
                error.args = (f"{error.args[0]}\n\npdb=True, but {why}",)
            raise error
        return [r.channel.load_result() for r in sorted(self.ranks, key=lambda r: r.rank)]

    def _step(self) -> None:
        needs_polling = any(r.proc.exit_fd is None and not r.done for r in self.ranks)
        wait = 0.05 if needs_polling or self.stop_sent_at else 1.0
        if self.control is not None and self.debugged is None:  # past the deadline it would spin
            wait = self.control.wait_limit(time.monotonic(), wait)
        wait = max(0.0, min(wait, self.resources.next_at - time.monotonic()))
        for key, _ in self.sel.select(timeout=wait):
            r, kind = key.data
            if kind == "control":
                self.control.drain()
            elif kind == "gate":
                for proc in self.gate.accept():
                    self._add(proc)
            elif kind == "gate_end":
                self.sel.unregister(key.fileobj)
                self.gate_open = False
            elif kind == "warm":
                self.warm.pump()  # its end shows as warm.lost, handled below
            elif kind == "exit":
                self.sel.unregister(key.fileobj)
                r.proc.poll()
            else:
                self._read(r, key.fileobj, kind)
        if self.debugged is None and self.stop_sent_at is None:
            waiting = next((r for r in self.ranks if r.channel.pdb and not r.done), None)
            if waiting is not None:
                self._keep_for_pdb(waiting)
        if self.warm is not None and self.warm.lost and not self.server_lost:
            self._server_lost()  # shut down by another thread, or its end seen by another reader
        now = time.monotonic()
        if self.resources.due(now):
            for event in self.resources.sample(now, [r.rank for r in self.ranks if not r.done]):
                self.sink.handle(event)
        # A rank kept in pdb: the timeout no longer applies (module docstring).
        if self.control is not None and not self.stopped and self.debugged is None and self.control.check(now):
            self.stopped = self.control.reason
            self.stop(self.stopped)
        for r in self.ranks:
            if not r.done:
                self._maybe_finish(r, now)
        self._check_group(now)
        if self.debugged is not None and all(o.done for o in self.ranks if o is not self.debugged):
            self._converse(self.debugged)
            if self.pdb_ended_at is not None and time.monotonic() - self.pdb_ended_at > PDB_EXIT_GRACE_S:
                self.debugged.proc.send_signal(signal.SIGKILL)
        if self.stop_sent_at is None:
            live = [(r.rank, r.proc.pid, rank_state(r.channel.result is not None, r.channel)) for r in self.ranks if not r.reported]
            for event in self.watch.tick(now, live):
                self.sink.handle(event)
        if self.stop_sent_at is not None and not self.killed and now - self.stop_sent_at > STOP_GRACE_S:
            self._signal_all(signal.SIGKILL)
            self.killed = True

    def _read(self, r: _Rank, sock, stream: str) -> None:
        events = r.channel.read(stream, sock)
        if events is None:
            return
        if stream not in r.channel.open:
            self.sel.unregister(sock)
        if r.channel.moved() or events:
            for event in self.watch.progress(time.monotonic()):  # output, a result, its function began
                self.sink.handle(event)
        for event in events:
            self.sink.handle(event)

    # -- completion and failure ---------------------------------------------------------------
    def _maybe_finish(self, r: _Rank, now: float) -> None:
        code = r.proc.poll()
        if code is None:
            return
        if r.exited_at is None:
            r.exited_at = now
        if r.channel.open and now - r.exited_at < DRAIN_GRACE_S:
            return
        r.done = True
        watch_probe.forget(r.proc.pid)
        for sock in (r.proc.out, r.proc.err, r.proc.ctrl):
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
        for event in r.channel.flush():
            self.sink.handle(event)
        if r.reported:
            return
        error = r.channel.error
        peak_rss, peak_device = self.resources.peaks(r.rank)
        peak_rss = r.proc.max_rss or peak_rss  # exact where we reaped it, else sampled
        peaks = {"peak_rss": peak_rss, "peak_device_memory": peak_device}
        if r.channel.result is not None and code == 0:
            self.sink.handle(ev.RankFinished(r.rank, now - r.started, **peaks))
            return
        if self.stopped:
            # Ended from outside: whatever the rank said while dying is not its failure.
            self.sink.handle(ev.RankStopped(r.rank, self.stopped))
            return
        if self.stop_sent_at is not None and error is None:
            self.sink.handle(ev.RankStopped(r.rank, "stopped after another rank failed"))
            return
        if error is not None:
            failure = ev.RankFailed(r.rank, r.proc.pid, code, **error, **peaks)
        elif getattr(r.proc, "exit_unknown", False):
            failure = ev.RankFailed(r.rank, r.proc.pid, None, message=UNKNOWN_END, **peaks)
        else:
            failure = dataclasses.replace(failure_from_exit(r.rank, r.proc.pid, code), **peaks)
            if code == -signal.SIGKILL:  # not our own: a rank we stopped was reported above
                oom, note = self.resources.oom(r.rank, peak_rss)
                failure = dataclasses.replace(failure, oom=oom, memory_note=note)
        returned = sorted(o.rank for o in self.ranks if o is not r and o.channel.result is not None)
        if error is not None and _is_peer_fallout(error) and returned and not self.failures:
            # Not a crash: a peer finished the function while this rank still waited in a collective.
            failure = dataclasses.replace(failure, exc_type=None, message=_left_behind(error, returned))
        elif self.stop_sent_at is not None and error is not None and _is_peer_fallout(error):
            self.sink.handle(ev.RankStopped(r.rank, failure.summary()))
            return
        self.failures.append(failure)
        self.sink.handle(failure)
        if self.stop_sent_at is None:
            self.stop(f"rank {r.rank} failed")

    def _keep_for_pdb(self, r: _Rank) -> None:
        """`r` failed and waits in pdb: report it now, stop the others; it is debugged once they end."""
        self.debugged = r
        r.reported = True  # its exit, after pdb, says nothing more
        peak_rss, peak_device = self.resources.peaks(r.rank)
        error = r.channel.error or {"message": "it stopped in pdb without reporting an error"}
        peaks = {"peak_rss": peak_rss, "peak_device_memory": peak_device}
        failure = ev.RankFailed(r.rank, r.proc.pid, None, **error, **peaks)
        self.failures.append(failure)
        self.sink.handle(failure)
        self.stop(f"rank {r.rank} failed")

    def _converse(self, r: _Rank) -> None:
        """The debugged rank's pdb output shown, and the user's line for each prompt sent back."""
        if self.console is None:
            self.console = pdb_relay.Console()
            self.console.write(  # failures[0] is r's: a rank is kept in pdb only before any stop
                f"{self.failures[0].summary()}\npdb on rank {r.rank}'s frames; the other ranks were stopped, "
                "and this rank ends with the debugger (q, c or the end of input):\n"
            )
        while r.channel.pdb:
            output, prompt = r.channel.pdb.pop(0)
            self.console.write(output)
            if prompt is None:  # pdb ended: the rank exits now
                self.pdb_ended_at = self.pdb_ended_at or time.monotonic()
                continue
            line = None
            try:
                line = self.console.read_line(prompt)
            finally:  # an interrupt too ends pdb (the rank is killed with the launch anyway)
                try:
                    send_frame(r.proc.ctrl, ("pdb_line", line))
                except OSError:
                    pass

    def _check_group(self, now: float) -> None:
        """Fail the ranks waiting to join the process group once a rank has returned without ever
        joining (the watch's group_cannot_form): init_process_group would wait 30 minutes for it."""
        if self.stop_sent_at is not None:
            return
        rows = [(r.rank, r.channel.group, r.done and r.channel.result is not None, not r.done) for r in self.ranks]
        found = self.watch.group_cannot_form(now, rows)
        if found is None:
            return
        stuck, left = found
        message = stall.group_cannot_form(left)
        for r in self.ranks:
            if r.rank in stuck and not r.done:
                r.reported = True
                failure = ev.RankFailed(r.rank, r.proc.pid, None, message=message)
                self.failures.append(failure)
                self.sink.handle(failure)
        names = ", ".join(map(str, left))
        self.stop(f"rank(s) {names} returned without joining the process group")

    def _server_lost(self) -> None:
        """The forkserver's socket ended: its ranks died with it (they die with their parent), and
        their exit codes will never come. Fail every rank still running, naming the cause."""
        self.server_lost = True
        try:
            self.sel.unregister(self.warm.sock)
        except (KeyError, ValueError):
            pass
        for r in self.ranks:
            if r.done:
                continue
            r.proc.send_signal(signal.SIGKILL)  # in case one outlived its parent
            r.done = True
            for event in r.channel.flush():
                self.sink.handle(event)
            peak_rss, peak_device = self.resources.peaks(r.rank)
            failure = ev.RankFailed(
                r.rank, r.proc.pid, None, message=self.warm.lost, peak_rss=peak_rss, peak_device_memory=peak_device
            )
            self.failures.append(failure)
            self.sink.handle(failure)

    def stop(self, reason: str) -> None:
        """Ask every running rank to stop (SIGTERM), SIGKILL after STOP_GRACE_S."""
        if self.stop_sent_at is None:
            self.stop_sent_at = time.monotonic()
            self._signal_all(signal.SIGTERM)

    def _signal_all(self, sig: int) -> None:
        for r in self.ranks:
            if not r.done and r is not self.debugged:  # it ends with its pdb
                r.proc.send_signal(sig)


def _is_peer_fallout(error: dict) -> bool:
    # Ranks blocked in a collective with a rank that died fail with transport errors: not a root cause.
    text = f"{error.get('exc_type', '')} {error.get('message', '')}"
    return any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "DistBackendError")
    )


def _left_behind(error: dict, returned: list) -> str:
    ops = re.findall(r"torch[/\\]distributed[/\\]distributed_c10d\.py\", line \d+, in (\w+)", error.get("traceback", ""))
    op = ops[-1] if ops else "a collective"
    who = f"rank {returned[0]}" if len(returned) == 1 else "ranks " + ", ".join(map(str, returned))
    return (
        f"it was still in {op} when {who} returned from the function, so that collective could never complete: "
        f"every rank must run the same collectives in the same order. No rank crashed: the transport error in "
        f"the traceback only says that {who} left"
    )
