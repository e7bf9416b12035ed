"""What this machine has: the single source of "what is here" (see shared/DESIGN.md).

Nothing here initialises CUDA in the calling process, so a fork after asking stays safe: CUDA
details come from NVML (through ctypes) or `nvidia-smi`, other families' details from a short-lived
child process. Importing this module imports neither IPython nor ipywidgets.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .device_probes import (  # noqa: F401  (re-exported: part of hardware's public surface)
    AcceleratorDevice,
    GiB,
    MiB,
    _cuda_devices,
    _devices_from_child,
    _nvidia_smi_records,
    _nvml_records,
    cuda_precision_flags,
    parse_nvidia_smi_csv,
    probe_in_child,
    visible_cuda_records,
)
from .utils import families, packages


def detect_device_family() -> Optional[str]:
    """The accelerator family present here, or None for CPU only. Never initialises CUDA."""
    return families.detect()


def device_count(family: Optional[str]) -> int:
    """How many devices of `family` this process sees (NVML-based for CUDA: no initialisation)."""
    if family is None:
        return 0
    module = families.family(family).module()
    if module is None:  # xla and neuron: one host device as far as a process here is concerned
        return 1
    try:
        return int(module.device_count())
    except Exception:
        return 0


def tpu_present(env: Mapping[str, str] = os.environ) -> bool:
    """A TPU host: torch_xla installed and the runtime's variables say TPU."""
    return packages.has_module("torch_xla") and packages.tpu_runtime(env)


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


def physical_cores() -> int:
    """Physical cores this process may run on (its CPU affinity can allow fewer than the machine has)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        usable = os.cpu_count() or 1
    return max(1, min(_cores_and_ram()[0], usable))


def ram_available() -> int:
    """Bytes of RAM available now (not cached: it changes as a notebook runs)."""
    return _cores_and_ram()[3]


def _versions() -> dict:
    from importlib import metadata

    from .utils.version import __version__

    versions = {
        "python": platform.python_version(),
        "torch": None,
        "cuda": None,
        "torch_xla": None,
        "notebook_accel": __version__,
    }
    if packages.has_module("torch"):
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
            *(
                (name, v.get(key) or "-")
                for name, key in (
                    ("Python", "python"),
                    ("torch", "torch"),
                    ("CUDA (torch build)", "cuda"),
                    ("torch_xla", "torch_xla"),
                    ("notebook_accel", "notebook_accel"),
                )
            ),
        ]

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
            table.append(
                (
                    str(a.index),
                    a.kind,
                    a.name,
                    mem,
                    cc,
                    yes[a.supports_bf16],
                    yes[a.supports_fp16],
                    yes[a.supports_fp8],
                )
            )
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


# -- accelerate's probes that ask this machine's devices (utils.imports and utils.other re-export them)


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 works here: always on CPU (emulated where no native support); on CUDA, compute >= 8.0."""
    if tpu_present() and not ignore_tpu:
        return True
    if families.family("cuda").is_available():
        return all(d.supports_bf16 for d in accelerators())
    return True


def is_fp8_available() -> bool:
    if not any(map(packages.has_module, ("transformer_engine", "torchao"))):
        return False
    if not families.family("cuda").is_available():
        return False
    return any(d.supports_fp8 for d in accelerators())


def check_cuda_fp8_capability() -> bool:
    """Whether the first CUDA GPU can compute in fp8 (compute capability 8.9 or later), read through NVML
    without initialising CUDA; False where there is no CUDA GPU (accelerate raises there)."""
    if not families.family("cuda").is_available():
        return False
    found = [d for d in accelerators() if d.kind == "cuda"]
    return bool(found) and found[0].supports_fp8


def get_gpu_info() -> tuple:
    """(names, count) of the CUDA GPUs this process can use, found without initialising CUDA
    (accelerate asks nvidia-smi); ([], 0) where there are none."""
    names = [device.name for device in accelerators() if device.kind == "cuda"]
    return names, len(names)
