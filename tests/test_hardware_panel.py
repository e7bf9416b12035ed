"""hardware_widget(): what it shows for the real machine and for a faked report."""

from __future__ import annotations

import dataclasses
import html
import platform

import pytest

from notebook_accel import __version__, hardware
from notebook_accel.hardware import AcceleratorDevice, HardwareReport
from notebook_accel.jupyter.hardware_panel import ENVIRONMENT_NAMES, hardware_widget

GiB = 2**30


def parts(box):
    view, button = box.children
    return view, button


def fake_report(**changes) -> HardwareReport:
    base = HardwareReport(
        cpu_model="Fake CPU 9000",
        physical_cores=4,
        logical_cores=8,
        ram_total=64 * GiB,
        ram_available=48 * GiB,
        accelerators=(),
        device_family=None,
        tpu=False,
        environment="colab",
        versions={
            "python": "3.11.0",
            "torch": "2.5.0",
            "cuda": "12.4",
            "torch_xla": None,
            "notebook_accel": "0.1.0",
        },
    )
    return dataclasses.replace(base, **changes)


def test_widget_shows_this_machine_and_a_launch_preview():
    import torch

    report = hardware.report()
    box = hardware_widget()
    view, button = parts(box)
    assert "nacc-hardware" in box._dom_classes
    assert "nacc-refresh" in button._dom_classes
    page = view.value
    assert html.escape(report.cpu_model) in page
    assert f"{report.physical_cores} physical / {report.logical_cores} logical cores" in page
    used = (report.ram_total - report.ram_available) / GiB
    assert '<th>RAM</th><td><span class="nacc-bar"' in page
    assert f"{used:.1f} / {report.ram_total / GiB:.1f} GiB used" in page
    assert f"<th>Environment</th><td>{ENVIRONMENT_NAMES[report.environment]}</td>" in page
    assert f"<th>Python</th><td>{platform.python_version()}</td>" in page
    assert f"<th>torch</th><td>{torch.__version__}</td>" in page
    assert f"<th>notebook_accel</th><td>{__version__}</td>" in page
    assert "<th>TPU</th><td>no</td>" in page
    assert "none: CPU only" in page  # this test machine has no accelerator
    assert "A launch here would use" in page
    assert "<td>MULTI_CPU on gloo, N CPU processes</td>" in page
    assert "<th>Start method</th><td>fork (local engine)</td>" in page
    assert not torch.cuda.is_initialized()


def test_refresh_probes_again_and_redraws(monkeypatch):
    calls = []

    def report(refresh=False):
        calls.append(refresh)
        return fake_report(cpu_model=f"CPU probe {len(calls)}")

    monkeypatch.setattr(hardware, "report", report)
    view, button = parts(hardware_widget())
    assert calls == [False]
    assert "CPU probe 1" in view.value
    button.click()
    assert calls == [False, True]
    assert "CPU probe 2" in view.value and "CPU probe 1" not in view.value
    assert not button.disabled


def test_accelerators_are_listed_with_memory_bars(monkeypatch):
    devices = (
        AcceleratorDevice("cuda", 0, "NVIDIA H100 80GB HBM3", 80 * GiB, 60 * GiB, (9, 0), True, True, True),
        AcceleratorDevice("cuda", 1, "Tesla T4", 16 * GiB, 1 * GiB, (7, 5), False, True, False),
    )
    monkeypatch.setattr(
        hardware, "report", lambda refresh=False: fake_report(accelerators=devices, device_family="cuda")
    )
    page = parts(hardware_widget())[0].value
    assert "<td>cuda:0</td><td>NVIDIA H100 80GB HBM3</td>" in page
    assert "<td>cuda:1</td><td>Tesla T4</td>" in page
    assert page.count('<span class="nacc-bar"') == 3  # RAM and two devices
    assert 'style="width:25.0%"></span></span>20.0 / 80.0 GiB used' in page
    assert 'nacc-high" style="width:93.8%"></span></span>15.0 / 16.0 GiB used' in page
    assert "<td>9.0</td>" in page and "<td>7.5</td>" in page
    assert page.count('nacc-badge-on" title="bf16 supported"') == 1
    assert page.count('nacc-badge-off" title="fp8 not supported"') == 1
    assert page.count('nacc-badge-on" title="fp16 supported"') == 2
    assert "<th>Environment</th><td>Google Colab</td>" in page
    assert "<th>CUDA (torch build)</th><td>12.4</td>" in page
    assert "<th>torch_xla</th><td>-</td>" in page
    assert "none: CPU only" not in page


def test_a_plan_that_fails_shows_why(monkeypatch):
    from notebook_accel.launch import preview as plan  # where launch_preview reads it
    from notebook_accel.launch.errors import LaunchConfigError

    def refuse(**kwargs):
        raise LaunchConfigError("CUDA is already initialised in this process <here>")

    monkeypatch.setattr(plan, "make_plan", refuse)
    page = parts(hardware_widget())[0].value
    assert "a launch here would fail: CUDA is already initialised in this process &lt;here&gt;</div>" in page
    assert "Distributed type" not in page


def test_a_broken_probe_is_shown(monkeypatch):
    def broken(refresh=False):
        raise OSError("driver gone")

    monkeypatch.setattr(hardware, "report", broken)
    page = parts(hardware_widget())[0].value
    assert "hardware probe failed: driver gone" in page


@pytest.mark.parametrize(
    "name,shown", [("kaggle", "Kaggle"), ("vscode", "VS Code"), ("jupyterlab", "JupyterLab")]
)
def test_environment_names(monkeypatch, name, shown):
    monkeypatch.setattr(hardware, "report", lambda refresh=False: fake_report(environment=name))
    assert f"<th>Environment</th><td>{shown}</td>" in parts(hardware_widget())[0].value


def test_plan_notes_are_shown_below_the_preview(monkeypatch):
    from notebook_accel.launch import preview as plan  # where launch_preview reads it

    real = plan.make_plan

    def with_note(**kwargs):
        return dataclasses.replace(real(**kwargs), notes=("a note <for you>",))

    monkeypatch.setattr(plan, "make_plan", with_note)
    page = parts(hardware_widget())[0].value
    assert page.endswith('</table><div class="nacc-muted">a note &lt;for you&gt;</div>')


def _config(monkeypatch, tmp_path, text: str):
    from notebook_accel import config

    path = tmp_path / "default_config.yaml"
    path.write_text(text)
    monkeypatch.setenv(config.CONFIG_ENV, str(path))
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)


def test_a_config_with_fsdp_shows_fsdp_and_its_settings(monkeypatch, tmp_path):
    _config(monkeypatch, tmp_path, "distributed_type: FSDP\nuse_cpu: true\nnum_processes: 2\nfsdp_config:\n"
            "  fsdp_version: 2\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 500\n")  # fmt: skip
    page = parts(hardware_widget())[0].value
    assert "<th>Distributed type</th><td>FSDP</td>" in page
    assert (
        "<th>FSDP</th><td>on (auto_wrap_policy=size_based_wrap, min_num_params=500, version=2)</td>" in page
    )
    assert "shards nothing" not in page


def test_fsdp_on_one_process_says_it_shards_nothing(monkeypatch, tmp_path):
    _config(monkeypatch, tmp_path, "distributed_type: FSDP\nuse_cpu: true\nnum_processes: 1\n")
    page = parts(hardware_widget())[0].value
    assert "<th>Distributed type</th><td>NO</td>" in page
    assert "on one process FSDP shards nothing: launch 2 or more to shard" in page
    assert "<th>With num_processes=N</th><td>FSDP on gloo, N CPU processes</td>" in page


def test_no_fsdp_row_without_fsdp(monkeypatch, tmp_path):
    _config(monkeypatch, tmp_path, "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\n")
    page = parts(hardware_widget())[0].value
    assert "<th>Distributed type</th><td>MULTI_CPU</td>" in page and "<th>FSDP</th>" not in page
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # the ranks inherit this process's switch
    page = parts(hardware_widget())[0].value
    assert "<th>Distributed type</th><td>FSDP</td>" in page and "<th>FSDP</th><td>on (the plugin&#x27;s defaults: FSDP2" in page


def test_one_process_without_fsdp_says_more_processes_give_multi_cpu(monkeypatch, tmp_path):
    _config(monkeypatch, tmp_path, "distributed_type: NO\nuse_cpu: true\nnum_processes: 1\n")
    page = parts(hardware_widget())[0].value
    assert "<th>With num_processes=N</th><td>MULTI_CPU on gloo, N CPU processes</td>" in page
