"""LaunchPanel: a launch's ranks, output, progress bars and failures as one ipywidgets view.

The launcher calls handle() from its own thread, perhaps 100k lines a second, so handle() only
records under a lock. flush() turns what changed into widget updates; with autoflush a daemon
thread calls it `fps` times a second, so the front end sees at most that many updates per view.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import Optional

import ipywidgets as widgets
from ipywidgets.widgets.widget_string import HTMLStyle

from ..launch import events as ev
from ..launch.sinks import Sink
from .progress import ANSI, parse_bar
from .style import esc, rank_color, style_tag

STOP_REASON = "stopped from the launch panel"
INTERRUPT_HINT = "Interrupt the kernel (■) to stop"

# -- what handle() records ----------------------------------------------------------------------


class _Log:
    """The newest `max_lines` items of a view, and how many were ever added (its version)."""

    __slots__ = ("items", "added")

    def __init__(self, max_lines: int):
        self.items: deque = deque(maxlen=max_lines)
        self.added = 0

    def add(self, item) -> None:
        self.items.append(item)
        self.added += 1


class _Rank:
    __slots__ = (
        "rank",
        "pid",
        "state",
        "detail",
        "started",
        "seconds",
        "log",
        "current",
        "bar_text",
        "bar_final",
    )

    def __init__(self, rank: int, max_lines: int):
        self.rank = rank
        self.pid: Optional[int] = None
        self.state = "pending"
        self.detail = ""
        self.started: Optional[float] = None  # time.monotonic()
        self.seconds: Optional[float] = None  # once it ended
        self.log = _Log(max_lines)
        self.current: dict = {}  # stream -> the redraw in progress (transient text)
        self.bar_text: Optional[str] = None  # the newest line that may be a tqdm bar
        self.bar_final = False

    def end(self, state: str, detail: str = "", seconds: Optional[float] = None) -> None:
        self.state, self.detail = state, detail
        if seconds is None and self.started is not None:
            seconds = time.monotonic() - self.started
        self.seconds = seconds

    def elapsed(self, now: float) -> Optional[float]:
        if self.seconds is not None:
            return self.seconds
        return None if self.started is None else now - self.started


def _failure_detail(event: ev.RankFailed) -> str:
    parts = [event.exc_type] if event.exc_type else []
    if event.signal_name:
        parts.append(event.signal_name)
    elif event.exitcode is not None:
        parts.append(f"exit code {event.exitcode}")
    return ", ".join(parts)


class LaunchPanel(Sink):
    """A launch sink drawn as widgets: header with Stop, a status row per rank, logs, bars, tracebacks.

    Public widgets: `widget` (the root), `stop_button`, `views` ("all", "rank-R" -> HTML), `tabs`,
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
        self._lock = threading.Lock()  # handle() against flush() and text()
        self._render_lock = threading.RLock()  # one flush at a time
        self._control = None
        self._shown = False
        self._flusher: Optional[threading.Thread] = None
        self._stop_flushing = threading.Event()
        self._flush_error_reported = False
        self.show_after = float(show_after)
        self._waiting = False  # started, not shown yet (show_after)
        self._widgets_made = False
        self._reset(None)
        if not self.show_after:
            self._make_widgets()

    # -- sink interface (launcher thread) --------------------------------------------------------

    def attach(self, control) -> None:
        self._control = control

    def handle(self, event) -> None:
        if isinstance(event, ev.RankOutput):
            with self._lock:
                self._record_output(event)
            if self._waiting:
                self._reveal()
            return
        with self._lock:
            started = self._record(event)
        if started:
            self._launch_started()
        elif self._waiting and (
            isinstance(event, (ev.RankFailed, ev.RankStopped, ev.LaunchNotice))
            or (isinstance(event, ev.LaunchFinished) and not event.ok)
        ):
            self._reveal()

    def poll(self) -> None:
        """Show a waiting panel once the launch has run `show_after` seconds (the cell's thread)."""
        if self._waiting and time.monotonic() - self._launch_began >= self.show_after:
            self._reveal()

    def close(self) -> None:
        self._stop_flushing.set()
        flusher = self._flusher
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join()
        self._flusher = None
        self.flush()

    # -- queries ---------------------------------------------------------------------------------

    def status(self, rank: int) -> str:
        with self._lock:
            r = self._ranks.get(rank)
            return r.state if r is not None else "pending"

    def text(self, view="all") -> str:
        """The plain text a view keeps now: "all", "rank-R" or R."""
        rank = _view_rank(view)
        with self._lock:
            if rank is None:
                lines = [f"[rank {r}] {text}" for r, _, text in self._all.items]
                lines += [f"[rank {r.rank}] {t}" for r in self._sorted_ranks() for t in _current_lines(r)]
                return "\n".join(lines)
            r = self._ranks.get(rank)
            if r is None:
                raise KeyError(f"no rank {rank} in this launch")
            return "\n".join([text for _, text in r.log.items] + _current_lines(r))

    # -- recording (under self._lock) ------------------------------------------------------------

    def _reset(self, started: Optional[ev.LaunchStarted]) -> None:
        self._launch = "running" if started else "pending"
        self._launch_began = time.monotonic()
        self._launch_seconds: Optional[float] = None
        self._launch_note = self._notice = ""
        self._stop_requested = False
        self._failures: list = []
        self._all = _Log(self.max_lines)
        self._ranks: dict = {}
        self._layout = getattr(self, "_layout", 0) + 1  # the set of ranks changed
        self._launches = getattr(self, "_launches", 0) + 1  # a panel may show several launches in turn
        if started is not None:
            first = started.node_rank * started.num_processes
            for rank in started.ranks or range(first, first + started.num_processes):
                self._ranks[rank] = _Rank(rank, self.max_lines)

    def _rank(self, rank: int) -> _Rank:
        r = self._ranks.get(rank)
        if r is None:  # a rank LaunchStarted did not announce: show it anyway
            r = self._ranks[rank] = _Rank(rank, self.max_lines)
            self._layout += 1
        return r

    def _sorted_ranks(self) -> list:
        return [self._ranks[k] for k in sorted(self._ranks)]

    def _record_output(self, e: ev.RankOutput) -> None:
        r = self._ranks.get(e.rank) or self._rank(e.rank)
        if e.transient:
            if e.text.strip():
                r.current[e.stream] = e.text
                if e.text.rstrip().endswith("]"):  # cheap test; flush() parses
                    r.bar_text, r.bar_final = e.text, False
            else:  # a bar erased itself (tqdm leave=False)
                r.current.pop(e.stream, None)
            return
        r.current.pop(e.stream, None)
        if e.text.rstrip().endswith("]"):
            r.bar_text, r.bar_final = e.text, True
        r.log.add((e.stream, e.text))
        self._all.add((e.rank, e.stream, e.text))

    def _record(self, event) -> bool:
        if isinstance(event, ev.LaunchStarted):
            self._reset(event)
            return True
        if isinstance(event, ev.RankStarted):
            r = self._rank(event.rank)
            r.pid, r.state, r.started = event.pid, "running", time.monotonic()
            if self._launch_note == self._notice:  # "waiting for the other nodes" is over
                self._launch_note = ""
        elif isinstance(event, ev.RankFinished):
            self._rank(event.rank).end("done", seconds=event.seconds)
        elif isinstance(event, ev.RankFailed):
            r = self._rank(event.rank)
            r.pid = r.pid or event.pid
            r.end("failed", _failure_detail(event))
            self._failures.append(event)
        elif isinstance(event, ev.RankStopped):
            r = self._rank(event.rank)
            if r.state in ("pending", "running"):
                r.end("stopped", event.reason)
        elif isinstance(event, ev.LaunchNotice):
            self._launch_note = self._notice = event.text
        elif isinstance(event, ev.LaunchFinished):
            self._launch_seconds = event.seconds
            if event.stopped:
                self._launch, self._launch_note = "stopped", event.stopped
            elif event.ok:
                self._launch, self._launch_note = "done", ""
            else:
                self._launch = "failed"
                if self._failures:
                    self._launch_note = self._failures[0].summary()
                elif event.failed_ranks:
                    self._launch_note = f"rank(s) {', '.join(map(str, event.failed_ranks))} failed"
            for r in self._ranks.values():  # ranks the launcher ended without a word
                if r.state in ("pending", "running") and not event.ok:
                    r.end("stopped", event.stopped or "the launch ended")
        return False

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
            from IPython.display import display

            display(self.widget)
        if self.autoflush and (self._flusher is None or not self._flusher.is_alive()):
            self._stop_flushing = threading.Event()
            self._flusher = threading.Thread(
                target=self._flush_loop, args=(self._stop_flushing,), name="notebook_accel-panel", daemon=True
            )
            self._flusher.start()

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
            if self._launch in ("done", "failed", "stopped"):
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
        if not _clicks_arrive(self.stop_button):
            stop = widgets.HTML(f'<span class="nacc-muted">{esc(INTERRUPT_HINT)}</span>', style=html)
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
                widgets.HBox([self.header, stop], layout=widgets.Layout(align_items="center")),
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
        with self._lock:
            if self._launch != "running" or self._stop_requested:
                return
            control = self._control
            if control is None:
                self._launch_note = f"this launch cannot be stopped from here: {INTERRUPT_HINT.lower()}"
                return
            self._stop_requested = True
        self.stop_button.disabled = True
        control.request_stop(STOP_REASON)

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
        self.progress_box.children = [self._progress_rows[r] for r in self._ranks_built if r in self._progress_rows]

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
        now = time.monotonic()
        ranks = self._sorted_ranks()
        if self._launches != self._drawn_launch:  # a new launch: its logs restart their versions
            self._bodies.clear()
            self._bars_seen.clear()
        logs = {}
        cached = self._bodies.get("all")
        if cached is None or cached[0] != self._all.added:
            logs["all"] = (self._all.added, list(self._all.items))
        for r in ranks:
            cached = self._bodies.get(f"rank-{r.rank}")
            if cached is None or cached[0] != r.log.added:
                logs[f"rank-{r.rank}"] = (r.log.added, list(r.log.items))
        return {
            "launch_id": self._launches,
            "layout": self._layout,
            "launch": (self._launch, self._launch_note, self._stop_requested),
            "launch_elapsed": self._launch_seconds if self._launch_seconds is not None else now - self._launch_began,
            "rows": [(r.rank, r.pid, r.state, r.detail, r.elapsed(now)) for r in ranks],
            "logs": logs,
            "dropped": {"all": self._all.added - len(self._all.items),
                        **{f"rank-{r.rank}": r.log.added - len(r.log.items) for r in ranks}},
            "current": [(r.rank, stream, text) for r in ranks for stream, text in sorted(r.current.items())],
            "bars": {r.rank: (r.bar_text, r.bar_final) for r in ranks if r.bar_text is not None},
            "failures": [(f, [] if f.traceback else list(self._ranks[f.rank].log.items)[-20:]) for f in self._failures],
        }  # fmt: skip

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
        _set(self.status_table, "value", _status_html(snap["rows"]))
        for name, view in self.views.items():
            if name in snap["logs"]:
                version, items = snap["logs"][name]
                rank = _view_rank(name)
                lines = [_line_html(t, s, r) for r, s, t in items] if rank is None else [
                    _line_html(t, s) for s, t in items
                ]  # fmt: skip
                self._bodies[name] = (version, "\n".join(lines))
            body = self._bodies.get(name, (0, ""))[1]
            current = [(r, s, t) for r, s, t in snap["current"] if name == "all" or name == f"rank-{r}"]
            _set(view, "value", _view_html(name, body, snap["dropped"].get(name, 0), current))
        failed = {f.rank for f, _ in snap["failures"]}
        titles = ["All ranks"] + [f"Rank {r} ✗" if r in failed else f"Rank {r}" for r in ranks]
        if tuple(self.tabs.titles) != tuple(titles):
            self.tabs.titles = titles
        states = {row[0]: row[2] for row in snap["rows"]}
        for rank, seen in snap["bars"].items():
            self._draw_bar(rank, seen, states.get(rank))
        _set(self.traceback, "value", "".join(_traceback_html(f, tail) for f, tail in snap["failures"]))
        # The launch's state last: a front end that shows "done" already shows the rest.
        state, note, stopping = snap["launch"]
        _set(self.stop_button, "disabled", state != "running" or stopping)
        _set(self.header, "value", _header_html(self.title, state, note, stopping, snap["launch_elapsed"]))

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


def _view_rank(view) -> Optional[int]:
    if isinstance(view, int):
        return view
    if view == "all":
        return None
    if isinstance(view, str) and view.startswith("rank-") and view[5:].isdigit():
        return int(view[5:])
    raise ValueError(f"view must be 'all', 'rank-R' or a rank number, got {view!r}")


def _current_lines(r: _Rank) -> list:
    return [text for _, text in sorted(r.current.items()) if parse_bar(text) is None]


def _prefix(rank: int) -> str:
    return f'<span class="nacc-prefix" style="color:{rank_color(rank)}">[rank {rank}]</span> '


def _line_html(text: str, stream: str, rank: Optional[int] = None) -> str:
    body = esc(ANSI.sub("", text))
    if rank is not None:
        body = _prefix(rank) + body
    return f'<span class="nacc-err" title="stderr">{body}</span>' if stream == "stderr" else body


def _view_html(name: str, body: str, dropped: int, current: list) -> str:
    parts = []
    if dropped:
        noun = "line" if dropped == 1 else "lines"
        parts.append(f'<span class="nacc-note">… {dropped} earlier {noun} dropped</span>')
    if body:
        parts.append(body)
    for rank, stream, text in current:
        if parse_bar(text) is None:
            line = _line_html(text, stream, rank if name == "all" else None)
            parts.append(f'<span class="nacc-current">{line}</span>')
    if not parts:
        parts.append('<span class="nacc-note">no output yet</span>')
    content = "\n".join(parts)
    return f'<div class="nacc-scroll"><pre class="nacc-log" data-view="{name}">{content}</pre></div>'


def _seconds(value: Optional[float], running: bool) -> str:
    if value is None:
        return ""
    return f"{value:.0f} s" if running else f"{value:.1f} s"


def _header_html(title: str, state: str, note: str, stopping: bool, elapsed: float) -> str:
    if state == "pending":
        text = "waiting for the launch"
    elif state == "running":
        text = f"{'stopping' if stopping else 'running'} · {_seconds(elapsed, True)}"
    elif state == "done":
        text = f"finished in {_seconds(elapsed, False)}"
    elif state == "failed":
        text = f"failed after {_seconds(elapsed, False)}"
    else:
        text = "stopped"
    if note:
        text += f": {note}" if state in ("failed", "stopped") else f" · {note}"
    return (
        f'<span class="nacc-title">{esc(title)}</span>'
        f'<span class="nacc-launch-status" data-status="{state}">{esc(text)}</span>'
    )


def _status_html(rows: list) -> str:
    out = ['<table class="nacc-table"><tr><th>rank</th><th>pid</th><th>status</th><th>time</th></tr>']
    for rank, pid, state, detail, elapsed in rows:
        label = f"{state} ({detail})" if detail else state
        out.append(
            f'<tr><td><span class="nacc-prefix" style="color:{rank_color(rank)}">{rank}</span></td>'
            f"<td>{pid if pid is not None else ''}</td>"
            f'<td><span class="nacc-status" data-rank="{rank}" data-status="{state}">{esc(label)}</span></td>'
            f"<td>{_seconds(elapsed, state == 'running')}</td></tr>"
        )
    out.append("</table>")
    return "".join(out)


def _traceback_html(failure: ev.RankFailed, tail: list) -> str:
    if failure.traceback:
        detail = failure.traceback.rstrip("\n")
    elif tail:
        detail = "last output:\n" + "\n".join(text for _, text in tail)
    else:
        detail = ""
    pre = f"<pre>{esc(ANSI.sub('', detail))}</pre>" if detail else ""
    return (
        f'<div class="nacc-traceback" data-rank="{failure.rank}">'
        f'<div class="nacc-traceback-summary">{esc(failure.summary())}</div>{pre}</div>'
    )
