"""tools/gpu_check.py runs once on a GPU machine; this keeps it runnable (and honest) on CPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECKS = [
    "hardware_report_leaves_cuda_uninitialised",
    "launcher_leaves_cuda_uninitialised",
    "fork_after_cuda_init_is_refused",
    "results_arrive_on_cpu_and_gpu_ids_choose",
    "rank_device_memory_sampled_through_nvml",
    "fsdp_cpu_offload_and_bf16_hook_on_two_gpus",
    "stall_report_names_the_nccl_collective",
    "ray_rank_gets_its_own_gpu",
    "training_step_fp32",
    "training_step_bf16",
    "training_step_fp16",
    "training_step_fp8",
    "dispatch_and_offload_to_cuda0",
    "offloaded_weights_copied_to_cuda0_ahead",
]
# Runs on any machine: its subprocess reports what is here without touching CUDA.
EVERYWHERE = {"hardware_report_leaves_cuda_uninitialised"}


@pytest.mark.timeout(300)
def test_gpu_check_runs_and_reports_every_check(tmp_path):
    done = subprocess.run(
        [sys.executable, os.path.join("tools", "gpu_check.py"), "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output

    data = json.loads((tmp_path / "gpu_check.json").read_text())
    results = {r["name"]: r for r in data["checks"]}
    assert [r["name"] for r in data["checks"]] == CHECKS, output
    for name, r in results.items():
        word = {True: "PASS", False: "FAIL", None: "SKIP"}[r["ok"]]
        assert f"{word} {name}: " in done.stdout

    cuda = torch.cuda.is_available()
    assert data["header"]["cuda_available"] is cuda
    report = results["hardware_report_leaves_cuda_uninitialised"]
    assert report["ok"] is True, report
    assert report["initialized_after_report"] is False
    if cuda:
        assert not [r for r in data["checks"] if r["ok"] is False], output
    else:
        assert report["devices"] == []
        for name in set(CHECKS) - EVERYWHERE:
            assert results[name]["ok"] is None and results[name]["detail"] == "no CUDA device", results[name]
