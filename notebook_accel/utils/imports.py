"""Cheap, cached probes for optional packages and device families.

Each probe looks for a package without importing it where it can, and never initialises CUDA:
the parent of a fork must stay fork-safe after asking what is here.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from typing import Optional

from . import families
from .packages import at_least as _at_least
from .packages import fork_safe_cuda_count as _fork_safe_cuda_count
from .packages import has_module as _has
from .packages import installed_version, tpu_runtime  # noqa: F401  (importable from here, as before)


# Optional packages: each probe looks for one of its modules without importing it.
def is_torch_available() -> bool:
    return _has("torch")


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
    return any(map(_has, ("tensorboard", "tensorboardX")))


def is_wandb_available() -> bool:
    return _has("wandb")


def is_transformer_engine_available() -> bool:
    return _has("transformer_engine")


def is_deepspeed_available() -> bool:
    return _has("deepspeed")


def is_ccl_available() -> bool:
    return any(map(_has, ("oneccl_bindings_for_pytorch", "torch_ccl")))


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """torch_xla installed (and, with a check, the PJRT device says TPU or GPU). Does not import it."""
    if not _has("torch_xla"):
        return False
    if check_is_tpu:
        return tpu_runtime(os.environ)
    if check_is_gpu:
        return os.environ.get("PJRT_DEVICE", "").upper() in ("GPU", "CUDA")
    return True


def is_tpu_available(check_device: bool = True) -> bool:
    return is_torch_xla_available(check_is_tpu=True)


def is_mpi_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_mpi_available()


# accelerate's other probes. A package counts when its module is found *and* its distribution is
# installed (a stray folder named like a package is not the package); where accelerate needs a
# minimum version, the installed version is compared. Nothing here imports the package.
_DISTRIBUTIONS = {  # the distributions to look for where they are not named like the module
    "comet_ml": ("comet_ml", "comet-ml"),
    "import_timer": ("import_timer", "import-timer"),
    "lomo_optim": ("lomo_optim", "lomo-optim"),
    "megatron": ("megatron-core",),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "msamp": ("msamp", "ms-amp"),
    "pynvml": ("pynvml", "nvidia-ml-py"),
    "transformer_engine": ("transformer_engine", "transformer-engine"),
    "triton": ("triton", "pytorch-triton", "triton-xpu"),
}


def _installed(module: str, minimum: Optional[str] = None) -> bool:
    found = installed_version(module, _DISTRIBUTIONS.get(module, (module,)))
    return found is not None and (minimum is None or _at_least(found, minimum))


def is_aim_available() -> bool:
    return _installed("aim")


def is_amdsmi_available() -> bool:
    return _installed("amdsmi")


def is_boto3_available() -> bool:
    return _installed("boto3")


def is_clearml_available() -> bool:
    return _installed("clearml")


def is_comet_ml_available() -> bool:
    return _installed("comet_ml")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_dvclive_available() -> bool:
    return _installed("dvclive")


def is_import_timer_available() -> bool:
    return _installed("import_timer")


def is_lomo_available() -> bool:
    return _installed("lomo_optim")


def is_matplotlib_available() -> bool:
    return _installed("matplotlib")


def is_msamp_available() -> bool:
    return _installed("msamp")


def is_pandas_available() -> bool:
    return _installed("pandas")


def is_peft_available() -> bool:
    return _installed("peft")


def is_pynvml_available() -> bool:
    return _installed("pynvml")


def is_pytest_available() -> bool:
    return _installed("pytest")


def is_sagemaker_available() -> bool:
    return _installed("sagemaker")


def is_schedulefree_available() -> bool:
    return _installed("schedulefree")


def is_swanlab_available() -> bool:
    return _installed("swanlab")


def is_timm_available() -> bool:
    return _installed("timm")


def is_torchdata_available() -> bool:
    return _installed("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    return _installed("torchdata", "0.8.0")


def is_torchvision_available() -> bool:
    return _installed("torchvision")


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_triton_available() -> bool:
    return _installed("triton")


def is_4bit_bnb_available() -> bool:
    return _installed("bitsandbytes", "0.39.0")


def is_8bit_bnb_available() -> bool:
    return _installed("bitsandbytes", "0.37.2")


def is_tqdm_available() -> bool:
    return _installed("tqdm")


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    return _installed("numpy", min_version)


def hf_accelerate_installed() -> bool:
    """Hugging Face's accelerate is installed where this process looks: its distribution, so an
    `accelerate` module that only aliases notebook_accel (the conformance tests') does not count.
    Not cached: a notebook may install it between launches."""
    try:
        importlib.metadata.distribution("accelerate")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def is_bnb_available(min_version: Optional[str] = None) -> bool:
    return _installed("bitsandbytes", min_version)


def is_bitsandbytes_multi_backend_available() -> bool:
    """bitsandbytes installed and built with its multi-backend feature (imports bitsandbytes to ask)."""
    if not is_bnb_available():
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_mlflow_available() -> bool:
    return _installed("mlflow")


def is_trackio_available() -> bool:
    return sys.version_info >= (3, 10) and _installed("trackio")


def is_rich_available() -> bool:
    """rich installed and asked for (ACCELERATE_ENABLE_RICH), as accelerate decides."""
    from .environment import parse_bool

    if not _installed("rich"):
        return False
    return parse_bool(os.environ.get("ACCELERATE_ENABLE_RICH", "0"))


def is_torchao_available() -> bool:
    return _installed("torchao", "0.6.1")


def is_transformer_engine_mxfp8_available() -> bool:
    """TransformerEngine installed and saying this GPU supports MXFP8 (imports transformer_engine)."""
    if not _installed("transformer_engine"):
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support

    return bool(check_mxfp8_support()[0])


def is_megatron_lm_available() -> bool:
    """Megatron-LM asked for (ACCELERATE_USE_MEGATRON_LM) and megatron-core >= 0.8 installed."""
    from .environment import parse_bool

    if not parse_bool(os.environ.get("ACCELERATE_USE_MEGATRON_LM", "0")):
        return False
    return _installed("megatron", "0.8.0") and _has("megatron.training")


def is_pippy_available() -> bool:
    """torch.distributed.pipelining is here (torch 2.4 and later)."""
    return _has("torch.distributed.pipelining")


def is_weights_only_available() -> bool:
    """torch.load's weights_only with an allowlist (torch 2.4 and later)."""
    import torch

    return _at_least(torch.__version__, "2.4.0")


def is_rocm_available() -> bool:
    """This torch is a ROCm build and sees an AMD GPU (counted without initialising it)."""
    import torch

    return torch.version.hip is not None and _fork_safe_cuda_count() > 0


def is_xccl_available() -> bool:
    """torch.distributed has the XCCL backend (Intel GPUs)."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    probe = getattr(dist.distributed_c10d, "is_xccl_available", None)
    return bool(probe and probe())


def is_habana_gaudi1() -> bool:
    """An HPU is here and it is a first-generation Gaudi."""
    if not families.family("hpu").is_available():
        return False
    import habana_frameworks.torch.utils.experimental as htexp

    return htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi


def is_fp16_available() -> bool:
    """fp16 autocast works here: everywhere but a first-generation Gaudi."""
    return not is_habana_gaudi1()


# One probe per device family (the family table says how each is found); xla's is
# is_torch_xla_available above. `check_device` is accepted for accelerate's signature: our probe always
# checks that a device is there, which is what accelerate's does with check_device=True.
def is_cuda_available() -> bool:
    return families.family("cuda").is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    return families.family("xpu").is_available()


def is_npu_available(check_device: bool = False) -> bool:
    return families.family("npu").is_available()


def is_mlu_available(check_device: bool = False) -> bool:
    return families.family("mlu").is_available()


def is_sdaa_available(check_device: bool = False) -> bool:
    return families.family("sdaa").is_available()


def is_musa_available(check_device: bool = False) -> bool:
    return families.family("musa").is_available()


def is_neuron_available(check_device: bool = False) -> bool:
    return families.family("neuron").is_available()


def is_hpu_available(init_hccl: bool = False) -> bool:
    """An HPU is here; with init_hccl, its collective backend is registered too (by importing it)."""
    if not families.family("hpu").is_available():
        return False
    if init_hccl:
        import habana_frameworks.torch.distributed.hccl  # noqa: F401  (registers the backend)
    return True


def is_mps_available(min_version: str = "1.12") -> bool:
    """Apple's GPU is here and torch is at least `min_version`."""
    import torch

    return _at_least(torch.__version__, min_version) and families.family("mps").is_available()


# These ask this machine's devices, which hardware.py knows, above the floor: accelerate's path
# keeps them here, imported on first use (hardware imports this floor).
_MACHINE_PROBES = ("is_bf16_available", "is_fp8_available", "check_cuda_fp8_capability")


def __getattr__(name: str):
    if name in _MACHINE_PROBES:
        from .. import hardware

        return getattr(hardware, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted([name for name in globals() if name.startswith("is_")] + list(_MACHINE_PROBES))
