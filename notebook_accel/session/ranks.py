"""Which ranks a call targets, what the parent knows about each worker, and a cell's reply."""

from __future__ import annotations

import operator
import signal
from dataclasses import dataclass, field
from typing import Optional

from ..launch.channel import RankChannel


def parse_ranks(spec, world: int) -> list:
    """Ranks from "all", "0,2", "1:", ":2", "1:3" (mixed: "0,2:4"), an int or a list of ints."""
    valid = f"valid ranks are 0..{world - 1}" if world > 0 else "there are no ranks"
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("all", ":")):
        return list(range(world))
    if isinstance(spec, bool):
        raise ValueError(f"ranks={spec!r} is not a rank spec; {valid}")
    if isinstance(spec, str):
        items = spec.split(",")
    else:
        try:
            items = list(spec)
        except TypeError:
            items = [spec]
    out = []
    for item in items:
        for rank in _one(item, spec, world, valid):
            if rank not in out:
                out.append(rank)
    if not out:
        raise ValueError(f"ranks={spec!r} selects no rank; {valid}")
    return out


def _one(item, spec, world: int, valid: str) -> list:
    if isinstance(item, str) and ":" in item:
        start, _, stop = item.partition(":")
        start = _number(start, spec, valid, 0)
        stop = _number(stop, spec, valid, world)
        if stop < start or start < 0 or stop > world:
            raise ValueError(f"ranks={spec!r}: {item.strip()!r} is not a range within 0..{world}; {valid}")
        return list(range(start, stop))
    if isinstance(item, str):
        number = _number(item, spec, valid, None)
    else:
        try:  # ints, and numpy's or torch's integer scalars
            if isinstance(item, bool):
                raise TypeError
            number = operator.index(item)
        except TypeError:
            raise ValueError(f"ranks={spec!r}: {item!r} is not a rank number; {valid}") from None
    if not 0 <= number < world:
        raise ValueError(f"ranks={spec!r}: rank {number} does not exist; {valid}")
    return [number]


def _number(text: str, spec, valid: str, empty) -> int:
    text = text.strip()
    if not text and empty is not None:
        return empty
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"ranks={spec!r}: {text!r} is not a rank number; {valid}") from None


@dataclass
class CellReply:
    """One rank's answer to a cell. `result` and each of `displays` are mime bundles
    (mime type -> data; images base64), like Jupyter's display data."""

    rank: int
    ok: bool
    error: Optional[dict] = None  # {exc_type, message, traceback}
    result: Optional[dict] = None
    displays: list = field(default_factory=list)

    @property
    def result_repr(self) -> Optional[str]:
        return None if self.result is None else self.result.get("text/plain")


class WorkerState:
    """The parent's view of one worker (its process, channel and what it is doing)."""

    def __init__(self, rank: int, proc):
        self.rank = rank
        self.proc = proc  # launch.procs.RankProcess: its sockets, exit fd and signals
        self.pid = proc.pid
        self.channel = RankChannel(rank)  # its stdout, stderr and the launch's control frames
        self.conn = None  # channel socket, once the worker said hello
        self.device = None
        self.busy: set = set()  # ids of requests sent and not yet answered
        self.dead = False
        self.exitcode: Optional[int] = None

    @property
    def launch_error(self) -> Optional[dict]:
        """What the rank reported if its serve loop raised (it failed while starting, say)."""
        return self.channel.error

    @property
    def state(self) -> str:
        return "dead" if self.dead else "busy" if self.busy else "idle"

    @property
    def signal_name(self) -> Optional[str]:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"
