"""The doors strangers can knock on: the session channel's listener while workers start, and the
elastic hub's Unix socket. A stranger's connection is dropped; the launch or session goes on."""

from __future__ import annotations

import socket
import time

import pytest
from stranger import closed_by_parent, start_with_stranger

from notebook_accel.launch.plan import make_plan
from notebook_accel.launch.sinks import ListSink
from notebook_accel.launch.starters import elastic
from notebook_accel.session import protocol
from notebook_accel.session import reader as session_reader


# -- the elastic hub ---------------------------------------------------------------------------
def _serve(hub, until, timeout=10.0):
    """Drive the hub as serve_until does, until `until()` or the timeout; True if it came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for key, _ in hub.sel.select(timeout=0.05):
            if key.data is None:
                hub._accept()
            else:
                hub._read(key.data)
        if until():
            return True
    return False


def _closed_by_peer(sock) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.timeout(60)
def test_the_elastic_hub_drops_a_connection_with_a_malformed_header_line():
    hub = elastic._Hub(make_plan(num_processes=2, cpu=True, use_port="auto"), ListSink())
    strangers = []
    try:
        for first in (
            b"x" * 300,  # no newline within the cap
            b"0 0 ctrl 0" + b" " * 300 + b"\n",  # a newline, but past the cap
            b"garbage\n",  # one field
            b"0 0 ctrl\n",  # three
            b"0 0 ctrl 0 1\n",  # five
            b"a 0 ctrl 0\n",  # not an int
            b"0 -1 ctrl 0\n",  # not a count
            b"0 0 stdin 0\n",  # no such stream
            b"\xff\xfe 0 ctrl 0\n",  # not text
            b"7 0 ctrl 0\n",  # no such local rank
        ):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(hub.path)
            sock.sendall(first)
            sock.setblocking(False)
            strangers.append((first, sock))
        worker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        worker.connect(hub.path)
        worker.sendall(b"1 0 ctrl 1\n")
        worker.settimeout(10)
        served = {}

        def done():
            served.update(
                {first: True for first, s in strangers if first not in served and _closed_by_peer(s)}
            )
            return len(served) == len(strangers)

        assert _serve(hub, done), [first for first, _ in strangers if first not in served]
        assert worker.recv(1) == elastic.GO  # a well-formed worker is still served
        assert (1, 0) in hub.channels and hub.open == 1
    finally:
        for _, sock in strangers:
            sock.close()
        hub.close()


# -- the session channel while workers start ---------------------------------------------------
@pytest.mark.timeout(120)
def test_a_strangers_connection_is_dropped_and_the_session_starts(monkeypatch):
    feed = protocol.FrameReader.feed

    def feed_that_fails_on_boom(self, data):
        if data.startswith(b"BOOM"):
            raise RuntimeError("a bug these bytes hit")
        return feed(self, data)

    monkeypatch.setattr(protocol.FrameReader, "feed", feed_that_fails_on_boom)
    frame = protocol.encode(protocol.new_key(), protocol.TO_PARENT, {"type": "hello", "rank": 0})
    outcome = {}

    def stranger(address):
        socks = {what: socket.create_connection(address) for what in ("silent", "half a frame", "boom")}
        socks["half a frame"].sendall(frame[:5])
        socks["boom"].sendall(b"BOOM")
        wait = session_reader.HELLO_WAIT_S + 10
        outcome.update({what: closed_by_parent(s, wait) for what, s in socks.items()})
        for s in socks.values():
            s.close()

    session, _, error = start_with_stranger(stranger)
    try:
        assert error is None, error
        assert outcome == {"silent": True, "half a frame": True, "boom": True}
        assert session._pool.dropped_connections == 3
        assert session._pool.failure is None
        replies = session.run_cell("'fine'")
        assert {r: reply.result_repr for r, reply in replies.items()} == {0: "'fine'", 1: "'fine'"}
    finally:
        session.stop()
