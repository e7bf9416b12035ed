"""Cheap, cached probes for optional packages and device families.

Each probe looks for a package without importing it where it can, and never initialises CUDA:
the parent of a fork must stay fork-safe after asking what is here.
"""

from __future__ import annotations

import functools
import importlib.util
import os


@functools.lru_cache(maxsize=None)
def _has(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def is_torch_available() -> bool:
    return _has("torch")


def is_numpy_available() -> bool:
    return _has("numpy")


def is_cloudpickle_available() -> bool:
    return _has("cloudpickle")


def is_safetensors_available() -> bool:
    return _has("safetensors")


def is_psutil_available() -> bool:
    return _has("psutil")


def is_yaml_available() -> bool:
    return _has("yaml")


def is_ipython_available() -> bool:
    return _has("IPython")


def is_ipywidgets_available() -> bool:
    return _has("ipywidgets")


def is_tensorboard_available() -> bool:
    return _has("tensorboard") or _has("tensorboardX")


def is_wandb_available() -> bool:
    return _has("wandb")


def is_mlflow_available() -> bool:
    return _has("mlflow")


def is_transformer_engine_available() -> bool:
    return _has("transformer_engine")


def is_torchao_available() -> bool:
    return _has("torchao")


def is_deepspeed_available() -> bool:
    return _has("deepspeed")


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """torch_xla installed (and, with a check, the PJRT device says TPU or GPU). Does not import it."""
    if not _has("torch_xla"):
        return False
    device = os.environ.get("PJRT_DEVICE", "").upper()
    if check_is_tpu:
        return device == "TPU" or any(
            os.environ.get(k) for k in ("TPU_NAME", "COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE")
        )
    if check_is_gpu:
        return device in ("GPU", "CUDA")
    return True


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


def is_cuda_available() -> bool:
    if not is_torch_available():
        return False
    return _fork_safe_cuda_count() > 0


def _torch_backend_available(attr: str) -> bool:
    import torch

    mod = getattr(torch, attr, None)
    try:
        return bool(mod is not None and mod.is_available())
    except Exception:
        return False


def is_xpu_available() -> bool:
    return is_torch_available() and _torch_backend_available("xpu")


def is_mps_available() -> bool:
    if not is_torch_available():
        return False
    import torch

    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def _plugin_available(package: str, attr: str) -> bool:
    """Vendor plugins (torch_npu, torch_mlu, ...) register torch.<attr> when imported."""
    if not _has(package):
        return False
    try:
        importlib.import_module(package)
    except Exception:
        return False
    return _torch_backend_available(attr)


def is_npu_available() -> bool:
    return _plugin_available("torch_npu", "npu")


def is_mlu_available() -> bool:
    return _plugin_available("torch_mlu", "mlu")


def is_sdaa_available() -> bool:
    return _plugin_available("torch_sdaa", "sdaa")


def is_musa_available() -> bool:
    return _plugin_available("torch_musa", "musa")


def is_hpu_available() -> bool:
    return _has("habana_frameworks") and _plugin_available("habana_frameworks.torch", "hpu")


def is_neuron_available() -> bool:
    return _has("torch_neuronx")


def is_ccl_available() -> bool:
    return _has("oneccl_bindings_for_pytorch") or _has("torch_ccl")


def is_mpi_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_mpi_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 works here: always on CPU (emulated where no native support); on CUDA, compute >= 8.0."""
    if is_tpu_available() and not ignore_tpu:
        return True
    if is_cuda_available():
        from .. import hardware

        return all(d.supports_bf16 for d in hardware.accelerators())
    return True


def is_fp8_available() -> bool:
    if not (is_transformer_engine_available() or is_torchao_available()):
        return False
    if not is_cuda_available():
        return False
    from .. import hardware

    return any(d.supports_fp8 for d in hardware.accelerators())
