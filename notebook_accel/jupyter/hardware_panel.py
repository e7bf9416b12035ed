"""hardware_widget(): what this machine has, and what a launch here would use, as a widget."""

from __future__ import annotations

from typing import Optional

import ipywidgets as widgets

from ..launch.preview import Preview, launch_preview
from .style import badge, bar, esc, style_tag

ENVIRONMENT_NAMES = {
    "colab": "Google Colab",
    "kaggle": "Kaggle",
    "vscode": "VS Code",
    "jupyterlab": "JupyterLab",
    "notebook": "Jupyter Notebook",
    "ipython": "IPython terminal",
    "terminal": "terminal",
    "script": "script",
}
VERSION_NAMES = (
    ("Python", "python"),
    ("torch", "torch"),
    ("CUDA (torch build)", "cuda"),
    ("torch_xla", "torch_xla"),
    ("notebook_accel", "notebook_accel"),
)


def hardware_widget() -> widgets.VBox:
    """A box showing `hardware.report()` and the launch it implies; Refresh probes again."""
    from .. import hardware

    view = widgets.HTML(layout=widgets.Layout(width="100%"))
    button = widgets.Button(description="Refresh", icon="refresh", tooltip="Probe the hardware again")
    button.add_class("nacc-refresh")

    def draw(refresh: bool) -> None:
        try:
            report = hardware.report(refresh=refresh)
            view.value = style_tag() + render(report, launch_preview())
        except Exception as exc:  # show a broken probe rather than an empty box
            view.value = style_tag() + f'<div class="nacc-error">hardware probe failed: {esc(exc)}</div>'

    def on_click(_button) -> None:
        button.disabled = True
        try:
            draw(refresh=True)
        finally:
            button.disabled = False

    button.on_click(on_click)
    draw(refresh=False)
    box = widgets.VBox([view, button], layout=widgets.Layout(width="100%"))
    box.add_class("nacc-hardware")
    return box


def render(report, preview: Preview) -> str:
    """The widget's HTML for a HardwareReport and a launch_preview() result."""
    used_ram = report.ram_total - report.ram_available
    machine = [
        ("Environment", esc(ENVIRONMENT_NAMES.get(report.environment, report.environment))),
        (
            "CPU",
            esc(
                f"{report.cpu_model} · {report.physical_cores} physical / {report.logical_cores} logical cores"
            ),
        ),
        ("RAM", bar(used_ram, report.ram_total, f"{_gib(used_ram)} / {_gib(report.ram_total)} GiB used")),
        ("Device family", esc(report.device_family or "none (CPU only)")),
        ("TPU", "yes" if report.tpu else "no"),
    ]
    versions = [(name, esc(report.versions.get(key) or "-")) for name, key in VERSION_NAMES]
    if preview.error:
        launch = f'<div class="nacc-error">a launch here would fail: {esc(preview.error)}</div>'
    else:
        launch = _table([(k, esc(v)) for k, v in preview.rows])
        launch += "".join(f'<div class="nacc-muted">{esc(note)}</div>' for note in preview.notes)
    return (
        '<div class="nacc-title">This machine</div>'
        + _table(machine)
        + '<div class="nacc-section">Accelerators</div>'
        + _accelerators(report.accelerators)
        + '<div class="nacc-section">Versions</div>'
        + _table(versions)
        + '<div class="nacc-section">A launch here would use</div>'
        + launch
    )


def _gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**30:.1f}"


def _table(rows: list) -> str:
    body = "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="nacc-table">{body}</table>'


def _accelerators(devices) -> str:
    if not devices:
        return '<div class="nacc-muted">none: CPU only</div>'
    out = [
        '<table class="nacc-table"><tr><th>device</th><th>name</th><th>memory</th>'
        "<th>capability</th><th>precision</th></tr>"
    ]
    for d in devices:
        if d.total_memory and d.free_memory is not None:
            used = d.total_memory - d.free_memory
            memory = bar(used, d.total_memory, f"{_gib(used)} / {_gib(d.total_memory)} GiB used")
        elif d.total_memory:
            memory = esc(f"{_gib(d.total_memory)} GiB")
        else:
            memory = "-"
        capability = ".".join(map(str, d.compute_capability)) if d.compute_capability else "-"
        flags = "".join(badge(t, getattr(d, f"supports_{t}")) for t in ("bf16", "fp16", "fp8"))
        out.append(
            f"<tr><td>{esc(f'{d.kind}:{d.index}')}</td><td>{esc(d.name)}</td><td>{memory}</td>"
            f"<td>{esc(capability)}</td><td>{flags}</td></tr>"
        )
    out.append("</table>")
    return "".join(out)
