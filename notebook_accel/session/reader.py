"""The parent's one background reader: every worker's stdout, stderr and control socket, the
channel (listener and connections) and process exits, all through one selector. Output is read
as it comes, so a worker never blocks on a full pipe however long or loud its cell is."""

from __future__ import annotations

import selectors
import socket
import sys
import threading
import time
import traceback

from ..launch.channel import recv_ready
from ..launch.control import Wakeup
from . import protocol

MAX_UNBOUND = 64  # connections that have not said hello yet; more are refused
HELLO_WAIT_S = 5.0  # a worker says hello as soon as it connects; a silent connection is a stranger


class _Conn:
    def __init__(self, sock: socket.socket, key: bytes, deadline: float):
        self.sock = sock
        self.frames = protocol.FrameReader(key, protocol.TO_PARENT, limit=protocol.HELLO_LIMIT)
        self.rank = None  # the worker's _Rank once it said hello
        self.deadline = deadline  # for its whole hello frame
        self.closed = False


class Reader(threading.Thread):
    def __init__(self, pool, listener: socket.socket, ranks: list, key: bytes):
        super().__init__(name="notebook-accel-session-reader", daemon=True)
        self.pool = pool
        self.key = key
        self.sel = selectors.DefaultSelector()
        self.listener: socket.socket | None = listener  # closed once every worker said hello
        self.unbound: set = set()  # connections that have not said hello yet
        self.running = True
        self._wakeup = Wakeup()
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, ("listen", None))
        self.sel.register(self._wakeup.fileno(), selectors.EVENT_READ, ("wake", None))
        self.polled = []  # ranks with no exit fd: their exit is found by polling
        for r in ranks:
            for sock, kind in ((r.proc.out, "stdout"), (r.proc.err, "stderr"), (r.proc.ctrl, "ctrl")):
                self.sel.register(sock, selectors.EVENT_READ, (kind, r))
            if r.proc.exit_fd is not None:
                self.sel.register(r.proc.exit_fd, selectors.EVENT_READ, ("exit", r))
            else:
                self.polled.append(r)

    def stop(self) -> None:
        self.running = False
        self._wakeup.wake()

    def run(self) -> None:
        try:
            while self.running:
                for key, _ in self.sel.select(self._timeout()):
                    kind, item = key.data
                    if kind == "listen":
                        self._accept()
                    elif kind == "wake":
                        self._wakeup.drain()
                    elif kind == "chan":
                        self._read_channel(item)
                    elif kind == "exit":
                        self._unregister(key.fileobj)
                        self._exited(item)
                    else:
                        self._read_output(item, kind, key.fileobj)
                self._drop_silent(time.monotonic())
                for r in [r for r in self.polled if self.pool.poll_exit(r)]:
                    self.polled.remove(r)
                    self._exited(r)
        except BaseException as exc:  # a dead reader would leave callers waiting forever: tell them
            traceback.print_exc(file=sys.__stderr__)
            self.pool.on_reader_failed(exc)
        finally:
            self.close_listener()
            self.sel.close()
            self._wakeup.close()

    def _timeout(self):
        waits = [0.2] if self.polled else []
        if self.unbound:
            waits.append(max(0.0, min(c.deadline for c in self.unbound) - time.monotonic()))
        return min(waits) if waits else None

    # -- channel --------------------------------------------------------------------------------
    def close_listener(self) -> None:
        """Nothing needs to connect once every worker said hello: stop listening."""
        if self.listener is None:
            return
        while True:  # whoever still waits in the backlog is nobody we started: drop and count them
            try:
                sock, _ = self.listener.accept()
            except OSError:
                break
            self.pool.on_dropped_connection()  # counted before the close a stranger can see
            sock.close()
        self._unregister(self.listener)
        self.listener.close()
        self.listener = None
        self.pool.on_listener_closed()

    def _accept(self) -> None:
        while self.listener is not None:  # every pending connection, then back to the selector
            try:
                sock, _ = self.listener.accept()
            except OSError:  # none left (BlockingIOError), or one that was gone before we took it
                return
            if len(self.unbound) >= MAX_UNBOUND:
                self.pool.on_dropped_connection()
                sock.close()
                continue
            try:
                sock.setblocking(True)  # the pool sends on it from the caller's thread
                protocol.no_delay(sock)
            except OSError:
                sock.close()
                continue
            conn = _Conn(sock, self.key, time.monotonic() + HELLO_WAIT_S)
            self.unbound.add(conn)
            self.sel.register(sock, selectors.EVENT_READ, ("chan", conn))

    def _drop_silent(self, now: float) -> None:
        for conn in [c for c in self.unbound if c.deadline <= now]:
            self.pool.on_dropped_connection()
            self._close(conn)

    def _read_channel(self, conn: _Conn) -> None:
        try:
            self._read_frames(conn)
        except Exception:
            # One connection's bytes never end the reader: that connection goes, the rest go on.
            if conn.rank is not None:  # a signed frame we fail on is our bug: say so
                traceback.print_exc(file=sys.__stderr__)
            self.pool.on_dropped_connection()
            if not conn.closed:
                self._close(conn)

    def _read_frames(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        try:
            frames = conn.frames.feed(data)
        except protocol.BadFrame:
            self.pool.on_bad_frame()
            self._close(conn)
            return
        for header, payload in frames:
            if conn.rank is None:
                conn.rank = self.pool.on_hello(header, conn.sock)
                if conn.rank is None:  # signed, yet not a hello we expect: drop it all the same
                    self.pool.on_bad_frame()
                    self._close(conn)
                    return
                self.unbound.discard(conn)
                conn.frames.limit = None
                if self.pool.all_connected():
                    self.close_listener()
            elif header["type"] == "done":
                # Output written before the reply is already in the socket buffers: deliver it first.
                self._drain_output(conn.rank)
                self.pool.on_reply(conn.rank, header, payload)

    def _close(self, conn: _Conn) -> None:
        conn.closed = True
        self.unbound.discard(conn)
        self._unregister(conn.sock)
        conn.sock.close()

    # -- output, control, exits -----------------------------------------------------------------
    def _read_output(self, r, stream: str, sock) -> bool:
        """Read what is there (output or control frames); False once nothing more is (or it ended)."""
        data = recv_ready(sock)
        if data is None:
            return False
        if not data:
            self._unregister(sock)
        self._emit(r.channel.feed(stream, data))
        return bool(data)

    def _emit(self, events: list) -> None:
        for e in events:
            if hasattr(e, "text"):  # output; the launch's RankStarted says nothing a session needs
                self.pool.emit(e.rank, e.stream, e.text, e.transient)

    def _drain_output(self, r) -> None:
        for stream, sock in (("stdout", r.proc.out), ("stderr", r.proc.err)):
            # What was written before the reply fits in the socket buffer; the bound keeps a
            # background thread that never stops printing from holding the reply back forever.
            for _ in range(64):
                if stream not in r.channel.open or not self._read_output(r, stream, sock):
                    break
            self._emit(r.channel.flush(stream))  # a cell's last partial line

    def _exited(self, r) -> None:
        self._drain_output(r)
        while "ctrl" in r.channel.open and self._read_output(r, "ctrl", r.proc.ctrl):
            pass
        self.pool.on_exit(r)

    def _unregister(self, fileobj) -> None:
        try:
            self.sel.unregister(fileobj)
        except (KeyError, ValueError):
            pass
