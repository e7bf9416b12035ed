"""hardware.py: the report on this machine, environment detection, and the GPU paths' pure logic."""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import platform
import pty
import shutil
import subprocess
import sys
import types

import pytest
import torch

import notebook_accel
from notebook_accel import device_probes, hardware
from notebook_accel.hardware import AcceleratorDevice, HardwareReport
from notebook_accel.utils import imports

GiB = 1 << 30
CPU_ONLY = hardware.detect_device_family() is None
H100_UUID = "GPU-3f1c2a7e-5b6d-4c8e-9a0b-1c2d3e4f5a6b"
A100_UUID = "GPU-77aa0c12-9d3e-4f11-8b2a-0e5c6d7f8a9b"


def _run_python(code: str, **kwargs) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VSCODE_", "COLAB_", "KAGGLE_"))}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, **kwargs
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


# -- the report on this machine ---------------------------------------------------------------


@pytest.mark.skipif(not CPU_ONLY, reason="describes a machine without accelerators")
def test_report_on_this_cpu_only_machine():
    r = hardware.report(refresh=True)
    assert r.logical_cores >= 1 and 1 <= r.physical_cores <= r.logical_cores
    assert r.ram_total > 0 and 0 < r.ram_available <= r.ram_total
    assert isinstance(r.cpu_model, str) and r.cpu_model.strip()
    assert r.accelerators == () and hardware.accelerators() == []
    assert r.device_family is None and r.tpu is False
    assert r.environment in ("script", "terminal")
    assert r.versions == {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torch_xla": None if not imports.is_torch_xla_available() else r.versions["torch_xla"],
        "notebook_accel": notebook_accel.__version__,
    }


def test_report_is_cached_and_refreshable():
    first = hardware.report()
    assert hardware.report() is first
    again = hardware.report(refresh=True)
    assert again is not first and hardware.report() is again
    assert (again.cpu_model, again.logical_cores, again.ram_total) == (
        first.cpu_model,
        first.logical_cores,
        first.ram_total,
    )
    devices = hardware.accelerators()
    devices.append("not a device")
    assert "not a device" not in hardware.accelerators()


def test_report_leaves_cuda_uninitialised():
    hardware.report(refresh=True)
    hardware.accelerators(refresh=True)
    assert not torch.cuda.is_initialized()


def _child_after_report(conn):
    torch.set_num_threads(1)
    conn.send((float(torch.arange(10.0).sum()), torch.cuda.is_initialized()))
    conn.close()


def test_fork_after_report_is_safe():
    hardware.report(refresh=True)
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_after_report, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "forked child gave no answer within 60 s"
        assert parent.recv() == (45.0, False)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_report_in_a_fresh_script_process():
    # A separate interpreter: nothing this test session imported can leak into the answer.
    code = (
        "import json, sys, torch; from notebook_accel import hardware; r = hardware.report(); "
        "print(json.dumps([r.environment, 'IPython' in sys.modules, 'ipywidgets' in sys.modules, "
        "torch.cuda.is_initialized(), r.logical_cores]))"
    )
    env_name, ipython, widgets, cuda_init, cores = json.loads(_run_python(code, stdin=subprocess.DEVNULL))
    assert env_name == "script"
    assert (ipython, widgets, cuda_init) == (False, False, False)
    assert cores == hardware.report().logical_cores


def test_a_tty_on_stdin_is_a_terminal():
    main_fd, tty_fd = pty.openpty()
    try:
        code = "from notebook_accel.hardware import detect_environment; print(detect_environment())"
        assert _run_python(code, stdin=tty_fd) == "terminal"
    finally:
        os.close(main_fd)
        os.close(tty_fd)


def test_terminal_ipython_is_ipython():
    code = "from notebook_accel.hardware import detect_environment; print(detect_environment())"
    done = subprocess.run(
        [sys.executable, "-m", "IPython", "--quick", "--no-banner", "-c", code],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].endswith("ipython")


def test_a_real_kernel_defaults_to_jupyterlab():
    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VSCODE_", "COLAB_", "KAGGLE_"))}
    km, kc = start_new_kernel(kernel_name="python3", env=env, startup_timeout=60)
    try:
        outputs = []
        code = "from notebook_accel.hardware import detect_environment; print(detect_environment())"
        reply = kc.execute_interactive(
            code, timeout=60, output_hook=lambda m: outputs.append(m["content"].get("text", ""))
        )
        assert reply["content"]["status"] == "ok"
        # The kernel's parent is pytest, neither Lab nor Notebook: the documented fallback.
        assert "".join(outputs).strip() == "jupyterlab"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# -- detect_environment, variable by variable -------------------------------------------------


class ZMQInteractiveShell:
    """Stands in for ipykernel's shell class; detection looks at class names only."""


class ColabShell(ZMQInteractiveShell):
    pass


class TerminalInteractiveShell:
    pass


def _modules(shell=None, kernel=True) -> dict:
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: shell
    modules = {"IPython": ipython}
    if kernel:
        modules["ipykernel"] = types.ModuleType("ipykernel")
    return modules


KERNEL = _modules(ZMQInteractiveShell())


@pytest.mark.parametrize(
    "env, modules, expected",
    [
        ({"COLAB_RELEASE_TAG": "release-colab_20240626"}, {}, "colab"),
        ({"COLAB_GPU": "1"}, {}, "colab"),
        ({}, {"google.colab": types.ModuleType("google.colab")}, "colab"),
        ({}, {**_modules(ColabShell()), "google.colab": types.ModuleType("google.colab")}, "colab"),
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, KERNEL, "kaggle"),
        ({"KAGGLE_URL_BASE": "https://www.kaggle.com"}, {}, "kaggle"),
        ({"VSCODE_PID": "4242"}, KERNEL, "vscode"),
        ({"VSCODE_CWD": "/home/me"}, KERNEL, "vscode"),
        ({"VSCODE_IPC_HOOK_CLI": "/tmp/vscode-ipc.sock"}, KERNEL, "vscode"),
        ({}, KERNEL, "jupyterlab"),
        ({}, _modules(ColabShell()), "jupyterlab"),  # a subclass of the kernel shell is still a kernel
        ({}, _modules(TerminalInteractiveShell()), "ipython"),
        ({}, _modules(ZMQInteractiveShell(), kernel=False), "ipython"),
        ({"VSCODE_PID": "4242"}, _modules(TerminalInteractiveShell()), "ipython"),
    ],
)
def test_detect_environment(env, modules, expected):
    assert hardware.detect_environment(env, modules, isatty=False, parent_cmdline=[]) == expected


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["/usr/bin/python3", "/usr/local/bin/jupyter-lab", "--no-browser", "--notebook-dir=/nb"],
            "jupyterlab",
        ),
        (["/opt/conda/bin/python", "-m", "jupyterlab", "--port=8888"], "jupyterlab"),
        (["/opt/conda/bin/python", "/opt/conda/bin/jupyter-notebook", "--ip=0.0.0.0"], "notebook"),
        (["python", "-m", "notebook"], "notebook"),
        (["/usr/bin/python3", "/usr/local/bin/jupyter-nbclassic"], "notebook"),
        (["/usr/bin/python3", "/usr/local/bin/jupyter-server", "--notebook-dir=/nb"], None),
        (["python", "-m", "pytest", "tests/notebooks"], None),
        ([], None),
    ],
)
def test_lab_or_notebook_from_the_kernels_parent(argv, expected):
    env = {"JPY_PARENT_PID": "1"}
    assert hardware.detect_environment(env, KERNEL, isatty=False, parent_cmdline=argv) == (
        expected or "jupyterlab"
    )
    # A named server wins over VS Code variables inherited from the terminal that started it.
    env["VSCODE_IPC_HOOK_CLI"] = "/tmp/vscode-ipc.sock"
    assert hardware.detect_environment(env, KERNEL, isatty=False, parent_cmdline=argv) == (
        expected or "vscode"
    )


def test_parent_command_line_is_read_from_jpy_parent_pid():
    # A real process whose command line names jupyter-notebook stands in for the server.
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", "jupyter-notebook"], stdin=subprocess.PIPE
    )
    try:
        got = hardware.detect_environment({"JPY_PARENT_PID": str(proc.pid)}, KERNEL, isatty=False)
        assert got == "notebook"
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert hardware.detect_environment({"JPY_PARENT_PID": "not-a-pid"}, KERNEL, isatty=False) == "jupyterlab"


@pytest.mark.parametrize("isatty, expected", [(True, "terminal"), (False, "script")])
def test_no_ipython_means_terminal_or_script(isatty, expected):
    assert hardware.detect_environment({}, {}, isatty=isatty) == expected
    # IPython imported but no shell running (a library imported it) changes nothing.
    assert hardware.detect_environment({}, _modules(None, kernel=False), isatty=isatty) == expected


def test_detect_environment_does_not_import_ipython():
    code = (
        "import sys; from notebook_accel.hardware import detect_environment; detect_environment(); "
        "print('IPython' in sys.modules)"
    )
    assert _run_python(code, stdin=subprocess.DEVNULL) == "False"


# -- CUDA details without CUDA: precision mapping, nvidia-smi parsing, visible devices ---------


@pytest.mark.parametrize(
    "cc, bf16, fp16, fp8",
    [
        (None, False, False, False),
        ((3, 7), False, False, False),  # K80
        ((5, 2), False, False, False),  # Maxwell: fp16 storage only
        ((5, 3), False, True, False),  # Jetson TX1
        ((6, 0), False, True, False),  # P100
        ((7, 0), False, True, False),  # V100
        ((7, 5), False, True, False),  # T4
        ((8, 0), True, True, False),  # A100
        ((8, 6), True, True, False),  # A10 / RTX 30xx
        ((8, 9), True, True, True),  # L4 / RTX 40xx
        ((9, 0), True, True, True),  # H100 / H200
        ((10, 0), True, True, True),  # B200
        ([12, 0], True, True, True),
    ],
)
def test_cuda_precision_flags(cc, bf16, fp16, fp8):
    assert hardware.cuda_precision_flags(cc) == {
        "supports_bf16": bf16,
        "supports_fp16": fp16,
        "supports_fp8": fp8,
    }


SMI_TWO_GPUS = (
    f"0, {H100_UUID}, NVIDIA H100 80GB HBM3, 81559, 81004, 9.0\n"
    f"1, {A100_UUID}, NVIDIA A100-SXM4-40GB, 40960, [N/A], 8.0\n"
)


def test_parse_nvidia_smi_csv():
    records = hardware.parse_nvidia_smi_csv(SMI_TWO_GPUS + "\n")
    assert records == [
        {
            "index": 0,
            "uuid": H100_UUID,
            "name": "NVIDIA H100 80GB HBM3",
            "total_memory": 81559 << 20,
            "free_memory": 81004 << 20,
            "compute_capability": (9, 0),
        },
        {
            "index": 1,
            "uuid": A100_UUID,
            "name": "NVIDIA A100-SXM4-40GB",
            "total_memory": 40960 << 20,
            "free_memory": None,
            "compute_capability": (8, 0),
        },
    ]


def test_parse_nvidia_smi_csv_from_an_old_driver_without_compute_cap():
    fields = device_probes.NVIDIA_SMI_FIELDS[:-1]
    (record,) = hardware.parse_nvidia_smi_csv(
        f"0, {H100_UUID}, Tesla V100-SXM2-16GB, 16160, [Not Supported]\n", fields
    )
    assert record["compute_capability"] is None and record["free_memory"] is None
    assert record["total_memory"] == 16160 << 20 and record["name"] == "Tesla V100-SXM2-16GB"
    (device,) = hardware._cuda_devices([record])
    assert (device.supports_bf16, device.supports_fp16, device.supports_fp8) == (False, False, False)


@pytest.mark.parametrize(
    "spec, physical",
    [
        (None, [0, 1]),
        ("0,1", [0, 1]),
        ("1,0", [1, 0]),
        ("1", [1]),
        (" 1 ", [1]),
        ("", []),
        ("-1", []),
        ("0,7,1", [0]),  # like CUDA: enumeration stops at the first invalid entry
        ("0,0", [0]),
        ("GPU-77aa0c12", [1]),
        (f"{A100_UUID},{H100_UUID}", [1, 0]),
        ("GPU-ffff", []),
        ("MIG-5e2d0c1a-aaaa-bbbb-cccc-123456789abc", [0, 1]),
    ],
)
def test_visible_cuda_records(spec, physical):
    records = hardware.parse_nvidia_smi_csv(SMI_TWO_GPUS)
    assert [r["index"] for r in hardware.visible_cuda_records(records, spec)] == physical


def test_cuda_devices_are_numbered_as_the_process_sees_them():
    records = hardware.visible_cuda_records(hardware.parse_nvidia_smi_csv(SMI_TWO_GPUS), "1,0")
    a100, h100 = hardware._cuda_devices(records)
    assert (a100.index, a100.name, a100.compute_capability) == (0, "NVIDIA A100-SXM4-40GB", (8, 0))
    assert (a100.supports_bf16, a100.supports_fp8, a100.free_memory) == (True, False, None)
    assert (h100.index, h100.kind, h100.total_memory, h100.free_memory) == (
        1,
        "cuda",
        81559 << 20,
        81004 << 20,
    )
    assert (h100.supports_bf16, h100.supports_fp16, h100.supports_fp8) == (True, True, True)


# A stand-in for libnvidia-ml with the eight entry points we call, so the ctypes code (argument
# types, the memory struct, init/shutdown pairing) runs for real on a machine without a GPU.
FAKE_NVML_C = r"""
#include <stdlib.h>
#include <string.h>
typedef struct { unsigned long long total, free, used; } mem_t;
static int open_inits = 0;
int fake_open_inits(void) { return open_inits; }
int nvmlInit_v2(void) { if (getenv("FAKE_NVML_FAIL")) return 9; open_inits++; return 0; }
int nvmlShutdown(void) { open_inits--; return 0; }
int nvmlDeviceGetCount_v2(unsigned int *n) { *n = 2; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **h) {
    if (i > 1) return 2;
    *h = (void *)(size_t)(0x100 + i);
    return 0;
}
static int idx(void *h) { return (int)((size_t)h - 0x100); }
int nvmlDeviceGetName(void *h, char *buf, unsigned int len) {
    strncpy(buf, idx(h) ? "NVIDIA A100-SXM4-40GB" : "NVIDIA H100 80GB HBM3", len);
    return 0;
}
int nvmlDeviceGetUUID(void *h, char *buf, unsigned int len) {
    strncpy(buf, idx(h) ? "GPU-77aa0c12-9d3e-4f11-8b2a-0e5c6d7f8a9b" : "GPU-3f1c2a7e-5b6d-4c8e-9a0b-1c2d3e4f5a6b", len);
    return 0;
}
int nvmlDeviceGetMemoryInfo(void *h, mem_t *m) {
    if (idx(h)) return 3; /* NVML_ERROR_NOT_SUPPORTED */
    m->total = 85520809984ULL; m->free = 84939472896ULL; m->used = m->total - m->free;
    return 0;
}
int nvmlDeviceGetCudaComputeCapability(void *h, int *major, int *minor) {
    *major = idx(h) ? 8 : 9; *minor = 0;
    return 0;
}
"""


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler to build the NVML stand-in")
    folder = tmp_path_factory.mktemp("nvml")
    (folder / "nvml.c").write_text(FAKE_NVML_C)
    lib = folder / "libfakenvml.so"
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(lib), str(folder / "nvml.c")], check=True, timeout=120)
    return str(lib)


def test_nvml_records_through_ctypes(fake_nvml, monkeypatch):
    records = hardware._nvml_records(fake_nvml)
    assert records == [
        {
            "index": 0,
            "uuid": H100_UUID,
            "name": "NVIDIA H100 80GB HBM3",
            "total_memory": 85520809984,
            "free_memory": 84939472896,
            "compute_capability": (9, 0),
        },
        {
            "index": 1,
            "uuid": A100_UUID,
            "name": "NVIDIA A100-SXM4-40GB",
            "total_memory": None,
            "free_memory": None,
            "compute_capability": (8, 0),
        },
    ]
    assert ctypes.CDLL(fake_nvml).fake_open_inits() == 0  # every init was shut down
    (a100,) = hardware._cuda_devices(hardware.visible_cuda_records(records, "GPU-77aa"))
    assert (a100.index, a100.supports_bf16, a100.supports_fp8) == (0, True, False)
    monkeypatch.setenv("FAKE_NVML_FAIL", "1")
    assert hardware._nvml_records(fake_nvml) is None
    assert hardware._nvml_records("/nonexistent/libnvidia-ml.so.1") is None


def test_probe_in_child_reads_a_torch_device_module():
    # torch.cpu has device_count() but no properties: the child reports what it can.
    assert hardware.probe_in_child("cpu") == [{"index": 0, "name": "cpu"}]
    assert hardware.probe_in_child("no_such_family") is None


def test_devices_from_child_records():
    xpu = hardware._devices_from_child(
        "xpu",
        [{"index": 0, "name": "Intel(R) Data Center GPU Max 1550", "total_memory": 64 * GiB, "bf16": True}],
    )
    assert xpu == [
        AcceleratorDevice(
            "xpu", 0, "Intel(R) Data Center GPU Max 1550", 64 * GiB, None, None, True, True, False
        )
    ]
    (rocm,) = hardware._devices_from_child(
        "cuda", [{"index": 0, "name": "AMD Instinct MI300X", "compute_capability": [9, 4]}]
    )
    assert rocm.compute_capability == (9, 4) and rocm.supports_bf16 and rocm.supports_fp8
    (npu,) = hardware._devices_from_child("npu", [{"index": 0, "name": "Ascend910A"}])
    assert (npu.supports_bf16, npu.supports_fp16, npu.compute_capability) == (False, True, None)


@pytest.mark.parametrize(
    "env",
    [
        {"TPU_NAME": "my-tpu"},
        {"PJRT_DEVICE": "TPU"},
        {"PJRT_DEVICE": "tpu"},
        {"COLAB_TPU_ADDR": "10.0.0.2:8470"},
        {"TPU_ACCELERATOR_TYPE": "v4-8"},
    ],
)
def test_tpu_presence_needs_a_signal_and_torch_xla(env):
    assert hardware.tpu_present(env) is imports.is_torch_xla_available()
    assert hardware.tpu_present({"PJRT_DEVICE": "CPU"}) is False
    assert hardware.tpu_present({}) is False


# -- what people read: summary, table, dict ---------------------------------------------------


def _report(devices=(), **overrides) -> HardwareReport:
    fields = dict(
        cpu_model="Intel(R) Xeon(R) Platinum 8480C",
        physical_cores=112,
        logical_cores=224,
        ram_total=2015 * GiB,
        ram_available=1900 * GiB,
        accelerators=tuple(devices),
        device_family="cuda" if devices else None,
        tpu=False,
        environment="jupyterlab",
        versions={
            "python": "3.11.7",
            "torch": "2.13.0",
            "cuda": "12.8",
            "torch_xla": None,
            "notebook_accel": "0.1.0",
        },
    )
    fields.update(overrides)
    return HardwareReport(**fields)


def _h100(i):
    return AcceleratorDevice(
        "cuda", i, "NVIDIA H100 80GB HBM3", 81559 << 20, 81004 << 20, (9, 0), True, True, True
    )


def _t4(i):
    return AcceleratorDevice("cuda", i, "Tesla T4", 15360 << 20, 15000 << 20, (7, 5), False, True, False)


def test_summary_and_table_on_this_machine_name_the_cores():
    r = hardware.report()
    assert f"({r.logical_cores} cores)" in r.summary() or r.accelerators
    text = str(r)
    assert f"{r.physical_cores} physical, {r.logical_cores} logical" in text
    assert r.cpu_model in text and r.environment in text
    assert "\n" not in r.summary() and len(text.splitlines()) > 5


def test_summary_lines():
    assert _report(ram_total=int(23.4 * GiB)).summary() == "CPU (224 cores) · 23.4 GiB RAM"
    assert _report([_h100(i) for i in range(8)]).summary() == "8 x NVIDIA H100 80GB HBM3 · bf16 fp8"
    assert _report([_t4(0), _t4(1)]).summary() == "2 x Tesla T4 · fp16"
    assert _report([_h100(0), _t4(1)]).summary() == "1 x NVIDIA H100 80GB HBM3 + 1 x Tesla T4 · fp16"
    k80 = AcceleratorDevice("cuda", 0, "Tesla K80", 12 * GiB, None, (3, 7))
    assert _report([k80]).summary() == "1 x Tesla K80"


def test_table_lists_each_device():
    text = str(_report([_h100(0), _t4(1)]))
    lines = text.splitlines()
    assert "Accelerators:" in lines
    h100_row = next(line for line in lines if "H100" in line).split()
    assert h100_row[:2] == ["0", "cuda"] and h100_row[-4:] == ["9.0", "yes", "yes", "yes"]
    t4_row = next(line for line in lines if "Tesla T4" in line).split()
    assert t4_row[:2] == ["1", "cuda"] and t4_row[-4:] == ["7.5", "no", "yes", "no"]
    assert "79.1 / 79.6 GiB" in text and "112 physical, 224 logical" in text
    assert "Accelerators: none" in str(_report())


def test_to_dict_is_json_serialisable():
    for r in (hardware.report(), _report([_h100(0), _t4(1)])):
        d = r.to_dict()
        assert json.loads(json.dumps(d)) == d
        assert set(d) == {f.name for f in HardwareReport.__dataclass_fields__.values()}
    d = _report([_h100(0)]).to_dict()
    assert d["accelerators"][0]["compute_capability"] == [9, 0]
    assert d["accelerators"][0]["total_memory"] == 81559 << 20
    assert d["versions"]["cuda"] == "12.8"
