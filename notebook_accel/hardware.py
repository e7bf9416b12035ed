"""What this machine has: the single source of "what is here" (see shared/DESIGN.md).

Nothing here initialises CUDA in the calling process, so a fork after asking stays safe.
"""

from __future__ import annotations

from typing import Optional

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


