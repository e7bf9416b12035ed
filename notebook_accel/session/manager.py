"""Session: N worker processes that keep their state across notebook cells.

The public face; pool.py holds the running workers. Nothing here imports IPython, and every call
blocks the calling thread (the kernel's) until the ranks answer: no reply has a time limit.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import sys
import threading
import time
from typing import Callable, Optional

from ..launch.stall_settings import resolve_stall_after
from .errors import CellError, SessionError, SessionNotStarted, SessionTimeout
from .pool import Request, WorkerPool, cell_reply
from .processes import reap
from .ranks import parse_ranks

STRANDED_NOTICE_S = 10.0  # a rank failed a cell this long ago and others still run it: say so, once
INTERRUPT_GRACE_S = 10.0  # after an interrupt: SIGINT again each second, SIGKILL after this long
STOP_GRACE_S = 3.0  # a stop message, then SIGTERM, then after TERM_GRACE_S, SIGKILL
TERM_GRACE_S = 2.0


def print_output(rank: int, stream: str, text: str, transient: bool) -> None:
    """The default output handler: `[rank N] line` on sys.stdout (redraws are skipped)."""
    if not transient:
        print(f"[rank {rank}] {text}", file=sys.stdout, flush=True)


class Session:
    def __init__(
        self,
        num_processes: int,
        start_method: str = "fork",
        mixed_precision: Optional[str] = None,
        cpu: Optional[bool] = None,
        on_output: Optional[Callable] = None,
        fsdp=None,
        gpu_ids=None,
        stall_after=None,
    ):
        # Checked here, before any worker starts; start() adds the config file's value (make_plan's).
        self._stall_after = stall_after
        # Seconds without progress before a cell's stall watch speaks (0.0: off); run_cell may override.
        self.stall_after = resolve_stall_after(stall_after)
        self.num_processes = num_processes
        self.gpu_ids = gpu_ids  # the devices the workers see ("0,2"), as make_plan takes it
        self.start_method = start_method
        self.mixed_precision = mixed_precision
        self.cpu = cpu
        self.fsdp = fsdp  # as make_plan takes it: None (the config's choice), True, False or settings
        self.fsdp_on = False  # whether the running workers have FSDP on (their plan's word)
        self.on_output = on_output or print_output  # (rank, stream, text, transient), from a thread
        self.tick: Optional[Callable] = None  # called often in the waiting thread while calls wait
        # (failed ranks, ranks still running): a cell failed on some ranks STRANDED_NOTICE_S ago and
        # the others still run it, perhaps waiting in a collective for the failed ones. None: a warning.
        self.on_stranded: Optional[Callable] = None
        # Called with LaunchStalled / LaunchResumed while a cell waits (the stall watch); None: printed.
        self.on_stall: Optional[Callable] = None
        self._pool: Optional[WorkerPool] = None
        self._plan = None
        self._ids = itertools.count(1)
        self._cell_numbers = itertools.count(1)

    def __enter__(self) -> "Session":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def started(self) -> bool:
        return self._pool is not None

    @property
    def port(self) -> Optional[int]:
        """The channel's port on 127.0.0.1 that the workers connected to, while started. It listens
        only while they start: once every worker has said hello nothing accepts on it."""
        return self._pool.port if self._pool is not None else None

    @property
    def dropped_connections(self) -> int:
        """Connections to the channel dropped since the last start: silent ones, over the cap of
        unknown peers, and ones whose bytes could not be read."""
        return self._pool.dropped_connections if self._pool is not None else 0

    @property
    def dropped_frames(self) -> int:
        """Frames dropped for a bad signature since the last start."""
        return self._pool.dropped_frames if self._pool is not None else 0

    # -- lifetime -----------------------------------------------------------------------------
    def start(self, timeout: float = 300.0) -> "Session":
        """Start the workers; returns once every one is connected and has said hello."""
        if self._pool is not None:
            raise SessionError("the session is already started; call restart() to start it afresh")
        from ..launch.launcher import send_notes
        from ..launch.plan import ONE_MACHINE, default, make_plan
        from ..launch.sinks import ConsoleSink

        plan = make_plan(
            num_processes=self.num_processes,
            mixed_precision=self.mixed_precision or default("no"),
            start_method=self.start_method,
            cpu=self.cpu,
            fsdp=self.fsdp,
            gpu_ids=self.gpu_ids,
            stall_after=self._stall_after,
            **ONE_MACHINE,
        )
        if plan.engine != "local":
            raise SessionError(f"interactive sessions need local processes, not the {plan.engine} engine")
        send_notes(plan, ConsoleSink())  # the console's words, once-per-process notes once
        pool = WorkerPool(lambda *line: self.on_output(*line))
        pool.open(plan, timeout)
        self._pool = pool
        self._plan = plan  # holds the rendezvous port it picked while the workers live
        self.fsdp_on = plan.fsdp
        self.stall_after = plan.stall_after
        return self

    def stop(self) -> None:
        """Ask each worker to stop, then SIGTERM, then SIGKILL; returns when none is left."""
        pool, self._pool, self._plan = self._pool, None, None
        if pool is not None:
            pool.stop(STOP_GRACE_S, TERM_GRACE_S)

    def restart(self) -> "Session":
        self.stop()
        return self.start()

    # -- cells and values ---------------------------------------------------------------------
    def run_cell(
        self,
        source: str,
        filename: Optional[str] = None,
        ranks=None,
        timeout: Optional[float] = None,
        check: bool = False,
        stall_after=None,
    ) -> dict:
        """Run `source` on the ranks; rank -> CellReply once every one has answered. With `timeout`
        the ranks are interrupted when it runs out and SessionTimeout is raised. `check=True`
        raises CellError when the cell raised on some rank. `stall_after` (seconds, 0 off) replaces the
        session's own `stall_after` for this cell."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        stall_after = self.stall_after if stall_after is None else resolve_stall_after(stall_after)
        filename = filename or f"<session-cell-{next(self._cell_numbers)}>"
        request = {"type": "exec", "source": source, "filename": filename}
        answers = self._call(ranks, request, timeout=timeout, stall_after=stall_after)
        replies = {rank: cell_reply(rank, header) for rank, (header, _) in answers.items()}
        errors = {rank: reply.error for rank, reply in replies.items() if not reply.ok}
        if check and errors:
            raise CellError(errors)
        return replies

    def push(self, values: dict, ranks=None) -> None:
        """Set names in the workers' namespaces (values travel with cloudpickle)."""
        if not isinstance(values, dict) or not all(isinstance(k, str) and k.isidentifier() for k in values):
            raise ValueError("push() takes a dict of variable names (identifiers) to values")
        answers = self._call(ranks, {"type": "push", "names": sorted(values)}, _dumps(values))
        errors = {rank: header["error"] for rank, (header, _) in answers.items() if not header["ok"]}
        if errors:
            raise CellError(errors, what="push")

    def pull(self, name: str, rank: int = 0):
        """The value of `name` on `rank` (tensors come back on the CPU)."""
        header, payload = self._call([rank], {"type": "pull", "name": name})[rank]
        if not header["ok"]:
            raise CellError({rank: header["error"]}, what="pull")
        import cloudpickle

        return cloudpickle.loads(payload)  # its frame's signature was checked on arrival

    def debug(self, rank: int, read_line: Callable[[str], str], write: Callable[[str], None]) -> None:
        """pdb on the traceback of `rank`'s last cell, if it failed, as IPython's %debug does:
        `write(text)` gets pdb's output, `read_line(prompt)` is asked for each command (EOFError: the
        end of input, which quits). Returns once pdb ends; the worker keeps its state. Whatever else
        `read_line` raises (KeyboardInterrupt) ends the worker's pdb first, then goes on up."""
        world = len(self._live().workers)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank {rank!r} does not exist; the session's ranks are 0..{world - 1}")
        request = {"type": "debug"}
        try:
            while True:
                header, _ = self._call([rank], request)[rank]
                if not header["ok"]:
                    raise SessionError(header["error"]["message"])
                write(header.get("output") or "")
                if header.get("finished"):
                    return
                try:
                    line = read_line(header.get("prompt") or "")
                except EOFError:
                    line = None
                request = {"type": "debug_line", "line": line}
        except (Exception, KeyboardInterrupt) as exc:
            if not isinstance(exc, SessionError):  # the worker may wait at pdb's prompt: end it
                with contextlib.suppress(Exception):
                    self._call([rank], {"type": "debug_line", "line": None})
            raise

    def interrupt(self, ranks=None) -> None:
        """SIGINT to the busy workers among `ranks`: their running cell raises KeyboardInterrupt."""
        pool = self._live()
        for rank in parse_ranks(ranks, len(pool.workers)):
            if pool.workers[rank].busy:
                pool.signal(pool.workers[rank], signal.SIGINT)

    def pids(self) -> dict:
        """rank -> pid of each worker ({} before start); cheap, unlike status()."""
        pool = self._pool
        return {} if pool is None else {w.rank: w.pid for w in pool.workers}

    def stacks(self, ranks=None):
        """Where each worker is now, as data (launch/stall.py StallReport): its threads' stacks and
        the collective it waits in, if any; idle workers are said to be idle. Read from outside the
        workers' Python, so a worker blocked in a collective answers too (not with stall_after=0,
        which starts no server in the workers)."""
        from ..launch import frontend
        from ..launch.watch import snapshot

        pool = self._live()
        rows = []
        for rank in parse_ranks(ranks, len(pool.workers)):
            w = pool.workers[rank]
            if not w.dead:
                rows.append((rank, w.pid, None if w.busy else "idle"))
        return snapshot(time.monotonic() - pool.last_activity, rows, frontend.label_traceback, asked=True)

    def status(self) -> list:
        """One dict per rank: rank, pid, state (idle/busy/dead), exitcode, signal, device, rss."""
        import psutil

        pool = self._pool
        if pool is None:
            return []
        reap([w for w in pool.workers if w.dead], pool.warm, 10.0, pool.cond)  # forkserver exit codes
        rows = []
        for w in pool.workers:
            rss = None
            if not w.dead:
                try:
                    rss = psutil.Process(w.pid).memory_info().rss
                except psutil.Error:
                    pass
            rows.append(
                {
                    "rank": w.rank,
                    "pid": w.pid,
                    "state": w.state,
                    "exitcode": w.exitcode,
                    "signal": w.signal_name,
                    "device": w.device,
                    "rss": rss,
                }
            )
        return rows

    # -- requests -----------------------------------------------------------------------------
    def _live(self) -> WorkerPool:
        if self._pool is None:
            raise SessionNotStarted("the session is not started; call start()")
        if self._pool.failure is not None:
            raise SessionError(f"the session's reader thread failed ({self._pool.failure!r}); call restart()")
        return self._pool

    def _call(
        self, ranks, header: dict, payload: bytes = b"", timeout: Optional[float] = None, stall_after: float = 0.0
    ) -> dict:
        """rank -> (reply header, payload) from every targeted rank; WorkerDied if one died."""
        pool = self._live()
        targets = parse_ranks(ranks, len(pool.workers))
        dead = [r for r in targets if pool.workers[r].dead]
        if dead:
            raise pool.died(dead, {})
        busy = [r for r in targets if pool.workers[r].busy]
        if busy:
            raise SessionError(f"ranks {busy} are still running an earlier request; interrupt() or restart()")
        req = Request(next(self._ids), targets)
        # A Ctrl-C while the request is being sent waits until every rank has it, then interrupts
        # them all; raised mid-send it would leave ranks running a cell nobody waits for.
        try:
            with _sigint_deferred():
                pool.submit(req, header, payload)
            self._await(pool, req, timeout, stall_after)
        except KeyboardInterrupt:
            self._interrupt(pool, req)
            raise
        except BaseException:
            pool.cancel_unsent(req)
            raise
        finally:
            pool.forget(req)
        if req.dead:
            raise pool.died(sorted(req.dead), req.replies)
        return {r: req.replies[r] for r in targets}

    def _await(self, pool: WorkerPool, req: Request, timeout: Optional[float], stall_after: float = 0.0) -> None:
        # stall_after: for the stall watch (issue 29); 0.0 (push, pull): not watched
        deadline = None if timeout is None else time.monotonic() + timeout
        watch = _StrandedWatch(pool, req, self.on_stranded, self.on_stall or _print_stall, self.tick)
        if stall_after > 0:
            watch = _CellWatch(pool, req, stall_after, self.on_stall or _print_stall, watch.tick)
        done = pool.wait_until(req.finished, deadline, watch.tick)  # KeyboardInterrupt: see _call
        if not done:
            killed = self._interrupt(pool, req)
            replies = {r: cell_reply(r, h) for r, (h, _) in sorted(req.replies.items())}
            raise SessionTimeout(timeout, replies, killed, stall=getattr(watch, "last_report", None))

    def _interrupt(self, pool: WorkerPool, req: Request) -> list:
        """SIGINT the ranks still on `req` (again each second); SIGKILL after INTERRUPT_GRACE_S or
        a second KeyboardInterrupt. Returns the ranks killed."""
        pool.cancel_unsent(req)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        try:
            while req.waiting() and time.monotonic() < deadline:
                for rank in req.waiting():
                    pool.signal(pool.workers[rank], signal.SIGINT)
                pool.wait_until(lambda: not req.waiting(), min(deadline, time.monotonic() + 1.0), self.tick)
        except KeyboardInterrupt:
            pass  # a second interrupt: kill now
        killed = req.waiting()
        for rank in killed:
            pool.signal(pool.workers[rank], signal.SIGKILL)
        if killed:
            print(
                f"notebook_accel session: ranks {killed} did not stop on interrupt and were killed; call restart()",
                file=sys.stderr,
            )
        try:
            pool.wait_until(lambda: not req.waiting(), time.monotonic() + 5.0, self.tick)
        except KeyboardInterrupt:
            pass
        return killed


class _StrandedWatch:
    """While a request waits: once some ranks have answered with an error and others still run it
    STRANDED_NOTICE_S later, say so once, as the stall watch does (a LaunchStalled report to
    `on_stall`: where the others wait, and that they never return by themselves; `on_stranded(failed,
    running)` too where it was set). A rank blocked in a collective with a rank whose cell failed
    never returns by itself (gloo waits 30 minutes)."""

    def __init__(self, pool: WorkerPool, req: Request, on_stranded, on_stall: Callable, tick: Optional[Callable]):
        self.pool, self.req, self.on_stranded, self.on_stall, self.inner = pool, req, on_stranded, on_stall, tick
        self.first_failure: Optional[float] = None
        self.told = False

    def tick(self) -> None:
        if self.inner is not None:
            self.inner()
        if self.told:
            return
        failed = sorted(r for r, (header, _) in list(self.req.replies.items()) if not header.get("ok", True))
        if not failed:
            return
        now = time.monotonic()
        if self.first_failure is None:
            self.first_failure = now
        running = self.req.waiting()
        if running and now - self.first_failure >= STRANDED_NOTICE_S:
            self.told = True
            if self.on_stranded is not None:
                self.on_stranded(failed, running)
            from ..launch import frontend
            from ..launch.events import LaunchStalled
            from ..launch.watch import snapshot

            workers = self.pool.workers
            rows = [(r, workers[r].pid, "failed") for r in failed] + [(r, workers[r].pid, None) for r in running]
            self.on_stall(LaunchStalled(snapshot(now - self.first_failure, rows, frontend.label_traceback)))


class _CellWatch:
    """The launch's stall watch (launch/watch.py) over a session cell: progress is any worker's
    output or reply (the reader thread stamps `pool.last_activity`), and the collectives the
    workers complete; `report(event)` gets LaunchStalled and LaunchResumed."""

    def __init__(self, pool: WorkerPool, req: Request, stall_after: float, report: Callable, inner: Callable):
        from ..launch import frontend
        from ..launch.watch import Watch

        self.pool, self.req, self.report, self.inner = pool, req, report, inner
        self.seen = pool.last_activity
        self.watch = Watch(stall_after, time.monotonic(), frontend.label_traceback)

    @property
    def last_report(self):
        return self.watch.last_report

    def tick(self) -> None:
        self.inner()
        events = []
        if self.pool.last_activity != self.seen:
            self.seen = self.pool.last_activity
            events += self.watch.progress(self.seen)
        req, workers = self.req, self.pool.workers
        ranks = [(r, workers[r].pid, r in req.replies) for r in req.ranks if r not in req.dead and r not in req.cancelled]
        events += self.watch.tick(time.monotonic(), ranks)
        for event in events:
            self.report(event)


def _print_stall(event) -> None:
    from ..launch.sinks import ConsoleSink

    ConsoleSink().handle(event)
    sys.stderr.flush()


@contextlib.contextmanager
def _sigint_deferred():
    """Hold a SIGINT that arrives inside the block, and deliver it when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield  # SIGINT is only ever handled on the main thread
        return
    held: list = []
    previous = signal.signal(signal.SIGINT, lambda *args: held.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            if callable(previous):
                previous(*held[0])  # Python's default handler raises KeyboardInterrupt here
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt


def _dumps(values: dict) -> bytes:
    from ..launch.payload import dumps

    try:  # the launch payload carries notebook cells' source lines too, for workers' tracebacks
        return dumps(dict, (values,))
    except Exception:
        import cloudpickle

        for name, value in values.items():
            try:
                cloudpickle.dumps(value)
            except Exception as exc:
                raise SessionError(
                    f"push: {name!r} ({type(value).__name__}) cannot be pickled: {exc}"
                ) from exc
        raise
