"""notebook_launcher and debug_launcher: accelerate's signatures, plus start_method and results."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Optional

from . import events as ev
from .control import LaunchControl
from .errors import LaunchConfigError, LaunchFailedError, LaunchStoppedError, LaunchTimeoutError
from .plan import LaunchPlan, default, make_plan
from .sinks import ConsoleSink, Fanout


def notebook_launcher(
    function,
    args=(),
    num_processes: Optional[int] = None,
    mixed_precision: str = default("no"),
    use_port: str = default("29500"),
    master_addr: str = default("127.0.0.1"),
    node_rank: int = default(0),
    num_nodes: int = default(1),
    rdzv_backend: str = default("static"),
    rdzv_endpoint: str = "",
    rdzv_conf: Optional[dict] = None,
    rdzv_id: str = "none",
    max_restarts: int = default(0),
    monitor_interval: float = 0.1,
    log_line_prefix_template: Optional[str] = None,
    start_method: str = "fork",
    *,
    cpu: Optional[bool] = None,
    sinks=None,
    timeout: Optional[float] = None,
) -> list:
    """Run `function(*args)` on `num_processes` processes; return each local rank's return value.

    A rank that raises makes this raise `LaunchFailedError` (a torch `ChildFailedError`) with that
    rank's traceback; the other ranks are stopped. `timeout` (seconds) stops every rank and raises
    `LaunchTimeoutError` when the run takes longer. `sinks` replace the default sink: the live panel
    in a notebook kernel with widgets, else rank-prefixed text on the console (see sinks.py).
    Arguments left out come from the config file (`notebook-accel config`) when there is one, else
    take the defaults shown; `cpu=None` means the config's `use_cpu`, else False.
    """
    if not callable(function):
        raise TypeError(
            f"notebook_launcher needs a function to run, got {type(function).__name__}: {function!r}"
        )
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of arguments, got {type(args).__name__}; write args=(value,).")
    plan = make_plan(
        num_processes=num_processes, mixed_precision=mixed_precision, use_port=use_port,
        master_addr=master_addr, node_rank=node_rank, num_nodes=num_nodes, rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf, rdzv_id=rdzv_id, max_restarts=max_restarts,
        monitor_interval=monitor_interval, log_line_prefix_template=log_line_prefix_template,
        start_method=start_method, cpu=cpu,
    )  # fmt: skip
    control = LaunchControl(timeout)
    for note in plan.notes:
        print(note, file=sys.stderr)
    sink = Fanout(sinks if sinks is not None else default_sinks())
    try:
        sink.attach(control)
        return run_plan(plan, function, tuple(args), sink, control)
    except LaunchFailedError as exc:
        if "ipykernel" in sys.modules:  # name notebook cells as IPython does: Cell In[N]
            from ..jupyter.cells import relabel_cells

            exc.args = (relabel_cells(exc.args[0]),)
        raise
    finally:
        sink.close()
        control.close()


def default_sinks(show_after: float = 0.0) -> list:
    """The live launch panel in a kernel with widgets (unless NOTEBOOK_ACCEL_WIDGETS=0), else text;
    plus the JupyterLab extension's sink while it is connected to this kernel. `show_after`: see
    LaunchPanel (session cells pass it, so a quick silent cell builds no widgets)."""
    if "ipykernel" in sys.modules:  # cheap test first: never import IPython outside a kernel
        from ..jupyter import widgets_enabled
        from ..jupyter.comm import active_sinks  # the JupyterLab extension, when it is connected

        if widgets_enabled():
            from ..jupyter.panel import LaunchPanel

            return [LaunchPanel(show_after=show_after), *active_sinks()]
        return [ConsoleSink(), *active_sinks()]
    return [ConsoleSink()]


def debug_launcher(function, args=(), num_processes: int = 2) -> list:
    """Run on `num_processes` CPU processes with gloo (MULTI_CPU, distinct ranks), for debugging."""
    # Every launch setting explicit: a config file for real runs must not turn this into one.
    return notebook_launcher(
        function, args, num_processes=num_processes, mixed_precision="no", use_port="auto",
        master_addr="127.0.0.1", node_rank=0, num_nodes=1, rdzv_backend="static", max_restarts=0, cpu=True,
    )  # fmt: skip


def run_plan(plan: LaunchPlan, function, args: tuple, sink, control: Optional[LaunchControl] = None) -> list:
    control = control or LaunchControl()
    if plan.engine == "xla":
        from .xla import launch_xla

        if control.timeout is not None:
            raise LaunchConfigError(
                "timeout is not supported on TPU (xmp.spawn has no way to stop its processes)"
            )
        return launch_xla(plan, function, args)
    if plan.engine == "elastic":
        from .elastic import launch_elastic

        return launch_elastic(plan, function, args, sink, control)
    if plan.num_processes == 1 and plan.num_nodes == 1:
        return _run_here(plan, function, args, control)
    return _launch_local(plan, function, args, sink, control)


def _run_here(plan: LaunchPlan, function, args: tuple, control: LaunchControl) -> list:
    """One process: run in the caller (accelerate does too), with the plan's settings visible."""
    from ..utils.environment import DEBUG_ENV, MIXED_PRECISION_ENV, USE_CPU_ENV

    keep = {k: plan.env[k] for k in (MIXED_PRECISION_ENV, USE_CPU_ENV, DEBUG_ENV) if k in plan.env}
    with _patched_environ(keep), _alarm(control):
        return [function(*args)]


@contextmanager
def _alarm(control: LaunchControl):
    """A timeout for a function run in this process: SIGALRM raises in the main thread."""
    if control.timeout is None:
        yield
        return
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        raise LaunchConfigError("timeout with one process needs the main thread; use num_processes >= 2")

    def expire(signum, frame):
        control.timed_out = True
        raise LaunchTimeoutError(f"timed out after {control.timeout:g} s (timeout={control.timeout:g})")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, control.timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def _patched_environ(values: dict):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launch_local(plan: LaunchPlan, function, args: tuple, sink, control: LaunchControl) -> list:
    from . import procs
    from .monitor import Monitor

    payload = None
    if plan.start_method != "fork":
        from .payload import dumps

        payload = dumps(function, args)  # fails here, naming the object, before any process starts
    else:
        from .. import state  # noqa: F401  (imported once here rather than in every forked rank)
    warm = None
    if plan.start_method == "forkserver":
        from .warm import WarmServer

        warm = WarmServer.get()
    started = time.monotonic()
    sink.handle(ev.LaunchStarted(plan.num_processes, plan.start_method, plan.world_size, plan.node_rank))
    handles = []
    monitor = None
    try:
        requests = []
        for local_rank in range(plan.num_processes):
            env = plan.rank_env(local_rank)
            rank = int(env["RANK"])
            if plan.start_method == "fork":
                handles.append(
                    procs.start_fork(local_rank, rank, env, plan.threads_per_process, function, args)
                )
            elif plan.start_method == "spawn":
                handles.append(procs.start_spawn(local_rank, rank, env, plan.threads_per_process, payload))
            else:
                requests.append((local_rank, rank, env, plan.threads_per_process, payload))
        if requests:
            handles.extend(warm.start_ranks(requests))
        control.start()
        monitor = Monitor(handles, plan, sink, warm=warm, control=control)
        results = monitor.run()
    except BaseException as exc:
        # KeyboardInterrupt, a failure while starting, or a rank failure: leave no process behind.
        if monitor is None:
            monitor = Monitor(handles, plan, sink, warm=warm) if handles else None
        if monitor is not None:
            monitor.kill_now()
            for h in handles:
                h.close()
        sink.handle(ev.LaunchFinished(False, time.monotonic() - started, _failed(exc), _stopped(exc)))
        raise
    sink.handle(ev.LaunchFinished(True, time.monotonic() - started))
    return results


def _stopped(exc: BaseException) -> str:
    if isinstance(exc, LaunchStoppedError):
        return exc.reason
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else ""


def _failed(exc: BaseException) -> tuple:
    reports = getattr(exc, "reports", None)
    return tuple(sorted(reports)) if reports else ()
