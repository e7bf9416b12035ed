"""Ranks the forkserver forked ahead (issue #19): each waits on its own socket for a launch request.

Forking a rank from the server (which holds torch, 290 MiB) copies its page tables: about 6 ms per
rank, on the launch's path. Spares are forked when the server is ready and once it has been idle
0.25 s after a launch (not while that launch's ranks start, which it would slow), so the next
launch hands them its requests instead; launches back to back fork what they need. The server keeps as many as the last launch asked for (2 at first), at most
NOTEBOOK_ACCEL_SPARES (default 8; 0 turns them off). An idle spare is named `SPARE_NAME` (what `ps`
and psutil's `name()` show) and exits when the server goes (its socket ends).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import warnings
from collections import deque
from typing import Callable, Optional

ENV = "NOTEBOOK_ACCEL_SPARES"
DEFAULT_MOST = 8
FIRST = 2  # before any launch: the usual notebook launch, and what benchmarks/launch.py times
SPARE_NAME = "accel-spare"


def most_wanted() -> int:
    """NOTEBOOK_ACCEL_SPARES read; a value that is not a whole number >= 0 is named in a warning and
    the default used."""
    value = os.environ.get(ENV, "")
    if not value.strip():
        return DEFAULT_MOST
    try:
        most = int(value)
    except ValueError:
        most = -1
    if most < 0:
        warnings.warn(
            f"{ENV}={value!r} is not a whole number >= 0; the forkserver keeps up to {DEFAULT_MOST} ranks "
            f"forked ahead. Set {ENV}=0 to fork every rank at its launch.",
            stacklevel=2,
        )
        return DEFAULT_MOST
    return most


class Spares:
    """The idle spares of one server: (pid, socket) pairs, oldest first."""

    def __init__(self, most: int):
        self.most = most
        self.want = min(FIRST, most)
        self.idle: deque = deque()

    def server_ends(self) -> list:
        """Sockets every process the server forks must close, so a spare sees its server go."""
        return [sock for _, sock in self.idle]

    def asked(self, count: int) -> None:
        """A launch asked for `count` ranks on this server: keep that many ready for the next."""
        self.want = max(1, min(count, self.most)) if self.most else 0

    def fill(self, child: Callable[[socket.socket, list], None], server_fds: list) -> None:
        """Fork spares up to `want` (and let go of those above it); in each, `child(its socket, the
        fds to close)` never returns. `server_fds` are the server's own (its client's socket, its
        wake-up pipe). A fork that fails (no memory, a pids limit, no fds) stops spares for good:
        the server forks each rank at its launch, as without them, and never dies of a spare."""
        while len(self.idle) > self.want:
            pid, sock = self.idle.pop()
            sock.close()
            _kill_and_reap(pid)
        try:
            self._fork_up_to_want(child, server_fds)
        except OSError:
            self.most = self.want = 0

    def _fork_up_to_want(self, child, server_fds: list) -> None:
        while len(self.idle) < self.want:
            mine, theirs = socket.socketpair()
            close = [*server_fds, *(s.fileno() for s in self.server_ends()), mine.fileno()]
            try:
                pid = os.fork()
            except OSError:
                mine.close()
                theirs.close()
                raise
            if pid == 0:
                try:
                    child(theirs, close)
                finally:
                    os._exit(1)
            theirs.close()
            self.idle.append((pid, mine))

    def hand(self, request: dict, fds: list) -> Optional[int]:
        """Give a request (and its fds) to the oldest live spare: its pid, or None when there is
        none (fork the rank then)."""
        from .channel import send_frame_with_fds

        while self.idle:
            pid, sock = self.idle.popleft()
            try:
                send_frame_with_fds(sock, request, fds)
            except OSError:  # it died while idle (killed from outside): never a rank. One killed as
                # it is handed the request (its socket still open) fails as that rank, as a forked one would.
                _kill_and_reap(pid)
                continue
            finally:
                sock.close()
            return pid
        return None

    def reap(self) -> None:
        """Forget spares that died while idle."""
        for pid, sock in list(self.idle):
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                self.idle.remove((pid, sock))
                sock.close()
                _kill_and_reap(pid)


def wait_for_request(sock: socket.socket, close: list):
    """In a spare: leave the server's sockets, wait for the request; (request, fds). Exits when the
    server goes before sending one."""
    from .channel import recv_frame_with_fds

    signal.set_wakeup_fd(-1)  # before its pipe is closed below
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in close:
        os.close(fd)
    os.setpgid(0, 0)
    own = _name()
    _set_name(SPARE_NAME)
    try:
        request = recv_frame_with_fds(sock, 3)
    except (EOFError, OSError):
        os._exit(0)
    sock.close()
    _set_name(own)
    return request


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _name() -> Optional[str]:
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _set_name(name: Optional[str]) -> None:
    if name is None or not sys.platform.startswith("linux"):
        return
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass
