"""Interactive sessions: N worker processes (ranks) that live across notebook cells.

`Session(4).start()` launches the workers with the launch machinery; `run_cell(source)` runs
source text on every rank (or some) in a namespace that persists, `push` / `pull` move values,
`stop()` ends them. Kernel-independent: the `%accelerate` magics drive this from Jupyter.
"""

from .errors import CellError, SessionError, SessionNotStarted, SessionTimeout, WorkerDied
from .manager import Session, print_output
from .ranks import CellReply, parse_ranks

__all__ = [
    "CellError",
    "CellReply",
    "Session",
    "SessionError",
    "SessionNotStarted",
    "SessionTimeout",
    "WorkerDied",
    "parse_ranks",
    "print_output",
]
