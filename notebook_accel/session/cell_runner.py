"""Running cells on a worker: one namespace that lives across cells, IPython-like results.

SIGINT raises KeyboardInterrupt only while a cell runs, and only once per cell: between cells the
worker is reading or writing the channel, and an exception there would cut a frame in half.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import sys
import traceback
import types
from typing import Optional

from . import display


class Cells:
    def __init__(self):
        # The namespace is a fresh __main__ module, so pickle finds cell-defined functions by name
        # (DataLoader workers started with spawn) and cloudpickle sends them by value.
        self.module = types.ModuleType("__main__")
        self.namespace = self.module.__dict__
        self.namespace["__builtins__"] = builtins
        self.namespace["display"] = display.display
        sys.modules["__main__"] = self.module
        self.armed = False
        self.cells_run = 0
        # The last cell's exception while no later cell has run, for a post-mortem debugger
        # (post_mortem.py), as IPython's %debug keeps the last one; `compiled`: it got as far as running.
        self.failure: Optional[BaseException] = None
        self.compiled = False

    def on_sigint(self, signum, frame) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt

    def run(self, source: str, filename: str) -> dict:
        """Run one cell; the reply fields: ok, error, result (a bundle or None), displays."""
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        self.failure = None  # its frames go now: their tensors may be what the next cell needs
        self.cells_run += 1
        self.compiled = False
        display.take()
        value = None
        error = None
        try:
            self.armed = True
            body, last = _compile(source, filename)
            self.compiled = True
            exec(body, self.namespace)
            if last is not None:
                value = eval(last, self.namespace)
            self.armed = False
        except BaseException as exc:  # KeyboardInterrupt and SystemExit end the cell, not the worker
            self.armed = False
            error = error_report(exc)
            self.failure = exc
        result = None
        try:
            if value is not None:
                self.namespace["_"] = value
                result = display.bundle(value)
            display.capture_figures(skip=value)
        except Exception as exc:
            if error is None:
                error, self.failure = error_report(exc), exc
        return {"ok": error is None, "error": error, "result": result, "displays": display.take()}


def _compile(source: str, filename: str):
    """(code for the cell, code for its last expression or None), as IPython splits a cell."""
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
        last = compile(last, filename, "eval")
    return compile(tree, filename, "exec"), last


def user_traceback(exc: BaseException):
    """`exc`'s traceback from the user's code on: our own frames above it cut off."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def error_report(exc: BaseException) -> dict:
    tb = user_traceback(exc)
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    kind = type(exc)
    name = (
        kind.__qualname__
        if kind.__module__ in ("builtins", "__main__")
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    return {"exc_type": name, "message": str(exc), "traceback": text}
