"""LaunchPanel driven by synthetic events (no kernel needed), plus one real two-rank launch."""

from __future__ import annotations

import html
import re
import sys
import threading
import time
import types

import ipywidgets as widgets
import pytest

from notebook_accel.jupyter import panel as panel_mod
from notebook_accel.jupyter.panel import STOP_REASON, LaunchPanel
from notebook_accel.jupyter.progress import parse_bar
from notebook_accel.launch import events as ev

BUSY = "notebook_accel.jupyter.busy"


@pytest.fixture(autouse=True)
def clicks_arrive(monkeypatch):
    """A stand-in for busy.py whose kernel delivers clicks; tests that need otherwise patch again."""
    module = types.ModuleType(BUSY)
    module.calls = []
    module.deliver_while_busy = lambda widget: module.calls.append(widget) or True
    monkeypatch.setitem(sys.modules, BUSY, module)
    return module


class FakeControl:
    def __init__(self):
        self.reasons = []

    def request_stop(self, reason):
        self.reasons.append(reason)


def make(n=2, node_rank=0, **kwargs):
    p = LaunchPanel(autoflush=False, show=False, **kwargs)
    p.handle(ev.LaunchStarted(n, "fork", n * (node_rank + 1), node_rank))
    return p


def out(p, rank, text, stream="stdout", transient=False):
    p.handle(ev.RankOutput(rank, stream, text, transient))


def all_widgets(w):
    yield w
    for child in getattr(w, "children", ()):
        yield from all_widgets(child)


def with_class(root, name):
    return [w for w in all_widgets(root) if name in w._dom_classes]


def test_dom_contract_classes():
    p = make()
    p.flush()
    assert "nacc-launch" in p.widget._dom_classes
    assert with_class(p.widget, "nacc-stop") == [p.stop_button]
    assert with_class(p.widget, "nacc-progress") == []  # a rank's bar is made when it shows one
    assert '<pre class="nacc-log" data-view="all">' in p.views["all"].value
    assert '<pre class="nacc-log" data-view="rank-1">' in p.views["rank-1"].value
    assert p.tabs.titles == ("All ranks", "Rank 0", "Rank 1")


def test_status_through_the_lifecycle():
    p = make()
    p.flush()
    assert [p.status(0), p.status(1)] == ["pending", "pending"]
    assert '<span class="nacc-status" data-rank="1" data-status="pending">' in p.status_table.value
    assert '<span class="nacc-launch-status" data-status="running">' in p.header.value

    p.handle(ev.RankStarted(0, 4242))
    p.handle(ev.RankStarted(1, 4243))
    p.flush()
    assert [p.status(0), p.status(1)] == ["running", "running"]
    assert "<td>4243</td>" in p.status_table.value
    assert 'data-rank="0" data-status="running">running</span></td><td>0 s</td>' in p.status_table.value

    p.handle(ev.RankFinished(0, 1.25))
    p.handle(ev.RankFinished(1, 2.5))
    p.handle(ev.LaunchFinished(True, 2.75))
    p.flush()
    assert [p.status(0), p.status(1)] == ["done", "done"]
    assert 'data-rank="1" data-status="done">done</span></td><td>2.5 s</td>' in p.status_table.value
    assert '<span class="nacc-launch-status" data-status="done">finished in 2.8 s</span>' in p.header.value


def test_a_ranks_node_shows_beside_its_pid_where_the_launch_names_it():
    p = make()
    p.handle(ev.RankStarted(0, 4242, "10.0.0.5 (1a2b3c4d)"))
    p.handle(ev.RankStarted(1, 4243))
    p.flush()
    assert "<td>4242 on 10.0.0.5 (1a2b3c4d)</td>" in p.status_table.value
    assert "<td>4243</td>" in p.status_table.value


def test_a_notice_shows_in_the_header_until_ranks_start():
    p = make()
    p.handle(ev.LaunchNotice("node 0 of 2: waiting for the other nodes at 10.0.0.1:29500"))
    p.flush()
    assert re.search(r"running · \d+ s · node 0 of 2: waiting for the other nodes at 10\.0\.0\.1:29500</span>", p.header.value)
    p.handle(ev.RankStarted(0, 4242))
    p.flush()
    assert "waiting for the other nodes" not in p.header.value


def test_a_panel_that_shows_after_a_delay_costs_no_widgets_for_a_quick_silent_launch(monkeypatch):
    import ipywidgets
    from IPython import display as ipython_display

    shown = []
    monkeypatch.setattr(ipython_display, "display", lambda w: shown.append(w))
    made = []
    original = ipywidgets.Widget.open

    def counting_open(self):
        made.append(type(self).__name__)
        return original(self)

    monkeypatch.setattr(ipywidgets.Widget, "open", counting_open)
    quiet = LaunchPanel(autoflush=False, show_after=0.5)
    quiet.handle(ev.LaunchStarted(2, "session", 2))
    for r in (0, 1):
        quiet.handle(ev.RankStarted(r, 10 + r))
        quiet.handle(ev.RankFinished(r, 0.01))
    quiet.poll()  # well under 0.5 s
    quiet.handle(ev.LaunchFinished(True, 0.01))
    quiet.close()
    assert made == [] and shown == [] and quiet.status(1) == "done"

    chatty = LaunchPanel(autoflush=False, show_after=0.5)
    chatty.handle(ev.LaunchStarted(2, "session", 2))
    chatty.handle(ev.RankStarted(0, 10))
    assert shown == []
    out(chatty, 0, "hello")  # output: shown at once
    assert shown == [chatty.widget] and made
    chatty.flush()
    assert "hello" in chatty.views["rank-0"].value

    slow = LaunchPanel(autoflush=False, show_after=0.05)
    slow.handle(ev.LaunchStarted(1, "session", 1))
    deadline = time.monotonic() + 10
    while len(shown) < 2:  # poll() shows it once the launch has run show_after seconds
        assert time.monotonic() < deadline
        slow.poll()
        time.sleep(0.01)
    assert shown[-1] is slow.widget

    failing = LaunchPanel(autoflush=False, show_after=30)
    failing.handle(ev.LaunchStarted(1, "session", 1))
    failing.handle(ev.RankFailed(0, 10, 1, exc_type="ValueError", message="bad"))
    assert shown[-1] is failing.widget  # a failure shows its traceback box at once


def test_only_local_ranks_are_shown():
    p = make(n=2, node_rank=1)  # ranks 2 and 3 of 4
    p.flush()
    assert p.tabs.titles == ("All ranks", "Rank 2", "Rank 3")
    assert 'data-rank="2"' in p.status_table.value
    assert 'data-rank="0"' not in p.status_table.value


def test_failed_ranks_show_exit_code_or_signal():
    p = make()
    p.handle(ev.RankStarted(0, 10))
    p.handle(ev.RankStarted(1, 11))
    p.handle(ev.RankFailed(0, 10, 3))
    p.handle(ev.RankFailed(1, 11, -9, signal_name="SIGKILL"))
    p.handle(ev.LaunchFinished(False, 1.0, (0, 1)))
    p.flush()
    assert [p.status(0), p.status(1)] == ["failed", "failed"]
    assert 'data-rank="0" data-status="failed">failed (exit code 3)</span>' in p.status_table.value
    assert 'data-rank="1" data-status="failed">failed (SIGKILL)</span>' in p.status_table.value
    assert (
        '<span class="nacc-launch-status" data-status="failed">failed after 1.0 s: '
        "rank 0 exited with code 3 without a result</span>"
    ) in p.header.value


def test_stopped_ranks_and_launch():
    p = make(n=3)
    for rank in range(3):
        p.handle(ev.RankStarted(rank, 100 + rank))
    p.handle(ev.RankFinished(0, 0.5))
    p.handle(ev.RankStopped(1, "stopped from the launch panel"))
    p.handle(ev.RankStopped(0, "too late"))  # a finished rank stays done
    p.handle(ev.LaunchFinished(False, 1.5, stopped="stopped from the launch panel"))
    p.flush()
    assert [p.status(0), p.status(1), p.status(2)] == ["done", "stopped", "stopped"]
    assert (
        'data-rank="1" data-status="stopped">stopped (stopped from the launch panel)</span>'
        in p.status_table.value
    )
    assert (
        'data-rank="2" data-status="stopped">stopped (stopped from the launch panel)</span>'
        in p.status_table.value
    )
    assert (
        '<span class="nacc-launch-status" data-status="stopped">stopped: stopped from the launch panel</span>'
    ) in p.header.value


def test_text_views_prefix_and_escape():
    p = make()
    out(p, 0, "hello from 0")
    out(p, 1, "say <b>bold</b> & more")
    out(p, 1, "a warning", stream="stderr")
    out(p, 0, "bye from 0")
    p.flush()
    assert p.text("all").splitlines() == [
        "[rank 0] hello from 0",
        "[rank 1] say <b>bold</b> & more",
        "[rank 1] a warning",
        "[rank 0] bye from 0",
    ]
    assert p.text("rank-1").splitlines() == ["say <b>bold</b> & more", "a warning"]
    assert p.text(0).splitlines() == ["hello from 0", "bye from 0"]

    every = p.views["all"].value
    assert "say &lt;b&gt;bold&lt;/b&gt; &amp; more" in every
    assert "<b>" not in every
    color0 = panel_mod.rank_color(0)
    assert f'<span class="nacc-prefix" style="color:{color0}">[rank 0]</span> hello from 0' in every
    assert '<span class="nacc-err" title="stderr">' in every
    assert 'title="stderr">a warning</span>' in p.views["rank-1"].value
    assert "hello" not in p.views["rank-1"].value
    with pytest.raises(KeyError):
        p.text("rank-7")


def test_max_lines_keeps_newest_and_notes_drops():
    p = make(max_lines=5)
    for i in range(12):
        out(p, 0, f"zero {i}")
    for i in range(3):
        out(p, 1, f"one {i}")
    p.flush()
    assert p.text("rank-0").splitlines() == [f"zero {i}" for i in range(7, 12)]
    assert "… 7 earlier lines dropped" in p.views["rank-0"].value
    assert p.text("all").splitlines() == [f"[rank 0] zero {i}" for i in (10, 11)] + [
        f"[rank 1] one {i}" for i in range(3)
    ]
    assert "… 10 earlier lines dropped" in p.views["all"].value
    assert "dropped" not in p.views["rank-1"].value
    for i in range(3, 6):
        out(p, 1, f"one {i}")
    p.flush()
    assert "… 1 earlier line dropped" in p.views["rank-1"].value


BARS = [
    "train:   0%|          | 0/100 [00:00<?, ?it/s]",
    "train:  10%|█         | 10/100 [00:00<00:03, 30.0it/s]",
    "train:  45%|████▌     | 45/100 [00:01<00:02, 30.1it/s]",
]


def test_tqdm_redraws_update_a_bar_not_the_log():
    p = make()
    out(p, 0, "before the loop")
    p.flush()
    for line in BARS:
        out(p, 0, line, stream="stderr", transient=True)
    p.flush()
    bar, label = p.progress_bars[0], p.progress_labels[0]
    assert bar.value == pytest.approx(0.45)
    assert label.value == "train: 45/100 [00:01<00:02, 30.1it/s]"
    assert p.text("rank-0") == "before the loop"
    assert "45%" not in p.views["rank-0"].value and "45%" not in p.views["all"].value
    assert p.progress_box.children[0].layout.display == "flex"
    assert len(p.progress_box.children) == 1 and 1 not in p.progress_bars  # rank 1 printed no bar
    assert with_class(p.widget, "nacc-progress") == [bar]

    final = "train: 100%|██████████| 100/100 [00:03<00:00, 30.1it/s]"
    out(p, 0, final, stream="stderr")
    p.flush()
    assert bar.value == 1.0
    assert bar.bar_style == "success"
    assert p.text("rank-0").splitlines() == ["before the loop", final]


def test_tqdm_forms_without_desc_or_total():
    assert parse_bar(" 45%|████▌     | 45/100 [00:01<00:02, 30.1it/s]").fraction == pytest.approx(0.45)
    assert parse_bar(" 45%|████▌     | 45/100 [00:01<00:02, 30.1it/s]").desc == ""
    unknown = parse_bar("45it [00:01, 30it/s]")
    assert unknown.fraction is None and unknown.label == "45it [00:01, 30it/s]"
    assert parse_bar("load: 1.50k/3.00k [00:01<00:01, 1.0kit/s]").fraction == pytest.approx(0.5)
    assert parse_bar("epoch [3/10]") is None
    assert parse_bar("loss 0.5 [done]") is None

    p = make()
    out(p, 1, "step: 45it [00:01, 30it/s]", transient=True)
    p.flush()
    assert p.progress_labels[1].value == "step: 45it [00:01, 30it/s]"
    assert p.progress_bars[1].value == 0.0
    assert p.text("rank-1") == ""


def test_transient_text_that_is_not_a_bar_is_one_current_line():
    p = make()
    out(p, 0, "first")
    for i in range(5):
        out(p, 0, f"loading shard {i}/5", transient=True)
    p.flush()
    assert p.text("rank-0").splitlines() == ["first", "loading shard 4/5"]
    assert p.views["rank-0"].value.count("loading shard") == 1
    assert '<span class="nacc-current">[' not in p.views["rank-0"].value
    assert '<span class="nacc-current"><span class="nacc-prefix"' in p.views["all"].value
    out(p, 0, "loaded")
    p.flush()
    assert p.text("rank-0").splitlines() == ["first", "loaded"]
    assert "loading shard" not in p.views["all"].value


def test_failure_shows_traceback_box_and_marks_tab():
    p = make()
    tb = 'Traceback (most recent call last):\n  File "<stdin>", line 1, in <module>\nValueError: boom\n'
    p.handle(ev.RankStarted(1, 77))
    p.handle(ev.RankFailed(1, 77, 1, "ValueError", "boom", tb))
    p.flush()
    box = p.traceback.value
    assert box.startswith('<div class="nacc-traceback" data-rank="1">')
    assert '<div class="nacc-traceback-summary">rank 1 raised ValueError: boom</div>' in box
    assert "in &lt;module&gt;\nValueError: boom</pre>" in box
    assert p.tabs.titles == ("All ranks", "Rank 0", "Rank 1 ✗")
    assert 'data-status="failed">failed (ValueError, exit code 1)</span>' in p.status_table.value


def test_failure_without_traceback_shows_last_output():
    p = make()
    out(p, 0, "allocating 80 GiB")
    p.handle(ev.RankFailed(0, 5, -9, signal_name="SIGKILL"))
    p.flush()
    assert '<div class="nacc-traceback-summary">rank 0 died with SIGKILL</div>' in p.traceback.value
    assert "<pre>last output:\nallocating 80 GiB</pre>" in p.traceback.value


def test_stop_button_requests_stop_once_and_is_disabled_after_finish(clicks_arrive):
    p = LaunchPanel(autoflush=False, show=False)
    assert clicks_arrive.calls == [p.stop_button, p.stacks_button]
    assert p.stop_button.disabled
    control = FakeControl()
    p.attach(control)
    p.handle(ev.LaunchStarted(2, "fork", 2))
    p.flush()
    assert not p.stop_button.disabled
    p.stop_button.click()
    p.stop_button.click()
    assert control.reasons == [STOP_REASON]
    assert p.stop_button.disabled
    p.flush()
    assert 'data-status="running">stopping' in p.header.value
    p.handle(ev.LaunchFinished(False, 0.5, stopped=STOP_REASON))
    p.flush()
    assert p.stop_button.disabled
    assert 'data-status="stopped">stopped: stopped from the launch panel' in p.header.value


def test_stop_without_control_says_how_to_stop():
    p = make()
    p.flush()
    p.stop_button.click()
    p.flush()
    assert not p.stop_button.disabled
    assert "interrupt the kernel (■) to stop" in p.header.value


@pytest.mark.parametrize("busy", ["refuses", "missing"])
def test_interrupt_hint_replaces_stop_when_clicks_cannot_arrive(monkeypatch, busy):
    if busy == "missing":
        monkeypatch.setitem(sys.modules, BUSY, None)  # import raises ImportError
    else:
        module = types.ModuleType(BUSY)
        module.deliver_while_busy = lambda widget: False
        monkeypatch.setitem(sys.modules, BUSY, module)
    p = make()
    assert with_class(p.widget, "nacc-stop") == []
    hints = [
        w for w in all_widgets(p.widget) if "Interrupt the kernel (■) to stop" in getattr(w, "value", "")
    ]
    assert len(hints) == 1


def count_values(widget):
    seen = []
    widget.observe(lambda change: seen.append(change["new"]), names="value")
    return seen


def test_flush_sets_only_widgets_that_changed():
    p = make()
    p.flush()
    counts = {name: count_values(view) for name, view in p.views.items()}
    counts["header"] = count_values(p.header)
    counts["status"] = count_values(p.status_table)
    counts["traceback"] = count_values(p.traceback)
    p.flush()
    assert {k: len(v) for k, v in counts.items()} == dict.fromkeys(counts, 0)

    out(p, 0, "one line")
    p.flush()
    assert {k: len(v) for k, v in counts.items()} == {
        "all": 1, "rank-0": 1, "rank-1": 0, "header": 0, "status": 0, "traceback": 0
    }  # fmt: skip
    p.handle(ev.RankFinished(1, 0.1))
    p.flush()
    p.flush()
    assert {k: len(v) for k, v in counts.items()} == {
        "all": 1, "rank-0": 1, "rank-1": 0, "header": 0, "status": 1, "traceback": 0
    }  # fmt: skip


def test_autoflush_throttles_renders():
    fps, max_lines, total = 10.0, 1000, 20000
    p = LaunchPanel(autoflush=True, show=False, fps=fps, max_lines=max_lines)
    began = time.monotonic()
    p.handle(ev.LaunchStarted(2, "fork", 2))
    p.flush()  # builds the rank views now, so their renders can be counted from here
    renders = count_values(p.views["all"])
    rank_renders = count_values(p.views["rank-1"])
    for chunk in range(20):
        for i in range(chunk * 1000, (chunk + 1) * 1000):
            out(p, i % 2, f"line {i}")
        time.sleep(0.025)
    p.close()
    elapsed = time.monotonic() - began
    assert not any(t.name == "notebook_accel-panel" for t in threading.enumerate())
    assert 2 <= len(renders) <= elapsed * fps + 3
    assert 2 <= len(rank_renders) <= elapsed * fps + 3
    expected = [f"[rank {i % 2}] line {i}" for i in range(total - max_lines, total)]
    assert p.text("all").splitlines() == expected
    assert f"… {total - max_lines} earlier lines dropped" in p.views["all"].value
    assert p.views["all"].value.endswith(f"line {total - 1}</pre></div>")


def test_show_displays_once(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    p = LaunchPanel(autoflush=False, show=True)
    assert shown == []
    p.handle(ev.LaunchStarted(1, "fork", 1))
    p.handle(ev.LaunchStarted(1, "fork", 1))
    assert shown == [p.widget]
    assert p.tabs.titles == ("All ranks", "Rank 0")  # drawn before it was displayed


@pytest.mark.timeout(120)
def test_real_launch_fills_the_panel():
    from panel_targets import print_lines

    from notebook_accel import notebook_launcher

    p = LaunchPanel(autoflush=False, show=False)
    results = notebook_launcher(print_lines, args=(3,), num_processes=2, use_port="auto", cpu=True, sinks=[p])
    p.flush()
    assert sorted(results) == [0, 1]
    assert [p.status(0), p.status(1)] == ["done", "done"]
    for rank in (0, 1):
        lines = p.text(rank).splitlines()
        assert [line for line in lines if " line " in line] == [f"rank {rank} line {i}" for i in range(3)]
        assert f"rank {rank} says <b>hi</b> on stderr" in lines
        assert len(lines) == 4
        assert f'data-rank="{rank}" data-status="done">done</span>' in p.status_table.value
        # The kernel's exact peak RSS of the reaped rank, in its final row.
        assert re.search(rf'class="nacc-rss" data-rank="{rank}"[^>]*>peak \d+\.\d MiB<', p.status_table.value)
        assert f"[rank {rank}]</span> rank {rank} line 2" in p.views["all"].value
    assert "says &lt;b&gt;hi&lt;/b&gt; on stderr" in p.views["rank-1"].value
    assert '<span class="nacc-launch-status" data-status="done">finished in' in p.header.value


def test_the_header_marks_an_fsdp_launch_and_only_that_launch():
    p = LaunchPanel(autoflush=False, show=False)
    p.handle(ev.LaunchStarted(2, "fork", 2, fsdp=True))
    p.flush()
    assert '<span class="nacc-title">notebook_accel launch</span><span class="nacc-launch-mode" data-mode="fsdp">FSDP' in (
        p.header.value
    )
    p.handle(ev.LaunchFinished(True, 1.0))
    p.handle(ev.LaunchStarted(2, "fork", 2))  # the panel reused for a plain launch
    p.flush()
    assert "FSDP" not in p.header.value and "nacc-launch-mode" not in p.header.value


@pytest.mark.timeout(120)
def test_real_fsdp_launch_shows_fsdp_in_the_header(monkeypatch):
    from panel_targets import print_lines

    from notebook_accel import notebook_launcher

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    p = LaunchPanel(autoflush=False, show=False)
    notebook_launcher(print_lines, args=(1,), num_processes=2, use_port="auto", cpu=True, sinks=[p], fsdp=True)
    p.flush()
    assert 'data-mode="fsdp">FSDP</span>' in p.header.value and "finished in" in p.header.value
    notebook_launcher(print_lines, args=(1,), num_processes=2, use_port="auto", cpu=True, sinks=[p], fsdp=False)
    p.flush()
    assert "nacc-launch-mode" not in p.header.value and "finished in" in p.header.value


def test_a_panel_reused_for_a_second_launch_starts_clean():
    p = make()
    p.handle(ev.RankStarted(0, 1))
    for i in range(3):
        out(p, 0, f"first launch {i}")
    out(p, 0, BARS[-1], transient=True)
    p.handle(ev.RankFinished(0, 1.0))
    p.handle(ev.LaunchFinished(True, 1.0))
    p.flush()
    assert p.progress_box.children[0].layout.display == "flex"

    p.handle(ev.LaunchStarted(1, "fork", 1))
    for i in range(3):  # as many lines as before: a stale cached render would look current
        out(p, 0, f"second launch {i}")
    p.flush()
    assert p.text("rank-0").splitlines() == [f"second launch {i}" for i in range(3)]
    assert "first launch" not in p.views["rank-0"].value and "second launch 2" in p.views["rank-0"].value
    assert "first launch" not in p.views["all"].value
    assert p.tabs.titles == ("All ranks", "Rank 0")
    assert p.status(0) == "pending"
    assert p.progress_box.children[0].layout.display == "none"
    assert p.progress_bars[0].value == 0.0


@pytest.mark.timeout(120)
def test_real_tqdm_in_ranks_becomes_one_bar_per_rank():
    from panel_targets import tqdm_loop

    from notebook_accel import notebook_launcher

    p = LaunchPanel(autoflush=False, show=False)
    assert notebook_launcher(tqdm_loop, args=(20,), num_processes=2, use_port="auto", cpu=True, sinks=[p]) == [20, 20]
    p.flush()
    for rank in (0, 1):
        assert p.progress_bars[rank].value == pytest.approx(1.0)
        assert p.progress_labels[rank].value.startswith("train: 20/20 [")
        # The redraws went to the bar, not the log: at most the final line is kept.
        assert sum("train:" in line for line in p.text(rank).splitlines()) <= 1


def test_rank_rows_show_live_resources_then_peaks():
    mib = 1 << 20
    p = make()
    for rank in (0, 1):
        p.handle(ev.RankStarted(rank, 100 + rank))
    p.handle(ev.RankResources(0, 300 * mib, 97.46, memory_limit=1 << 30))
    p.handle(ev.RankResources(1, 50 * mib, 3.0, memory_limit=1 << 30))
    p.flush()
    table = p.status_table.value
    assert "<th>RSS</th><th>CPU</th>" in table and "device" not in table  # no device columns without NVML
    assert '<span class="nacc-rss" data-rank="0" title="resident memory of 1.0 GiB allowed">300.0 MiB</span>' in table
    assert '<span class="nacc-cpu" data-rank="0" title="100 % = one core">97 %</span>' in table
    p.handle(ev.RankFinished(0, 2.0, peak_rss=310 * mib))
    p.handle(ev.RankResources(0, 1 * mib, 0.0))  # a sample that arrives late changes nothing
    p.handle(
        ev.RankFailed(1, 101, -9, signal_name="SIGKILL", peak_rss=900 * mib, oom="likely", memory_note="most likely …")
    )
    p.flush()
    table = p.status_table.value
    assert 'data-rank="0" title="resident memory of 1.0 GiB allowed">peak 310.0 MiB</span>' in table
    assert '<span class="nacc-cpu" data-rank="0" title="100 % = one core"></span>' in table
    assert 'data-rank="1" data-status="failed">failed (most likely out of memory, SIGKILL)</span>' in table
    assert ">peak 900.0 MiB</span>" in table


def test_device_columns_appear_where_a_rank_has_device_numbers():
    gib = 1 << 30
    p = make(n=1)
    p.handle(ev.RankStarted(0, 100))
    p.handle(ev.RankResources(0, gib, 100.0, device_memory=3 * gib, device_util=88.0))
    p.flush()
    table = p.status_table.value
    assert "<th>device memory</th><th>device util</th>" in table
    assert '<span class="nacc-device-memory" data-rank="0">3.0 GiB</span>' in table
    assert '<span class="nacc-device-util" data-rank="0">88 %</span>' in table
    p.handle(ev.RankFinished(0, 1.0, peak_rss=gib, peak_device_memory=5 * gib))
    p.flush()
    assert '<span class="nacc-device-memory" data-rank="0">peak 5.0 GiB</span>' in p.status_table.value


def test_stacks_button_shows_where_each_running_rank_is(monkeypatch):
    from notebook_accel.launch import watch_probe

    monkeypatch.setattr(watch_probe, "collectives", lambda pid: watch_probe.Collectives(
        (watch_probe.Collective("all_reduce", "default", 7, ((4,),), ("Float",)),), (), {"default": 7}))
    monkeypatch.setattr(watch_probe, "stacks", lambda pid: f'Thread 0x1 (most recent call first):\n  File "/home/me/t.py", line {pid} in f\n')
    p = make()
    assert p.stacks_button.disabled  # nothing runs yet
    p.handle(ev.RankStarted(0, 11))
    p.handle(ev.RankStarted(1, 12))
    p.flush()
    assert not p.stacks_button.disabled
    p.stacks_button.click()
    assert "where the ranks are now: rank 0 waits in all_reduce #7 (float32[4]) at /home/me/t.py, line 11, in f" in (
        html.unescape(p.traceback.value)
    ), p.traceback.value
    assert "rank 1 waits in all_reduce #7 (float32[4]) at /home/me/t.py, line 12" in html.unescape(p.traceback.value)
    p.handle(ev.LaunchFinished(True, 1.0))
    p.flush()
    assert p.stacks_button.disabled


def test_stacks_button_asks_the_engine_where_ranks_are_not_reachable_by_pid():
    """A Ray launch's ranks run on other nodes: the button asks the launch (control.where_now),
    which asks them through their actors (tests/test_ray_engine.py)."""
    from notebook_accel.launch import stall
    from notebook_accel.launch.control import LaunchControl

    asked = []

    def where_now(label=None):
        asked.append(label)
        return stall.build(3.0, [stall.RankWhere(0, "running"), stall.RankWhere(1, "starting")], asked=True)

    p = make()
    control = LaunchControl()
    control.where_now = where_now
    p.attach(control)
    p.handle(ev.RankStarted(0, 11, "10.0.0.7 (a1b2c3d4)"))
    p.handle(ev.RankStarted(1, 12, "10.0.0.8 (e5f6a7b8)"))
    p.flush()
    p.stacks_button.click()
    assert len(asked) == 1 and asked[0] is not None  # the notebook's cell labels go with it
    text = html.unescape(p.traceback.value)
    assert "where the ranks are now: rank 0 is in no collective; rank 1 is still starting" in text, text


def test_where_clicks_cannot_arrive_the_panel_says_stacks_need_them(clicks_arrive):
    clicks_arrive.deliver_while_busy = lambda widget: False
    p = make()
    texts = [w.value for w in all_widgets(p.widget) if isinstance(w, widgets.HTML)]
    assert any("stacks on demand need a kernel" in t for t in texts), texts
    assert p.stacks_button not in list(all_widgets(p.widget))


def test_a_stall_marks_its_ranks_and_puts_its_sentence_on_top_until_they_move():
    from notebook_accel.launch import stall, watch_probe

    waiting = (watch_probe.Collective("barrier", "default", 3),)
    report = stall.build(61, [stall.RankWhere(0, "waiting", waiting), stall.RankWhere(1, "running")])
    p = make()
    p.handle(ev.RankStarted(0, 11))
    p.handle(ev.RankStarted(1, 12))
    p.handle(ev.LaunchStalled(report))
    p.flush()
    assert 'data-rank="0" data-status="running" data-stalled="1">running (stalled: waits in barrier #3)' in (
        p.status_table.value
    ), p.status_table.value
    assert "· stalled for 61 s</span>" in html.unescape(p.header.value), p.header.value  # the sentence is below
    assert 'class="nacc-stall" data-stalled="1"' in p.traceback.value and "<details>" in p.traceback.value
    p.handle(ev.LaunchResumed())
    p.flush()
    assert "data-stalled" not in p.status_table.value and "nacc-stall" not in p.traceback.value
    assert "stalled" not in html.unescape(p.header.value)
