"""A stranger at the session channel's door while a session's workers start (a few seconds with
spawn): the window in which the channel listens."""

from __future__ import annotations

import threading
import time

import psutil

from notebook_accel.session import Session


def listening() -> set:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }


def start_with_stranger(stranger, timeout=60.0):
    """Start a 2-rank spawn session (a few seconds before its workers say hello) while
    `stranger(address)` runs in another thread against the channel's new listening socket.
    Returns (session, the listening addresses the stranger found, its exception or None)."""
    before = listening()
    seen: dict = {}

    def knock():
        try:
            deadline = time.monotonic() + timeout
            while not (new := listening() - before):
                assert time.monotonic() < deadline, "no new listening socket"
                time.sleep(0.005)
            seen["addresses"] = sorted(new)
            stranger(seen["addresses"][0])
        except BaseException as exc:
            seen["error"] = exc

    thread = threading.Thread(target=knock, daemon=True)
    thread.start()
    session = Session(2, start_method="spawn", cpu=True, on_output=lambda *line: None)
    try:
        session.start()
        thread.join(timeout)
        assert not thread.is_alive()
    except BaseException:
        session.stop()
        raise
    return session, seen.get("addresses"), seen.get("error")


def closed_by_parent(sock, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
