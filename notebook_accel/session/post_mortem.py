"""Inside a worker: pdb on the traceback of the last cell that failed here, its input and output
relayed over the session channel, one request per prompt (launch/pdb_relay.py runs pdb).

The kernel's "debug" request starts it. Each reply carries what pdb wrote since the last prompt and
the new prompt; the next request ("debug_line") carries the line the user typed, or None for the end
of input, which quits. The last reply says `finished`. The worker keeps its namespace: pdb only
reads the failed cell's frames (unless the user assigns with `!`).
"""

from __future__ import annotations

from typing import Optional

from ..launch import pdb_relay
from . import protocol
from .cell_runner import Cells, user_traceback


def refusal(cells: Cells, rank: int) -> Optional[str]:
    """Why `rank` has nothing to debug, or None when it has."""
    exc = cells.failure
    if exc is None:
        why = "its last cell ran without error" if cells.cells_run else "it has run no cell yet"
        return f"rank {rank} has no failed cell to debug ({why})"
    if not cells.compiled or user_traceback(exc) is None:
        return f"rank {rank}'s last cell failed before it ran ({type(exc).__name__}: {exc}): it has no frame to debug"
    return None


class PostMortem:
    """One debugging session, from the "debug" request `request_id` until pdb ends."""

    def __init__(self, channel: protocol.Channel, cells: Cells, rank: int, request_id):
        self.channel, self.cells, self.rank = channel, cells, rank
        self.id = request_id  # the request the next reply answers
        self.next_message = None  # a request other than a line came while pdb waited: served after it
        self.lost: Optional[str] = None  # the channel closed (None from recv) or failed while pdb waited

    def run(self) -> Optional[dict]:
        """Debug until pdb ends; the last reply, or None when there is nothing left to answer."""
        try:
            output = pdb_relay.debug(user_traceback(self.cells.failure), self.ask)
        finally:
            self.cells.armed = False
        if self.lost is not None or self.next_message is not None:
            return None  # the last request was answered with its prompt already
        return {"ok": True, "error": None, "output": output, "prompt": "", "finished": True}

    def ask(self, text: str) -> str:
        """Answer the request in hand with pdb's output and its prompt (the text's last, unfinished
        line); return the next line for pdb, "" (the end of input) when none comes."""
        self.cells.armed = False  # a SIGINT while waiting for the user's line is no one's
        if self.lost is not None or self.next_message is not None:
            return ""  # pdb quits at the end of input: a guard, should it ask again
        output, prompt = pdb_relay.split_prompt(text)
        reply = {"ok": True, "error": None, "output": output, "prompt": prompt, "finished": False}
        try:
            self.channel.send({"type": "done", "id": self.id, "rank": self.rank, **reply})
            message = self.channel.recv()
        except (OSError, protocol.BadFrame) as exc:
            self.lost = f"{type(exc).__name__}: {exc}"
            return ""
        if message is None:
            self.lost = "closed"
            return ""
        header = message[0]
        if header["type"] != "debug_line":
            self.next_message = message
            return ""
        self.id = header.get("id")
        line = pdb_relay.as_pdb_line(header.get("line"))
        self.cells.armed = bool(line)  # the kernel's interrupt stops the command pdb runs now
        return line
