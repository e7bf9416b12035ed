"""Start rank processes: fork, spawn (a fresh interpreter) or forkserver (a warm server's fork).

Every rank gets three socket pairs (stdout, stderr, control); the parent keeps one end of each.
Every rank leads its own process group, so stopping it stops its children (DataLoader workers) too.
"""

from __future__ import annotations

import functools
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable, Optional

from . import child
from .channel import send_frame


class RankProcess:
    """The parent's handle on one local rank."""

    def __init__(self, local_rank: int, pid: int, channels: tuple, exit_status: Optional[Callable] = None):
        self.local_rank = local_rank
        self.pid = pid
        self.out, self.err, self.ctrl = channels
        self._exit_status = exit_status  # for ranks that are not our children (forkserver)
        self.exitcode: Optional[int] = None
        self.max_rss: Optional[int] = None  # bytes: the kernel's ru_maxrss, for a rank we reap
        # Readable once the process exits, even one we did not fork (a forkserver rank, whose
        # exit code still arrives through the server): a watcher sleeps instead of polling.
        self.exit_fd: Optional[int] = None
        if hasattr(os, "pidfd_open"):
            try:
                self.exit_fd = os.pidfd_open(pid)
            except OSError:
                self.exit_fd = None

    def poll(self) -> Optional[int]:
        """Exit code (negative: killed by that signal), or None while running. A rank that has
        ended takes what is left of its process group along before it is reaped (end_group)."""
        if self.exitcode is not None:
            return self.exitcode
        if self._exit_status is not None:  # the forkserver reaps it, and ends its group first
            self.exitcode = self._exit_status(self.pid)
            return self.exitcode
        try:
            if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return None
            end_group(self.pid)
            _, status, usage = os.wait4(self.pid, 0)
        except ChildProcessError:
            self.exitcode = -signal.SIGKILL
            return self.exitcode
        self.max_rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # kB on Linux
        self.exitcode = os.waitstatus_to_exitcode(status)
        return self.exitcode

    def exited(self) -> bool:
        """The process has ended; a forkserver rank's exit code may still be on its way (or, with
        the server gone, never come)."""
        if self.poll() is not None:
            return True
        return self.exit_fd is not None and bool(select.select([self.exit_fd], [], [], 0)[0])

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for sock in (self.out, self.err, self.ctrl):
            try:
                sock.close()
            except OSError:
                pass
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None


def _channels():
    pairs = [socket.socketpair() for _ in range(3)]
    return tuple(p for p, _ in pairs), tuple(c for _, c in pairs)


def end_group(pid: int) -> None:
    """SIGKILL what is left of an ended rank's process group: processes it started (DataLoader
    workers, a subprocess) end with it; one that left the group on purpose (setsid) is its own.
    Call it while the rank is a zombie, not yet reaped: its pid, and so the group's id, cannot be
    reused by another process until then."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _LastingThread:
    """One thread that lives as long as the process, to fork and spawn ranks on. A rank's
    PR_SET_PDEATHSIG fires when the *thread* that forked it ends, not the process: ranks forked
    by a launch or session started from a short-lived thread would die with that thread."""

    _lock = threading.Lock()
    _jobs: Optional[queue.SimpleQueue] = None

    @classmethod
    def call(cls, fn, *args):
        if threading.current_thread() is threading.main_thread():
            return fn(*args)  # the main thread lasts as long as the process
        with cls._lock:
            if cls._jobs is None:
                cls._jobs = queue.SimpleQueue()
                threading.Thread(target=cls._serve, name="notebook_accel-forker", daemon=True).start()
        done, box = threading.Event(), {}
        cls._jobs.put((fn, args, box, done))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    @classmethod
    def _forget(cls) -> None:
        # A forked child has no such thread: its first call from a thread starts its own.
        cls._lock = threading.Lock()
        cls._jobs = None

    @classmethod
    def _serve(cls) -> None:
        while True:
            fn, args, box, done = cls._jobs.get()
            try:
                box["value"] = fn(*args)
            except BaseException as exc:
                box["error"] = exc
            done.set()


os.register_at_fork(after_in_child=_LastingThread._forget)


def start_fork(local_rank: int, rank: int, env: dict, threads: int, function, args) -> RankProcess:
    parents, children = _channels()
    sys.stdout.flush()
    sys.stderr.flush()
    # The child goes on in the thread that forked: the whole rank runs inside _fork_rank.
    try:
        pid = _LastingThread.call(_fork_rank, parents, children, rank, env, threads, function, args)
    except BaseException:
        _close_all(parents)
        raise
    finally:
        _close_all(children)
    return RankProcess(local_rank, pid, parents)


def _close_all(socks) -> None:
    for sock in socks:
        sock.close()


def _fork_rank(parents, children, rank: int, env: dict, threads: int, function, args) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setpgid(0, 0)
        _after_fork_like_multiprocessing()
        for sock in parents:
            sock.close()
        fds = tuple(c.detach() for c in children)
        code = child.run(rank, fds, env, threads, lambda: (function, args))
        exit_like_multiprocessing()
    finally:
        os._exit(code)


def _after_fork_like_multiprocessing() -> None:
    # What a forked multiprocessing.Process does first: forget the parent's children and exit
    # finalizers, and reset inherited queues and locks (their after-fork hooks) for this process.
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is None:
        return
    import multiprocessing.process as mp_process

    mp_process._children = set()
    mp_util._finalizer_registry.clear()
    mp_util._run_after_forkers()


def exit_like_multiprocessing() -> None:
    # os._exit skips multiprocessing's exit hook, which flushes Queue feeder threads: without it an
    # item a rank put in an inherited multiprocessing.Queue just before returning can be lost.
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        try:
            mp_util._exit_function()
        except Exception:
            pass


SPAWN_CODE = "from notebook_accel.launch.child import spawn_main; spawn_main()"


def start_spawn(local_rank: int, rank: int, env: dict, threads: int, payload: bytes) -> RankProcess:
    parents, children = _channels()
    out_c, err_c, ctrl_c = children
    child_env = dict(os.environ)
    child_env.update(env)
    child_env["NOTEBOOK_ACCEL_CTRL_FD"] = str(ctrl_c.fileno())
    # The child must import what cloudpickle stored by reference: give it our sys.path.
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    popen = functools.partial(
        subprocess.Popen,
        [sys.executable, "-c", SPAWN_CODE],
        stdin=subprocess.DEVNULL,
        stdout=out_c.fileno(),
        stderr=err_c.fileno(),
        pass_fds=(ctrl_c.fileno(),),
        start_new_session=True,
        env=child_env,
    )
    try:
        proc = _LastingThread.call(popen)
    except BaseException:
        _close_all(parents)
        raise
    finally:
        _close_all(children)
    handle = RankProcess(local_rank, proc.pid, parents)
    proc.returncode = 0  # we reap it ourselves; stop Popen's destructor from warning
    try:
        send_frame(handle.ctrl, (rank, env, threads, payload))
    except OSError:  # it died before reading its spec: the monitor reports its exit as it is
        pass
    return handle
