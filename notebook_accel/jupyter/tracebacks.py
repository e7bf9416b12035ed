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
    """The lines IPython shows for `error` (its `_render_traceback_`), each exception of its chain
    (`__cause__`, `__context__`) without library frames. Never raises: IPython would print its own
    complaint instead of the error."""
    chain, seen, link = [], set(), error
    while link is not None and id(link) not in seen:  # the order IPython walks it in
        seen.add(id(link))
        chain.append((link, link.__traceback__))
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    try:
        from IPython import get_ipython

        shell = get_ipython()
        for link, tb in chain:
            link.__traceback__ = without_library_frames(tb)
        return shell.InteractiveTB.structured_traceback(type(error), error, error.__traceback__, tb_offset=0)
    except Exception:  # noqa: BLE001 - the plain traceback, whole, is better than none
        import traceback

        for link, tb in chain:
            link.__traceback__ = tb
        return traceback.format_exception(type(error), error, error.__traceback__)
    finally:
        for link, tb in chain:  # the exception keeps every frame (`%debug`, a caller's handler)
            link.__traceback__ = tb
