"""What a person sees in JupyterLab (headless Chromium): the hardware panel, and a %%accelerate
cell on 2 ranks whose launch panel shows both ranks' output and a finished status, in the light
and the dark theme. Screenshots go to tests/.artifacts/<test>/."""

import re

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
    "%load_ext notebook_accel\nimport notebook_accel\nnotebook_accel.hardware_widget()",
    "%%accelerate -n 2 --port auto\nimport os, sys\nrank = os.environ['RANK']\n"
    "for i in range(3):\n    print(f'line {i} from rank {rank}')\nprint(f'warning on rank {rank}', file=sys.stderr)",
    "%%accelerate -n 2 --port auto\nimport time\nprint('long cell started', flush=True)\ntime.sleep(120)",
]


def _switch_theme(page, name: str) -> None:
    page.locator("li.lm-MenuBar-item", has_text="Settings").click()
    page.locator(".lm-Menu-item", has_text="Theme").first.hover()
    page.get_by_role("menuitem", name=name, exact=True).click()
    page.wait_for_function(f"document.body.dataset.jpThemeName === {name!r}", timeout=20_000)


@pytest.mark.timeout(240)
def test_launch_panel_and_hardware_panel_render(jupyter_lab, browser_page, tmp_path):  # noqa: F811
    page = browser_page
    write_notebook(jupyter_lab.root, "panels.ipynb", CELLS)
    open_notebook(page, jupyter_lab, "panels.ipynb")
    run_all(page)

    hardware = wait_for_output(page, ".nacc-hardware")
    assert "CPU" in hardware.inner_text() and "gloo" in hardware.inner_text()

    wait_for_output(page, '.nacc-launch-status[data-status="done"]', timeout=90)
    panel = page.locator(".nacc-launch").first
    # The header, the rank table and the log are separate widgets, updated one after the other: the
    # header can show "done" a moment before the rest of the same redraw reaches the page.
    for rank in (0, 1):
        panel.locator(f'.nacc-status[data-rank="{rank}"][data-status="done"]').wait_for(timeout=10_000)
    all_ranks = panel.locator('pre.nacc-log[data-view="all"]')
    for rank in (0, 1):  # the last lines each rank printed
        for last in (f"line 2 from rank {rank}", f"warning on rank {rank}"):
            all_ranks.filter(has_text=last).wait_for(timeout=10_000)
    text = all_ranks.inner_text()
    for rank in (0, 1):
        for i in range(3):
            assert f"line {i} from rank {rank}" in text, text
        assert f"warning on rank {rank}" in text
    # Rank prefixes are coloured per rank (not one colour for all).
    colours = set(all_ranks.locator("span").evaluate_all("els => els.map(e => getComputedStyle(e).color)"))
    assert len(colours) >= 2, colours
    assert panel.locator(".nacc-stop").count() == 0 or panel.locator(".nacc-stop").is_disabled()

    for rank in (0, 1):  # each rank's peak RSS in its final row
        assert re.fullmatch(r"peak \d+\.\d MiB", panel.locator(f'.nacc-rss[data-rank="{rank}"]').inner_text())

    # The third cell runs for 2 minutes; its Stop button ends it while the kernel is busy.
    long_panel = page.locator(".nacc-launch").nth(1)
    long_panel.locator('pre.nacc-log[data-view="all"]', has_text="long cell started").wait_for(timeout=60_000)
    # Meanwhile the launcher samples its ranks once a second: RSS and CPU % in their rows.
    for rank in (0, 1):
        long_panel.locator(f'.nacc-rss[data-rank="{rank}"]', has_text=re.compile(r"^\d+\.\d MiB$")).wait_for(
            timeout=20_000
        )
        long_panel.locator(f'.nacc-cpu[data-rank="{rank}"]', has_text=re.compile(r"^\d+ %$")).wait_for(timeout=20_000)
    # The finished cell's output is the widget alone: the text/plain it carries for a saved notebook
    # (each rank's lines, sent when the launch ended) is not drawn beside it, nor a second panel.
    assert page.locator('[data-mime-type="text/plain"]', has_text="line 0 from rank 0").count() == 0
    assert page.locator(".nacc-launch").count() == 2
    panel.locator('.nacc-launch-status[data-status="done"]').wait_for(timeout=10_000)  # redrawn whole
    long_panel.scroll_into_view_if_needed()
    resources = screenshot(page, tmp_path / "panel-resources.png")
    long_panel.locator(".nacc-stop").click()
    long_panel.locator('.nacc-launch-status[data-status="stopped"]').wait_for(timeout=20_000)
    wait_for_output(page, "CellStoppedError", timeout=20)
    for rank in (0, 1):  # fails by timeout if a rank's row never says "stopped"
        long_panel.locator(f'.nacc-status[data-rank="{rank}"][data-status="stopped"]').wait_for(timeout=10_000)

    light = screenshot(page, tmp_path / "panels-light.png")
    _switch_theme(page, "JupyterLab Dark")
    panel.scroll_into_view_if_needed()
    background = page.evaluate("getComputedStyle(document.querySelector('.jp-Notebook')).backgroundColor")
    assert (
        re.match(r"rgb\((\d+), (\d+), (\d+)\)", background)
        and sum(int(c) for c in re.findall(r"\d+", background)[:3]) < 200
    ), background  # the page really is dark
    pre_colour = all_ranks.evaluate("e => getComputedStyle(e).color")
    assert sum(int(c) for c in re.findall(r"\d+", pre_colour)[:3]) > 400, pre_colour  # light text on dark
    dark = screenshot(page, tmp_path / "panels-dark.png")

    # The hardware panel in the dark theme: light text, on a background that is not white.
    hardware.scroll_into_view_if_needed()
    hardware_colour = hardware.evaluate("e => getComputedStyle(e).color")
    assert _rgb_sum(hardware_colour) > 400, hardware_colour
    cells_colours = hardware.locator(".nacc-table td").evaluate_all(
        "els => els.map(e => getComputedStyle(e).color)"
    )
    assert cells_colours and all(_rgb_sum(c) > 400 for c in cells_colours), cells_colours
    # What shows behind it: its own background, else the first ancestor's that is not transparent.
    behind = hardware.evaluate(
        """e => { for (let n = e; n; n = n.parentElement) {
                     const c = getComputedStyle(n).backgroundColor;
                     if (c !== 'transparent' && !/^rgba\\(.*, 0\\)$/.test(c)) return c; }
                   return 'none'; }"""
    )
    assert re.match(r"rgba?\(", behind) and _rgb_sum(behind) < 3 * 255, behind  # not white, not 'none'
    button = hardware.locator(".nacc-refresh")
    button_bg = button.evaluate("e => getComputedStyle(e).backgroundColor")
    assert re.match(r"rgba?\(", button_bg) and _rgb_sum(button_bg) < 3 * 255, button_bg
    hardware_dark = screenshot(page, tmp_path / "hardware-dark.png")
    print(f"\nscreenshots: {resources} {light} {dark} {hardware_dark}")


def _rgb_sum(colour: str) -> int:
    """r + g + b of a computed colour such as 'rgb(12, 34, 56)' or 'rgba(12, 34, 56, 0.5)'."""
    channels = re.findall(r"[\d.]+", colour)[:3]
    assert len(channels) == 3, colour
    return sum(int(float(c)) for c in channels)
