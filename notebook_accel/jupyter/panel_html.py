"""The launch panel's HTML: status table, logs, header and tracebacks (no widgets here)."""

from __future__ import annotations

import sys
from typing import Optional

from ..launch import events as ev
from ..launch.oom import human_bytes
from .cell_jobs import relabel_cells  # here, not on first use: the panel draws on a thread of ours
from .progress import ANSI, parse_bar
from .style import esc, rank_color


def view_rank(view) -> Optional[int]:
    if isinstance(view, int):
        return view
    if view == "all":
        return None
    if isinstance(view, str) and view.startswith("rank-") and view[5:].isdigit():
        return int(view[5:])
    raise ValueError(f"view must be 'all', 'rank-R' or a rank number, got {view!r}")


def current_lines(r) -> list:
    return [text for _, text in sorted(r.current.items()) if parse_bar(text) is None]


def _prefix(rank: int) -> str:
    return f'<span class="nacc-prefix" style="color:{rank_color(rank)}">[rank {rank}]</span> '


def line_html(text: str, stream: str, rank: Optional[int] = None) -> str:
    body = esc(ANSI.sub("", text))
    if rank is not None:
        body = _prefix(rank) + body
    return f'<span class="nacc-err" title="stderr">{body}</span>' if stream == "stderr" else body


def view_html(name: str, body: str, dropped: int, current: list) -> str:
    parts = []
    if dropped:
        noun = "line" if dropped == 1 else "lines"
        parts.append(f'<span class="nacc-note">… {dropped} earlier {noun} dropped</span>')
    if body:
        parts.append(body)
    for rank, stream, text in current:
        if parse_bar(text) is None:
            line = line_html(text, stream, rank if name == "all" else None)
            parts.append(f'<span class="nacc-current">{line}</span>')
    if not parts:
        parts.append('<span class="nacc-note">no output yet</span>')
    content = "\n".join(parts)
    return f'<div class="nacc-scroll"><pre class="nacc-log" data-view="{name}">{content}</pre></div>'


def _seconds(value: Optional[float], running: bool) -> str:
    if value is None:
        return ""
    return f"{value:.0f} s" if running else f"{value:.1f} s"


def header_text(state: str, note: str, stopping: bool, elapsed: float) -> str:
    """The launch's state in words, as the header shows it after the title."""
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
    return text


def header_html(title: str, state: str, note: str, stopping: bool, elapsed: float, fsdp: bool = False) -> str:
    text = header_text(state, note, stopping, elapsed)
    # What the ranks do with models, beside the title: FSDP shards them (plain data parallel says nothing).
    mode = '<span class="nacc-launch-mode" data-mode="fsdp">FSDP</span>' if fsdp else ""
    return (
        f'<span class="nacc-title">{esc(title)}</span>{mode}'
        f'<span class="nacc-launch-status" data-status="{state}">{esc(text)}</span>'
    )


def status_html(rows: list) -> str:
    """Rows of (rank, pid, state, detail, elapsed, usage): usage is the launch model's RankState.usage,
    the newest sample (RSS, CPU %, device) while a rank runs and its peaks once it ended."""
    device = any(
        u.get("device_memory") is not None or u.get("peak_device_memory") is not None for *_, u in rows
    )
    heads = ["rank", "pid", "status", "time", "RSS", "CPU"] + (
        ["device memory", "device util"] if device else []
    )
    out = ['<table class="nacc-table"><tr>' + "".join(f"<th>{h}</th>" for h in heads) + "</tr>"]
    for rank, pid, state, detail, elapsed, usage in rows:
        label = f"{state} ({detail})" if detail else state
        cells = [
            f'<span class="nacc-prefix" style="color:{rank_color(rank)}">{rank}</span>',
            "" if pid is None else esc(str(pid)),
            f'<span class="nacc-status" data-rank="{rank}" data-status="{state}"'
            f'{_stalled_attr(detail)}>{esc(label)}</span>',
            _seconds(elapsed, state == "running"),
        ]
        cells += _usage_cells(rank, usage, device, state == "running")
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _usage_cells(rank: int, u: dict, device: bool, running: bool) -> list:
    ended = "peak_rss" in u
    rss = u.get("peak_rss") if ended else u.get("rss")
    limit = f" of {human_bytes(u['limit'])} allowed" if u.get("limit") else ""
    memory = "" if rss is None else ("peak " if ended else "") + human_bytes(rss)
    cpu = "" if not running or u.get("cpu") is None else f"{u['cpu']:.0f} %"
    cells = [
        f'<span class="nacc-rss" data-rank="{rank}" title="resident memory{limit}">{memory}</span>',
        f'<span class="nacc-cpu" data-rank="{rank}" title="100 % = one core">{cpu}</span>',
    ]
    if device:
        used = u.get("peak_device_memory") if ended else u.get("device_memory")
        util = u.get("device_util") if running else None
        used_text = "" if used is None else ("peak " if ended else "") + human_bytes(used)
        cells.append(f'<span class="nacc-device-memory" data-rank="{rank}">{used_text}</span>')
        cells.append(
            f'<span class="nacc-device-util" data-rank="{rank}">{"" if util is None else f"{util:.0f} %"}</span>'
        )
    return cells


def traceback_html(failure: ev.RankFailed, tail: list) -> str:
    if failure.traceback:
        detail = label_cells(failure.traceback.rstrip("\n"))  # `Cell In[N]`, as the cell's error says
    elif tail:
        detail = "last output:\n" + "\n".join(text for _, text in tail)
    else:
        detail = ""
    pre = f"<pre>{esc(ANSI.sub('', detail))}</pre>" if detail else ""
    return (
        f'<div class="nacc-traceback" data-rank="{failure.rank}">'
        f'<div class="nacc-traceback-summary">{esc(failure.summary())}</div>{pre}</div>'
    )


def _stalled_attr(detail: str) -> str:
    return ' data-stalled="1"' if detail.startswith("stalled: ") else ""


def stall_html(report) -> str:
    """The watch's report below the rank table: the sentence, then each rank's stacks, folded."""
    if report is None:
        return ""
    body = report.text(label_cells)
    return (
        f'<div class="nacc-stall" data-stalled="{int(report.stalled)}">'
        f'<div class="nacc-stall-sentence">{esc(report.sentence)}</div>'
        f"<details><summary>where each rank is</summary><pre>{esc(body)}</pre></details></div>"
    )


def label_cells(text: str) -> str:
    """Notebook files named `Cell In[N]`, as IPython names them (in a kernel)."""
    return relabel_cells(text) if "ipykernel" in sys.modules else text

