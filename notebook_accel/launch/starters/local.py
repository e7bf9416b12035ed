"""Ranks on this machine, started by fork, spawn or forkserver and watched by our own monitor.

`start` is the one place that switches on the start method; launches (`run`) and interactive
sessions both start their ranks through it.
"""

from __future__ import annotations

import signal
import time
from typing import NamedTuple, Optional

from .. import events as ev
from .. import procs
from ..errors import LaunchStoppedError, LaunchTimeoutError


class StartedRanks(NamedTuple):
    handles: list  # procs.RankProcess, one per local rank, in local-rank order
    warm: Optional[object]  # the WarmServer that forked them (forkserver), else None


def start(plan, payload, deadline: Optional[float] = None) -> StartedRanks:
    """Start every local rank of `plan` running `payload`. If one fails to start, the ranks
    already started are killed and reaped before the error goes up: nothing is left behind.
    `deadline` (time.monotonic()) bounds waiting for the forkserver to fork them (a launch's timeout)."""
    warm = None
    if plan.start_method == "fork":
        from ... import state  # noqa: F401  (imported once here rather than in every forked rank)
        from .. import rank_imports

        rank_imports.import_all()  # likewise torch._dynamo and the training modules, once a process
    else:
        payload.pickled()  # pickled now: an unpicklable object is named before any process starts
    if plan.start_method == "forkserver":
        from ..warm import WarmServer

        warm = WarmServer.get()  # not bounded by `deadline`: it says ready, or its socket ends
    handles, requests = [], []
    try:
        for local_rank in range(plan.num_processes):
            env = plan.rank_env(local_rank)
            spec = (local_rank, int(env["RANK"]), env, plan.threads_per_process)
            if plan.start_method == "fork":
                handles.append(procs.start_fork(*spec, payload.function, payload.args))
            elif plan.start_method == "spawn":
                handles.append(procs.start_spawn(*spec, payload.pickled()))
            else:
                requests.append((*spec, payload.pickled()))
        if requests:
            handles.extend(warm.start_ranks(requests, deadline))
    except BaseException:
        kill(handles, warm)
        for h in handles:
            h.close()
        raise
    return StartedRanks(handles, warm)


def kill(handles: list, warm, seconds: float = 5.0) -> None:
    """SIGKILL every rank (and its process group) and wait up to `seconds` until each has exited."""
    for h in handles:
        h.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + seconds
    for h in handles:
        # A forkserver rank's exit code never comes once the server is gone; it died with it.
        while not h.exited() and not (warm is not None and warm.lost) and time.monotonic() < deadline:
            if warm is not None:
                warm.pump()
            time.sleep(0.01)


def run(plan, payload, sink, control) -> list:
    from ..monitor import Monitor

    if plan.start_method != "fork":
        payload.pickled()  # before LaunchStarted: a launch that cannot start shows no panel
    started = time.monotonic()
    sink.handle(
        ev.LaunchStarted(
            plan.num_processes, plan.start_method, plan.world_size, plan.node_rank, fsdp=plan.fsdp
        )
    )
    ranks = None
    try:
        if plan.start_method == "forkserver":
            from ..warm import WarmServer

            WarmServer.get()  # a kernel's one-time warm-up, before the launch's clock starts
        control.start()  # the timeout covers starting the ranks too
        try:
            ranks = start(plan, payload, control.deadline)
        except LaunchTimeoutError as exc:
            control.timed_out = True
            text = f"timed out after {control.timeout:g} s (timeout={control.timeout:g}) {exc.reason}"
            raise LaunchTimeoutError(text) from None
        results = Monitor(ranks.handles, plan, sink, warm=ranks.warm, control=control).run()
    except BaseException as exc:
        # KeyboardInterrupt, a failure while starting, or a rank failure: leave no process behind.
        if ranks is not None:
            kill(ranks.handles, ranks.warm)
            for h in ranks.handles:
                h.close()
        finished(sink, started, exc)
        raise
    finished(sink, started)
    return results


def finished(sink, started: float, exc: Optional[BaseException] = None) -> None:
    """A launch's LaunchFinished: ok, or failed as `exc` says (its failed ranks, why it was stopped)."""
    seconds = time.monotonic() - started
    if exc is None:
        sink.handle(ev.LaunchFinished(True, seconds))
    else:
        sink.handle(ev.LaunchFinished(False, seconds, _failed(exc), _stopped(exc)))


def _stopped(exc: BaseException) -> str:
    if isinstance(exc, LaunchStoppedError):
        return exc.reason
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else ""


def _failed(exc: BaseException) -> tuple:
    reports = getattr(exc, "reports", None)
    return tuple(sorted(reports)) if reports else ()
