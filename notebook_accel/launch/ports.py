"""The rendezvous port of a launch: an explicit one kept and checked, else a free one picked and held.

A port picked for a single-node launch stays bound (not listening) in this process until the launch
ends, so no other program that asks the system for a free port, and no plain bind, can take it in
the moment between the pick and rank 0's bind. Rank 0's store can still bind it: torch's TCPStore
sets SO_REUSEADDR, as the reservation does, and Linux lets such sockets share a port as long as
only one of them listens.
"""

from __future__ import annotations

import socket
import threading

from .errors import LaunchConfigError

_held: dict = {}  # port -> the socket holding it for a launch that has not ended yet
_lock = threading.Lock()


def resolve(use_port, master_addr: str, *, pick: bool, check_free: bool) -> tuple:
    """(port, held): a free port, held until `release`, when `pick` or use_port is 'auto' / 0;
    else `use_port` itself, refused while something listens there when `check_free`."""
    addr = master_addr or "127.0.0.1"
    text = str(use_port).strip().lower()
    if pick or text in ("auto", "0", ""):
        return reserve(addr), True
    try:
        port = int(text)
    except ValueError:
        raise LaunchConfigError(f"use_port={use_port!r} must be a port number or 'auto'.") from None
    if not 1 <= port <= 65535:
        raise LaunchConfigError(f"use_port={port} is outside 1..65535; pass a valid port or 'auto'.")
    if check_free and not is_free(port, addr):
        raise LaunchConfigError(
            f"Port {port} on {addr} is already in use (another launch or program holds it); "
            "pass use_port='auto' (or leave it out) to pick a free one, or another port."
        )
    return port, False


def free_port(addr: str = "127.0.0.1") -> int:
    """A port free right now (not held: for tests and tools that pass it on as an explicit port)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def reserve(addr: str = "127.0.0.1") -> int:
    """A free port, bound here (with SO_REUSEADDR, not listening) until `release(port)`."""
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.set_inheritable(False)  # spawned ranks and the forkserver never see it
        s.bind((addr, 0))
    except OSError:  # an address that is not this machine's: hold the port on every interface
        s.close()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.set_inheritable(False)
        s.bind(("", 0))
    port = s.getsockname()[1]
    with _lock:
        _held[port] = s
    return port


def release(port: int) -> None:
    """Let go of a port `reserve` held (a launch has ended, or its plan was dropped); idempotent."""
    with _lock:
        s = _held.pop(port, None)
    if s is not None:
        s.close()


def held() -> set:
    """The ports held for launches right now."""
    with _lock:
        return set(_held)


def is_free(port: int, addr: str) -> bool:
    with socket.socket() as s:
        # As torch's TCPStore binds: a port left in TIME_WAIT by the last launch is free, a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True
