"""One rank's channel to its parent: the control-frame format, and the reader that turns a rank's
stdout, stderr and control bytes into typed events.

A rank (or the forkserver) writes frames on its control socket: an 8-byte big-endian length, then a
pickle of a tuple whose first item is the kind: ("started", pid), ("result", bytes) or ("error",
{exc_type, message, traceback}) from a rank; ("ready", pid), ("pid", local_rank, pid) and ("exit",
pid, code) from the forkserver. Control sockets are private socket pairs (or a Unix socket in a
private directory) between a process and its own children, so unpickling them trusts no stranger.
Local launches, elastic launches and session workers all read their ranks through `RankChannel`.
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
        while len(self.buf) >= HEADER.size:
            (size,) = HEADER.unpack_from(self.buf)
            end = HEADER.size + size
            if len(self.buf) < end:
                break
            out.append(pickle.loads(bytes(self.buf[HEADER.size : end])))
            del self.buf[:end]
        return out


class RankChannel:
    """One rank's three streams as events: its lines become `RankOutput`, its "started" frame
    `RankStarted`; its result or error is kept (`result`, `error`) for whoever ends the rank."""

    def __init__(self, rank: int):
        self.rank = rank
        self.pid: Optional[int] = None
        self.result: Optional[bytes] = None
        self.error: Optional[dict] = None
        self.open = {"stdout", "stderr", "ctrl"}
        self._lines = {stream: LineSplitter() for stream in STREAMS}
        self._frames = FrameBuffer()

    def feed(self, stream: str, data: bytes) -> list:
        """Events for `data` read from `stream` ("stdout", "stderr" or "ctrl"); b"" means it ended."""
        if not data:
            self.open.discard(stream)
            return self.flush(stream) if stream in STREAMS else []
        if stream in STREAMS:
            return self._output(stream, self._lines[stream].feed(data))
        events = []
        for message in self._frames.feed(data):
            kind = message[0]
            if kind == "started":
                self.pid = message[1]
                events.append(ev.RankStarted(self.rank, message[1]))
            elif kind == "result":
                self.result = message[1]
            elif kind == "error":
                self.error = message[1]
        return events

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
