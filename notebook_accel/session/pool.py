"""The running workers of one session start: their processes, channel, reader thread and the
requests in flight. The caller's thread sends and waits; the reader thread (reader.py) reads
everything the workers send and wakes the waiter through one condition."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

from . import protocol
from .errors import SessionError, WorkerDied
from .processes import gone, reap, start_workers
from .ranks import CellReply


class Request:
    def __init__(self, rid: int, ranks: list):
        self.id = rid
        self.ranks = ranks
        self.replies: dict = {}  # rank -> (header, payload)
        self.dead: set = set()
        self.sent: set = set()  # ranks the request was written to
        self.cancelled: set = set()  # ranks it never reached (an interrupt came while sending)

    def waiting(self) -> list:
        return [
            r for r in self.ranks if r not in self.replies and r not in self.dead and r not in self.cancelled
        ]

    def finished(self) -> bool:
        return bool(self.dead) or not self.waiting()


class WorkerPool:
    def __init__(self, on_output: Callable):
        self.on_output = on_output
        self.last_activity = time.monotonic()  # the newest output line or reply of any worker
        self.cond = threading.Condition()
        self.workers: list = []
        self.pending: dict = {}
        self.listening = False  # the channel's listener is open (the reader closes it after the hellos)
        self.dropped_frames = 0  # frames that failed their signature (their connection was closed)
        self.key = protocol.new_key()
        self.warm = None
        self.failure: Optional[BaseException] = None
        self.dropped_connections = 0  # unheard: silent, over MAX_UNBOUND, or bytes the reader failed on
        self.port: Optional[int] = None  # the channel's port; nothing listens once every worker said hello
        self.reader = None
        self._output_failed = False

    def open(self, plan, timeout: float) -> None:
        """Start the workers; return once every one is connected and has said hello."""
        from .reader import Reader

        listener = socket.socket()
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)
            self.port = listener.getsockname()[1]
            self.workers, self.warm = start_workers(plan, self.port, self.key)
            self.reader = Reader(self, listener, self.workers, self.key)  # owns the listener from here
            self.listening = True
        except BaseException:
            listener.close()
            raise
        self.reader.start()
        try:
            ok = self.wait_until(
                # Return only once nothing listens: the reader closes the listener after the last hello.
                lambda: (all(w.conn for w in self.workers) and not self.listening)
                or any(w.dead for w in self.workers),
                time.monotonic() + timeout,
            )
            if not ok or not all(w.conn for w in self.workers):
                raise SessionError(self._start_failure(timeout))
        except BaseException:
            self.close()
            raise

    def stop(self, stop_grace: float, term_grace: float) -> None:
        """A stop message, then SIGTERM, then SIGKILL; then close."""
        try:
            for w in self.workers:
                if w.conn is not None and not w.dead:
                    try:
                        self.send(w, {"type": "stop", "id": 0})
                    except OSError:
                        pass
            for sig, grace in ((signal.SIGTERM, stop_grace), (signal.SIGKILL, term_grace)):
                if reap(self.workers, self.warm, grace, self.cond):
                    break
                for w in self.workers:
                    self.signal(w, sig)
        finally:
            self.close()

    def close(self) -> None:
        """Kill what is left, reap it, end the reader thread, close every socket and fd."""
        for w in self.workers:
            self.signal(w, signal.SIGKILL)
        reap(self.workers, self.warm, 5.0, self.cond)
        if self.reader is not None:
            self.reader.stop()
            self.reader.join(5.0)
            if not self.reader.is_alive():  # it never ran, or it is done: the listener is ours to close
                self.reader.close_listener()
        for w in self.workers:
            if w.conn is not None:
                w.conn.close()
            w.proc.close()

    # -- requests -----------------------------------------------------------------------------
    def submit(self, req: Request, header: dict, payload: bytes = b"") -> None:
        with self.cond:
            self.pending[req.id] = req
            for r in req.ranks:
                self.workers[r].busy.add(req.id)
        for r in req.ranks:
            try:
                self.send(self.workers[r], {**header, "id": req.id}, payload)
            except OSError:
                pass  # the worker is gone: its exit is seen, and reported through the request
            req.sent.add(r)

    def cancel_unsent(self, req: Request) -> None:
        """An interrupt while `req` was being sent: the ranks it never reached are not waited for."""
        with self.cond:
            for r in req.ranks:
                if r not in req.sent:
                    req.cancelled.add(r)
                    self.workers[r].busy.discard(req.id)
            self.cond.notify_all()

    def forget(self, req: Request) -> None:
        with self.cond:
            self.pending.pop(req.id, None)

    def send(self, w, header: dict, payload: bytes = b"") -> None:
        frame = protocol.encode(self.key, protocol.TO_WORKER, header, payload)
        try:
            w.conn.sendall(frame)
        except BaseException:
            try:  # half a frame would desynchronise the channel: end it (the worker then exits)
                w.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            raise

    def signal(self, w, sig: int) -> None:
        with self.cond:
            if w.dead or w.proc.poll() is not None:
                return
            try:
                if sig == signal.SIGINT:
                    os.kill(w.pid, sig)  # the worker only: Jupyter interrupts the kernel, not its children
                else:
                    w.proc.send_signal(sig)  # the rank's process group (DataLoader workers too)
            except ProcessLookupError:
                pass

    def wait_until(
        self, predicate: Callable, deadline: Optional[float], tick: Optional[Callable] = None
    ) -> bool:
        """Wait for `predicate`; `tick()` (if given) runs in this thread about 20 times a second,
        outside the lock: the kernel's magic uses it to show output in the running cell."""
        # Waits in slices of at most 1 s: _thread.interrupt_main() does not wake a blocked lock.
        step = 0.05 if tick is not None else 1.0
        while True:
            with self.cond:
                if predicate():
                    return True
                if self.failure is not None:
                    raise SessionError(
                        f"the session's reader thread failed ({self.failure!r}); call restart()"
                    )
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(step if left is None else min(left, step))
            if tick is not None:
                tick()

    def died(self, ranks: list, replies: dict) -> WorkerDied:
        workers = [self.workers[r] for r in ranks]
        reap(workers, self.warm, 10.0, self.cond)  # forkserver exit codes come late; returns when they do
        detail = "\n".join(
            f"rank {w.rank}: {w.launch_error['exc_type']}: {w.launch_error['message']}"
            for w in workers
            if w.launch_error
        )
        answered = {r: cell_reply(r, h) for r, (h, _) in sorted(replies.items())}
        return WorkerDied({w.rank: (w.exitcode, w.signal_name) for w in workers}, answered, detail)

    def _start_failure(self, timeout: float) -> str:
        dead = [w for w in self.workers if w.dead]
        if not dead:
            return (
                f"ranks {[w.rank for w in self.workers if not w.conn]} did not connect within {timeout:g} s"
            )
        text = f"a worker failed while starting: {self.died([w.rank for w in dead], {})}"
        for w in dead:
            if w.launch_error:
                text += f"\nrank {w.rank}:\n{w.launch_error['traceback']}"
        return text

    # -- called by the reader thread ------------------------------------------------------------
    def on_hello(self, header: dict, sock: socket.socket):
        with self.cond:
            rank = header.get("rank")
            if header["type"] != "hello" or not isinstance(rank, int) or not 0 <= rank < len(self.workers):
                return None
            w = self.workers[rank]
            if w.conn is not None or header.get("pid") != w.pid:
                return None
            w.conn, w.device = sock, header.get("device")
            self.cond.notify_all()
            return w

    def all_connected(self) -> bool:
        with self.cond:
            return all(w.conn for w in self.workers)

    def on_reply(self, w, header: dict, payload: bytes) -> None:
        with self.cond:
            w.busy.discard(header.get("id"))
            req = self.pending.get(header.get("id"))
            if req is not None and w.rank in req.ranks:
                req.replies[w.rank] = (header, payload)
                self.last_activity = time.monotonic()
            self.cond.notify_all()

    def on_exit(self, w) -> None:
        with self.cond:
            w.exitcode = w.proc.poll()
            w.dead = True
            w.busy.clear()
            for req in self.pending.values():
                if w.rank in req.ranks and w.rank not in req.replies:
                    req.dead.add(w.rank)
            self.cond.notify_all()

    def poll_exit(self, w) -> bool:
        with self.cond:
            return gone(w, self.warm)

    def on_bad_frame(self) -> None:
        with self.cond:
            self.dropped_frames += 1
            self.cond.notify_all()

    def on_listener_closed(self) -> None:
        with self.cond:
            self.listening = False
            self.cond.notify_all()

    def on_dropped_connection(self) -> None:
        with self.cond:
            self.dropped_connections += 1

    def on_reader_failed(self, exc: BaseException) -> None:
        with self.cond:
            self.failure = exc
            self.cond.notify_all()

    def emit(self, rank: int, stream: str, text: str, transient: bool) -> None:
        self.last_activity = time.monotonic()  # progress, for the stall watch (manager._CellWatch)
        try:
            self.on_output(rank, stream, text, transient)
        except Exception as exc:
            if not self._output_failed:  # say it once; output keeps going to the handler
                self._output_failed = True
                print(f"notebook_accel session: on_output failed: {exc!r}", file=sys.__stderr__)


def cell_reply(rank: int, header: dict) -> CellReply:
    fields = (header.get("error"), header.get("result"), header.get("displays") or [])
    return CellReply(rank, bool(header.get("ok")), *fields)
