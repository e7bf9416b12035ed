"""The session channel: signed frames over a loopback TCP connection.

A frame is: lengths (!II: header, payload), a JSON header, the payload bytes, then an
HMAC-SHA256 over a direction byte, the lengths, the header and the payload, keyed with the
session's random key. The key reaches workers through their launch arguments, never the socket.
The direction byte keeps a frame from being reflected back to its sender. Receivers check the
signature before they parse the header, so nothing from an unsigned frame is ever decoded.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
from collections import deque
from typing import Optional

LENGTHS = struct.Struct("!II")
MAC_SIZE = 32
TO_WORKER = b"W"
TO_PARENT = b"P"
MAX_HEADER = 64 << 20  # JSON headers carry source text and display bundles, never bulk data
HELLO_LIMIT = 64 << 10  # the first frame on a new connection: an unknown peer gets no big buffer


class BadFrame(Exception):
    """A frame that failed its signature or size check; the connection must be dropped."""


def new_key() -> bytes:
    return secrets.token_bytes(32)


def _mac(key: bytes, direction: bytes, *parts) -> bytes:
    mac = hmac.new(key, direction, hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def encode(key: bytes, direction: bytes, header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    lengths = LENGTHS.pack(len(head), len(payload))
    return b"".join((lengths, head, payload, _mac(key, direction, lengths, head, payload)))


class FrameReader:
    """Turns received bytes into verified (header, payload) pairs."""

    def __init__(self, key: bytes, direction: bytes, limit: Optional[int] = None):
        self.key = key
        self.direction = direction
        self.limit = limit  # most bytes one frame may claim; None: no limit beyond MAX_HEADER
        self.buf = bytearray()

    def feed(self, data: bytes) -> list:
        self.buf += data
        frames = []
        while len(self.buf) >= LENGTHS.size:
            head_len, payload_len = LENGTHS.unpack_from(self.buf)
            total = LENGTHS.size + head_len + payload_len + MAC_SIZE
            if head_len > MAX_HEADER or (self.limit is not None and total > self.limit):
                raise BadFrame(f"frame of {total} bytes is over the limit")
            if len(self.buf) < total:
                break
            view = memoryview(self.buf)
            body_end = total - MAC_SIZE
            expected = _mac(self.key, self.direction, view[:body_end])
            ok = hmac.compare_digest(expected, bytes(view[body_end:total]))
            head = bytes(view[LENGTHS.size : LENGTHS.size + head_len]) if ok else b""
            payload = bytes(view[LENGTHS.size + head_len : body_end]) if ok else b""
            view.release()
            del self.buf[:total]
            if not ok:
                raise BadFrame("bad signature")
            try:
                header = json.loads(head)
            except ValueError:
                raise BadFrame("header is not JSON") from None
            if not isinstance(header, dict) or not isinstance(header.get("type"), str):
                raise BadFrame("header has no type")
            frames.append((header, payload))
        return frames


class Channel:
    """Blocking send and receive on one connection (the worker's end)."""

    def __init__(self, sock: socket.socket, key: bytes, send_direction: bytes, recv_direction: bytes):
        self.sock = sock
        self.key = key
        self.send_direction = send_direction
        self.reader = FrameReader(key, recv_direction)
        self.ready: deque = deque()

    def send(self, header: dict, payload: bytes = b"") -> None:
        self.sock.sendall(encode(self.key, self.send_direction, header, payload))

    def recv(self):
        """The next verified (header, payload), or None when the peer closed. Raises BadFrame."""
        while not self.ready:
            data = self.sock.recv(1 << 20)
            if not data:
                return None
            self.ready.extend(self.reader.feed(data))
        return self.ready.popleft()


def no_delay(sock: socket.socket) -> None:
    # Small request/reply frames: without this Nagle holds a reply back for the peer's ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
