"""JupyterLab in headless Chromium: a notebook runs, its printed text and an ipywidgets slider show."""

import time

import pytest
from browser import (  # noqa: F401  (pytest fixtures)
    browser_page,
    jupyter_lab,
    open_notebook,
    run_all,
    screenshot,
    wait_for_output,
    write_notebook,
)

CELLS = [
    'print("hello from the kernel")',
    'import ipywidgets as w; w.IntSlider(value=7, description="seven")',
]


@pytest.mark.timeout(180)
def test_notebook_runs_and_widget_renders(jupyter_lab, browser_page, tmp_path):  # noqa: F811
    page = browser_page
    write_notebook(jupyter_lab.root, "smoke.ipynb", CELLS)

    t0 = time.monotonic()
    open_notebook(page, jupyter_lab, "smoke.ipynb")
    t_open = time.monotonic() - t0

    t0 = time.monotonic()
    run_all(page)
    printed = wait_for_output(page, "hello from the kernel")
    slider = wait_for_output(page, ".widget-slider")
    t_run = time.monotonic() - t0

    assert printed.inner_text().strip() == "hello from the kernel"
    # The live widget, drawn by the widget manager (not the "IntSlider(...)" text fallback).
    assert "jupyter-widgets" in (slider.get_attribute("class") or "").split()
    assert slider.locator(".widget-label").inner_text().strip() == "seven"
    assert slider.locator(".widget-readout").inner_text().strip() == "7"
    assert slider.locator('[role="slider"]').get_attribute("aria-valuenow") in ("7", "7.0")

    shot = screenshot(page, tmp_path / "after-run-all.png")
    assert shot.stat().st_size > 10_000, "the screenshot is suspiciously small"
    print(
        f"\ntimings: server {jupyter_lab.started_in:.1f}s, browser {page.started_in:.1f}s, "
        f"open notebook + idle kernel {t_open:.1f}s, run all to widget shown {t_run:.1f}s; screenshot {shot}"
    )
