"""Multi-node and restarts on torch.distributed.elastic, with our output capture and results.

The elastic agent starts, watches and restarts the workers; each worker connects back to a Unix
socket of ours (stdout, stderr, control), so output, results and tracebacks travel as in a local
launch, while this thread reads the sockets and drives the sinks.

With start_method="fork" (the default) the agent runs on the main thread of an agent process forked
from here (agent_process.py), and forks every attempt's ranks from there: the function and its
arguments reach each attempt by inheritance, as in a local fork launch (a fork-context Queue works).
Forking the ranks from an agent *thread* here could copy a lock another thread held (seen: a
restarted rank stuck importing a module). With "spawn" or "forkserver" the agent runs in a thread
here and the function travels pickled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import socket
import tempfile
import threading
import time

from ...utils import peers
from .. import events as ev
from .. import procs
from ..channel import RankChannel, recv_ready
from ..errors import (
    LaunchFailedError,
    LaunchStoppedError,
    LaunchTimeoutError,
    NodesMissingError,
    failure_from_exit,
)
from ..payload import loads_result
from ..resources import ResourceSampler
from .agent_process import AgentProcess, agent_failures

NODE_WAIT_NOTICE_S = 5.0  # no worker yet after this long: say which nodes we are waiting for
_WAIT_KEY = {"static": "timeout", "c10d": "join_timeout"}  # the rendezvous wait, in seconds
_FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "cloudpickle",
    "notebook_accel.state",
    "notebook_accel.launch.child",
)
GO, STOP = b"g", b"s"
STREAMS = ("stdout", "stderr", "ctrl")
MAX_HEADER_LINE = 256  # a worker's first line, "{local_rank} {attempt} {stream} {rank}\n", fits easily


def run(plan, payload, sink, control) -> list:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig

    start_method = plan.start_method
    if start_method == "forkserver":
        import multiprocessing

        from .. import rank_imports

        preload = list(_FORKSERVER_PRELOAD) + list(rank_imports.names())
        multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    # Forked ranks take the payload from memory; the others get it pickled, made here so an
    # unpicklable object is named before any process starts.
    target = payload if start_method == "fork" else payload.pickled()
    if start_method == "fork":
        from .. import rank_imports

        rank_imports.import_all()  # every attempt's ranks inherit them from the agent process
    endpoint = plan.rdzv_endpoint or f"{plan.master_addr}:{plan.master_port}"
    conf = _rendezvous_conf(plan)
    hub = _Hub(plan, sink, _waiting_text(plan, endpoint, conf))
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    config = LaunchConfig(
        min_nodes=plan.num_nodes,
        max_nodes=plan.num_nodes,
        nproc_per_node=plan.num_processes,
        run_id=plan.rdzv_id,  # every node must pass the same id to meet
        role="notebook_accel",
        rdzv_endpoint=endpoint,
        rdzv_backend=plan.rdzv_backend,
        rdzv_configs=conf,
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
        start_method=start_method,
        log_line_prefix_template=plan.log_line_prefix_template,
        logs_specs=DefaultLogsSpecs(log_dir=hub.tmp),
    )
    args = (hub.path, plan.env, plan.threads_per_process, target)
    sink.handle(
        ev.LaunchStarted(plan.num_processes, start_method, plan.world_size, plan.node_rank, fsdp=plan.fsdp)
    )
    started = time.monotonic()
    control.start()
    agent = None
    try:
        with _quiet_torch_loggers():  # before the agent starts: a forked agent process inherits it
            agent = (AgentProcess if start_method == "fork" else _AgentThread)(config, _entry, args)
            hub.serve_until(agent.thread, control)
    except BaseException as exc:
        if agent is not None:
            agent.stop()
            hub.stop_everything(agent.thread)
        reason = exc.reason if isinstance(exc, LaunchStoppedError) else ""
        if reason:
            for rank in sorted(set(hub.ranks.values())):
                if hub.outcome_kind(rank) is None:
                    sink.handle(ev.RankStopped(rank, reason))
        sink.handle(ev.LaunchFinished(False, time.monotonic() - started, stopped=reason))
        raise
    finally:
        hub.close()
    agent.thread.join()
    error = agent.error
    if error is not None and not hub.ranks and _is_rendezvous_timeout(error):
        sink.handle(ev.LaunchFinished(False, time.monotonic() - started))
        raise NodesMissingError(_missing_text(plan, endpoint, conf, error)) from error
    if error is not None:
        reports = hub.final_failures()
        told = {r.rank for r in reports}  # a worker the agent saw die (SIGKILL, OOM) told us nothing
        reports += [hub.exit_report(*f) for f in agent_failures(error, ChildFailedError) if f[0] not in told]
        sink.handle(ev.LaunchFinished(False, time.monotonic() - started, tuple(r.rank for r in reports)))
        if reports:
            raise LaunchFailedError(reports) from error
        raise error
    sink.handle(ev.LaunchFinished(True, time.monotonic() - started))
    return hub.results()


def _rendezvous_conf(plan) -> dict:
    conf = dict(plan.rdzv_conf)
    if plan.rdzv_backend == "static":
        conf.setdefault("rank", plan.node_rank)
    # torch calls the wait "timeout" for static and "join_timeout" for c10d: accept either for both.
    key = _WAIT_KEY.get(plan.rdzv_backend)
    other = {"timeout": "join_timeout", "join_timeout": "timeout"}.get(key)
    if key and key not in conf and other in conf:
        conf[key] = conf[other]
    return conf


def _wait_seconds(plan, conf: dict) -> int:
    return int(conf.get(_WAIT_KEY.get(plan.rdzv_backend, "timeout"), 600))  # torch's default for both


def _waiting_text(plan, endpoint: str, conf: dict) -> str:
    if plan.num_nodes <= 1:
        return ""
    return (
        f"node {plan.node_rank} of {plan.num_nodes}: waiting for the other nodes at {endpoint} "
        f"(rdzv_backend={plan.rdzv_backend!r}, rdzv_id={plan.rdzv_id!r}); start the same launch on each of them "
        f"with its node_rank. Gives up after {_wait_seconds(plan, conf)} s."
    )


class _AgentThread:
    """The agent in a thread of this process (spawn and forkserver ranks need no inheritance)."""

    def __init__(self, config, entry, args):
        from torch.distributed.launcher.api import elastic_launch

        self.error = None

        def agent():
            try:
                elastic_launch(config, entry)(*args)
            except BaseException as exc:  # reported by the reading thread
                self.error = exc

        self.thread = threading.Thread(target=agent, name="notebook_accel-elastic-agent", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        pass  # the hub refuses new attempts and kills the running ones; the agent then gives up


def _stopped_by_agent(error: dict) -> bool:
    # torch elastic's workers turn the agent's SIGTERM into this exception (api._terminate_process_handler).
    return (error.get("exc_type") or "").endswith("elastic.multiprocessing.api.SignalException")


def _is_rendezvous_timeout(error: BaseException) -> bool:
    # c10d raises RendezvousTimeoutError (no message); static a DistStoreError "waiting for clients"
    # on node 0, and a DistNetworkError "timed out ... trying to connect" on the others.
    name, text = getattr(error, "type_name", type(error).__name__), getattr(error, "text", str(error))
    return (
        name == "RendezvousTimeoutError"
        or (name == "DistStoreError" and "waiting for clients" in text)
        or (name == "DistNetworkError" and "trying to connect" in text)
    )


def _missing_text(plan, endpoint: str, conf: dict, error: BaseException) -> str:
    detail = f" (torch: {error})" if str(error) else ""
    key = _WAIT_KEY.get(plan.rdzv_backend, "timeout")
    return (
        f"node {plan.node_rank} of {plan.num_nodes} waited {_wait_seconds(plan, conf)} s at {endpoint} and not every "
        f"node joined{detail}. Start the same launch on every node within that time, each with num_nodes="
        f"{plan.num_nodes}, its own node_rank and the same endpoint and rdzv_id={plan.rdzv_id!r}; check that "
        f"{endpoint} is reachable from them. rdzv_conf={{{key!r}: seconds}} sets the wait."
    )


@contextlib.contextmanager
def _quiet_torch_loggers():
    # The agent logs every worker failure with its own traceback; ours is already shown, once.
    names = ("torch.distributed.elastic", "torch.multiprocessing.spawn")
    saved = {n: logging.getLogger(n).level for n in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def _entry(hub_path: str, env: dict, threads: int, target):
    """Runs in each elastic worker: connect back, wait for the go-ahead, run as a local rank does."""
    from .. import child

    os.setpgid(0, 0)
    local_rank = int(os.environ["LOCAL_RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])  # c10d assigns node order at rendezvous, not by node_rank
    fds = []
    for channel in ("stdout", "stderr", "ctrl"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(hub_path)
        sock.sendall(f"{local_rank} {attempt} {channel} {rank}\n".encode())
        fds.append(sock)
    if fds[2].recv(1) != GO:
        os._exit(1)  # the launch is being stopped: do not start
    env = {
        k: v
        for k, v in env.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }

    def load():
        from ..payload import loads

        return loads(target) if isinstance(target, bytes) else (target.function, target.args)

    peers.joined = False
    code = child.run(rank, tuple(s.detach() for s in fds), env, threads, load)
    if code == 0:  # returned; if it never joined the group, ranks waiting to join can stop waiting
        peers.say_left(rank, int(os.environ["WORLD_SIZE"]))
    else:
        procs.exit_like_multiprocessing()  # flush what it put in an inherited Queue, as a clean exit does
        os._exit(code)  # the traceback already went to the launcher; exit non-zero so the agent sees it
    return None


class _Conn:
    def __init__(self, sock):
        self.sock = sock
        self.head = b""
        self.key = None  # (local_rank, attempt, stream) once the header line has arrived
        self.channel = None  # the RankChannel of that rank's attempt


class _Hub:
    """Accepts worker connections and turns their bytes into events; keeps each rank's last attempt."""

    def __init__(self, plan, sink, waiting_text: str = ""):
        self.plan = plan
        self.sink = sink
        self.waiting_text = waiting_text  # said once if no worker has connected after NODE_WAIT_NOTICE_S
        self.tmp = tempfile.mkdtemp(prefix="notebook_accel-")
        self.path = os.path.join(self.tmp, "hub.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.open = 0
        self.stopping = False
        self.pids: dict = {}  # (local_rank, attempt) -> pid
        self.ranks: dict = {}  # local_rank -> global rank of its latest attempt
        self.outcomes: dict = {}  # local_rank -> (attempt, "result"/"error", value)
        self.channels: dict = {}  # (local_rank, attempt) -> RankChannel
        self.finished: set = set()  # (local_rank, attempt) whose outcome was reported
        self.started: dict = {}  # (local_rank, attempt) -> when its RankStarted came
        self.resources = ResourceSampler({})  # by global rank: a restart's worker replaces the last
        from .. import frontend
        from ..watch import Watch

        self.watch = Watch(getattr(plan, "stall_after", 0.0), time.monotonic(), frontend.label_traceback)

    def serve_until(self, thread: threading.Thread, control) -> None:
        drained_at = None
        notice_at = time.monotonic() + NODE_WAIT_NOTICE_S if self.waiting_text else None
        while True:
            for key, _ in self.sel.select(timeout=control.wait_limit(time.monotonic(), 0.05)):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            if notice_at is not None and (self.pids or time.monotonic() >= notice_at):
                if not self.pids and thread.is_alive():
                    self.sink.handle(ev.LaunchNotice(self.waiting_text))
                notice_at = None
            now = time.monotonic()
            if self.resources.due(now):
                for event in self.resources.sample(now, self._running()):
                    self.sink.handle(event)
            if thread.is_alive():
                for event in self.watch.tick(now, self._watched()):
                    self.sink.handle(event)
            reason = control.check(now)
            if reason and thread.is_alive():
                kind = LaunchTimeoutError if control.timed_out else LaunchStoppedError
                raise kind(reason, stall=self.watch.last_report)
            if not thread.is_alive():
                drained_at = drained_at or time.monotonic()
                if self.open == 0 or time.monotonic() - drained_at > 2.0:
                    return

    def _watched(self) -> list:
        """(rank, pid, rank_state) of each rank's latest attempt, for the stall watch."""
        from ..watch import rank_state

        latest = {}
        for local_rank, attempt in self.pids:
            latest[local_rank] = max(attempt, latest.get(local_rank, attempt))
        out = []
        for local_rank, attempt in sorted(latest.items()):
            outcome = self.outcomes.get(local_rank)
            if outcome is not None and outcome[0] == attempt and outcome[1] != "result":
                continue  # failed or stopped: the agent restarts it or ends the launch
            returned = outcome is not None and outcome[0] == attempt
            state = rank_state(returned, self.channels.get((local_rank, attempt)))
            out.append((self.ranks[local_rank], self.pids[(local_rank, attempt)], state))
        return out

    def _running(self) -> list:
        """Global ranks of the workers that started and have not reported an outcome."""
        latest = {}
        for local_rank, attempt in self.pids:
            latest[local_rank] = max(attempt, latest.get(local_rank, attempt))
        return sorted(
            {self.ranks[lr] for lr, attempt in latest.items() if (lr, attempt) not in self.finished}
        )

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            self.sel.register(sock, selectors.EVENT_READ, _Conn(sock))
            self.open += 1

    def _read(self, conn: _Conn) -> None:
        if conn.key is not None:  # past the header: the channel reads (a result's buffers in place)
            events = conn.channel.read(conn.key[2], conn.sock)
            if events is not None:
                self._deliver(conn, events)
            return
        data = recv_ready(conn.sock)
        if data is None:
            return
        if conn.key is None:
            conn.head += data
            end = conn.head.find(b"\n", 0, MAX_HEADER_LINE)
            if end < 0:
                if not data or len(conn.head) >= MAX_HEADER_LINE:
                    self._close(conn)
                return
            header, data = self._header(conn.head[:end]), conn.head[end + 1 :]
            if header is None:  # not one of our workers: drop it, the launch goes on
                self._close(conn)
                return
            local_rank, attempt, stream, rank = header
            conn.key = (local_rank, attempt, stream)
            conn.channel = self.channels.setdefault(conn.key[:2], RankChannel(rank))
            if stream == "ctrl":
                try:
                    conn.sock.setblocking(True)
                    conn.sock.sendall(STOP if self.stopping else GO)
                    conn.sock.setblocking(False)
                except OSError:
                    self._close(conn)
                    return
            if not data:
                return  # only the header so far
        self._deliver(conn, conn.channel.feed(conn.key[2], data))

    def _deliver(self, conn: _Conn, events: list) -> None:
        local_rank, attempt, stream = conn.key
        chan = conn.channel
        if chan.moved() or events:
            for event in self.watch.progress(time.monotonic()):  # output, an outcome, its function began
                self.sink.handle(event)
        for event in events:
            if isinstance(event, ev.RankStarted):
                self.ranks[local_rank] = chan.rank
                self.pids[(local_rank, attempt)] = event.pid
                self.started[(local_rank, attempt)] = time.monotonic()
                self.resources.add(chan.rank, event.pid)
            self.sink.handle(event)
        if chan.outcome is not None and (local_rank, attempt) not in self.finished:
            self.finished.add((local_rank, attempt))
            self._finished(local_rank, attempt, chan)
        if stream not in chan.open:
            self._close(conn)

    def _header(self, line: bytes):
        """(local_rank, attempt, stream, rank) from a worker's first line; None if it is not one."""
        fields = line.split(b" ")
        if len(fields) != 4:
            return None
        numbers, stream = (fields[0], fields[1], fields[3]), fields[2].decode("ascii", "replace")
        if stream not in STREAMS or not all(f.isdigit() for f in numbers):  # bytes: ASCII digits only
            return None
        local_rank, attempt, rank = (int(f) for f in numbers)
        if local_rank >= self.plan.num_processes or rank >= self.plan.world_size:
            return None
        return local_rank, attempt, stream, rank

    def _finished(self, local_rank: int, attempt: int, chan: RankChannel) -> None:
        kind = chan.outcome
        if kind == "error" and _stopped_by_agent(chan.error):
            kind = "stopped"  # the agent's SIGTERM after another worker failed: fallout, not a failure
        self.outcomes[local_rank] = (attempt, kind, chan.result if kind == "result" else chan.error)
        peak_rss, peak_device = self.resources.peaks(chan.rank)  # sampled: the agent reaps the worker
        peaks = {"peak_rss": peak_rss, "peak_device_memory": peak_device}
        if kind == "result":
            seconds = time.monotonic() - self.started.get((local_rank, attempt), time.monotonic())
            self.sink.handle(ev.RankFinished(chan.rank, seconds, **peaks))
        elif kind == "stopped":
            self.sink.handle(ev.RankStopped(chan.rank, "stopped by the elastic agent after another rank failed"))
        else:
            self.sink.handle(ev.RankFailed(chan.rank, chan.pid, 1, **chan.error, **peaks))

    def _close(self, conn: _Conn) -> None:
        self.sel.unregister(conn.sock)
        conn.sock.close()
        self.open -= 1

    def outcome_kind(self, rank: int):
        """The latest outcome ("result" or "error") of global `rank`, None while it runs."""
        for local_rank, (_, kind, _) in self.outcomes.items():
            if self.ranks.get(local_rank) == rank:
                return kind
        return None

    def exit_report(self, rank: int, pid, exitcode) -> ev.RankFailed:
        """A worker the agent saw end without a report of its own: its exit, sampled peaks, and for
        a SIGKILL whether memory killed it (see oom.diagnose)."""
        import dataclasses
        import signal

        peak_rss, peak_device = self.resources.peaks(rank)
        failure = dataclasses.replace(
            failure_from_exit(rank, pid, exitcode), peak_rss=peak_rss, peak_device_memory=peak_device
        )
        if exitcode == -signal.SIGKILL:
            oom, note = self.resources.oom(rank, peak_rss)
            failure = dataclasses.replace(failure, oom=oom, memory_note=note)
        return failure

    def final_failures(self) -> list:
        reports = []
        for local_rank, (attempt, kind, value) in sorted(self.outcomes.items()):
            if kind == "error":
                rank = self.ranks.get(local_rank, local_rank)
                peak_rss, peak_device = self.resources.peaks(rank)
                pid = self.pids.get((local_rank, attempt))
                reports.append(ev.RankFailed(rank, pid, 1, **value, peak_rss=peak_rss, peak_device_memory=peak_device))
        return reports

    def results(self) -> list:
        out = []
        for local_rank in range(self.plan.num_processes):
            attempt, kind, value = self.outcomes.get(local_rank, (None, None, None))
            if kind != "result":
                raise RuntimeError(f"local rank {local_rank} finished without sending its result")
            out.append(loads_result(*value))
        return out

    def stop_everything(self, thread: threading.Thread) -> None:
        """Interrupt: refuse new attempts, kill running workers, wait for the agent to give up."""
        import signal

        self.stopping = True
        deadline = time.monotonic() + 10.0
        while thread.is_alive() and time.monotonic() < deadline:
            for pid in list(self.pids.values()):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            for key, _ in self.sel.select(timeout=0.05):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)

    def close(self) -> None:
        import signal

        for pid in self.pids.values():  # each worker led its group: what it started ends with it
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for key in list(self.sel.get_map().values()):
            try:
                key.fileobj.close()
            except OSError:
                pass
        self.sel.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
