"""Running a notebook cell's source on every rank, and bringing named values back.

With fork a rank runs the cell in its copy of the notebook's namespace. With spawn or forkserver
only the names the cell reads travel (cloudpickled), checked one by one before anything starts
so that an unpicklable one is named.
"""

from __future__ import annotations

import linecache
import os
import re
import types
from typing import Optional

from ..launch.errors import LaunchFailedError, LaunchStoppedError, LaunchTimeoutError, UnpicklableError

# Names IPython keeps in the user namespace that are not the user's and need not travel.
_KERNEL_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open", "_", "__", "___", "_ih", "_oh", "_dh"}


class CellJob:
    """What each rank runs: the cell's source under its own file name (for tracebacks)."""

    def __init__(self, source: str, filename: str, out: tuple, namespace: Optional[dict] = None):
        self.source = source
        self.filename = filename
        self.out = out
        self.namespace = namespace  # None: run in the namespace this process already has (fork)

    def __call__(self, namespace: Optional[dict] = None):
        __tracebackhide__ = True  # noqa: F841  (the rank's traceback starts at the cell's line)
        from ..state import PartialState

        PartialState()  # the process group is up before the cell's first line, as in a session
        ns = namespace if namespace is not None else self.namespace
        if ns is None:
            raise RuntimeError("a cell job needs a namespace")
        ns.setdefault("__name__", "__main__")
        if self.filename not in linecache.cache:
            lines = self.source.splitlines(True)
            linecache.cache[self.filename] = (len(self.source), None, lines, self.filename)
        exec(compile(self.source, self.filename, "exec"), ns)
        if not self.out or int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return None
        missing = [name for name in self.out if name not in ns]
        if missing:
            raise NameError(
                f"--out names {', '.join(map(repr, missing))}, which the cell did not define on this rank"
            )
        return {name: ns[name] for name in self.out}


def cell_number(shell) -> int:
    """The running cell's prompt number (In[N]). IPython 9 has already counted the cell in
    execution_count while it runs (older ones count it after), so ask the input history."""
    history = getattr(getattr(shell, "history_manager", None), "input_hist_parsed", None)
    if history:
        return len(history) - 1
    return shell.execution_count


_FILE = re.compile(r'File "([^"]+)"')
_PATH = re.compile(r"/[^\s()\"':]+\.py")


def relabel_cells(text: str, shell=None) -> str:
    """`File "/tmp/ipykernel_1/123.py"` -> `Cell In[5]`, as IPython labels a cell's code."""
    return _relabel(_FILE, 1, text, shell)


def relabel_cell_paths(text: str, shell=None) -> str:
    """A cell's file as pdb names it (`/tmp/ipykernel_1/123.py(4)f()`) -> `Cell In[5](4)f()`."""
    return _relabel(_PATH, 0, text, shell)


def _relabel(pattern, group: int, text: str, shell) -> str:
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    label = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if label is None:
        return text

    def one(match):
        named = label(match.group(group))
        return f"{named[0]} {named[1]}" if named else match.group(0)

    return pattern.sub(one, text)


def names_read(code: types.CodeType) -> set:
    """Global names the code (and the functions and classes it defines) may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= names_read(const)
    return names


def travelling_namespace(source: str, filename: str, user_ns: dict) -> dict:
    """The part of the notebook's namespace the cell reads, each value checked for pickling."""
    import cloudpickle

    code = compile(source, filename, "exec")
    wanted = sorted(
        n for n in names_read(code) if n in user_ns and n not in _KERNEL_NAMES and not n.startswith("_i")
    )
    namespace = {}
    for name in wanted:
        value = user_ns[name]
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            raise CellUnpicklableError(
                f"the cell uses {name!r} ({type(value).__name__}), which cannot be sent to spawn/forkserver "
                f"processes: {exc}. Create it inside the cell, or run with --start-method fork."
            ) from None
        namespace[name] = value
    return namespace


class _ShownShort:
    """IPython shows `_render_traceback_()` instead of the magic's own frames."""

    def _render_traceback_(self) -> list:
        return [f"{type(self).__name__}: {self}"]


class CellFailedError(_ShownShort, LaunchFailedError):
    """A rank failed while running a %%accelerate cell: the rank's traceback, its cell lines
    labelled as IPython labels them."""

    def __init__(self, error: LaunchFailedError, filename: str, label: str):
        super().__init__(list(error.reports.values()))
        self._made_from = (error, filename, label)  # what pickle and copy rebuild it from
        self.args = (relabel_cells(str(error).replace(f'File "{filename}"', label)),)


class CellUnpicklableError(_ShownShort, UnpicklableError):
    """A name the cell reads cannot travel to spawn / forkserver ranks."""


class CellStoppedError(_ShownShort, LaunchStoppedError):
    """The cell's ranks were stopped from the panel."""


class CellTimeoutError(_ShownShort, LaunchTimeoutError):
    """The cell ran past --timeout."""


def shorten(error: BaseException, filename: str, label: str) -> BaseException:
    """The error to show for a failed cell launch."""
    if isinstance(error, LaunchFailedError):
        return CellFailedError(error, filename, label)
    if isinstance(error, LaunchStoppedError):
        kind = CellTimeoutError if isinstance(error, LaunchTimeoutError) else CellStoppedError
        return kind(error.reason, list(error.reports.values()), stall=error.stall)
    return error
