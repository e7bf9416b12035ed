"""Cheap, cached probes for optional packages and device families.

Each probe looks for a package without importing it where it can, and never initialises CUDA:
the parent of a fork must stay fork-safe after asking what is here.
"""

from __future__ import annotations

import functools
import importlib.util
import os

from . import current, families


@functools.lru_cache(maxsize=None)
def _has(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# Optional packages: each probe looks for one of its modules without importing it.
_PACKAGES = {
    "torch": ("torch",),
    "numpy": ("numpy",),
    "cloudpickle": ("cloudpickle",),
    "safetensors": ("safetensors",),
    "psutil": ("psutil",),
    "yaml": ("yaml",),
    "ipython": ("IPython",),
    "ipywidgets": ("ipywidgets",),
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "transformer_engine": ("transformer_engine",),
    "torchao": ("torchao",),
    "deepspeed": ("deepspeed",),
    "ccl": ("oneccl_bindings_for_pytorch", "torch_ccl"),
    "datasets": ("datasets",),
    "pytest": ("pytest",),
    "bnb": ("bitsandbytes",),
}


def _probe(name: str, check):
    def probe() -> bool:
        return check()

    probe.__name__ = probe.__qualname__ = f"is_{name}_available"
    return probe


for _name, _modules in _PACKAGES.items():
    globals()[f"is_{_name}_available"] = _probe(_name, lambda modules=_modules: any(map(_has, modules)))


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """torch_xla installed (and, with a check, the PJRT device says TPU or GPU). Does not import it."""
    if not _has("torch_xla"):
        return False
    if check_is_tpu:
        return tpu_runtime(os.environ)
    if check_is_gpu:
        return os.environ.get("PJRT_DEVICE", "").upper() in ("GPU", "CUDA")
    return True


def tpu_runtime(env) -> bool:
    """The runtime's variables in `env` say this host drives a TPU."""
    if env.get("PJRT_DEVICE", "").upper() == "TPU":
        return True
    return any(env.get(k) for k in ("TPU_NAME", "COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE"))


def is_tpu_available(check_device: bool = True) -> bool:
    return is_torch_xla_available(check_is_tpu=True)


def _fork_safe_cuda_count() -> int:
    import torch

    # NVML-based counting leaves CUDA uninitialised, so a later fork stays safe.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        return int(torch.cuda.device_count())
    except Exception:
        return 0


def is_mpi_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_mpi_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 works here: always on CPU (emulated where no native support); on CUDA, compute >= 8.0."""
    if is_tpu_available() and not ignore_tpu:
        return True
    if families.family("cuda").is_available():
        return all(d.supports_bf16 for d in current.accelerators())
    return True


def is_fp16_available() -> bool:
    """fp16 autocast runs on every device we support (on CPU too, through torch's CPU autocast)."""
    return True


def is_rocm_available() -> bool:
    """A ROCm build of torch with an AMD GPU visible; never initialises the GPU runtime."""
    import torch

    return torch.version.hip is not None and families.family("cuda").is_available()


def is_fp8_available() -> bool:
    if not any(map(_has, _PACKAGES["transformer_engine"] + _PACKAGES["torchao"])):
        return False
    if not families.family("cuda").is_available():
        return False
    return any(d.supports_fp8 for d in current.accelerators())


# One probe per device family, from the family table (is_cuda_available, is_npu_available, ...);
# xla's is is_torch_xla_available above, which takes arguments.
for _family in families.FAMILIES:
    if _family.name != "xla":
        globals()[f"is_{_family.name}_available"] = _probe(_family.name, _family.is_available)

__all__ = sorted(name for name in globals() if name.startswith("is_"))
