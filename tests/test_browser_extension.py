"""The JupyterLab extension (extension/) in headless Chromium: its status bar item follows a 2-rank
%%accelerate cell, its sidebar shows the ranks (and its Stop button stops a launch), "Run cell on N
processes" runs a plain cell on 2 ranks without editing it, and the numProcesses setting changes N.
Screenshots go to tests/.artifacts/<test>/.

Needs the built extension where the venv's JupyterLab finds it (share/jupyter/labextensions)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest
from browser import (  # noqa: F401  (pytest fixtures)
    OUTPUT,
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
time.sleep(6)  # long enough to see "2/2 ranks running" on a loaded machine
print("launch done on", os.environ["RANK"])"""
PLAIN = 'import os; print("rank", os.environ["RANK"])'
STATUS = ".nacc-x-status"
# What a launch here would use, once the kernel said hello: "2 x CPU · MULTI_CPU · fp32".
SUMMARY = r"\d+ x \S+ · \S+ · \S+"


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


def open_sidebar(page):
    """Click the status bar item; returns the sidebar once it is visible."""
    page.locator(STATUS).click()
    sidebar = page.locator("#notebook-accel-panel")
    sidebar.wait_for(state="visible", timeout=10_000)
    return sidebar


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
    summary = wait_status(page, SUMMARY)
    # No config file (conftest): N is 2, the precision fp32.
    assert re.search(r"2 x CPU · MULTI_CPU · fp32|x .* · MULTI_GPU · fp32", summary), summary

    sidebar = open_sidebar(page)  # open while the launch runs: its rows show live resources
    run_cell(page, 1)
    # Ranks report one by one ("1/2 ranks running" first); the cell sleeps 6 s, so 2/2 must show.
    assert "2/2 ranks running" in wait_status(page, r"2/2 ranks running")
    # The launcher samples each rank once a second: RSS and CPU % in each rank's row while it runs.
    page.wait_for_function(
        "() => [0, 1].every(r => { const q = (c) => document.querySelector("
        "`#notebook-accel-panel .nacc-x-launch .nacc-x-${c}[data-rank=\"${r}\"]`)?.textContent ?? '';"
        " return /^\\d+\\.\\d MiB$/.test(q('rss')) && /^\\d+ %$/.test(q('cpu')); })",
        timeout=30_000,
    )
    # Redraws replace the sidebar's content every second: scroll from inside the page, at once.
    page.evaluate("document.querySelector('#notebook-accel-panel .nacc-x-launch').scrollIntoView()")
    screenshot(page, tmp_path / "1-running.png")
    assert re.search(r"finished in \d+\.\d s", wait_status(page, "finished in", timeout=90))
    wait_for_output(page, "launch done on 1")

    launch = sidebar.locator(".nacc-x-launch").first
    assert launch.get_attribute("data-state") == "done"
    assert launch.locator('.nacc-x-rank[data-state="done"]').count() == 2
    for rank in (0, 1):  # the final rows: each rank's peak RSS, no CPU %
        assert re.fullmatch(r"peak \d+\.\d MiB", launch.locator(f'.nacc-x-rss[data-rank="{rank}"]').inner_text())
        assert launch.locator(f'.nacc-x-cpu[data-rank="{rank}"]').count() == 0
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
    page.locator(".lm-CommandPalette-item", has_text="Run cell on 2 processes").first.wait_for(timeout=10_000)
    page.keyboard.press("Escape")

    # The keyboard shortcut (Accel Shift Enter) runs the selected cell on N processes too.
    plain.locator(".jp-InputPrompt").click()
    page.keyboard.press("Control+Shift+Enter")
    page.wait_for_function(
        "() => { const l = document.querySelectorAll('#notebook-accel-panel .nacc-x-launch');"
        " return l.length === 3 && l[0].dataset.state === 'done'; }",
        timeout=90_000,
    )
    assert sidebar.locator(".nacc-x-launch").first.locator('.nacc-x-rank[data-state="done"]').count() == 2
    assert plain.locator(".jp-InputArea-editor").inner_text().strip() == PLAIN
    assert not [e for e in page.console_errors if "notebook_accel" in e or "nacc" in e], page.console_errors


SIDEBAR = "#notebook-accel-panel"
LIVE_SESSION = f'{SIDEBAR} .nacc-x-session[data-state="running"]'


def palette_run(page, label: str) -> None:
    page.keyboard.press("Control+Shift+C")
    page.locator(".lm-CommandPalette-input").fill(label)
    page.locator(".lm-CommandPalette-item", has_text=label).first.click()


def session_pids(page) -> list:
    return page.locator(f"{LIVE_SESSION} .nacc-x-srank td:nth-child(3)").all_inner_texts()


def extension_errors(page) -> list:
    return [
        e for e in page.console_errors if "notebook_accel" in e or "nacc" in e or e.startswith("pageerror")
    ]


@pytest.mark.timeout(300)
def test_session_command_restart_and_stop_in_the_sidebar(jupyter_lab, browser_page, tmp_path):  # noqa: F811
    require_extension()
    page = browser_page
    write_notebook(jupyter_lab.root, "session.ipynb", [SETUP])
    open_notebook(page, jupyter_lab, "session.ipynb")
    run_cell(page, 0)
    wait_status(page, SUMMARY)
    sidebar = open_sidebar(page)
    assert "No session running" in sidebar.inner_text()

    # The palette's "Start / stop a session" starts 2 workers; the sidebar and status bar show them.
    palette_run(page, "Start / stop a session")
    page.locator(LIVE_SESSION).wait_for(timeout=120_000)
    rows = page.locator(f"{LIVE_SESSION} .nacc-x-srank")
    assert rows.count() == 2
    assert [rows.nth(i).get_attribute("data-state") for i in range(2)] == ["idle", "idle"]
    first = session_pids(page)
    assert all(pid.isdigit() for pid in first), first
    assert "session: 2 workers" in wait_status(page, "session: 2 workers")
    screenshot(page, tmp_path / "1-session.png")

    # Restart: new workers, new pids.
    page.locator(f'{LIVE_SESSION} [data-action="restart"]').click()
    page.wait_for_function(
        "(old) => { const c = document.querySelectorAll("
        f"{json.dumps(LIVE_SESSION + ' .nacc-x-srank td:nth-child(3)')});"
        " return c.length === 2 && [...c].every((td, i) => /^\\d+$/.test(td.textContent) && td.textContent !== old[i]); }",
        arg=first,
        timeout=120_000,
    )
    assert sidebar.locator(".nacc-x-session").first.get_attribute("data-state") == "running"
    assert "restarted 1x" in sidebar.inner_text()
    screenshot(page, tmp_path / "2-restarted.png")

    # The same command again stops it.
    palette_run(page, "Start / stop a session")
    sidebar.locator('.nacc-x-session[data-state="stopped"]').wait_for(timeout=60_000)
    assert page.locator(LIVE_SESSION).count() == 0
    assert sidebar.locator('[data-action="start_session"]').count() == 1
    assert "session:" not in wait_status(page, r"^⚡ [^·]+· [^·]+· [^·]+$")
    screenshot(page, tmp_path / "3-stopped.png")
    assert not extension_errors(page), page.console_errors


@pytest.mark.timeout(180)
def test_a_kernel_without_the_extension_stays_not_connected(jupyter_lab, browser_page, tmp_path):  # noqa: F811
    require_extension()
    page = browser_page
    write_notebook(jupyter_lab.root, "plain.ipynb", ["x = 20", "print(x + 22)"])
    open_notebook(page, jupyter_lab, "plain.ipynb")
    run_cell(page, 0)
    run_cell(page, 1)
    wait_for_output(page, "42")
    sidebar = open_sidebar(page)
    assert "Not connected" in sidebar.inner_text()
    sidebar.locator('[data-action="connect"]').click()  # the kernel has no such target: still nothing
    page.wait_for_timeout(2000)
    assert "not connected" in status_text(page)
    assert "Not connected" in sidebar.inner_text()
    assert sidebar.locator(".nacc-x-session, [data-action=restart]").count() == 0
    screenshot(page, tmp_path / "not-connected.png")
    assert not extension_errors(page), page.console_errors


def _luminance(css_color: str) -> float:
    r, g, b = (int(v) for v in re.findall(r"\d+", css_color)[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


@pytest.mark.timeout(300)
def test_dark_theme_sidebar_and_status_bar(jupyter_lab, browser_page, tmp_path):  # noqa: F811
    require_extension()
    page = browser_page
    write_notebook(jupyter_lab.root, "dark.ipynb", [SETUP + "\n%accelerate start -n 2"])
    open_notebook(page, jupyter_lab, "dark.ipynb")
    run_cell(page, 0)
    wait_status(page, "session: 2 workers", timeout=120)

    page.locator("li.lm-MenuBar-item", has_text=re.compile(r"^Settings$")).click()
    page.locator(".lm-Menu-item", has_text=re.compile(r"^Theme$")).hover()
    page.get_by_role("menuitem", name="JupyterLab Dark", exact=True).click()
    try:
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
        page.wait_for_timeout(500)  # the theme's CSS applied
        sidebar = open_sidebar(page)
        page.locator(LIVE_SESSION).wait_for(timeout=30_000)
        colours = page.evaluate(
            """() => {
              const style = sel => getComputedStyle(document.querySelector(sel));
              const panel = style('#notebook-accel-panel'), status = style('.nacc-x-status');
              const bar = style('#jp-main-statusbar');
              return {text: panel.color, background: panel.backgroundColor, status: status.color,
                      bar: bar.backgroundColor};
            }"""
        )
        shot = screenshot(page, tmp_path / "dark.png")
        from PIL import Image

        with Image.open(shot) as full:  # the status bar and the sidebar, for a person to look at
            box = page.locator("#jp-main-statusbar").bounding_box()
            full.crop((0, int(box["y"]), min(full.width, 900), int(box["y"] + box["height"]))).save(
                shot.with_name("dark-statusbar.png")
            )
            side = sidebar.bounding_box()
            full.crop((int(side["x"]), int(side["y"]), int(side["x"] + side["width"]),
                       int(side["y"] + side["height"]))).save(shot.with_name("dark-sidebar.png"))  # fmt: skip
        assert _luminance(colours["text"]) > 0.6, colours
        assert _luminance(colours["background"]) < 0.3, colours
        assert _luminance(colours["status"]) > 0.6, colours
        assert _luminance(colours["bar"]) < 0.3, colours
        assert not extension_errors(page), page.console_errors
    finally:  # the server (and its settings) serve the module's other tests: back to the light theme
        page.locator("li.lm-MenuBar-item", has_text=re.compile(r"^Settings$")).click()
        page.locator(".lm-Menu-item", has_text=re.compile(r"^Theme$")).hover()
        page.get_by_role("menuitem", name="JupyterLab Light", exact=True).click()
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'true'", timeout=30_000)


STOP_CELL = """%%accelerate -n 2 --port auto
import os, time
print("rank", os.environ["RANK"], "sleeping", flush=True)
time.sleep(120)"""
PLUGIN = "notebook-accel-labextension:plugin"


def put_settings(lab, raw: str) -> None:
    """Replace the extension's user settings on the server (what the settings editor saves)."""
    req = urllib.request.Request(
        f"{lab.url}/lab/api/settings/{PLUGIN}", data=json.dumps({"raw": raw}).encode(), method="PUT",
        headers={"Authorization": f"token {lab.token}", "Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status in (200, 204), resp.status


def palette_shows(page, label: str, timeout: float = 30.0) -> None:
    """The command palette lists a command by exactly this label (its labels follow the setting)."""
    page.keyboard.press("Control+Shift+C")
    page.locator(".lm-CommandPalette-input").fill(label)
    item = page.locator(".lm-CommandPalette-itemLabel", has_text=re.compile(rf"^{re.escape(label)}$"))
    try:
        item.first.wait_for(timeout=timeout * 1000)
    finally:
        page.keyboard.press("Escape")


@pytest.mark.timeout(360)
def test_stop_button_and_the_num_processes_setting(jupyter_lab, browser_page, tmp_path):  # noqa: F811
    require_extension()
    page = browser_page
    write_notebook(jupyter_lab.root, "stop.ipynb", [SETUP, STOP_CELL])
    open_notebook(page, jupyter_lab, "stop.ipynb")
    run_cell(page, 0)
    wait_status(page, SUMMARY)
    sidebar = open_sidebar(page)

    # The sidebar's Stop button stops a running launch: ranks stopped, the cell ends in CellStoppedError.
    run_cell(page, 1)
    sidebar.locator(".nacc-x-launch .nacc-x-line", has_text=re.compile(r"rank \d sleeping")).first.wait_for(
        timeout=120_000
    )
    assert "ranks running" in status_text(page)
    screenshot(page, tmp_path / "1-before-stop.png")
    page.locator(f'{SIDEBAR} [data-action="stop"]').click()
    assert re.search(r"stopped after \d+\.\d s", wait_status(page, "stopped after", timeout=90))
    cell = page.locator(".jp-NotebookPanel .jp-Cell").nth(1)
    cell.locator(OUTPUT).filter(has_text="CellStoppedError").first.wait_for(timeout=60_000)
    outputs = cell.locator(OUTPUT).all_inner_texts()
    assert any("stopped from the JupyterLab extension" in t for t in outputs), outputs
    launch = sidebar.locator(".nacc-x-launch").first
    assert launch.get_attribute("data-state") == "stopped"
    assert launch.locator('.nacc-x-rank[data-state="stopped"]').count() == 2
    assert launch.locator('[data-action="stop"]').count() == 0
    screenshot(page, tmp_path / "2-stopped.png")

    # The numProcesses setting, changed in the Settings Editor, changes N in the commands' labels.
    palette_shows(page, "Run cell on 2 processes")  # no setting, no config file: 2
    try:
        page.locator("li.lm-MenuBar-item", has_text=re.compile(r"^Settings$")).click()
        page.locator('.lm-Menu-item[data-command="settingeditor:open"]').click()
        page.locator(f'.jp-PluginList-entry[data-id="{PLUGIN}"]').click(timeout=30_000)
        field = page.locator(f'input[id="jp-SettingsEditor-{PLUGIN}_numProcesses"]')
        field.wait_for(timeout=30_000)
        assert field.input_value() == "0"  # the default: from the config
        field.fill("3")
        palette_shows(page, "Run cell on 3 processes")
        palette_shows(page, "Start / stop a session (3 workers)")
        page.wait_for_function(  # the status bar's tooltip: what a launch on N processes would use
            f"() => /3 x CPU · MULTI_CPU · fp32|MULTI_GPU/.test(document.querySelector({STATUS!r}).title)",
            timeout=30_000,
        )
        screenshot(page, tmp_path / "3-setting.png")
        assert not extension_errors(page), page.console_errors
    finally:  # the server's settings serve the module's other tests
        put_settings(jupyter_lab, "{}")


# Rank 0 in all_reduce, rank 1 in barrier: the stall watch speaks after 2 s, the timeout ends it.
STALL_CELL = """import torch, torch.distributed as dist
from notebook_accel import PartialState, notebook_launcher

def stuck():
    state = PartialState()
    print("ready", flush=True)
    if state.process_index == 0:
        dist.all_reduce(torch.ones(4))
    else:
        dist.barrier()

notebook_launcher(stuck, num_processes=2, stall_after=2, timeout=15)"""


@pytest.mark.timeout(240)
def test_a_stalled_launch_in_the_sidebar(jupyter_lab, browser_page, tmp_path):  # noqa: F811
    require_extension()
    page = browser_page
    write_notebook(jupyter_lab.root, "stall.ipynb", [SETUP, STALL_CELL])
    open_notebook(page, jupyter_lab, "stall.ipynb")
    run_cell(page, 0)
    wait_status(page, SUMMARY)
    sidebar = open_sidebar(page)
    run_cell(page, 1)

    # While the ranks wait: the sentence on the launch, both ranks marked with what they wait in.
    sentence = sidebar.locator(".nacc-x-launch .nacc-x-stall-sentence")
    sentence.filter(has_text=re.compile(r"stalled for \d+ s: .*waits in all_reduce")).wait_for(timeout=60_000)
    marked = json.dumps(f'{SIDEBAR} .nacc-x-rank[data-stalled="1"]')
    page.wait_for_function(f"() => document.querySelectorAll({marked}).length === 2", timeout=10_000)
    launch = sidebar.locator(".nacc-x-launch").first
    assert launch.get_attribute("data-state") == "running"
    text = launch.inner_text()
    assert "stalled: waits in all_reduce" in text and "stalled: waits in barrier" in text, text
    # And the launch panel in the cell: the sentence above the folded stacks, both ranks marked.
    panel_sentence = page.locator(".jp-OutputArea-output .nacc-stall-sentence")
    assert "waits in all_reduce" in panel_sentence.first.inner_text(), panel_sentence.first.inner_text()
    stalled_rows = json.dumps('.jp-OutputArea-output .nacc-status[data-stalled="1"]')
    page.wait_for_function(f"() => document.querySelectorAll({stalled_rows}).length === 2", timeout=10_000)
    assert page.locator(".jp-OutputArea-output .nacc-stall details").count() == 1
    page.evaluate(f"document.querySelector({SIDEBAR + ' .nacc-x-stall'!r}).scrollIntoView()")
    screenshot(page, tmp_path / "1-stalled.png")

    # The timeout ends it; the sentence stays (it says why), the report opens and stays open on redraws.
    ended = wait_status(page, "stopped|failed", timeout=60)
    assert re.search(r"stopped after|rank \d failed|failed after", ended), ended
    assert launch.locator('.nacc-x-rank[data-stalled="1"]').count() == 0
    assert "waits in all_reduce" in launch.locator(".nacc-x-stall-sentence").inner_text()
    launch.locator(".nacc-x-stall-report summary").click()
    sidebar.locator('[data-action="refresh"]').click()  # a redraw (the kernel answers with a hello)
    page.wait_for_timeout(1000)
    report = sidebar.locator(".nacc-x-launch .nacc-x-stall-report[open] .nacc-x-stall-text")
    assert "rank 0: waits in all_reduce" in report.inner_text() and "Cell In[" in report.inner_text()
    page.evaluate(f"document.querySelector({SIDEBAR + ' .nacc-x-stall'!r}).scrollIntoView()")
    screenshot(page, tmp_path / "2-report.png")
    assert not extension_errors(page), page.console_errors


QUIET_CELL = """from notebook_accel import notebook_launcher

def quiet():
    import time
    print("sleeping", flush=True)
    time.sleep(12)

notebook_launcher(quiet, num_processes=2)"""


@pytest.mark.timeout(240)
def test_the_panel_s_stacks_button_shows_where_each_rank_is(jupyter_lab, browser_page, tmp_path):  # noqa: F811
    require_extension()
    page = browser_page
    write_notebook(jupyter_lab.root, "stacks.ipynb", [SETUP, QUIET_CELL])
    open_notebook(page, jupyter_lab, "stacks.ipynb")
    run_cell(page, 0)
    wait_status(page, SUMMARY)
    run_cell(page, 1)
    cell = page.locator(".jp-NotebookPanel .jp-Cell").nth(1)
    cell.locator(".nacc-log", has_text="sleeping").first.wait_for(timeout=120_000)
    cell.locator(".nacc-stacks").click()  # heard while the cell runs (the kernel's side shell)
    sentence = cell.locator(".nacc-stall-sentence")
    sentence.wait_for(timeout=30_000)
    text = sentence.inner_text()
    assert text.startswith("where the ranks are now: ranks 0, 1 are in no collective at Cell In[2], line 6"), text
    assert cell.locator('.nacc-status[data-stalled="1"]').count() == 0  # a snapshot, not a stall
    screenshot(page, tmp_path / "stacks.png")
    wait_status(page, "finished", timeout=90)
    assert not extension_errors(page), page.console_errors
