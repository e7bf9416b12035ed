"""LaunchPanel: a launch's ranks, output, progress bars and failures as one ipywidgets view.

The launcher calls handle() from its own thread, perhaps 100k lines a second, so handle() only
records, in a LaunchModel (launch_model.py, shared with the extension's CommSink). flush() turns
what changed into widget updates; with autoflush a daemon thread calls it `fps` times a second, so
the front end sees at most that many updates per view. The HTML is panel_html.py's. In a kernel
the panel's output also carries a text/plain, the launch's transcript once it ends (transcript.py),
for a notebook saved without its widgets.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Optional

import ipywidgets as widgets
from ipywidgets.widgets.widget_string import HTMLStyle

from ..launch import events as ev
from ..launch.sinks import Sink
from .launch_model import LaunchModel
from .panel_html import (
    current_lines,
    header_html,
    label_cells,
    line_html,
    stall_html,
    status_html,
    traceback_html,
    view_html,
    view_rank,
)
from .progress import parse_bar
from .style import esc, rank_color, style_tag
from .transcript import SavedOutput, transcript

STOP_REASON = "stopped from the launch panel"
INTERRUPT_HINT = "Interrupt the kernel (■) to stop"
NO_STACKS_HINT = "(stacks on demand need a kernel that hears clicks while busy)"


class LaunchPanel(Sink):
    """A launch sink drawn as widgets: header with Stop, a status row per rank, logs, bars, tracebacks.

    Public widgets: `widget` (the root), `stop_button`, `stacks_button`, `views` ("all", "rank-R" -> HTML), `tabs`,
    `status_table`, `header`, `progress_bars` / `progress_labels` (rank -> widget), `traceback`.

    `show_after=S` (interactive session cells): the panel is built and shown only once the launch
    prints, fails, is stopped or has run S seconds (`poll()` checks the time), so a quick silent
    cell costs no widgets; until then `widget` and the others do not exist.
    """

    def __init__(
        self,
        *,
        title: str = "notebook_accel launch",
        max_lines: int = 1000,
        fps: float = 10.0,
        autoflush: bool = True,
        show: bool = True,
        show_after: float = 0.0,
    ):
        if max_lines < 1:
            raise ValueError(f"max_lines={max_lines} must be 1 or more.")
        if not fps > 0:
            raise ValueError(f"fps={fps} must be more than 0.")
        self.title, self.max_lines, self.fps = title, int(max_lines), float(fps)
        self.autoflush, self.show = autoflush, show
        self.model = LaunchModel(self.max_lines)
        self._lock = self.model.lock  # handle() against flush() and text()
        self._render_lock = threading.RLock()  # one flush at a time
        self._control = None
        self._shown = False
        self._output: Optional[SavedOutput] = None  # the cell's output, in a kernel
        self._flusher: Optional[threading.Thread] = None
        self._stop_flushing = threading.Event()
        self._flush_error_reported = False
        self.show_after = float(show_after)
        self._waiting = False  # started, not shown yet (show_after)
        self._widgets_made = False
        if not self.show_after:
            self._make_widgets()

    # -- sink interface (launcher thread) --------------------------------------------------------

    def attach(self, control) -> None:
        self._control = control

    def handle(self, event) -> None:
        if isinstance(event, ev.RankOutput):  # the hot path: up to 100k lines a second
            self.model.output(event)
            if self._waiting:
                self._reveal()
            return
        self.model.handle(event)
        if isinstance(event, ev.LaunchStarted):
            self._launch_started()
        elif self._waiting and (
            isinstance(event, (ev.RankFailed, ev.RankStopped, ev.LaunchNotice))
            or (isinstance(event, ev.LaunchFinished) and not event.ok)
        ):
            self._reveal()
        if isinstance(event, ev.LaunchFinished):
            self._save_transcript()  # here too: a sink nobody closes

    def poll(self) -> None:
        """Show a waiting panel once the launch has run `show_after` seconds (the cell's thread)."""
        if self._waiting and time.monotonic() - self.model.began >= self.show_after:
            self._reveal()

    def close(self) -> None:
        self._stop_flushing.set()
        flusher = self._flusher
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join()
        self._flusher = None
        self.flush()
        self._save_transcript()  # lines that came after LaunchFinished

    # -- queries ---------------------------------------------------------------------------------

    def status(self, rank: int) -> str:
        with self._lock:
            r = self.model.ranks.get(rank)
            return r.state if r is not None else "pending"

    def text(self, view="all") -> str:
        """The plain text a view keeps now: "all", "rank-R" or R."""
        rank = view_rank(view)
        m = self.model
        with self._lock:
            if rank is None:
                lines = [f"[rank {r}] {text}" for r, _, text in m.all.items]
                lines += [f"[rank {r.rank}] {t}" for r in m.sorted_ranks() for t in current_lines(r)]
                return "\n".join(lines)
            r = m.ranks.get(rank)
            if r is None:
                raise KeyError(f"no rank {rank} in this launch")
            return "\n".join([text for _, text in r.log.items] + current_lines(r))

    # -- display and the flushing thread ---------------------------------------------------------

    def _launch_started(self) -> None:
        # LaunchStarted comes once, on the thread that runs the launch (the cell's), before any
        # rank starts: display() there lands in the right cell; from another thread it may not.
        if self.show_after and not self._shown:
            self._waiting = True
            return
        if not self._widgets_made:
            self._make_widgets()
        if self.show and not self._shown:
            self._shown = True
            self.flush()
            self._display()
        if self.autoflush and (self._flusher is None or not self._flusher.is_alive()):
            self._stop_flushing = threading.Event()
            self._flusher = threading.Thread(
                target=self._flush_loop, args=(self._stop_flushing,), name="notebook_accel-panel", daemon=True
            )
            self._flusher.start()

    def _display(self) -> None:
        from .kernel_env import in_kernel

        if in_kernel():
            first = f"{self.title}: running (each rank's output is saved here when it ends)"
            self._output = SavedOutput(self.widget, first)
        else:  # a terminal IPython prints what it is given: the widget, as before
            from IPython.display import display

            display(self.widget)

    def _save_transcript(self) -> None:
        output = self._output
        if output is None:
            return
        with self._lock:
            text = transcript(self.model, self.title)
        output.update(text)

    def _reveal(self) -> None:
        self._waiting = False
        self.show_after = 0.0
        self._launch_started()

    def _flush_loop(self, stop: threading.Event) -> None:
        while not stop.wait(1.0 / self.fps):
            try:
                self.flush()
            except Exception as exc:  # a display bug must not end the thread, nor the launch
                if not self._flush_error_reported:
                    self._flush_error_reported = True
                    sys.__stderr__.write(f"notebook_accel: launch panel failed to draw: {exc!r}\n")
            if self.model.state in ("done", "failed", "stopped"):
                return  # drawn; close() draws anything later, and a sink nobody closes stops here

    # -- widgets ---------------------------------------------------------------------------------

    def _make_widgets(self) -> None:
        self._widgets_made = True
        full = self._full = widgets.Layout(width="100%")  # shared: a Layout is a widget (a comm) too
        html = self._html_style = HTMLStyle()  # likewise: else one per HTML widget
        self.header = widgets.HTML(layout=widgets.Layout(flex="1 1 auto"), style=html)
        self.stop_button = widgets.Button(
            description="Stop", icon="stop", disabled=True, tooltip="Stop every rank of this launch"
        )
        self.stop_button.add_class("nacc-stop")
        self.stop_button.on_click(self._on_stop)
        stop: widgets.Widget = self.stop_button
        self.stacks_button = widgets.Button(
            description="Stacks", disabled=True, tooltip="Where each rank is now: its stacks and collective"
        )
        self.stacks_button.add_class("nacc-stacks")
        self.stacks_button.on_click(self._on_stacks)
        stacks: widgets.Widget = self.stacks_button
        if not _clicks_arrive(self.stop_button) or not _clicks_arrive(self.stacks_button):
            stop = widgets.HTML(f'<span class="nacc-muted">{esc(INTERRUPT_HINT)}</span>', style=html)
            stacks = widgets.HTML(f'<span class="nacc-muted">{esc(NO_STACKS_HINT)}</span>', style=html)
        self.status_table = widgets.HTML(layout=full, style=html)
        self.progress_box = widgets.VBox(layout=full)
        self.tabs = widgets.Tab(layout=full)
        self.traceback = widgets.HTML(layout=full, style=html)
        self.views: dict = {}
        self.progress_bars: dict = {}
        self.progress_labels: dict = {}
        self._progress_rows: dict = {}  # rank -> HBox, made when the rank first shows a bar
        self._ranks_built: list = []
        self._bodies: dict = {}  # view -> (log version, rendered lines)
        self._bars_seen: dict = {}  # rank -> (bar text, final) last drawn
        self._built_layout = 0
        self._drawn_launch = 0
        self.widget = widgets.VBox(
            [
                widgets.HTML(style_tag(), style=html),
                widgets.HBox([self.header, stacks, stop], layout=widgets.Layout(align_items="center")),
                self.status_table,
                self.progress_box,
                self.tabs,
                self.traceback,
            ],
            layout=full,
        )
        self.widget.add_class("nacc-launch")

    def _on_stop(self, _button=None) -> None:
        # Runs on the thread that delivers widget messages, not the launcher's.
        m = self.model
        with self._lock:
            if m.state != "running" or m.stop_requested:
                return
            control = self._control
            if control is None:
                m.note = f"this launch cannot be stopped from here: {INTERRUPT_HINT.lower()}"
                return
            m.stop_requested = True
        self.stop_button.disabled = True
        control.request_stop(STOP_REASON)

    def _on_stacks(self, _button=None) -> None:
        """A snapshot of every running rank, shown where a stall report is (the widget-message thread;
        launch/watch.py and stall.py were imported by the launch)."""
        from ..launch.watch import snapshot

        m = self.model
        with self._lock:
            if m.state != "running":
                return
            # A rank on another machine (node set: a Ray launch) has a pid there, not here: its engine
            # asks it (control.where_now), else it is left out.
            rows = [
                (r.rank, r.pid, r.state == "done")
                for r in m.sorted_ranks()
                if r.pid and not r.node and r.state in ("running", "done")
            ]
            began = m.began
            where_now = getattr(self._control, "where_now", None)
        self.stacks_button.disabled = True
        try:
            if where_now is not None:
                report = where_now(label_cells)
            else:
                report = snapshot(time.monotonic() - began, rows, label_cells, asked=True)
        finally:
            self.stacks_button.disabled = False
        with self._lock:
            if m.stall is None or not m.stall.stalled:  # a stall's report stays until the ranks move
                m.stall = report
        self.flush()

    def _build(self, ranks: list) -> None:
        """Widgets for the current set of ranks; existing ones are kept.

        Every widget is a comm and a message to the front end (about 1 ms each in a kernel): the
        views share one Layout, and a rank's progress row is made only when it shows a bar."""
        names = ["all"] + [f"rank-{r}" for r in ranks]
        self.views = {
            n: self.views.get(n) or widgets.HTML(layout=self._full, style=self._html_style) for n in names
        }
        self._ranks_built = list(ranks)
        self._place_progress_rows()
        self.tabs.children = [self.views[name] for name in names]

    def _place_progress_rows(self) -> None:
        rows = self._progress_rows
        self.progress_box.children = [rows[r] for r in self._ranks_built if r in rows]

    def _progress_row(self, rank: int) -> None:
        if rank in self._progress_rows:
            return
        bar = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, layout=widgets.Layout(width="40%"))
        bar.add_class("nacc-progress")
        label = widgets.Label()
        name = widgets.HTML(f'<span class="nacc-prefix" style="color:{rank_color(rank)}">rank {rank}</span>')
        self._progress_rows[rank] = widgets.HBox(
            [name, bar, label], layout=widgets.Layout(display="none", align_items="center")
        )
        self.progress_bars[rank], self.progress_labels[rank] = bar, label
        self._place_progress_rows()

    def flush(self) -> None:
        """Draw what changed since the last flush. Safe from any thread."""
        if not self._widgets_made:
            return  # show_after: nothing built yet
        with self._render_lock:
            with self._lock:
                snap = self._snapshot()
            self._draw(snap)

    def _snapshot(self) -> dict:
        """Copies of what flush draws, taken quickly under the lock; log copies only when they changed."""
        m, now = self.model, time.monotonic()
        ranks = m.sorted_ranks()
        if m.launches != self._drawn_launch:  # a new launch: its logs restart their versions
            self._bodies.clear()
            self._bars_seen.clear()
        logs, dropped = {}, {"all": m.all.dropped}
        for name, log in [("all", m.all)] + [(f"rank-{r.rank}", r.log) for r in ranks]:
            cached = self._bodies.get(name)
            if cached is None or cached[0] != log.added:
                logs[name] = (log.added, list(log.items))
            dropped[name] = log.dropped
        failures = [(f, [] if f.traceback else list(m.ranks[f.rank].log.items)[-20:]) for f in m.failures]
        return {
            "launch_id": m.launches,
            "layout": m.layout,
            "launch": (m.state, m.note, m.stop_requested),
            "launch_elapsed": m.elapsed(now),
            "fsdp": m.fsdp,
            "rows": [(r.rank, _where(r), r.state, r.detail, r.elapsed(now), dict(r.usage)) for r in ranks],
            "logs": logs,
            "dropped": dropped,
            "current": [(r.rank, stream, text) for r in ranks for stream, text in sorted(r.current.items())],
            "bars": {r.rank: (r.bar_text, r.bar_final) for r in ranks if r.bar_text is not None},
            "failures": failures,
            "stall": m.stall,
        }

    def _draw(self, snap: dict) -> None:
        ranks = [row[0] for row in snap["rows"]]
        if self._built_layout != snap["layout"]:
            self._build(ranks)
            self._built_layout = snap["layout"]
        if self._drawn_launch != snap["launch_id"]:
            for rank, row in self._progress_rows.items():  # bars of the last launch
                row.layout.display = "none"
                self.progress_bars[rank].value, self.progress_bars[rank].bar_style = 0.0, ""
            self._drawn_launch = snap["launch_id"]
        _set(self.status_table, "value", status_html(snap["rows"]))
        for name, view in self.views.items():
            if name in snap["logs"]:
                version, items = snap["logs"][name]
                if view_rank(name) is None:
                    lines = [line_html(t, s, r) for r, s, t in items]
                else:
                    lines = [line_html(t, s) for s, t in items]
                self._bodies[name] = (version, "\n".join(lines))
            body = self._bodies.get(name, (0, ""))[1]
            current = [(r, s, t) for r, s, t in snap["current"] if name == "all" or name == f"rank-{r}"]
            _set(view, "value", view_html(name, body, snap["dropped"].get(name, 0), current))
        failed = {f.rank for f, _ in snap["failures"]}
        titles = ["All ranks"] + [f"Rank {r} ✗" if r in failed else f"Rank {r}" for r in ranks]
        if tuple(self.tabs.titles) != tuple(titles):
            self.tabs.titles = titles
        states = {row[0]: row[2] for row in snap["rows"]}
        for rank, seen in snap["bars"].items():
            self._draw_bar(rank, seen, states.get(rank))
        failures = "".join(traceback_html(f, tail) for f, tail in snap["failures"])
        _set(self.traceback, "value", stall_html(snap["stall"]) + failures)
        # The launch's state last: a front end that shows "done" already shows the rest.
        state, note, stopping = snap["launch"]
        _set(self.stop_button, "disabled", state != "running" or stopping)
        _set(self.stacks_button, "disabled", state != "running")
        header = header_html(self.title, state, note, stopping, snap["launch_elapsed"], fsdp=snap["fsdp"])
        _set(self.header, "value", header)

    def _draw_bar(self, rank: int, seen: tuple, state: Optional[str]) -> None:
        text, final = seen
        bar = parse_bar(text) if self._bars_seen.get(rank, (None,))[0] != text else None
        if bar is not None:
            self._progress_row(rank)
            self._progress_rows[rank].layout.display = "flex"
            _set(self.progress_bars[rank], "value", bar.fraction if bar.fraction is not None else 0.0)
            _set(self.progress_labels[rank], "value", bar.label)
        self._bars_seen[rank] = seen
        if rank in self.progress_bars:
            complete = self.progress_bars[rank].value >= 1.0 and (final or state == "done")
            style = "danger" if state == "failed" else "success" if complete else ""
            _set(self.progress_bars[rank], "bar_style", style)


# -- helpers ------------------------------------------------------------------------------------


def _clicks_arrive(button) -> bool:
    """Whether the kernel delivers this button's clicks while a cell is running (see busy.py)."""
    try:
        from .busy import deliver_while_busy
    except ImportError:
        return False
    try:
        return bool(deliver_while_busy(button))
    except Exception:
        return False


def _set(widget, name: str, value) -> None:
    if getattr(widget, name) != value:
        setattr(widget, name, value)


def _where(rank) -> object:
    """The pid cell: the pid, and the rank's node where the launch spans machines (Ray)."""
    return f"{rank.pid} on {rank.node}" if rank.node and rank.pid is not None else rank.pid
