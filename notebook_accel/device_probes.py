"""Accelerator details without initialising any device runtime in the calling process.

CUDA: NVML through ctypes, else `nvidia-smi`; other families: a short-lived child process. Kept
apart from hardware.py, which assembles the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from .utils import families

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
    return {
        "index": index,
        "uuid": uuid,
        "name": name,
        "total_memory": total,
        "free_memory": free,
        "compute_capability": capability,
    }


def _nvml_library(library: Optional[str] = None):
    """NVML (libnvidia-ml) through ctypes, initialised; None where it cannot be loaded or
    initialised. `library`: a path to load instead (the tests' stand-in)."""
    import ctypes

    names = ("nvml.dll",) if sys.platform == "win32" else ("libnvidia-ml.so.1", "libnvidia-ml.so")
    for name in (library,) if library else names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        return lib if lib.nvmlInit_v2() == 0 else None
    return None


def _nvml_records(library: Optional[str] = None) -> Optional[list]:
    """Physical GPUs as NVML sees them, or None where NVML cannot be loaded or initialised."""
    import ctypes

    lib = _nvml_library(library)
    if lib is None:
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


class NvmlProcesses:
    """Device memory per process and utilisation per device, from NVML through ctypes (no pynvml,
    no CUDA initialised). `open()` gives None where NVML or a device is missing. NVML reports the
    pids of the machine's pid namespace: in a container that has its own, no rank matches."""

    _NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE: memory NVML cannot tell (MIG, WDDM)
    _INSUFFICIENT_SIZE = 7

    @classmethod
    def open(cls, library: Optional[str] = None) -> Optional["NvmlProcesses"]:
        import ctypes

        lib = _nvml_library(library)
        if lib is None:
            return None
        count, handles = ctypes.c_uint(), []
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0:
            for i in range(count.value):
                handle = ctypes.c_void_p()
                if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) == 0:
                    handles.append(handle)
        return cls(lib, handles) if handles else None

    def __init__(self, lib, handles: list):
        import ctypes

        class Utilization(ctypes.Structure):
            _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]

        # The unversioned call keeps the first layout (nvmlProcessInfo_v1_t) on every driver; the
        # _v3 one wrote 24- or 32-byte entries depending on the driver release (535.43-535.86).
        class Process(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

        self.lib, self.handles, self.Utilization, self.Process = lib, handles, Utilization, Process

    def _processes(self, handle) -> Optional[list]:
        import ctypes

        size = 16
        while True:
            # 40 bytes an entry, more than any layout NVML has had: a driver that wrote a larger
            # one would give wrong figures, not overwrite memory.
            buffer = ctypes.create_string_buffer(40 * size)
            count = ctypes.c_uint(size)
            status = self.lib.nvmlDeviceGetComputeRunningProcesses(handle, ctypes.byref(count), buffer)
            if status == 0:
                entries = ctypes.cast(buffer, ctypes.POINTER(self.Process))
                return [entries[i] for i in range(min(count.value, size))]
            if status != self._INSUFFICIENT_SIZE or size >= 4096:
                return None
            size = max(2 * size, count.value + 8)  # more started since: room to spare

    def by_pid(self) -> dict:
        """{pid: (device memory used in bytes, over every device; the highest utilisation % of
        the devices it uses)}; a device NVML fails to read is left out."""
        import ctypes

        out: dict = {}
        for handle in self.handles:
            util = self.Utilization()
            if self.lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(util)) != 0:
                continue
            for proc in self._processes(handle) or []:
                if proc.usedGpuMemory != self._NOT_AVAILABLE:
                    used, busy = out.get(proc.pid, (0, 0.0))
                    out[proc.pid] = (used + proc.usedGpuMemory, max(busy, float(util.gpu)))
        return out


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
                capture_output=True,
                text=True,
                timeout=30,
                stdin=subprocess.DEVNULL,
            )
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


def _plugin(family: str) -> str:
    # The vendor package that registers torch.<family>; "" for none (or a plain torch module like cpu).
    return (families.family(family).plugin or "") if family in families.names() else ""


def probe_in_child(family: str, timeout: float = 120.0) -> Optional[list]:
    """Device records for `family` read by a fresh Python process; None if that fails."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE_SCRIPT, family, _plugin(family)],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
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
