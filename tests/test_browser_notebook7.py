"""What a person sees in Jupyter Notebook 7 (headless Chromium): the hardware panel, and a %%accelerate
cell on 2 ranks whose launch panel shows both ranks' output and a finished status. Notebook 7 is built
from JupyterLab's components but has its own page, toolbar and menu bar. Screenshots go to
tests/.artifacts/<test>/."""

import time

import pytest
from browser import (  # noqa: F401  (pytest fixtures)
    browser_page,
    jupyter_notebook7,
    open_notebook7,
    run_all_notebook7,
    screenshot,
    wait_for_output,
    write_notebook,
)

CELLS = [
    "%load_ext notebook_accel\nimport notebook_accel\nnotebook_accel.hardware_widget()",
    "%%accelerate -n 2 --port auto\nimport os, sys\nrank = os.environ['RANK']\n"
    "for i in range(3):\n    print(f'line {i} from rank {rank}')\nprint(f'warning on rank {rank}', file=sys.stderr)",
]


@pytest.mark.timeout(240)
def test_panels_render_in_notebook7(jupyter_notebook7, browser_page, tmp_path):  # noqa: F811
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page = browser_page
    server = jupyter_notebook7
    t_test = time.monotonic()
    write_notebook(server.root, "panels.ipynb", CELLS)
    t_write = time.monotonic() - t_test

    t0 = time.monotonic()
    open_notebook7(page, server, "panels.ipynb")
    t_open = time.monotonic() - t0

    t0 = time.monotonic()
    run_all_notebook7(page)
    hardware = wait_for_output(page, ".nacc-hardware")
    t_hardware = time.monotonic() - t0
    # The live widget, drawn by the widget manager (not a "VBox(...)" text fallback).
    assert "jupyter-widgets" in (hardware.get_attribute("class") or "").split()
    assert "CPU" in hardware.inner_text()

    # Any end state, so that a failed launch fails the test at once, saying why.
    ended = wait_for_output(
        page,
        '.nacc-launch-status:is([data-status="done"], [data-status="failed"], [data-status="stopped"])',
        timeout=90,
    )
    t_done = time.monotonic() - t0
    panel = page.locator(".nacc-launch").first
    assert ended.get_attribute("data-status") == "done", panel.inner_text()
    # The header, the rank table and the log are separate widgets, updated one after the other: the
    # header can show "done" a moment before the rest of the same redraw reaches the page.
    expected = [f"line {i} from rank {r}" for r in (0, 1) for i in range(3)] + [
        f"warning on rank {r}" for r in (0, 1)
    ]
    try:
        page.wait_for_function(
            """([expected]) => {
              const panel = document.querySelector('.nacc-launch');
              const done = [0, 1].every(r => {
                const s = panel.querySelector(`.nacc-status[data-rank="${r}"]`);
                return s && s.getAttribute('data-status') === 'done';
              });
              const log = panel.querySelector('pre.nacc-log[data-view="all"]');
              return done && !!log && expected.every(t => log.innerText.includes(t));
            }""",
            arg=[expected],
            timeout=10_000,
            polling=100,
        )
    except PlaywrightTimeout:
        pass  # the assertions below say what the page shows
    for rank in (0, 1):
        status = panel.locator(f'.nacc-status[data-rank="{rank}"]')
        assert status.get_attribute("data-status") == "done", panel.locator(".nacc-status").all_inner_texts()
    text = panel.locator('pre.nacc-log[data-view="all"]').inner_text()
    for line in expected:
        assert line in text, text
    # No output area fell back to a widget's text repr.
    shown = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
    assert "VBox(" not in shown and "HBox(" not in shown and "HTML(" not in shown, shown

    t_checks = time.monotonic() - t0 - t_done
    t0 = time.monotonic()
    hardware.scroll_into_view_if_needed()
    shots = [screenshot(page, tmp_path / "notebook7-hardware.png")]
    panel.scroll_into_view_if_needed()
    shots.append(screenshot(page, tmp_path / "notebook7-launch.png"))
    for shot in shots:
        assert shot.stat().st_size > 10_000, f"{shot} is suspiciously small"
    t_shots = time.monotonic() - t0
    print(
        f"\ntimings: server {server.started_in:.1f}s, browser {page.started_in:.1f}s, "
        f"write notebook {t_write:.1f}s, open notebook + idle kernel {t_open:.1f}s, run all to hardware panel {t_hardware:.1f}s, "
        f"to launch done {t_done:.1f}s, checks {t_checks:.1f}s, screenshots {t_shots:.1f}s, "
        f"test body {time.monotonic() - t_test:.1f}s; screenshots {shots[0]} {shots[1]}"
    )
