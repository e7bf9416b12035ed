"""The warm forkserver: a helper process that imported torch once and forks ranks on request.

It never runs a parallel torch op, so its children are safe from the GNU OpenMP fork hang, and a
launch from a kernel that already computed costs a fork, not an interpreter start plus torch import.
One server per launching process; it exits when that process goes away (its stdin closes).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from typing import Optional

from . import child
from .channel import recv_frame, recv_frame_with_fds, send_frame, send_frame_with_fds

SERVER_CODE = "from notebook_accel.launch.warm import serve; serve()"
# torch._dynamo: DistributedDataParallel imports it at construction, about 1 s per rank otherwise.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "cloudpickle",
    "notebook_accel.state",
    "notebook_accel.launch.payload",
)


# -- server side ------------------------------------------------------------------------------
def serve() -> None:
    import importlib

    sock = socket.socket(fileno=int(os.environ.pop("NOTEBOOK_ACCEL_SERVER_FD")))
    for name in PRELOAD:
        importlib.import_module(name)
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
    children: set = set()
    while True:
        for key, _ in sel.select(timeout=1.0):
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
                pid = _fork_rank(request, fds, sock)
                children.add(pid)
                send_frame(sock, ("pid", request["local_rank"], pid))
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                send_frame(sock, ("exit", pid, os.waitstatus_to_exitcode(status)))


def _recv_request(sock: socket.socket):
    return recv_frame_with_fds(sock, 3)


def _fork_rank(request: dict, fds: list, server_sock: socket.socket) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setpgid(0, 0)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            server_sock.close()
            payload = request["payload"]

            def load():
                from .payload import loads

                return loads(payload)

            code = child.run(request["rank"], tuple(fds), request["env"], request["threads"], load)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    return pid


# -- client side ------------------------------------------------------------------------------
class WarmServer:
    """The parent's connection to its forkserver; `WarmServer.get()` starts it on first use."""

    _instance: Optional["WarmServer"] = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        env["NOTEBOOK_ACCEL_SERVER_FD"] = str(theirs.fileno())
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # A server that has never run a parallel op may keep the default thread count.
        env.pop("OMP_NUM_THREADS", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER_CODE],
            stdin=subprocess.PIPE,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
            env=env,
        )
        theirs.close()
        self.sock = mine
        self.exits: dict = {}
        self.pids: dict = {}
        kind, self.pid = recv_frame(self.sock)
        if kind != "ready":
            raise RuntimeError(f"notebook_accel forkserver failed to start: {kind!r}")

    @classmethod
    def get(cls) -> "WarmServer":
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls()
            return cls._instance

    @classmethod
    def shutdown(cls) -> None:
        with cls._lock:
            if cls._instance is not None:
                cls._instance.close()
                cls._instance = None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()
        self.sock.close()

    def start_ranks(self, requests: list) -> list:
        """Start ranks from (local_rank, rank, env, threads, payload) tuples; all requests go out
        before any reply is awaited, so the server forks them back to back."""
        from .procs import RankProcess, _channels

        parents_by_rank = {}
        for local_rank, rank, env, threads, payload in requests:
            parents, children = _channels()
            request = {
                "local_rank": local_rank,
                "rank": rank,
                "env": env,
                "threads": threads,
                "payload": payload,
            }
            send_frame_with_fds(self.sock, request, [c.fileno() for c in children])
            for sock in children:
                sock.close()
            parents_by_rank[local_rank] = parents
        handles = []
        for local_rank, parents in parents_by_rank.items():
            pid = self._wait_for("pid", local_rank)
            handles.append(RankProcess(local_rank, pid, parents, exit_status=self.exit_status))
        return handles

    def _wait_for(self, kind: str, key):
        if kind == "pid" and key in self.pids:
            return self.pids.pop(key)
        while True:
            message = recv_frame(self.sock)
            if message[0] == "exit":
                self.exits[message[1]] = message[2]
            elif message[0] == kind and message[1] == key:
                return message[2]
            elif message[0] == "pid":
                self.pids[message[1]] = message[2]

    def pump(self) -> None:
        """Read exit notices that have arrived (call when the socket is readable)."""
        self.sock.setblocking(False)
        try:
            while True:
                try:
                    header = self.sock.recv(8, socket.MSG_PEEK)
                except BlockingIOError:
                    return
                if not header:
                    return
                self.sock.setblocking(True)
                message = recv_frame(self.sock)
                self.sock.setblocking(False)
                if message[0] == "exit":
                    self.exits[message[1]] = message[2]
        finally:
            self.sock.setblocking(True)

    def exit_status(self, pid: int) -> Optional[int]:
        return self.exits.pop(pid, None) if pid in self.exits else None
