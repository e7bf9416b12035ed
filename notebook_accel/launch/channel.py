"""One rank's channel to its parent: the control-frame format, and the reader that turns a rank's
stdout, stderr and control bytes into typed events.

A rank (or the forkserver) writes frames on its control socket: an 8-byte big-endian length, then a
pickle of a tuple whose first item is the kind: ("started", pid), ("calling",), ("result", body, sizes) or
("error", {exc_type, message, traceback}) from a rank, and in a pdb=True launch ("pdb", output,
prompt or None) while pdb runs in it, answered with ("pdb_line", line or None) (child.py);
("ready", pid), ("pid", local_rank, pid) and ("exit", pid, code) from the forkserver. Control sockets are private socket pairs (or a Unix socket in a
private directory) between a process and its own children, so unpickling them trusts no stranger.
Local launches, elastic launches and session workers all read their ranks through `RankChannel`.

A result frame is followed on the stream by its out-of-band buffers, raw, of the announced `sizes`
(payload.dumps_result): the rank sends them from the tensors' own memory, and the reader receives
them straight into buffers of that size, on which the tensors are rebuilt.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Optional

from . import events as ev
from .lines import LineSplitter

HEADER = struct.Struct("!Q")
STREAMS = ("stdout", "stderr")


def encode(message: tuple) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def send_frame(sock: socket.socket, message: tuple) -> None:
    sock.sendall(encode(message))


def send_result(sock: socket.socket, body: bytes, buffers: list) -> None:
    send_frame(sock, ("result", body, [len(b) for b in buffers]))
    for buffer in buffers:
        sock.sendall(buffer)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("connection closed mid-frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket):
    """The next frame from a blocking socket; EOFError when it closes."""
    (size,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    return pickle.loads(recv_exact(sock, size))


def send_frame_with_fds(sock: socket.socket, message, fds: list) -> None:
    """A frame whose header carries file descriptors (SCM_RIGHTS): the forkserver's requests."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    socket.send_fds(sock, [HEADER.pack(len(data))], fds)
    sock.sendall(data)


def recv_frame_with_fds(sock: socket.socket, max_fds: int):
    """(message, fds) from send_frame_with_fds; EOFError when the socket closes."""
    header, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, max_fds)
    if not header:
        raise EOFError
    if len(header) < HEADER.size:
        header += recv_exact(sock, HEADER.size - len(header))
    (size,) = HEADER.unpack(header)
    return pickle.loads(recv_exact(sock, size)), fds


def recv_ready(sock, size: int = 1 << 16) -> Optional[bytes]:
    """What a readable socket holds without blocking: bytes, b"" at its end, None if nothing yet."""
    try:
        return sock.recv(size, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:  # reset by a peer that died: the same as its end
        return b""


class FrameBuffer:
    """Bytes in, whole messages out, for a non-blocking reader."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> list:
        self.buf += data
        out = []
        while True:
            message = self.next()
            if message is None:
                return out
            out.append(message)

    def next(self):
        """The next whole message in the buffer, or None."""
        if len(self.buf) < HEADER.size:
            return None
        (size,) = HEADER.unpack_from(self.buf)
        end = HEADER.size + size
        if len(self.buf) < end:
            return None
        with memoryview(self.buf) as view:
            message = pickle.loads(view[HEADER.size : end])
        del self.buf[:end]
        return message


class _Buffers:
    """The out-of-band buffers a result frame announced, filled as their bytes arrive."""

    def __init__(self, sizes: list):
        self.buffers = [bytearray(n) for n in sizes]
        self.index, self.filled = 0, 0
        self._skip_empty()

    @property
    def complete(self) -> bool:
        return self.index == len(self.buffers)

    def target(self) -> memoryview:
        return memoryview(self.buffers[self.index])[self.filled :]

    def add(self, count: int) -> None:
        self.filled += count
        if self.filled == len(self.buffers[self.index]):
            self.index, self.filled = self.index + 1, 0
            self._skip_empty()

    def fill(self, data) -> bytes:
        """Copy what fits; the rest of `data` (bytes after the last buffer) is returned."""
        view, pos = memoryview(data), 0
        while pos < len(view) and not self.complete:
            target = self.target()
            count = min(len(target), len(view) - pos)
            target[:count] = view[pos : pos + count]
            pos += count
            self.add(count)
        return bytes(view[pos:])

    def _skip_empty(self) -> None:
        while self.index < len(self.buffers) and not self.buffers[self.index]:
            self.index += 1


class RankChannel:
    """One rank's three streams as events: its lines become `RankOutput`, its "started" frame
    `RankStarted`; its result or error is kept (`result`, `error`) for whoever ends the rank."""

    def __init__(self, rank: int):
        self.rank = rank
        self.pid: Optional[int] = None
        self.result: Optional[tuple] = None  # (pickle body, out-of-band buffers) once all arrived
        self.error: Optional[dict] = None
        self.group = ""  # "joining", then "joined": where the rank is with the process group
        self.calling = False  # past its start (imports, the function's unpickling): in the function
        self._moved = False  # "calling" arrived and no reader has asked (`moved`)
        self.pdb: list = []  # (output, prompt) from pdb in the rank, not yet answered; prompt None: it ended
        self.open = {"stdout", "stderr", "ctrl"}
        self._lines = {stream: LineSplitter() for stream in STREAMS}
        self._frames = FrameBuffer()
        self._body: Optional[bytes] = None
        self._incoming: Optional[_Buffers] = None  # a result's buffers, while their bytes arrive

    def read(self, stream: str, sock) -> Optional[list]:
        """Events for what `sock` (this rank's `stream`) holds now, without blocking; None when
        nothing was ready. A result's buffers are received in place, not through a bytes object."""
        if stream == "ctrl" and self._incoming is not None:
            try:
                count = sock.recv_into(self._incoming.target(), 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                count = 0
            if not count:
                return self.feed(stream, b"")
            self._incoming.add(count)
            self._result_arrived()
            return []
        data = recv_ready(sock, 1 << 20 if stream == "ctrl" else 1 << 16)
        return None if data is None else self.feed(stream, data)

    def feed(self, stream: str, data: bytes) -> list:
        """Events for `data` read from `stream` ("stdout", "stderr" or "ctrl"); b"" means it ended."""
        if not data:
            self.open.discard(stream)
            return self.flush(stream) if stream in STREAMS else []
        if stream in STREAMS:
            return self._output(stream, self._lines[stream].feed(data))
        events = []
        while data:
            if self._incoming is not None:
                data = self._incoming.fill(data)
                self._result_arrived()
                continue
            self._frames.buf += data
            data = b""
            while self._incoming is None and (message := self._frames.next()) is not None:
                events += self._on_message(message)
            if self._incoming is not None:  # raw buffer bytes follow the frame
                data = bytes(self._frames.buf)
                self._frames.buf.clear()
        return events

    def _on_message(self, message: tuple) -> list:
        kind = message[0]
        if kind == "started":
            self.pid = message[1]
            return [ev.RankStarted(self.rank, message[1])]
        if kind == "calling":
            self.calling = self._moved = True
        elif kind == "result":
            self._body, self._incoming = message[1], _Buffers(message[2])
            self._result_arrived()
        elif kind == "error":
            self.error = message[1]
        elif kind == "group":
            self.group = message[1]
        elif kind == "pdb":
            self.pdb.append((message[1], message[2]))
        return []

    def moved(self) -> bool:
        """Whether the rank got into its function since the last call: progress, for the stall watch,
        though it sends no event."""
        moved, self._moved = self._moved, False
        return moved

    def _result_arrived(self) -> None:
        if self._incoming is not None and self._incoming.complete:
            self.result = (self._body, self._incoming.buffers)
            self._incoming = None

    def load_result(self):
        """The rank's return value, its tensors built on the received buffers."""
        from .payload import loads_result

        body, buffers = self.result
        return loads_result(body, buffers)

    def flush(self, stream: Optional[str] = None) -> list:
        """A partial last line as a whole one (the stream ended, or a session cell did)."""
        streams = STREAMS if stream is None else (stream,)
        return [e for s in streams for e in self._output(s, self._lines[s].finish())]

    def _output(self, stream: str, segments: list) -> list:
        return [ev.RankOutput(self.rank, stream, text, transient) for text, transient in segments]

    @property
    def outcome(self) -> Optional[str]:
        """ "result" or "error" once the rank sent one, else None."""
        return "error" if self.error is not None else "result" if self.result is not None else None
