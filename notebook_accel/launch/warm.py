"""The warm forkserver: a helper process that imported torch once and forks ranks on request.

It never runs a parallel torch op, so its children are safe from the GNU OpenMP fork hang, and a
launch from a kernel that already computed costs a fork, not an interpreter start plus torch import.
One server per launching process; it exits when that process goes away (its stdin closes), even
while it is still importing. A kernel starts it early, without waiting for it (launch/prewarm.py):
the first launch then waits for that server instead of starting another.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

# The rest of launch/ is imported where it is used: a kernel imports this module to start the
# server early (prewarm), and that import is part of `import notebook_accel`.

SERVER_START_S = 120.0  # booting (torch, torch._dynamo) takes about 4.5 s; past this it is stuck, not slow
SPARES_IDLE_S = 0.25  # the server forks spares once it has had no request for this long
SERVER_CODE = "from notebook_accel.launch.warm import serve; serve()"
# And rank_imports.names() after these (torch._dynamo, the training modules).
PRELOAD = (
    "torch",
    "torch.distributed",
    "cloudpickle",
    "notebook_accel.state",
    "notebook_accel.launch.payload",
)


# -- server side ------------------------------------------------------------------------------
def serve() -> None:
    import importlib

    from .channel import send_frame
    from .procs import end_group
    from .spares import Spares, most_wanted, wait_for_request

    sock = socket.socket(fileno=int(os.environ.pop("NOTEBOOK_ACCEL_SERVER_FD")))
    with _exit_with_parent_while_booting():
        for name in PRELOAD:
            importlib.import_module(name)
        from . import rank_imports

        rank_imports.import_all(respect_opt_out=False)  # PREWARM=0 is about the kernel, not the server
    send_frame(sock, ("ready", os.getpid()))
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "request")
    sel.register(sys.stdin, selectors.EVENT_READ, "lifeline")
    # SIGCHLD wakes the selector through this pipe, so an exit is reported at once, not on a poll.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel.register(wake_r, selectors.EVENT_READ, "child")
    own_fds = [sock.fileno(), wake_r, wake_w]

    def spare(theirs: socket.socket, close: list) -> None:
        request, fds = wait_for_request(theirs, close)
        _run_rank(request, fds)

    spares = Spares(most_wanted())
    spares.fill(spare, own_fds)
    children: set = set()
    while True:
        # Spares are forked once the server has been idle a moment, not while a launch's ranks
        # start: forking them then (13 ms of CPU for 2) slowed that launch by about as much as it
        # saved a launch right after it (benchmarks/launch.py, in a kernel: 0.104 s against 0.078).
        events = sel.select(timeout=1.0 if len(spares.idle) >= spares.want else SPARES_IDLE_S)
        for key, _ in events:
            if key.data == "child":
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
            elif key.data == "lifeline":
                if not os.read(sys.stdin.fileno(), 1024):
                    os._exit(0)
            else:
                try:
                    request, fds = _recv_request(sock)
                except EOFError:
                    os._exit(0)
                pid = spares.hand(request, fds)
                if pid is None:
                    pid = _fork_rank(request, fds, [*own_fds, *(s.fileno() for s in spares.server_ends())])
                for fd in fds:
                    os.close(fd)
                spares.asked(request.get("of", 1))
                children.add(pid)
                send_frame(sock, ("pid", request["token"], request["local_rank"], pid))
        if not events:  # idle: fork ahead what the next launch will want, replace spares that died
            spares.reap()
            spares.fill(spare, own_fds)
        for pid in list(children):
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                continue
            end_group(pid)  # before reaping, while the pid cannot be reused
            _, status = os.waitpid(pid, 0)
            children.discard(pid)
            send_frame(sock, ("exit", pid, os.waitstatus_to_exitcode(status)))


@contextlib.contextmanager
def _exit_with_parent_while_booting():
    """A kernel may go while its server still imports torch (seconds): leave at once, not after.
    The watching thread is gone before the first fork, so ranks come from a one-thread process."""
    stop_r, stop_w = os.pipe()

    def watch() -> None:
        while True:
            readable = select.select([0, stop_r], [], [])[0]
            if stop_r in readable:
                return
            if not os.read(0, 1024):
                os._exit(0)

    watcher = threading.Thread(target=watch, name="lifeline", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        os.write(stop_w, b"x")
        watcher.join()
        os.close(stop_r)
        os.close(stop_w)


def _recv_request(sock: socket.socket):
    from .channel import recv_frame_with_fds

    return recv_frame_with_fds(sock, 3)


def _fork_rank(request: dict, fds: list, close: list) -> int:
    """Fork a rank now (no spare was ready); `close` are the server's fds the rank must not hold."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in close:
                os.close(fd)
            _run_rank(request, fds)
        finally:
            os._exit(1)
    return pid


def _run_rank(request: dict, fds: list) -> None:
    """In a forked rank or a spare given its request: run it and exit."""
    from . import child

    code = 1
    try:
        _enter_launcher_context(request["context"])
        payload = request["payload"]

        def load():
            from .payload import loads

            return loads(payload)

        code = child.run(request["rank"], tuple(fds), request["env"], request["threads"], load)
    finally:
        os._exit(code)


def _enter_launcher_context(context: tuple) -> None:
    # The launching process's environment, sys.path and folder as they are now, not as they were
    # when the server started (at import, with prewarm): a forkserver rank sees what a fork rank sees.
    environ, path, cwd = context
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    try:
        os.chdir(cwd)
    except OSError:
        pass  # the folder is gone: stay where the server is


# -- client side ------------------------------------------------------------------------------
class ForkserverLost(RuntimeError):
    """The forkserver exited while it had ranks (killed, or out of memory): they are gone with it."""


class WarmServer:
    """The parent's connection to its forkserver; `WarmServer.get()` starts it on first use and
    waits until it is ready, `WarmServer.prewarm()` starts it without waiting.

    Any thread may launch through it: one start at a time (`_starting`), and one reader or writer
    of the socket at a time (`_io`), so frames never interleave; whatever a thread reads is kept
    for its owner (pids by request token, exit codes by pid).
    """

    _instance: Optional["WarmServer"] = None
    _lock = threading.Lock()
    _inherited: list = []  # in a forked child: the parent's server, its descriptors closed

    def __init__(self) -> None:
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        env["NOTEBOOK_ACCEL_SERVER_FD"] = str(theirs.fileno())
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # A server that has never run a parallel op may keep the default thread count.
        env.pop("OMP_NUM_THREADS", None)
        from . import spares

        env[spares.ENV] = str(spares.most_wanted())  # read here, so a bad value is named where the user looks
        # No lowered priority (nice): its ranks would inherit it, and cannot raise it back.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER_CODE],
            stdin=subprocess.PIPE,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
            env=env,
        )
        theirs.close()
        self.sock = mine
        self.pid: Optional[int] = None  # once it says ready
        self._deadline = time.monotonic() + SERVER_START_S
        self.exits: dict = {}  # pid -> exit code, until its owner asks
        self.pids: dict = {}  # (token, local_rank) -> pid, until its owner asks
        self.lost = ""  # why the server is gone, once it is
        self._io = threading.Lock()
        self._starting = threading.Lock()
        self._tokens = itertools.count(1)

    def _ready(self) -> None:
        while self.pid is None:
            with self._io:
                self._read_one(1.0)
            if self.lost:
                raise ForkserverLost(f"notebook_accel's forkserver failed to start: {self.lost}")
            if time.monotonic() > self._deadline:
                raise ForkserverLost(
                    f"notebook_accel's forkserver did not start within {SERVER_START_S:g} s (importing torch "
                    "there hung?); use start_method='spawn' or 'fork'"
                )

    @classmethod
    def get(cls) -> "WarmServer":
        """The ready server: one still booting (prewarm) is waited for, never started twice."""
        with cls._lock:
            server = cls._current()
            if server.pid is None:
                try:
                    server._ready()
                except BaseException:
                    server.close()
                    cls._instance = None
                    raise
            return server

    @classmethod
    def prewarm(cls) -> Optional["WarmServer"]:
        """Start the server if there is none, and return at once (a Popen: milliseconds)."""
        if not cls._lock.acquire(blocking=False):
            return cls._instance  # a launch is starting one, or waiting for it: never wait here
        try:
            return cls._current()
        finally:
            cls._lock.release()

    @classmethod
    def _current(cls) -> "WarmServer":
        old = cls._instance
        if old is None or old.lost or old.proc.poll() is not None:
            cls._instance = None
            if old is not None:
                old.close()  # reaps it: a dead server is no zombie
            cls._instance = cls()
        return cls._instance

    @classmethod
    def _forget_in_child(cls) -> None:
        # A process forked from here (a fork rank, the elastic agent) must not hold the server's
        # lifeline, or the server outlives its kernel while that process lives.
        server, cls._instance = cls._instance, None
        cls._lock = threading.Lock()
        if server is not None:
            cls._inherited.append(server)  # never collected: its Popen is not this process's child
            for stream in (server.sock, server.proc.stdin):
                try:
                    stream.close()
                except Exception:
                    pass

    @classmethod
    def shutdown(cls) -> None:
        with cls._lock:
            if cls._instance is not None:
                cls._instance.close()
                cls._instance = None

    def close(self) -> None:
        with self._io:  # whoever still holds this server sees it gone, not a closed socket
            self.lost = self.lost or "the forkserver was shut down; its ranks are gone with it"
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()

    def start_ranks(self, requests: list, deadline: Optional[float] = None) -> list:
        """Start ranks from (local_rank, rank, env, threads, payload) tuples; all requests go out
        before any reply is awaited, so the server forks them back to back. Past `deadline`
        (time.monotonic()) this raises LaunchTimeoutError."""
        from .channel import send_frame_with_fds
        from .procs import RankProcess, _channels

        wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._starting.acquire(timeout=wait):
            from .errors import LaunchTimeoutError

            raise LaunchTimeoutError("while waiting for another launch to start its ranks")
        try:
            token = next(self._tokens)
            context = (dict(os.environ), list(sys.path), _cwd())
            parents_by_rank = {}
            with self._io:
                for local_rank, rank, env, threads, payload in requests:
                    parents, children = _channels()
                    request = {"token": token, "local_rank": local_rank, "rank": rank, "env": env}
                    request.update(threads=threads, payload=payload, context=context, of=len(requests))
                    try:
                        send_frame_with_fds(self.sock, request, [c.fileno() for c in children])
                    except OSError as exc:
                        self._lose(f"the connection broke ({exc})")
                        raise ForkserverLost(self.lost) from None
                    finally:
                        for sock in children:
                            sock.close()
                    parents_by_rank[local_rank] = parents
            handles = []
            try:
                for local_rank, parents in parents_by_rank.items():
                    pid = self._wait_pid(token, local_rank, deadline)
                    handles.append(RankProcess(local_rank, pid, parents, exit_status=self.exit_status))
            except BaseException:
                self._abandon(token, parents_by_rank, handles)
                raise
            return handles
        finally:
            self._starting.release()

    def _abandon(self, token: int, parents_by_rank: dict, handles: list) -> None:
        """A start that failed half way: kill the ranks already forked (those whose pid is still
        on its way too), so none runs a function nobody watches."""
        for h in handles:
            h.send_signal(signal.SIGKILL)
            h.close()
        for local_rank, parents in list(parents_by_rank.items())[len(handles) :]:
            try:
                pid = self._wait_pid(token, local_rank, time.monotonic() + 2.0)
                os.kill(pid, signal.SIGKILL)  # its process group may not exist yet
            except (Exception, KeyboardInterrupt):
                pass  # never forked, or the server is gone and took it along
            for sock in parents:
                sock.close()

    def _wait_pid(self, token: int, local_rank: int, deadline: Optional[float]) -> int:
        while True:
            with self._io:
                pid = self.pids.pop((token, local_rank), None)
                if pid is not None:
                    return pid
                if self.lost:
                    raise ForkserverLost(self.lost)
                self._read_one(_left(deadline, 0.1))
            _check(deadline, "while the forkserver started the ranks")

    def pump(self) -> bool:
        """Read what has arrived (exit codes, other threads' pids) without waiting; False once the
        server is gone (its socket ended)."""
        with self._io:
            while not self.lost and self._read_one(0.0):
                pass
        return not self.lost

    def _read_one(self, timeout: float) -> bool:
        """One frame, if one arrives within `timeout` s; call with `_io` held."""
        if self.lost or not select.select([self.sock], [], [], timeout)[0]:
            return False
        from .channel import recv_frame

        try:
            message = recv_frame(self.sock)
        except (EOFError, OSError):
            self._lose()
            return False
        kind = message[0]
        if kind == "exit":
            self.exits[message[1]] = message[2]
        elif kind == "pid":
            self.pids[(message[1], message[2])] = message[3]
        elif kind == "ready":
            self.pid = message[1]
        return True

    def _lose(self, how: str = "") -> None:
        try:
            code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and code < 0:
            try:
                how = how or f"it exited ({signal.Signals(-code).name})"
            except ValueError:
                how = how or f"it exited (signal {-code})"
        elif code is not None:
            how = how or f"it exited (exit code {code})"
        self.lost = f"the forkserver is gone: {how or 'its connection closed'}; its ranks are gone with it"

    def exit_status(self, pid: int) -> Optional[int]:
        return self.exits.pop(pid, None) if pid in self.exits else None


os.register_at_fork(after_in_child=WarmServer._forget_in_child)


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # this process's folder was deleted
        return ""


def _left(deadline: Optional[float], most: float) -> float:
    return most if deadline is None else max(0.0, min(most, deadline - time.monotonic()))


def _check(deadline: Optional[float], what: str) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        from .errors import LaunchTimeoutError

        raise LaunchTimeoutError(f"timed out {what}")
