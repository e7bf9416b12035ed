"""What this machine has: the single source of "what is here" (see shared/DESIGN.md).

Nothing here initialises CUDA in the calling process, so a fork after asking stays safe: CUDA
details come from NVML (through ctypes) or `nvidia-smi`, other families' details from a short-lived
child process. Importing this module imports neither IPython nor ipywidgets.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .utils import imports

# Probe order: the first family present wins. mps has no multi-process backend.
_PROBES = (
    ("xla", lambda: imports.is_torch_xla_available(check_is_tpu=True)),
    ("cuda", imports.is_cuda_available),
    ("xpu", imports.is_xpu_available),
    ("npu", imports.is_npu_available),
    ("mlu", imports.is_mlu_available),
    ("sdaa", imports.is_sdaa_available),
    ("musa", imports.is_musa_available),
    ("hpu", imports.is_hpu_available),
    ("neuron", imports.is_neuron_available),
    ("mps", imports.is_mps_available),
)


def detect_device_family() -> Optional[str]:
    """The accelerator family present here, or None for CPU only. Never initialises CUDA."""
    for family, probe in _PROBES:
        try:
            if probe():
                return family
        except Exception:
            continue
    return None


def device_count(family: Optional[str]) -> int:
    if family is None:
        return 0
    if family == "cuda":
        import torch

        return int(torch.cuda.device_count())  # NVML-based, see utils.imports
    if family in ("xla", "neuron"):
        return 1
    import torch

    mod = getattr(torch, family, None)
    try:
        return int(mod.device_count()) if mod is not None else 0
    except Exception:
        return 0


# -- accelerator devices ----------------------------------------------------------------------

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class AcceleratorDevice:
    kind: str  # "cuda", "xpu", "npu", "mps", "tpu", ...
    index: int  # as this process addresses it (after CUDA_VISIBLE_DEVICES)
    name: str
    total_memory: Optional[int] = None  # bytes
    free_memory: Optional[int] = None  # bytes
    compute_capability: Optional[tuple] = None  # (major, minor), CUDA only
    supports_bf16: bool = False
    supports_fp16: bool = False
    supports_fp8: bool = False


def cuda_precision_flags(capability: Optional[Sequence[int]]) -> dict:
    """Which reduced precisions a CUDA device of this compute capability runs natively.

    fp16 arithmetic needs sm_53, bf16 tensor cores Ampere (8.0), fp8 tensor cores Ada/Hopper (8.9).
    An unknown capability claims nothing rather than guess.
    """
    if not capability:
        return {"supports_bf16": False, "supports_fp16": False, "supports_fp8": False}
    cc = (int(capability[0]), int(capability[1]))
    return {"supports_bf16": cc >= (8, 0), "supports_fp16": cc >= (5, 3), "supports_fp8": cc >= (8, 9)}


def _record(index, uuid, name, total, free, capability) -> dict:
    return {"index": index, "uuid": uuid, "name": name, "total_memory": total, "free_memory": free,
            "compute_capability": capability}  # fmt: skip


def _nvml_records(library: Optional[str] = None) -> Optional[list]:
    """Physical GPUs as NVML sees them, or None where NVML cannot be loaded or initialised."""
    import ctypes

    names = ("nvml.dll",) if sys.platform == "win32" else ("libnvidia-ml.so.1", "libnvidia-ml.so")
    names = (library,) if library else names
    lib = None
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None or lib.nvmlInit_v2() != 0:
        return None

    class Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    records = []
    try:
        count = ctypes.c_uint()
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        for i in range(count.value):
            handle = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                continue
            buf = ctypes.create_string_buffer(96)
            name = (
                buf.value.decode(errors="replace") if lib.nvmlDeviceGetName(handle, buf, 96) == 0 else "GPU"
            )
            uuid_buf = ctypes.create_string_buffer(96)
            uuid = uuid_buf.value.decode() if lib.nvmlDeviceGetUUID(handle, uuid_buf, 96) == 0 else None
            mem = Memory()
            ok_mem = lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) == 0
            major, minor = ctypes.c_int(), ctypes.c_int()
            ok_cc = (
                lib.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0
            )
            total, free = (int(mem.total), int(mem.free)) if ok_mem else (None, None)
            records.append(_record(i, uuid, name, total, free, (major.value, minor.value) if ok_cc else None))
    finally:
        lib.nvmlShutdown()
    return records


NVIDIA_SMI_FIELDS = ("index", "uuid", "name", "memory.total", "memory.free", "compute_cap")


def parse_nvidia_smi_csv(text: str, fields: Sequence[str] = NVIDIA_SMI_FIELDS) -> list:
    """Parse `nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits` into NVML-like records.

    Memory comes in MiB; "[N/A]" / "[Not Supported]" become None.
    """
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        # GPU names contain no commas, so a plain split is exact.
        raw = dict(zip(fields, (v.strip() for v in line.split(","))))
        value = {k: (None if v.startswith("[") or v == "" else v) for k, v in raw.items()}
        cc = value.get("compute_cap")
        if cc is not None:
            major, _, minor = cc.partition(".")
            cc = (int(major), int(minor or 0))
        index = int(value["index"]) if value.get("index") is not None else len(records)
        total, free = _mib_to_bytes(value.get("memory.total")), _mib_to_bytes(value.get("memory.free"))
        records.append(_record(index, value.get("uuid"), value.get("name") or "GPU", total, free, cc))
    return records


def _mib_to_bytes(value: Optional[str]) -> Optional[int]:
    return int(float(value) * MiB) if value is not None else None


def _nvidia_smi_records() -> Optional[list]:
    for fields in (NVIDIA_SMI_FIELDS, NVIDIA_SMI_FIELDS[:-1]):  # drivers before 510 lack compute_cap
        try:
            done = subprocess.run(
                ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None
        if done.returncode == 0:
            try:
                return parse_nvidia_smi_csv(done.stdout, fields)
            except ValueError:
                return None
    return None


def visible_cuda_records(records: list, spec: Optional[str]) -> list:
    """The records this process sees, in its own order, given CUDA_VISIBLE_DEVICES (`spec`).

    Like CUDA, the list stops at the first entry that names no device. MIG instances cannot be
    mapped from here, so a MIG entry shows every physical GPU rather than none.
    """
    if spec is None:
        return list(records)
    chosen = []
    for entry in (e.strip() for e in spec.split(",")):
        if entry.startswith("MIG-"):
            return list(records)
        if entry.lstrip("-").isdigit():
            match = [r for r in records if r["index"] == int(entry)]
        elif entry.startswith("GPU-"):
            match = [r for r in records if r.get("uuid") and r["uuid"].startswith(entry)]
        else:
            match = []
        if len(match) != 1 or match[0] in chosen:
            break
        chosen.append(match[0])
    return chosen


def _cuda_devices(records: list) -> list:
    return [
        AcceleratorDevice(
            kind="cuda",
            index=i,
            name=r["name"],
            total_memory=r["total_memory"],
            free_memory=r["free_memory"],
            compute_capability=r["compute_capability"],
            **cuda_precision_flags(r["compute_capability"]),
        )
        for i, r in enumerate(records)
    ]


# Run in a child so that whatever the runtime initialises stays out of the caller.
_PROBE_SCRIPT = r"""
import importlib, json, sys
family, plugin = sys.argv[1], sys.argv[2]
import torch
if plugin:
    importlib.import_module(plugin)
mod = getattr(torch, family)
out = []
for i in range(mod.device_count()):
    d = {"index": i, "name": family}
    try:
        p = mod.get_device_properties(i)
        d["name"] = str(getattr(p, "name", family))
        d["total_memory"] = getattr(p, "total_memory", None)
        if hasattr(p, "major"):
            d["compute_capability"] = [int(p.major), int(p.minor)]
    except Exception:
        pass
    try:
        d["free_memory"] = int(mod.mem_get_info(i)[0])
    except Exception:
        pass
    try:
        d["bf16"] = bool(mod.is_bf16_supported())
    except Exception:
        pass
    out.append(d)
print(json.dumps(out))
"""

_PLUGINS = {"npu": "torch_npu", "mlu": "torch_mlu", "sdaa": "torch_sdaa", "musa": "torch_musa",
            "hpu": "habana_frameworks.torch"}  # fmt: skip


def probe_in_child(family: str, timeout: float = 120.0) -> Optional[list]:
    """Device records for `family` read by a fresh Python process; None if that fails."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE_SCRIPT, family, _PLUGINS.get(family, "")],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if done.returncode != 0:
            return None
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _devices_from_child(family: str, records: list) -> list:
    devices = []
    for r in records:
        cc = tuple(r["compute_capability"]) if r.get("compute_capability") else None
        if family == "cuda":
            flags = cuda_precision_flags(cc)  # ROCm reports gfx versions here; close enough
        else:
            flags = {
                "supports_bf16": bool(r.get("bf16", False)),
                "supports_fp16": True,
                "supports_fp8": False,
            }
        devices.append(
            AcceleratorDevice(
                kind=family,
                index=int(r["index"]),
                name=r.get("name") or family,
                total_memory=r.get("total_memory"),
                free_memory=r.get("free_memory"),
                compute_capability=cc if family == "cuda" else None,
                **flags,
            )
        )
    return devices


def tpu_present(env: Mapping[str, str] = os.environ) -> bool:
    """A TPU host: torch_xla installed and the runtime's variables say TPU."""
    signals = env.get("TPU_NAME") or env.get("COLAB_TPU_ADDR") or env.get("TPU_ACCELERATOR_TYPE")
    return bool(imports.is_torch_xla_available() and (signals or env.get("PJRT_DEVICE", "").upper() == "TPU"))


def _probe_accelerators() -> list:
    family = detect_device_family()
    if family is None:
        return []
    if family == "cuda":
        try:
            records = _nvml_records()
        except (OSError, AttributeError):  # a driver library without the _v2 entry points
            records = None
        if records is None:
            records = _nvidia_smi_records()
        if records is not None:
            return _cuda_devices(visible_cuda_records(records, os.environ.get("CUDA_VISIBLE_DEVICES")))
        # No NVML (ROCm, say): ask a child process.
    if family == "xla":
        # One entry for the TPU host; counting chips would need torch_xla's runtime here.
        kind = os.environ.get("TPU_ACCELERATOR_TYPE", "")
        return [AcceleratorDevice("tpu", 0, f"TPU {kind}".strip(), supports_bf16=True, supports_fp16=False)]
    if family == "mps":
        mac = platform.mac_ver()[0]
        bf16 = bool(mac) and int(mac.split(".")[0]) >= 14  # MPS runs bf16 from macOS 14
        return [
            AcceleratorDevice("mps", 0, f"Apple GPU ({_cpu_model()})", supports_bf16=bf16, supports_fp16=True)
        ]
    records = probe_in_child(family)
    if records is not None:
        return _devices_from_child(family, records)
    return [AcceleratorDevice(family, i, family, supports_fp16=True) for i in range(device_count(family))]


_lock = threading.Lock()
_accelerators: Optional[tuple] = None
_report: Optional["HardwareReport"] = None


def accelerators(refresh: bool = False) -> list:
    """Every accelerator device this process can use (empty on a CPU-only machine). Cached."""
    global _accelerators
    with _lock:
        if _accelerators is None or refresh:
            try:
                _accelerators = tuple(_probe_accelerators())
            except Exception:  # a broken driver must not break callers such as is_bf16_available
                _accelerators = ()
        return list(_accelerators)


# -- where this process runs ------------------------------------------------------------------

ENVIRONMENTS = ("colab", "kaggle", "vscode", "jupyterlab", "notebook", "ipython", "terminal", "script")
_VSCODE_VARS = ("VSCODE_PID", "VSCODE_CWD", "VSCODE_IPC_HOOK_CLI")


def _ipython_shell(modules: Mapping[str, object]):
    # Only an IPython that is already imported: importing it here would cost and mislead.
    ipython = modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    if get is None:
        return None
    try:
        return get()
    except Exception:
        return None


def _parent_cmdline(pid: Optional[str]) -> list:
    try:
        import psutil

        return psutil.Process(int(pid)).cmdline()
    except Exception:
        return []


def _frontend_from_cmdline(argv: Sequence[str]) -> Optional[str]:
    """The front end ("jupyterlab" or "notebook") whose server runs as `argv`, else None."""
    for i, arg in enumerate(argv):
        base = os.path.basename(arg).lower()
        module = argv[i + 1].lower() if arg == "-m" and i + 1 < len(argv) else ""
        if base.startswith("jupyter-lab") or module == "jupyterlab":
            return "jupyterlab"
        if base.startswith(("jupyter-notebook", "jupyter-nbclassic")) or module in ("notebook", "nbclassic"):
            return "notebook"
    return None


def _stdin_is_tty() -> bool:
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    try:
        return bool(sys.stdin and sys.stdin.isatty())
    except Exception:
        return False


def detect_environment(
    env: Mapping[str, str] = os.environ,
    modules: Mapping[str, object] = sys.modules,
    *,
    isatty: Optional[bool] = None,
    parent_cmdline: Optional[Sequence[str]] = None,
) -> str:
    """Where this process runs: one of ENVIRONMENTS.

    `isatty` and `parent_cmdline` (the command line of the process that started the kernel,
    JPY_PARENT_PID's) default to what this process sees; tests pass them.
    """
    if "google.colab" in modules or "COLAB_RELEASE_TAG" in env or "COLAB_GPU" in env:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env:
        return "kaggle"
    shell = _ipython_shell(modules)
    if shell is not None:
        mro = {cls.__name__ for cls in type(shell).__mro__}
        if "ipykernel" in modules and "ZMQInteractiveShell" in mro:
            if parent_cmdline is None:
                parent_cmdline = _parent_cmdline(env.get("JPY_PARENT_PID"))
            # A server named on the command line beats VS Code variables inherited from a terminal.
            frontend = _frontend_from_cmdline(parent_cmdline)
            if frontend:
                return frontend
            if any(k in env for k in _VSCODE_VARS):
                return "vscode"
            return "jupyterlab"  # also nbclient, papermill and unknown front ends
        return "ipython"
    if isatty is None:
        isatty = _stdin_is_tty()
    return "terminal" if isatty else "script"


# -- CPU, memory, versions --------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            )
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _cores_and_ram() -> tuple:
    try:
        import psutil

        logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
        physical = psutil.cpu_count(logical=False) or logical
        mem = psutil.virtual_memory()
        return physical, logical, int(mem.total), int(mem.available)
    except ImportError:  # psutil is a dependency; this keeps a broken install reporting something
        logical = os.cpu_count() or 1
        page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
        return logical, logical, page * pages, page * os.sysconf("SC_AVPHYS_PAGES")


def _versions() -> dict:
    from importlib import metadata

    from . import __version__

    versions = {"python": platform.python_version(), "torch": None, "cuda": None, "torch_xla": None,
                "notebook_accel": __version__}  # fmt: skip
    if imports.is_torch_available():
        import torch

        versions["torch"] = torch.__version__
        versions["cuda"] = torch.version.cuda  # the CUDA torch was built for; None on CPU builds
    try:
        versions["torch_xla"] = metadata.version("torch_xla")  # never import it: it can fail to load
    except metadata.PackageNotFoundError:
        pass
    return versions


# -- the report -------------------------------------------------------------------------------


def _gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / GiB:.1f}"


@dataclass(frozen=True)
class HardwareReport:
    cpu_model: str
    physical_cores: int
    logical_cores: int
    ram_total: int  # bytes
    ram_available: int  # bytes
    accelerators: tuple  # of AcceleratorDevice
    device_family: Optional[str]
    tpu: bool
    environment: str  # one of ENVIRONMENTS
    versions: dict

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["accelerators"] = [
            {**a, "compute_capability": list(a["compute_capability"]) if a["compute_capability"] else None}
            for a in d["accelerators"]
        ]
        return d

    def summary(self) -> str:
        """One line: '8 x NVIDIA H100 80GB HBM3 · bf16 fp8' or 'CPU (8 cores) · 23.4 GiB RAM'."""
        if not self.accelerators:
            return f"CPU ({self.logical_cores} cores) · {_gib(self.ram_total)} GiB RAM"
        counts: dict = {}
        for a in self.accelerators:
            counts[a.name] = counts.get(a.name, 0) + 1
        devices = " + ".join(f"{n} x {name}" for name, n in counts.items())
        tags = [t for t in ("bf16", "fp8") if all(getattr(a, f"supports_{t}") for a in self.accelerators)]
        if not tags and all(a.supports_fp16 for a in self.accelerators):
            tags = ["fp16"]
        return f"{devices} · {' '.join(tags)}" if tags else devices

    def _rows(self) -> list:
        v = self.versions
        return [
            ("Environment", self.environment),
            ("CPU", self.cpu_model),
            ("Cores", f"{self.physical_cores} physical, {self.logical_cores} logical"),
            ("RAM", f"{_gib(self.ram_total)} GiB total, {_gib(self.ram_available)} GiB available"),
            ("Device family", self.device_family or "none (CPU only)"),
            ("TPU", "yes" if self.tpu else "no"),
            *((name, v.get(key) or "-") for name, key in (
                ("Python", "python"), ("torch", "torch"), ("CUDA (torch build)", "cuda"),
                ("torch_xla", "torch_xla"), ("notebook_accel", "notebook_accel"),
            )),
        ]  # fmt: skip

    def __str__(self) -> str:
        rows = self._rows()
        width = max(len(k) for k, _ in rows)
        lines = ["Hardware report", *(f"  {k:<{width}}  {v}" for k, v in rows)]
        if not self.accelerators:
            lines.append("Accelerators: none")
            return "\n".join(lines)
        yes = {True: "yes", False: "no"}
        table = [("#", "kind", "name", "memory free / total", "capability", "bf16", "fp16", "fp8")]
        for a in self.accelerators:
            cc = ".".join(map(str, a.compute_capability)) if a.compute_capability else "-"
            mem = f"{_gib(a.free_memory)} / {_gib(a.total_memory)} GiB" if a.total_memory else "-"
            table.append((str(a.index), a.kind, a.name, mem, cc, yes[a.supports_bf16], yes[a.supports_fp16],
                          yes[a.supports_fp8]))  # fmt: skip
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines.append("Accelerators:")
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        return "\n".join(lines)


def report(refresh: bool = False) -> HardwareReport:
    """What this machine has, probed once and cached; `refresh=True` probes again."""
    global _report
    with _lock:
        cached = _report
    if cached is not None and not refresh:
        return cached
    devices = accelerators(refresh=refresh)
    physical, logical, ram_total, ram_available = _cores_and_ram()
    result = HardwareReport(
        cpu_model=_cpu_model(),
        physical_cores=physical,
        logical_cores=logical,
        ram_total=ram_total,
        ram_available=ram_available,
        accelerators=tuple(devices),
        device_family=detect_device_family(),
        tpu=tpu_present(),
        environment=detect_environment(),
        versions=_versions(),
    )
    with _lock:
        _report = result
    return result
