"""Ranks launched from a real kernel leave its IPython shell: `tqdm.auto` draws text bars that the
launch panel shows per rank, `display()` and `print` become the rank's output, and nothing the ranks
do reaches the kernel's sockets or its own terminal (the Jupyter server's log), which the kernel
here writes to files we read."""

from __future__ import annotations

import html
import os
import re

import pytest
from kernels import run

from notebook_accel.demo import _kernel_manager_class

CELL = """\
%%accelerate -n 2 --start-method {method}
import os, time
from IPython.display import display
from tqdm.auto import tqdm
for step in tqdm(range(4), desc="cell"):
    time.sleep(0.02)
display({{"displayed by": int(os.environ["RANK"])}})
print("printed by", os.environ["RANK"])
"""

# As `import transformers` does in a kernel: tqdm.auto chosen there, with widgets.
KERNEL_TQDM = """\
import tqdm.auto as tqdm_lib
print("KERNEL BAR", [c.__module__ for c in tqdm_lib.tqdm.__mro__])
"""

LAUNCHER = """\
from notebook_accel import notebook_launcher

def train(n):
    from tqdm.auto import tqdm
    for _ in tqdm(range(n), desc="imported"):
        pass
    for _ in tqdm_lib.tqdm(range(n), desc="held"):  # the kernel's module, as transformers holds it
        pass
    try:
        input("a question no one can answer")
    except EOFError:
        print("input: EOF")
    return n

print("RESULTS", notebook_launcher(train, args=(3,), num_processes=2, use_port="auto"{extra}))
"""

SESSION_CELL = """\
%%accelerate
from tqdm.auto import tqdm
for _ in tqdm(range(5), desc="session"):
    pass
"""


@pytest.fixture
def kernel_with_logs(tmp_path):
    """A kernel whose own stdout and stderr (what a Jupyter server logs) go to files, at the
    default log level (ipykernel's fork warnings are WARNINGs), with the launch panel on."""
    logs = {name: tmp_path / f"kernel-{name}.txt" for name in ("stdout", "stderr")}
    files = {name: open(path, "w") for name, path in logs.items()}
    km = _kernel_manager_class()(kernel_name="python3")
    env = {**os.environ, "NOTEBOOK_ACCEL_WIDGETS": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    km.start_kernel(env=env, cwd=str(tmp_path), stdout=files["stdout"], stderr=files["stderr"])
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        loaded = run(kc, "%load_ext notebook_accel")
        assert not loaded["errors"], loaded
        yield kc, lambda: {name: path.read_text() for name, path in logs.items()}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        for f in files.values():
            f.close()


def panel(seen: dict) -> dict:
    """What the launch panel's widgets last showed: per rank its bar's value, the bar's label and
    its log's text."""
    states = list(seen["comms"].values())
    bars = [s for s in states if "nacc-progress" in s.get("_dom_classes", [])]
    labels = [s["value"] for s in states if s.get("_model_name") == "LabelModel" and s.get("value")]
    logs = {}
    for s in states:
        m = re.search(r'data-view="rank-(\d+)">(.*?)</pre>', str(s.get("value", "")), re.S)
        if m:
            logs[int(m.group(1))] = html.unescape(re.sub(r"<[^>]+>", "", m.group(2)))
    return {"bars": [b.get("value") for b in bars], "labels": sorted(labels), "logs": logs}


def assert_kernel_logs_clean(read_logs) -> None:
    logs = read_logs()
    for name, text in logs.items():
        assert "comm_open" not in text and "comm_msg" not in text, (name, text[:2000])
        assert "send message from fork" not in text, (name, text[:2000])
        assert "display_data" not in text and "Traceback" not in text, (name, text[:2000])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_tqdm_auto_in_an_accelerate_cell_becomes_one_text_bar_per_rank(kernel_with_logs, method):
    kc, read_logs = kernel_with_logs
    seen = run(kc, CELL.format(method=method), timeout=150)
    assert not seen["errors"], seen["errors"]
    assert seen["reply"]["status"] == "ok"
    shown = panel(seen)
    assert shown["bars"] == [1.0, 1.0], shown
    assert len(shown["labels"]) == 2, shown
    assert all(label.startswith("cell: 4/4 [") for label in shown["labels"]), shown
    for rank in (0, 1):
        log = shown["logs"][rank]
        assert f"{{'displayed by': {rank}}}" in log and f"printed by {rank}" in log, log
        assert "Traceback" not in log and "HBox" not in log, log
    assert_kernel_logs_clean(read_logs)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("extra", ["", ", max_restarts=1"], ids=["local", "elastic"])
def test_tqdm_auto_in_a_launched_function_even_when_the_kernel_chose_widgets(kernel_with_logs, extra):
    # max_restarts=1: torch elastic's agent, in a process forked from the kernel, forks the ranks.
    kc, read_logs = kernel_with_logs
    kernel_bar = run(kc, KERNEL_TQDM)
    assert "tqdm.notebook" in kernel_bar["text"], kernel_bar  # the kernel itself keeps its widgets
    seen = run(kc, LAUNCHER.format(extra=extra), timeout=150)
    assert not seen["errors"], seen["errors"]
    assert "RESULTS [3, 3]" in seen["text"], seen["text"]
    shown = panel(seen)
    assert shown["bars"] == [1.0, 1.0], shown
    assert len(shown["labels"]) == 2, shown
    assert all(label.startswith("held: 3/3 [") for label in shown["labels"]), shown
    for rank in (0, 1):
        log = shown["logs"][rank]
        assert "imported: 100%" in log and "3/3" in log, log  # the first bar's last state, as text
        assert "input: EOF" in log and "Traceback" not in log, log
    assert_kernel_logs_clean(read_logs)


@pytest.mark.timeout(180)
def test_tqdm_auto_in_a_session_cell_becomes_one_text_bar_per_rank(kernel_with_logs):
    # Session workers are ranks too: they leave the kernel through the same launch/child.py.
    kc, read_logs = kernel_with_logs
    started = run(kc, "%accelerate start -n 2", timeout=120)
    assert started["reply"]["status"] == "ok", started
    seen = run(kc, SESSION_CELL)
    assert not seen["errors"], seen["errors"]
    shown = panel(seen)
    assert shown["bars"] == [1.0, 1.0], shown
    assert len(shown["labels"]) == 2, shown
    assert all(label.startswith("session: 5/5 [") for label in shown["labels"]), shown
    assert run(kc, "%accelerate stop")["reply"]["status"] == "ok"
    assert_kernel_logs_clean(read_logs)
