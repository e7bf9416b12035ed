"""The launcher's side of watch_rank.py: ask a rank's worker server for its stacks and collectives.

Plain HTTP/1.1 over the rank's Unix socket, with a short timeout: a rank without a server (it has
not started it yet, an old torch, a rank of a foreign engine) answers None and the report says
what it could not see.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Optional

from .watch_rank import socket_path

ASK_TIMEOUT_S = 2.0


def forget(pid: int) -> None:
    """Remove the socket of rank `pid` once its process is gone: a rank that was killed could not
    (the folder would fill, launch after launch). A process that lives on (xmp's) keeps it."""
    if pid and not os.path.exists(f"/proc/{pid}"):
        try:
            os.unlink(socket_path(pid))
        except OSError:
            pass


def ask(pid: int, handler: str, timeout: float = ASK_TIMEOUT_S) -> Optional[bytes]:
    """The body of POST /handler/HANDLER from rank `pid`'s worker server, or None."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_path(pid))
            sock.sendall(f"POST /handler/{handler} HTTP/1.1\r\nHost: rank\r\nContent-Length: 0\r\n\r\n".encode())
            return _read_response(sock)
    except (OSError, ValueError):
        return None


def _read_response(sock) -> Optional[bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].split(" ")[1:2] == ["200"]:
        return None
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return _dechunk(sock, body)
    length = int(headers.get("content-length", "-1"))
    while length < 0 or len(body) < length:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        body += chunk
    return body if length < 0 else body[:length]


def _dechunk(sock, data: bytes) -> bytes:
    out = b""
    while True:
        while b"\r\n" not in data:
            data += sock.recv(1 << 20)
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return out
        while len(data) < size + 2:
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise ValueError("chunked body cut short")
            data += chunk
        out += data[:size]
        data = data[size + 2 :]


@dataclass(frozen=True)
class Collective:
    """One entry of torch's flight recorder: `op` without its backend prefix ("all_reduce")."""

    op: str
    group: str  # the process group's name (its ranks where it has none)
    seq: int  # per group
    shapes: tuple = ()  # of the inputs
    dtypes: tuple = ()

    def describe(self) -> str:
        tensors = ", ".join(f"{_dtype(d)}{list(s)}" for s, d in zip(self.shapes, self.dtypes))
        group = "" if self.group in ("", "default") else f" of group {self.group}"
        return f"{self.op} #{self.seq}{group}" + (f" ({tensors})" if tensors else "")


@dataclass(frozen=True)
class Collectives:
    """Where a rank is among its collectives: `waiting` the ones enqueued and not completed (one per
    group at most in practice), `last` the latest entry of each group, `issued` group -> the last
    sequence number enqueued (the watch's sign of progress: gloo marks completion lazily)."""

    waiting: tuple = ()
    last: tuple = ()
    issued: dict = field(default_factory=dict)


def collectives(pid: int) -> Optional[Collectives]:
    body = ask(pid, "fr_trace_json")
    if body is None:
        return None
    try:
        return parse_trace(json.loads(body))
    except (ValueError, KeyError, TypeError):
        return None


def stacks(pid: int) -> Optional[str]:
    body = ask(pid, "dump_traceback")
    return None if body is None else body.decode("utf-8", "replace")


def parse_trace(trace: dict) -> Collectives:
    """The flight recorder's JSON (fr_trace_json) -> Collectives."""
    names: dict = {}
    status = trace.get("pg_status") or {}
    latest: dict = {}  # pg id -> the entry with the highest sequence number
    for entry in trace.get("entries") or []:
        pg = str(entry.get("pg_id"))
        if pg not in latest or int(entry.get("collective_seq_id", -1)) > int(latest[pg].get("collective_seq_id", -1)):
            latest[pg] = entry
    waiting, last, issued = [], [], {}
    for pg, entry in sorted(latest.items()):
        group = _group_name(entry, names)
        c = Collective(
            op=str(entry.get("profiling_name", "?")).split(":", 1)[-1],
            group=group,
            seq=int(entry.get("collective_seq_id", -1)),
            shapes=tuple(tuple(s) for s in entry.get("input_sizes") or ()),
            dtypes=tuple(entry.get("input_dtypes") or ()),
        )
        last.append(c)
        done = int((status.get(pg) or {}).get("last_completed_collective", -1))
        enqueued = int((status.get(pg) or {}).get("last_enqueued_collective", c.seq))
        issued[group] = enqueued
        if enqueued > done and c.seq == enqueued:
            waiting.append(c)
    return Collectives(tuple(waiting), tuple(last), issued)


def _group_name(entry: dict, names: dict) -> str:
    pg = entry.get("process_group") or []  # [name, description]
    name = str(pg[0]) if pg else str(entry.get("pg_id"))
    desc = str(pg[1]) if len(pg) > 1 else ""
    if name == "0" or desc == "default_pg":
        return "default"
    return desc if desc and desc != "undefined" else f"#{name}"


_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}


def _dtype(name: str) -> str:
    return _DTYPES.get(name, str(name).lower())
