"""pdb on a traceback in one process, typed at in another, one prompt at a time.

The debugged side (`debug`) runs the standard library's pdb with a relay as its stdin and stdout: at
each prompt, `ask(text)` gets what pdb wrote since the last one, ending with the prompt, and returns
the user's line (`as_pdb_line`; "" is the end of input, which quits). A rank of a `pdb=True` launch
asks over its control socket (child.py), a session worker over the session channel
(session/post_mortem.py). The user's side (`Console`) prints that output, notebook cells named
`Cell In[N]` in a kernel, and reads each line with input(): in a kernel the front end answers it.
"""

from __future__ import annotations

import builtins
import io
import pdb
import sys
from typing import Callable, Optional

PDB_ENV = "NOTEBOOK_ACCEL_PDB"  # "1" in a rank's environment: keep it in pdb when it raises


def check(value, engine: str) -> None:
    """make_plan's check of `pdb=`: a bool, and an engine whose ranks this launcher talks to."""
    from .errors import LaunchConfigError  # torch's: not at import, which session workers do

    if not isinstance(value, bool):
        raise LaunchConfigError(f"pdb={value!r} must be True or False.")
    if value and engine == "elastic":
        raise LaunchConfigError(
            "pdb=True needs a launch on this machine by notebook_accel's own process manager; several nodes, "
            "max_restarts > 0 or a dynamic rdzv_backend run the ranks under torch's elastic agent, which "
            "ends a failed rank. Debug on one machine (num_nodes=1, max_restarts=0, rdzv_backend='static'), "
            "or in a session (%accelerate start, then %accelerate debug RANK after a failed cell)."
        )
    if value and engine == "xla":
        raise LaunchConfigError(
            "pdb=True cannot keep a TPU rank in the debugger (xmp.spawn ends it); debug the function on "
            "CPU ranks (cpu=True), or in a session (%accelerate start --cpu, then %accelerate debug RANK)."
        )


# -- the debugged side -------------------------------------------------------------------------------
def stdlib_pdb() -> type:
    # A kernel puts IPython's debugger in pdb.Pdb (ipykernel's init_pdb) and a forked process inherits
    # it; it would build a terminal shell there (the rank left the kernel's). The same pdb everywhere.
    return next((c for c in pdb.Pdb.__mro__ if c.__module__ == "pdb" and c.__name__ == "Pdb"), pdb.Pdb)


class Relay(io.TextIOBase):
    """pdb's stdin and stdout, and sys.stdout / sys.stderr while it runs (a `!print(...)`)."""

    def __init__(self, ask: Callable[[str], str]):
        self.ask = ask
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
        return self.ask(self.take())

    def take(self) -> str:
        text, self.parts = "".join(self.parts), []
        return text


def debug(tb, ask: Callable[[str], str]) -> str:
    """pdb on traceback `tb` until it ends (q, c, the end of input); returns what it wrote after its
    last prompt. Never raises: pdb's own failure is told in that text."""
    relay = Relay(ask)
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = relay
    try:
        debugger = stdlib_pdb()(stdin=relay, stdout=relay, nosigint=True, readrc=False)
        debugger.reset()
        debugger.interaction(None, tb)
    except BaseException as exc:  # pdb's own failure (a SIGINT outside its loop): not the process's end
        relay.write(f"the debugger ended: {type(exc).__name__}: {exc}\n")
    finally:
        sys.stdout, sys.stderr = saved
    return relay.take()


def split_prompt(text: str) -> tuple:
    """(output, prompt): the prompt is the text's last, unfinished line."""
    cut = text.rfind("\n") + 1
    return text[:cut], text[cut:]


def as_pdb_line(line) -> str:
    """The user's line as pdb reads it; anything but a string is the end of input, which quits."""
    if not isinstance(line, str):
        return ""
    return line.replace("\n", " ") + "\n"  # "\n" alone repeats pdb's last command, as in a terminal


# -- the user's side ---------------------------------------------------------------------------------
class Console:
    """pdb's output printed here, each command read with input() on the calling thread (in a kernel,
    the front end answers it). `refused` says why no line can be read, once that is known."""

    def __init__(self):
        self.refused: Optional[str] = _no_input()

    def write(self, text: str) -> None:
        if text and self.refused is None:
            from . import frontend

            print(frontend.label_cell_paths(text), end="", flush=True)

    def read_line(self, prompt: str) -> Optional[str]:
        """The user's line; None for the end of input or when none can be read (then `refused` says
        why). Whatever else input() raises (KeyboardInterrupt) goes up."""
        if self.refused is not None:
            return None
        try:
            return builtins.input(prompt)
        except EOFError:
            return None
        except NotImplementedError as exc:  # IPython's StdinNotImplementedError: the front end cannot
            self.refused = f"this front end does not answer input requests ({type(exc).__name__}: {exc})"
            return None


def _no_input() -> Optional[str]:
    """Why input() cannot read a line here, where that is known before asking; None if it may.
    A replaced input() (a kernel's, which asks the front end) is tried and tells for itself."""
    if getattr(builtins.input, "__self__", None) is not builtins:
        return None
    stdin = sys.stdin
    try:
        if stdin is not None and stdin.isatty():
            return None
    except (ValueError, OSError):  # closed
        pass
    return "stdin is not a terminal, so the debugger could not read a command"
