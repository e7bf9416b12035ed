"""What a saved notebook keeps of a launch panel: its text/plain, the launch's rank-prefixed
transcript once it ends (jupyter/transcript.py). Unit tests on synthetic events, then one notebook
executed by nbclient (a launch, a %%accelerate cell, a session cell, a bounded log, two failures)
and converted by nbconvert to markdown and HTML without its widget state."""

from __future__ import annotations

import copy
import html
import json
import re
import sys
import threading
import types

import pytest

from notebook_accel.jupyter.panel import LaunchPanel
from notebook_accel.jupyter.transcript import WIDGET_VIEW, transcript
from notebook_accel.launch import events as ev

WIDGET_REPR = "VBox(children="


@pytest.fixture(autouse=True)
def clicks_arrive(monkeypatch):  # as in test_panel.py: no side shell from a test process
    module = types.ModuleType("notebook_accel.jupyter.busy")
    module.deliver_while_busy = lambda widget: True
    monkeypatch.setitem(sys.modules, module.__name__, module)


def make(n=2, **kwargs):
    p = LaunchPanel(autoflush=False, show=False, **kwargs)
    p.handle(ev.LaunchStarted(n, "fork", n))
    for rank in range(n):
        p.handle(ev.RankStarted(rank, 100 + rank))
    return p


def out(p, rank, text, stream="stdout", transient=False):
    p.handle(ev.RankOutput(rank, stream, text, transient))


def text_of(p):
    with p.model.lock:
        return transcript(p.model, p.title)


def test_lines_in_the_all_ranks_order_with_state_and_no_ansi():
    p = make()
    out(p, 1, "first from one")
    out(p, 0, "\x1b[31mred\x1b[0m from zero", stream="stderr")
    out(p, 1, "redrawing 3/9", transient=True)  # a redraw in progress (not a bar): kept as text() keeps it
    p.handle(ev.RankFinished(0, 1.0))
    p.handle(ev.RankFinished(1, 1.0))
    p.handle(ev.LaunchFinished(True, 2.5))
    assert text_of(p).splitlines() == [
        "notebook_accel launch: finished in 2.5 s",
        "[rank 1] first from one",
        "[rank 0] red from zero",
        "[rank 1] redrawing 3/9",
    ]


def test_a_bounded_log_counts_what_it_dropped_per_rank():
    p = make(max_lines=5)
    order = [0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0]  # rank 0: 5 lines, rank 1: 6
    for i, rank in enumerate(order):
        out(p, rank, f"line {i}")
    p.handle(ev.LaunchFinished(True, 1.0))
    lines = text_of(p).splitlines()
    # The first 6 are dropped: ranks 0, 1, 1, 0, 1, 1 -> rank 0: 2, rank 1: 4.
    assert lines[1] == "… 6 earlier lines dropped (rank 0: 2, rank 1: 4)"
    assert lines[2:] == [f"[rank {order[i]}] line {i}" for i in range(6, 11)]
    p = make(max_lines=2)
    for i in range(3):
        out(p, 1, f"line {i}")
    assert text_of(p).splitlines()[1:] == [
        "… 1 earlier line dropped (rank 1: 1)",
        "[rank 1] line 1",
        "[rank 1] line 2",
    ]


def test_failures_end_with_their_traceback_or_summary():
    p = make(3)
    out(p, 0, "before")
    tb = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nValueError: broke\n'
    p.handle(ev.RankFailed(1, 101, 1, "ValueError", "broke", tb))
    p.handle(ev.RankFailed(2, 102, None, signal_name="SIGKILL"))
    p.handle(ev.LaunchFinished(False, 3.0, (1, 2)))
    assert text_of(p).splitlines() == [
        "notebook_accel launch: failed after 3.0 s: rank 1 raised ValueError: broke",
        "[rank 0] before",
        "",
        "Traceback from rank 1:",
        *tb.rstrip("\n").splitlines(),
        "",
        "rank 2 died with SIGKILL",
    ]


class _Publisher:
    """ipykernel's display publisher, as far as SavedOutput uses it: a parent header per thread."""

    def __init__(self):
        self.parent_header = {"msg_id": "the-cell"}
        self.set_for = []

    def set_thread_parent(self, parent):
        self.set_for.append((threading.current_thread().name, parent["msg_id"]))
        return "token"

    def reset_thread_parent(self, token):
        assert token == "token"


@pytest.fixture
def kernel_display(monkeypatch):
    """The panel believes it is in a kernel; what it displays and updates is recorded."""
    import IPython
    import IPython.display

    from notebook_accel.jupyter import kernel_env

    sent, publisher = [], _Publisher()
    shell = types.SimpleNamespace(display_pub=publisher)
    monkeypatch.setattr(kernel_env, "in_kernel", lambda: True)
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.setattr(
        IPython.display,
        "display",
        lambda obj, raw, display_id: sent.append(("display", display_id, dict(obj))),
    )
    monkeypatch.setattr(
        IPython.display,
        "update_display",
        lambda obj, display_id, raw: sent.append(
            ("update", display_id, dict(obj), threading.current_thread().name)
        ),
    )
    return sent, publisher


def test_in_a_kernel_the_output_is_the_widget_view_and_its_text(kernel_display):
    sent, publisher = kernel_display
    p = LaunchPanel(autoflush=False, show=True)
    p.handle(ev.LaunchStarted(1, "fork", 1))
    assert len(sent) == 1
    kind, display_id, bundle = sent[0]
    assert kind == "display" and display_id
    assert bundle[WIDGET_VIEW] == p.widget._repr_mimebundle_()[WIDGET_VIEW]  # the view ipywidgets would send
    assert bundle["text/plain"].startswith("notebook_accel launch: running")
    out(p, 0, "hello")
    p.handle(ev.RankFinished(0, 1.0))
    p.handle(ev.LaunchFinished(True, 1.0))
    assert [s[0] for s in sent] == ["display", "update"]
    _, same_id, final, _ = sent[1]
    assert same_id == display_id and final[WIDGET_VIEW] == bundle[WIDGET_VIEW]
    assert final["text/plain"] == "notebook_accel launch: finished in 1.0 s\n[rank 0] hello"
    p.close()  # nothing new: no second update
    assert len(sent) == 2 and publisher.set_for == []


def test_an_update_from_another_thread_goes_out_under_the_cells_parent(kernel_display):
    sent, publisher = kernel_display
    p = LaunchPanel(autoflush=False, show=True)
    p.handle(ev.LaunchStarted(1, "fork", 1))
    publisher.parent_header = {"msg_id": "a-later-cell"}  # the kernel moved on; this thread did not display
    worker = threading.Thread(target=p.handle, args=(ev.LaunchFinished(True, 1.0),), name="launcher")
    worker.start()
    worker.join()
    assert publisher.set_for == [("launcher", "the-cell")]
    assert sent[-1][0] == "update" and sent[-1][3] == "launcher"


def test_a_panel_that_never_showed_updates_nothing(kernel_display):
    sent, _ = kernel_display
    p = LaunchPanel(autoflush=False, show=True, show_after=30.0)
    p.handle(ev.LaunchStarted(1, "session", 1))
    p.handle(ev.RankFinished(0, 0.1))
    p.handle(ev.LaunchFinished(True, 0.1))
    p.close()
    assert sent == []


def test_outside_a_kernel_the_widget_is_displayed_as_before(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    p = LaunchPanel(autoflush=False, show=True)
    p.handle(ev.LaunchStarted(1, "fork", 1))
    p.handle(ev.LaunchFinished(True, 1.0))
    p.close()
    assert shown == [p.widget] and p._output is None


# -- a notebook executed by nbclient, converted by nbconvert ------------------------------------

LINES = 510  # per rank in the bounded launch: 1020 lines, 20 more than the panel keeps (1000)

CELLS = [
    ("setup", "%load_ext notebook_accel\nimport os\nfrom notebook_accel import notebook_launcher\n\n"
     "def hello(tag):\n    rank = int(os.environ['RANK'])\n    for i in range(3):\n"
     "        print(f'{tag} {i} from rank {rank}', flush=True)\n\n"
     "def chatty():\n    rank = int(os.environ['RANK'])\n    for i in range(%d):\n"
     "        print(f'chatty {i} from rank {rank}')\n\n"
     "def breaks():\n    if os.environ['RANK'] == '1':\n        raise ValueError('rank one broke')\n"
     "    print('rank zero was fine', flush=True)".replace("%d", str(LINES))),
    ("launch", "notebook_launcher(hello, ('launched',), num_processes=2, start_method='fork', cpu=True, use_port='auto');"),
    ("magic", "%%accelerate -n 2 --cpu --port auto\nfor i in range(3):\n    print(f'magic {i} from rank {os.environ[\"RANK\"]}')"),
    ("bounded", "notebook_launcher(chatty, num_processes=2, start_method='fork', cpu=True, use_port='auto');"),
    ("failing", "notebook_launcher(breaks, num_processes=2, start_method='fork', cpu=True, use_port='auto')"),
    ("start", "%accelerate start -n 2 --cpu"),
    ("session", "%%accelerate\nimport os\nfor i in range(3):\n    print(f'session {i} from rank {os.environ[\"RANK\"]}')"),
    ("session-fails", "%%accelerate\nimport os\nif os.environ['RANK'] == '1':\n    raise ValueError('session rank one broke')\n"
                      "print('session rank zero was fine')"),
    ("session-silent", "%%accelerate\nx = 1"),
    ("stop", "%accelerate stop"),
]  # fmt: skip
FAILING = {"failing", "session-fails"}
CASES = {"launch": "launched", "magic": "magic", "session": "session"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("nbconvert")
    from notebook_accel.demo import run_notebook

    path = tmp_path_factory.mktemp("saved") / "saved.ipynb"
    cells = []
    for name, source in CELLS:
        cell = nbformat.v4.new_code_cell(source, metadata={"name": name})
        if name in FAILING:
            cell.metadata["tags"] = ["raises-exception"]  # nbclient goes on past it
        cells.append(cell)
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    nb, error = run_notebook(str(path), timeout=120, widgets=True)
    assert error is None, error
    return {c.metadata["name"]: c for c in nb.cells}, nb


def _panel_text(cell) -> str:
    """The one panel output of `cell` (widget view and text), and that nothing else repeats its lines."""
    panels = [o for o in cell.outputs if o.output_type == "display_data" and WIDGET_VIEW in o.data]
    assert len(panels) == 1, cell.outputs
    text = panels[0].data["text/plain"]
    assert WIDGET_REPR not in text, text
    streams = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    assert "[rank" not in streams and " from rank " not in streams, streams  # nothing printed twice
    return text


def _rank_lines(tag: str) -> list:
    return [f"[rank {rank}] {tag} {i} from rank {rank}" for rank in (0, 1) for i in range(3)]


@pytest.mark.timeout(300)
def test_each_launch_and_session_cell_saves_its_transcript(saved):
    cells, nb = saved
    assert "widgets" in nb.metadata  # nbclient stored the widget state; the conversions below drop it
    for name, tag in CASES.items():
        text = _panel_text(cells[name])
        lines = text.splitlines()
        assert lines[0].startswith("notebook_accel launch: finished in "), text
        for line in _rank_lines(tag):
            assert line in lines, (name, text)
        for rank in (0, 1):  # each rank's lines in its own order
            mine = [line for line in lines if line.startswith(f"[rank {rank}] {tag} ")]
            assert mine == [f"[rank {rank}] {tag} {i} from rank {rank}" for i in range(3)], text


@pytest.mark.timeout(300)
def test_a_silent_session_cell_saves_what_it_showed(saved):
    cells, _ = saved
    outputs = cells["session-silent"].outputs
    # Quick: no panel, live or saved. Slow (a loaded machine): the panel, and a transcript of no lines.
    if outputs:
        assert _panel_text(cells["session-silent"]).startswith("notebook_accel launch: finished in "), outputs
        assert "\n" not in _panel_text(cells["session-silent"])


@pytest.mark.timeout(300)
def test_a_bounded_launch_keeps_the_last_lines_and_counts_the_rest(saved):
    cells, _ = saved
    lines = _panel_text(cells["bounded"]).splitlines()
    kept = [line for line in lines if line.startswith("[rank ")]
    assert len(kept) == 1000, len(kept)
    note = re.fullmatch(r"… 20 earlier lines dropped \((.*)\)", lines[1])
    assert note, lines[:3]
    cuts = {
        int(rank): int(n) for rank, n in re.findall(r"rank (\d+): (\d+)", note.group(1))
    }  # ranks that lost lines
    assert sum(cuts.values()) == 20 and all(cuts.values()), lines[1]
    for rank in (0, 1):
        cut = cuts.get(rank, 0)
        mine = [line for line in kept if line.startswith(f"[rank {rank}] ")]
        # What is kept of a rank is its last lines, in order.
        assert mine == [f"[rank {rank}] chatty {i} from rank {rank}" for i in range(cut, LINES)]


@pytest.mark.timeout(300)
def test_a_failing_rank_s_error_is_in_the_transcript(saved):
    cells, _ = saved
    for name, zero_line, message in [
        ("failing", "[rank 0] rank zero was fine", "ValueError: rank one broke"),
        ("session-fails", "[rank 0] session rank zero was fine", "ValueError: session rank one broke"),
    ]:
        cell = cells[name]
        assert [o.output_type for o in cell.outputs].count("error") == 1, cell.outputs
        text = _panel_text(cell)
        assert zero_line in text.splitlines(), text
        assert "Traceback from rank 1:" in text and message in text, text
        assert "Cell In[" in text, text  # the cell's lines named as IPython names them


@pytest.mark.timeout(300)
def test_the_panel_s_traceback_names_the_cell_as_the_error_does(saved):
    cells, nb = saved
    state = json.dumps(nb.metadata["widgets"])
    shown = [m.group(0) for m in re.finditer(r'nacc-traceback\\" data-rank=.*?</pre>', state)]
    launch = [t for t in shown if "raised ValueError: rank one broke" in t]
    assert launch and all("Cell In[1], line " in t for t in launch), shown  # `breaks` is cell 1's
    assert any("session rank one broke" in t for t in shown), shown
    for text in shown:
        assert "ipykernel_" not in text and "Cell In[" in text, text
    error = next(o for o in cells["failing"].outputs if o.output_type == "error")
    seen = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error.traceback))
    assert "Cell In[1], line " in seen and "notebook_accel/" not in seen, seen


@pytest.mark.timeout(300)
def test_markdown_and_html_without_widget_state_show_each_rank_s_lines(saved):
    import nbconvert

    _, nb = saved
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)  # as GitHub or nbviewer would have it: no widget state
    markdown, _ = nbconvert.MarkdownExporter().from_notebook_node(nb)
    page, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    page = html.unescape(page)
    for converted in (markdown, page):
        assert WIDGET_REPR not in converted
        for tag in CASES.values():
            for line in _rank_lines(tag):
                assert line in converted, (line, converted[:2000])
        assert "Traceback from rank 1:" in converted
