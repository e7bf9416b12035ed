"""The one table of accelerator families: every other module reads "which families exist" here.

A family is what torch calls a device type with its own runtime (cuda, xpu, npu, ...). Each row
says what the family implies (distributed type, collective backend, torch module, the variable
that hides devices, whether it keeps its own RNG) and how to ask whether it is present without
initialising it, so a fork after asking stays safe. Order matters: it is the probe order, and the
first family present wins (tests/test_families.py checks nobody else lists families).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Optional

from . import packages
from .enums import DistributedType


@dataclass(frozen=True)
class Family:
    name: str
    distributed_type: Optional[DistributedType]  # for world_size > 1; None: no multi-process backend
    backend: Optional[str]  # default collective backend
    torch_module: Optional[str] = None  # "torch.cuda"; None where torch has no per-family module
    plugin: Optional[str] = None  # the vendor package that registers torch_module when imported
    visible_env: Optional[str] = None  # the variable that restricts a process to chosen devices
    own_rng: bool = False  # the torch module keeps per-device RNG states
    needs_index: bool = False  # some plugins cannot resolve a bare "npu" before first use: say "npu:0"
    rank_per_device: bool = True  # a launch runs one rank per device by default, and at most that many

    def module(self):
        """The torch module (torch.cuda, ...) if torch has it here, else None. Imports no plugin."""
        if self.torch_module is None:
            return None
        import torch

        return getattr(torch, self.torch_module.split(".", 1)[1], None)

    def is_available(self) -> bool:
        """A device of this family can be used here. Never initialises CUDA."""
        if self.name == "xla":
            return packages.has_module("torch_xla") and packages.tpu_runtime(os.environ)
        if self.name == "neuron":
            return packages.has_module("torch_neuronx")
        if not packages.has_module("torch"):
            return False
        if self.name == "cuda":
            return packages.fork_safe_cuda_count() > 0
        if self.name == "mps":
            import torch

            return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
        if self.plugin is not None:
            # Vendor plugins (torch_npu, torch_mlu, ...) register torch.<name> when imported.
            if not packages.has_module(self.plugin):
                return False
            try:
                importlib.import_module(self.plugin)
            except Exception:
                return False
        try:
            module = self.module()
            return bool(module is not None and module.is_available())
        except Exception:
            return False

    def used_module(self):
        """The torch module once this process has used the family (reading it then initialises
        nothing new), else None. A module without is_initialized counts as used when available."""
        module = self.module()
        if module is None:
            return None
        try:
            if self.name == "mps":
                return module if self.is_available() else None
            initialised = getattr(module, "is_initialized", None)
            if initialised is not None:
                return module if initialised() else None
            return module if module.is_available() else None
        except Exception:
            return None


_MULTI = DistributedType
FAMILIES = (
    Family("xla", _MULTI.XLA, "xla", rank_per_device=False),  # xmp.spawn decides from the topology
    Family("cuda", _MULTI.MULTI_GPU, "nccl", "torch.cuda", None, "CUDA_VISIBLE_DEVICES", own_rng=True),
    Family(
        "xpu", _MULTI.MULTI_XPU, "xccl", "torch.xpu", None, "ZE_AFFINITY_MASK", own_rng=True, needs_index=True
    ),
    Family(
        "npu",
        _MULTI.MULTI_NPU,
        "hccl",
        "torch.npu",
        "torch_npu",
        "ASCEND_RT_VISIBLE_DEVICES",
        own_rng=True,
        needs_index=True,
    ),
    Family(
        "mlu",
        _MULTI.MULTI_MLU,
        "cncl",
        "torch.mlu",
        "torch_mlu",
        "MLU_VISIBLE_DEVICES",
        own_rng=True,
        needs_index=True,
    ),
    Family(
        "sdaa",
        _MULTI.MULTI_SDAA,
        "tccl",
        "torch.sdaa",
        "torch_sdaa",
        "SDAA_VISIBLE_DEVICES",
        own_rng=True,
        needs_index=True,
    ),
    Family(
        "musa",
        _MULTI.MULTI_MUSA,
        "mccl",
        "torch.musa",
        "torch_musa",
        "MUSA_VISIBLE_DEVICES",
        own_rng=True,
        needs_index=True,
    ),
    Family("hpu", _MULTI.MULTI_HPU, "hccl", "torch.hpu", "habana_frameworks.torch", own_rng=True),
    Family("neuron", _MULTI.MULTI_NEURON, "xla"),
    # Apple GPUs: one device, no multi-process backend; torch.mps keeps the RNG of that one device.
    Family("mps", None, None, "torch.mps", own_rng=True, rank_per_device=False),  # one device, one process
)
_BY_NAME = {f.name: f for f in FAMILIES}


def names() -> tuple:
    """Every family's name, in probe order."""
    return tuple(_BY_NAME)


def family(name: str) -> Family:
    """The family called `name`; a ValueError naming the known ones otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"Unknown device family {name!r}; expected one of {sorted(_BY_NAME)}.") from None


def detect() -> Optional[str]:
    """The first family present here, or None for CPU only. Never initialises CUDA."""
    for f in FAMILIES:
        try:
            if f.is_available():
                return f.name
        except Exception:
            continue
    return None
