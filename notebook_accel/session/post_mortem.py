"""Inside a worker: pdb on the traceback of the last cell that failed here, its input and output
relayed over the session channel, one request per prompt.

The kernel's "debug" request starts it. Each reply carries what pdb wrote since the last prompt and
the new prompt; the next request ("debug_line") carries the line the user typed, or None for the end
of input, which quits. The last reply says `finished`. The worker keeps its namespace: pdb only
reads the failed cell's frames (unless the user assigns with `!`).
"""

from __future__ import annotations

import io
import pdb
import sys
from typing import Optional

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


def _stdlib_pdb() -> type:
    # A kernel puts IPython's debugger in pdb.Pdb (ipykernel's init_pdb) and a forked worker inherits
    # it; it would build a terminal shell here (the worker left the kernel's). The same pdb everywhere.
    return next((c for c in pdb.Pdb.__mro__ if c.__module__ == "pdb" and c.__name__ == "Pdb"), pdb.Pdb)


class _Relay(io.TextIOBase):
    """pdb's stdin and stdout, and sys.stdout / sys.stderr while it runs (a `!print(...)`)."""

    def __init__(self, session: "PostMortem"):
        self.session = session
        self.parts: list = []

    @property
    def encoding(self) -> str:
        return "utf-8"

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def write(self, text) -> int:
        self.parts.append(str(text))
        return len(text)

    def readline(self, size=-1) -> str:
        return self.session.ask(self.take())

    def take(self) -> str:
        text, self.parts = "".join(self.parts), []
        return text


class PostMortem:
    """One debugging session, from the "debug" request `request_id` until pdb ends."""

    def __init__(self, channel: protocol.Channel, cells: Cells, rank: int, request_id):
        self.channel, self.cells, self.rank = channel, cells, rank
        self.id = request_id  # the request the next reply answers
        self.next_message = None  # a request other than a line came while pdb waited: served after it
        self.lost: Optional[str] = None  # the channel closed (None from recv) or failed while pdb waited

    def run(self) -> Optional[dict]:
        """Debug until pdb ends; the last reply, or None when there is nothing left to answer."""
        relay = _Relay(self)
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = relay
        try:
            debugger = _stdlib_pdb()(stdin=relay, stdout=relay, nosigint=True, readrc=False)
            debugger.reset()
            debugger.interaction(None, user_traceback(self.cells.failure))
        except BaseException as exc:  # pdb's own failure (a SIGINT outside its loop): not the worker's end
            relay.write(f"the debugger ended: {type(exc).__name__}: {exc}\n")
        finally:
            self.cells.armed = False
            sys.stdout, sys.stderr = saved
        if self.lost is not None or self.next_message is not None:
            return None  # the last request was answered with its prompt already
        return {"ok": True, "error": None, "output": relay.take(), "prompt": "", "finished": True}

    def ask(self, text: str) -> str:
        """Answer the request in hand with pdb's output and its prompt (the text's last, unfinished
        line); return the next line for pdb, "" (the end of input) when none comes."""
        self.cells.armed = False  # a SIGINT while waiting for the user's line is no one's
        if self.lost is not None or self.next_message is not None:
            return ""  # pdb quits at the end of input: a guard, should it ask again
        cut = text.rfind("\n") + 1
        reply = {"ok": True, "error": None, "output": text[:cut], "prompt": text[cut:], "finished": False}
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
        line = header.get("line")
        if not isinstance(line, str):
            return ""
        self.cells.armed = True  # the kernel's interrupt stops the command pdb runs now
        return line.replace("\n", " ") + "\n"  # "\n" alone repeats pdb's last command, as in a terminal
