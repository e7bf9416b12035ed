"""Which packages are installed, found without importing them (the family table and the
accelerate-named probes in imports.py both ask here). Nothing here initialises CUDA: the parent of
a fork must stay fork-safe after asking what is here."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from typing import Optional


@functools.lru_cache(maxsize=None)
def has_module(name: str) -> bool:
    """`name` can be imported (its spec is found); the package is not imported."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def installed_version(module: str, distributions) -> Optional[str]:
    """The version of the first of `distributions` installed, when `module` can be found; else None."""
    if not has_module(module):
        return None
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def at_least(version: str, minimum: str) -> bool:
    from torch.torch_version import TorchVersion  # PEP 440 comparison, as torch ships it

    return TorchVersion(version) >= minimum


def tpu_runtime(env) -> bool:
    """The runtime's variables in `env` say this host drives a TPU."""
    if env.get("PJRT_DEVICE", "").upper() == "TPU":
        return True
    return any(env.get(k) for k in ("TPU_NAME", "COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE"))


def fork_safe_cuda_count() -> int:
    import torch

    # NVML-based counting leaves CUDA uninitialised, so a later fork stays safe.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        return int(torch.cuda.device_count())
    except Exception:
        return 0
