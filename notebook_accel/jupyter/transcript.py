"""What a saved notebook keeps of a launch panel.

A front end without live widgets (nbclient's saved file, nbconvert, GitHub, nbviewer) shows an
output's text/plain, which for a bare widget is its repr. So the panel goes out as one bundle, the
widget's view plus a text/plain of our own, under a display id; when the launch ends that text
becomes `transcript()`. Live front ends render the widget, the richer type, and never the text.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter

from .panel_html import current_lines, header_text, label_cells
from .progress import ANSI

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def transcript(model, title: str) -> str:
    """`model` (a LaunchModel; hold its lock) as plain text: the title and state, a line counting
    the lines the all-ranks view dropped (per rank), each kept line as `[rank N] text` in that
    view's order, then each failure's traceback (or its summary, without one)."""
    m = model
    lines = [f"{title}: {header_text(m.state, m.note, m.stop_requested, m.elapsed(time.monotonic()))}"]
    if m.all.dropped:
        kept = Counter(rank for rank, _, _ in m.all.items)
        # A rank's own log counts every line it printed, the all-ranks view the ones it still has.
        cut = [(r.rank, r.log.added - kept[r.rank]) for r in m.sorted_ranks()]
        per_rank = ", ".join(f"rank {rank}: {n:,}" for rank, n in cut if n)
        noun = "line" if m.all.dropped == 1 else "lines"
        lines.append(f"… {m.all.dropped:,} earlier {noun} dropped ({per_rank})")
    lines += [f"[rank {rank}] {_plain(text)}" for rank, _, text in m.all.items]
    lines += [f"[rank {r.rank}] {_plain(text)}" for r in m.sorted_ranks() for text in current_lines(r)]
    if m.stall is not None:  # the watch's last report, while the stall lasted or when it ended the run
        lines += ["", f"notebook_accel: {m.stall.text(_label)}"]
    for failure in m.failures:
        if failure.traceback:
            text = _plain(_label(failure.traceback.rstrip("\n")))
            lines += ["", f"Traceback from rank {failure.rank}:", text]
        else:
            lines += ["", failure.summary()]
    return "\n".join(lines)


def _plain(text: str) -> str:
    return ANSI.sub("", text)


def _label(text: str) -> str:
    return label_cells(text)


class SavedOutput:
    """The panel's output in the running cell: `widget`'s view with `text` as its text/plain."""

    def __init__(self, widget, text: str):
        from IPython import get_ipython
        from IPython.display import display

        self.widget, self.text = widget, text
        self.display_id = uuid.uuid4().hex
        # ipykernel routes a display message by the parent header of the thread that sends it:
        # the update goes out under the one this display had, whichever thread sends it.
        self.thread = threading.current_thread()
        self._publisher = getattr(get_ipython(), "display_pub", None)
        self._parent = getattr(self._publisher, "parent_header", None)
        display(self._bundle(), raw=True, display_id=self.display_id)

    def _bundle(self) -> dict:
        # What ipywidgets' _repr_mimebundle_ gives for the view, without its text/plain: a repr of
        # every child, the logs' HTML included (hundreds of KiB), only to be cut to 110 characters.
        view = {"version_major": 2, "version_minor": 0, "model_id": self.widget.model_id}
        return {WIDGET_VIEW: view, "text/plain": self.text}

    def update(self, text: str) -> None:
        """Replace the text/plain (the widget's view stays); nothing if it did not change."""
        if text == self.text:
            return
        self.text = text
        from IPython.display import update_display

        with self._as_displayed():
            update_display(self._bundle(), display_id=self.display_id, raw=True)

    @contextlib.contextmanager
    def _as_displayed(self):
        setter = getattr(self._publisher, "set_thread_parent", None)
        reset = getattr(self._publisher, "reset_thread_parent", None)
        if threading.current_thread() is self.thread or not self._parent or setter is None or reset is None:
            yield  # the cell's own thread: its current cell is the one to tell (nbclient listens to it)
            return
        token = setter(self._parent)
        try:
            yield
        finally:
            reset(token)
