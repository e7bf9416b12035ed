"""Colab and Kaggle set-ups (a TPU host, two GPUs) reach the launcher's defaults and the hardware
panel. The devices are described to the probes (there are none here); everything above the probes
is the real code."""

from __future__ import annotations

import pytest

from notebook_accel import hardware
from notebook_accel.jupyter.hardware_panel import launch_preview
from notebook_accel.launch.plan import make_plan
from notebook_accel.utils import imports, packages

PLATFORM_VARS = ("COLAB_RELEASE_TAG", "COLAB_GPU", "COLAB_TPU_ADDR", "KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE",
                 "TPU_NAME", "TPU_ACCELERATOR_TYPE", "PJRT_DEVICE")  # fmt: skip


@pytest.fixture(autouse=True)
def clean_platform(monkeypatch):
    for name in PLATFORM_VARS:
        monkeypatch.delenv(name, raising=False)


def _rows() -> dict:
    preview = launch_preview()
    assert preview.error is None, preview.error
    return dict(preview.rows)


def test_kaggle_with_two_gpus_launches_two_ranks_on_nccl(monkeypatch):
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.setattr(hardware, "detect_device_family", lambda: "cuda")
    monkeypatch.setattr(hardware, "device_count", lambda family: 2 if family == "cuda" else 0)
    assert hardware.detect_environment() == "kaggle"
    plan = make_plan(use_port="auto")
    assert (plan.num_processes, plan.engine, plan.start_method) == (2, "local", "fork")
    rows = _rows()
    assert rows["Distributed type"] == "MULTI_GPU" and rows["Backend"] == "nccl" and rows["Processes"] == "2"


def test_colab_tpu_goes_through_xla(monkeypatch):
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20261101")
    monkeypatch.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
    real_has = packages.has_module
    fake_has = lambda name: name == "torch_xla" or real_has(name)  # noqa: E731
    monkeypatch.setattr(packages, "has_module", fake_has)
    monkeypatch.setattr(imports, "_has", fake_has)
    assert hardware.detect_environment() == "colab"
    assert hardware.detect_device_family() == "xla" and hardware.tpu_present()
    plan = make_plan(use_port="auto")
    assert plan.engine == "xla"
    rows = _rows()
    assert rows["Distributed type"] == "XLA" and "xla" in rows["Start method"]


def test_colab_gpu_runtime_is_colab_with_one_gpu(monkeypatch):
    monkeypatch.setenv("COLAB_GPU", "1")
    monkeypatch.setattr(hardware, "detect_device_family", lambda: "cuda")
    monkeypatch.setattr(hardware, "device_count", lambda family: 1 if family == "cuda" else 0)
    assert hardware.detect_environment() == "colab"
    plan = make_plan(use_port="auto")
    assert plan.num_processes == 1  # runs in the kernel, as accelerate does
    assert _rows()["Distributed type"] == "NO"
