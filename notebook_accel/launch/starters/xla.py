"""TPU launch through torch_xla's xmp.spawn, watched like any other launch.

xmp.spawn creates the processes (one per TPU device, as the topology decides) and returns nothing
per rank, so each process it starts runs `xla_entry`, which connects back to a hub here and receives
the same three sockets (stdout, stderr, control) a forked rank gets, plus a fourth that carries its
exit code. From there the rank is what every rank is: output captured at the fd level, a result or a
traceback on the control socket, and the monitor's events, failure handling, stop and timeout.
The ranks are known only as they connect, so the monitor takes them through this hub (its `gate`).

The xmp.spawn call is the only line that needs torch_xla; tests run this file against a stand-in
module with xmp.spawn's documented signature.
"""

from __future__ import annotations

import hmac
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

from .. import events as ev
from ..channel import recv_frame, recv_frame_with_fds, recv_ready, send_frame, send_frame_with_fds
from ..procs import RankProcess
from .local import finished

RETURN_WAIT_S = 30.0  # after the ranks, how long to wait for xmp.spawn's own return
HELLO_WAIT_S = 10.0  # a process that connected must say who it is within this long

# A process forked while a greeting holds a rank's socket ends would keep them open (the rank's
# output would not end with it): xmp.spawn forks from its own thread, so greetings and forks take turns.
# The hooks look the lock up when they run: a forked child gets a fresh one, and its own forks
# (an elastic agent's ranks) must take that one, not the copy of ours it inherited held.
_greeting = threading.Lock()


def _before_fork() -> None:
    _greeting.acquire()


def _after_fork_in_parent() -> None:
    _greeting.release()


def _after_fork_in_child() -> None:
    global _greeting
    _greeting = threading.Lock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def _spawn(function, args, start_method: str) -> None:
    import torch_xla.distributed.xla_multiprocessing as xmp

    # nprocs=None: one process per device, as the topology says (nprocs=1 would run in this process).
    xmp.spawn(function, args=args, start_method=start_method)


class XlaRank(RankProcess):
    """A rank that xmp.spawn started: its process belongs to xmp's pool (which reaps it and may
    outlive the rank), so its end is told by the fourth socket, which carries the exit code, or
    closes with the process."""

    def __init__(self, index: int, pid: int, channels: tuple, done: socket.socket):
        self.local_rank = index
        self.pid = pid
        self.out, self.err, self.ctrl = channels
        self.done = done
        self.exit_fd = done.fileno()  # readable on the code, or at the process's end
        self.exitcode = None
        self.exit_unknown = False  # the process ended without its code; xmp took its status
        self.max_rss = None  # xmp reaps it: its peak is the sampled one

    def poll(self):
        if self.exitcode is not None:
            return self.exitcode
        data = recv_ready(self.done, 1)
        if data:
            self.exitcode = data[0]
        elif data == b"":  # the process ended before its entry could say how
            self.exitcode = _peek_exit(self.pid)
            if self.exitcode is None:
                self.exitcode, self.exit_unknown = 1, True
        return self.exitcode

    def close(self) -> None:
        for sock in (self.out, self.err, self.ctrl, self.done):
            try:
                sock.close()
            except OSError:
                pass


def _peek_exit(pid: int):
    """The exit status of a child that xmp's pool has not reaped yet, leaving it for the pool."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        return None
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class Hub:
    """Where xmp.spawn's processes connect: a Unix socket in a private folder, and a key they
    must present (they get it as an argument of the function xmp.spawn runs)."""

    def __init__(self, plan, payload):
        self.folder = tempfile.mkdtemp(prefix="notebook_accel-xla-")  # mode 0700: this user only
        self.address = os.path.join(self.folder, "hub")
        self.key = os.urandom(16)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.address)
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.env, self.threads = dict(plan.env), plan.threads_per_process
        self.ended_r, self._ended_w = os.pipe()  # readable once xmp.spawn has returned or raised
        self.error = None  # what xmp.spawn raised, if anything
        self.expected = None  # how many ranks xmp.spawn starts, once the first one has said
        # Forked ranks inherit the function; the others get it pickled (cloudpickle, as spawn ranks do).
        body = None if plan.start_method == "fork" else payload.pickled()
        work = (payload.function, payload.args) if body is None else body
        args = (self.address, self.key, work)
        self.thread = threading.Thread(
            target=self._run, args=(args, plan.start_method), name="notebook_accel-xmp", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def _run(self, args, start_method: str) -> None:
        try:
            _spawn(xla_entry, args, start_method)
        except BaseException as exc:
            self.error = exc
        finally:
            os.close(self._ended_w)

    def accept(self) -> list:
        """The ranks that connected since the last call, each as an XlaRank."""
        handles = []
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return handles
            with conn:
                handle = self._greet(conn)
            if handle is not None:
                handles.append(handle)

    def _greet(self, conn: socket.socket):
        conn.setblocking(True)
        conn.settimeout(HELLO_WAIT_S)
        try:
            kind, key, index, pid, world = recv_frame(conn)
        except (OSError, EOFError, ValueError, TypeError):
            return None
        if kind != "hello" or not hmac.compare_digest(key, self.key):
            return None
        if isinstance(world, int) and world > 0:
            self.expected = world
        with _greeting:
            pairs = [socket.socketpair() for _ in range(4)]
            try:
                send_frame_with_fds(conn, (index, self.env, self.threads), [c.fileno() for _, c in pairs])
            except OSError:
                for ours, _ in pairs:
                    ours.close()
                return None
            finally:
                for _, theirs in pairs:
                    theirs.close()
        ours = [p for p, _ in pairs]
        return XlaRank(index, pid, tuple(ours[:3]), ours[3])

    def close(self) -> None:
        self.sock.close()
        os.close(self.ended_r)
        shutil.rmtree(self.folder, ignore_errors=True)


_process_lock = threading.Lock()
_process_ranks = 0  # ranks running in this process now (xmp runs one per device, as threads on TPU v2/v3)
_process_stdio = None  # the fds 1 and 2 this process had before its first rank took them over


def xla_entry(index: int, address: str, key: bytes, work) -> None:
    """What each process xmp.spawn starts runs: connect to the hub, then run as a rank."""
    from .. import child

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hub:
        hub.connect(address)
        send_frame(hub, ("hello", key, index, os.getpid(), _world_size()))
        (rank, env, threads), fds = recv_frame_with_fds(hub, 4)
    out_fd, err_fd, ctrl_fd, done_fd = fds
    first = _enter(out_fd, err_fd)
    ctrl = socket.socket(fileno=ctrl_fd)
    code = 1
    try:
        prepare = (lambda: child._prepare_process(env, threads)) if first else (lambda: os.environ.update(env))
        code = child.run_function(rank, ctrl, prepare, lambda: _load(work))
    finally:
        child.flush_output()
        ctrl.close()
        _leave()
        os.write(done_fd, bytes([code]))
        os.close(done_fd)


def _world_size():
    """How many ranks this replication has, as torch_xla's runtime says (the rank initialises it
    anyway), so the hub knows when every one has come and gone."""
    try:
        import torch_xla.runtime as xr

        return int(xr.world_size())
    except Exception:
        return None


def _enter(out_fd: int, err_fd: int) -> bool:
    """The first rank of a process takes over its fds 1 and 2 (as a forked rank does); a second
    one in the same process (a thread per device) shares them: its own output sockets close."""
    global _process_ranks, _process_stdio
    from .. import child
    from ..leave_kernel import leave_the_kernel

    with _process_lock:
        _process_ranks += 1
        if _process_ranks > 1:
            os.close(out_fd)
            os.close(err_fd)
            return False
        if _process_stdio is None:
            child._die_with_parent()
            os.setpgid(0, 0)  # stopping the rank stops what it started (DataLoader workers) too
        _process_stdio = (os.dup(1), os.dup(2), os.dup(0), sys.stdout, sys.stderr)
        kernel_streams = (_process_stdio[3], _process_stdio[4])
        child._take_over_stdio(out_fd, err_fd)
        leave_the_kernel(kernel_streams)
        os.close(out_fd)
        os.close(err_fd)
        return True


def _leave() -> None:
    """The last rank of a process gives fds 1 and 2 back: the hub sees its output sockets end while
    xmp's process lives on."""
    global _process_ranks
    with _process_lock:
        _process_ranks -= 1
        if _process_ranks or _process_stdio is None:
            return
        out, err, inp, sys_out, sys_err = _process_stdio
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.dup2(inp, 0)
        sys.stdout, sys.stderr = sys_out, sys_err


def _load(work):
    if isinstance(work, bytes):
        from ..payload import loads

        return loads(work)
    return work


def run(plan, payload, sink, control) -> list:
    from ..monitor import Monitor

    if plan.start_method != "fork":
        payload.pickled()  # before LaunchStarted: a launch that cannot start shows no panel
    started = time.monotonic()
    # How many processes xmp.spawn starts is the topology's to say: the panel adds each as it connects.
    sink.handle(ev.LaunchStarted(0, plan.start_method, 0, plan.node_rank, fsdp=plan.fsdp))
    hub = Hub(plan, payload)
    monitor = None
    try:
        control.start()
        hub.start()
        monitor = Monitor([], plan, sink, control=control, gate=hub)
        results = monitor.run()
        if not results:
            raise RuntimeError(f"xmp.spawn started no rank ({hub.error!r})") from hub.error
        # As xmp.spawn itself does, return once its processes are gone: a TPU is free for the next launch.
        hub.thread.join(RETURN_WAIT_S)
        if hub.thread.is_alive():
            sink.handle(ev.LaunchNotice(f"xmp.spawn had not returned {RETURN_WAIT_S:g} s after every rank finished"))
    except BaseException as exc:
        if monitor is not None:
            for r in monitor.ranks:
                r.proc.send_signal(signal.SIGKILL)
            hub.thread.join(5.0)  # xmp's pool notices and reaps them
        finished(sink, started, exc)
        raise
    finally:
        hub.close()
    finished(sink, started)
    return results
