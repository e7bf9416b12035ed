"""The JupyterLab extension (extension/) in headless Chromium: its status bar item follows a 2-rank
%%accelerate cell, its sidebar shows the ranks, and "Run cell on N processes" runs a plain cell on
2 ranks without editing it. Screenshots go to tests/.artifacts/<test>/.

Needs the built extension where the venv's JupyterLab finds it (share/jupyter/labextensions)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from browser import (  # noqa: F401  (pytest fixtures)
    browser_page,
    jupyter_lab,
    open_notebook,
    screenshot,
    wait_for_output,
    write_notebook,
)

NAME = "notebook-accel-labextension"
SETUP = "%load_ext notebook_accel"
LAUNCH = """%%accelerate -n 2 --port auto
import os, time
time.sleep(3)
print("launch done on", os.environ["RANK"])"""
PLAIN = 'import os; print("rank", os.environ["RANK"])'
STATUS = ".nacc-x-status"


def require_extension() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True, text=True
    )
    if NAME not in listed.stdout + listed.stderr:
        pytest.fail(f"{NAME} is not installed for JupyterLab: build extension/ and link it (see extension/README.md)",
                    pytrace=False)  # fmt: skip


def status_text(page) -> str:
    return page.locator(STATUS).inner_text()


def wait_status(page, pattern: str, timeout: float = 60.0) -> str:
    page.wait_for_function(
        f"() => {{ const e = document.querySelector({STATUS!r}); return !!e && new RegExp({json.dumps(pattern)})"
        ".test(e.textContent); }",
        timeout=timeout * 1000,
        polling=50,
    )
    return status_text(page)


def run_cell(page, index: int) -> None:
    page.locator(".jp-NotebookPanel .jp-Cell").nth(index).locator(".jp-InputPrompt").click()
    page.keyboard.press("Shift+Enter")


@pytest.mark.timeout(300)
def test_status_bar_sidebar_and_run_on_n_processes(jupyter_lab, browser_page, tmp_path):  # noqa: F811
    require_extension()
    page = browser_page
    write_notebook(jupyter_lab.root, "ext.ipynb", [SETUP, LAUNCH, PLAIN])
    open_notebook(page, jupyter_lab, "ext.ipynb")

    page.locator(STATUS).wait_for(state="visible", timeout=30_000)
    assert "not connected" in status_text(page)

    run_cell(page, 0)
    summary = wait_status(page, r"\d+ x \S+ · \S+")
    assert re.search(r"2 x CPU · MULTI_CPU|x .* · MULTI_GPU", summary), summary

    run_cell(page, 1)
    assert "2/2 ranks running" in wait_status(page, "ranks running")
    screenshot(page, tmp_path / "1-running.png")
    assert re.search(r"finished in \d+\.\d s", wait_status(page, "finished in", timeout=90))
    wait_for_output(page, "launch done on 1")

    page.locator(STATUS).click()  # opens the sidebar
    sidebar = page.locator("#notebook-accel-panel")
    sidebar.wait_for(state="visible", timeout=10_000)
    launch = sidebar.locator(".nacc-x-launch").first
    assert launch.get_attribute("data-state") == "done"
    assert launch.locator('.nacc-x-rank[data-state="done"]').count() == 2
    assert "launch done on 0" in launch.inner_text()
    assert "Distributed type" in sidebar.inner_text()
    screenshot(page, tmp_path / "2-sidebar.png")

    # "Run cell on N processes" from the notebook toolbar, on the plain cell.
    page.locator(".jp-NotebookPanel .jp-Cell").nth(2).locator(".jp-InputPrompt").click()
    page.locator('.jp-NotebookPanel-toolbar [data-command="notebook-accel:run-cell"]').click()
    plain = page.locator(".jp-NotebookPanel .jp-Cell").nth(2)
    for rank in (0, 1):  # each rank's line, in the launch panel widget (rendered, not its text repr)
        plain.locator(".nacc-launch").filter(has_text=re.compile(rf"\[rank {rank}\]\s*rank {rank}")).wait_for(
            timeout=90_000
        )
    page.wait_for_function(  # the second launch, not the first one's status
        "() => { const l = document.querySelectorAll('#notebook-accel-panel .nacc-x-launch');"
        " return l.length === 2 && l[0].dataset.state === 'done'; }",
        timeout=90_000,
    )
    assert re.search(r"finished in \d+\.\d s", status_text(page))
    newest = sidebar.locator(".nacc-x-launch").first
    assert newest.locator('.nacc-x-rank[data-state="done"]').count() == 2
    source = plain.locator(".jp-InputArea-editor").inner_text()
    assert source.strip() == PLAIN  # the cell was not edited
    screenshot(page, tmp_path / "3-run-on-n.png")

    # The command palette knows the command by its label.
    page.keyboard.press("Control+Shift+C")
    page.locator(".lm-CommandPalette-input").fill("Run cell on 2 processes")
    assert page.locator(".lm-CommandPalette-item", has_text="Run cell on 2 processes").count() >= 1
    page.keyboard.press("Escape")
    assert not [e for e in page.console_errors if "notebook_accel" in e or "nacc" in e], page.console_errors
