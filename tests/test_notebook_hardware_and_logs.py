"""notebooks/hardware_and_logs.ipynb, executed once in a real kernel (panels off, as in a terminal);
the checks read what its cells printed, including what the explicitly built launch panels hold."""

import os
import re

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from notebook_accel.demo import cell_texts  # noqa: E402
from notebooks import cell, execute  # noqa: E402

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
TOTAL = sum(range(40))  # what work(40) returns

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def executed():
    return execute("hardware_and_logs.ipynb", label="the hardware-and-logs notebook")


def _cell(executed, marker):
    """The first code cell whose source contains `marker`, and its printed text (streams only)."""
    _, found = cell(executed, marker)
    return found, "".join(o.text for o in found.outputs if o.output_type == "stream")


def _widgets_shown(cell):
    return sum(WIDGET_MIME in o.get("data", {}) for o in cell.outputs if o.output_type == "display_data")


def test_hardware_panel_is_shown_and_the_report_printed(executed):
    import torch

    cell, text = _cell(executed, "hardware_widget()")
    assert _widgets_shown(cell) == 1, cell.outputs
    assert text.startswith("Hardware report\n"), text
    assert re.search(rf"^  torch\s+{re.escape(torch.__version__)}$", text, re.M), text
    assert re.search(rf"^  Cores\s+\d+ physical, {os.cpu_count()} logical$", text, re.M), text
    assert re.search(r"^Accelerators: ", text, re.M), text
    assert re.search(r"^in one line: \S.+$", text, re.M), text


def test_text_mode_is_on_in_the_test_kernel(executed):
    _, text = _cell(executed, "widgets_enabled()")
    # run_notebook starts the kernel with NOTEBOOK_ACCEL_WIDGETS=0
    assert "NOTEBOOK_ACCEL_WIDGETS when the kernel started: 0\n" in text
    assert "launches draw the panel by themselves: False\n" in text
    assert "after setting NOTEBOOK_ACCEL_WIDGETS=0: False\n" in text


def test_text_launch_prints_rank_lines_and_each_bar_once(executed):
    cell, _ = _cell(
        executed, 'totals = notebook_launcher(work, args=(40,), num_processes=2, use_port="auto")\n'
    )
    assert _widgets_shown(cell) == 0
    text = "".join(cell_texts(cell))
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank}: 40 steps to do\n" in text
        assert f"[rank {rank}] rank {rank}: finished, total {TOTAL}\n" in text
        bars = re.findall(rf"^\[rank {rank}\] rank {rank}: +(\d+)%\|.*\| (\d+)/40 ", text, re.M)
        assert bars == [("100", "40")], text  # the bar's redraws are not printed, its final state once
    assert f"returned: [{TOTAL}, {TOTAL}]\n" in text


def test_panel_built_explicitly_reports_done_and_full_bars(executed):
    cell, text = _cell(executed, "panel = LaunchPanel()")
    assert "sinks=[panel]" in cell.source
    assert _widgets_shown(cell) == 1  # the panel displays itself, even with the panels off
    before, _, after = text.partition("last lines of the 'All ranks' view:\n")
    assert "[rank " not in before, text  # the panel replaced the printed lines
    assert f"returned: [{TOTAL}, {TOTAL}]\n" in before
    for rank in (0, 1):
        status = re.search(rf"^rank {rank}: (\w+), progress bar ([\d.]+) \((.*)\)$", before, re.M)
        assert status, text
        assert status.group(1) == "done"
        assert float(status.group(2)) == 1.0
        assert status.group(3).startswith(f"rank {rank}: 40/40 ["), status.group(3)
        assert f"[rank {rank}] rank {rank}: finished, total {TOTAL}" in after
        assert re.search(rf"^\[rank {rank}\] rank {rank}: 100%\|", after, re.M), after
    assert len(after.splitlines()) == 4


def test_failing_rank_in_the_panel(executed):
    cell, text = _cell(executed, "failing = LaunchPanel()")
    assert _widgets_shown(cell) == 1
    assert "LaunchFailedError: rank 1 raised RuntimeError: rank 1 gave up at step 100\n" in text
    assert re.search(r"^rank 0: stopped, ", text, re.M), text  # still running when rank 1 failed
    bar = re.search(r"^rank 1: failed, progress bar ([\d.]+) \(style: (\w+)\)$", text, re.M)
    assert bar, text
    assert 0.0 < float(bar.group(1)) <= 0.5 and bar.group(2) == "danger", text
    box = text.partition("the panel's traceback box:\n")[2]
    assert box.startswith("rank 1 raised RuntimeError: rank 1 gave up at step 100\n"), box
    assert "Traceback (most recent call last):" in box
    assert re.search(r"line \d+, in work$", box, re.M), box
    assert 'raise RuntimeError(f"rank {rank} gave up at step {step}")' in box
    assert box.rstrip().endswith("RuntimeError: rank 1 gave up at step 100"), box


def test_timeout_stops_every_rank(executed):
    cell, text = _cell(executed, "timeout=3")
    assert _widgets_shown(cell) == 1
    assert "LaunchTimeoutError (a TimeoutError: True): launch stopped: timed out after 3 s" in text, text
    seconds = float(re.search(r"^the call returned after ([\d.]+) s$", text, re.M).group(1))
    assert 3 <= seconds < 20, text  # each rank alone would need a minute
    for rank in (0, 1):
        status = re.search(rf"^rank {rank}: (\w+), progress bar ([\d.]+)$", text, re.M)
        assert status, text
        assert status.group(1) == "stopped"
        assert float(status.group(2)) < 0.5
