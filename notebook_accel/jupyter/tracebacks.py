"""How IPython shows a launch error in a kernel: the user's frames, none of the library's.

A failed rank's message already holds that rank's traceback (its cells named `Cell In[N]`); the
frames between the user's call and the raise (launcher, starters, monitor) say nothing to the user.
The exception keeps them all (`__traceback__`, and `.reports` for each rank's whole traceback).
"""

from __future__ import annotations

import os
import types

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _hidden(tb) -> bool:
    frame = tb.tb_frame
    return frame.f_code.co_filename.startswith(_PACKAGE) or bool(frame.f_locals.get("__tracebackhide__"))


def without_library_frames(tb):
    """A copy of traceback `tb` without this package's frames and those marked `__tracebackhide__`
    (IPython's own bottom frame is); None when none is left."""
    kept = []
    while tb is not None:
        if not _hidden(tb):
            kept.append(tb)
        tb = tb.tb_next
    shown = None
    for t in reversed(kept):
        shown = types.TracebackType(shown, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return shown


def render(error: BaseException) -> list:
    """The lines IPython shows for `error` (its `_render_traceback_`). Never raises: IPython would
    print its own complaint instead of the error."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        tb = without_library_frames(error.__traceback__)
        return shell.InteractiveTB.structured_traceback(type(error), error, tb, tb_offset=0)
    except Exception:  # noqa: BLE001 - the plain message is better than no error at all
        return [f"{type(error).__name__}: {error}"]
