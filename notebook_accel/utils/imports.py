"""Cheap, cached probes for optional packages and device families.

Each probe looks for a package without importing it where it can, and never initialises CUDA:
the parent of a fork must stay fork-safe after asking what is here.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys
from typing import Optional

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
    "cloudpickle": ("cloudpickle",),
    "safetensors": ("safetensors",),
    "psutil": ("psutil",),
    "yaml": ("yaml",),
    "ipython": ("IPython",),
    "ipywidgets": ("ipywidgets",),
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "transformer_engine": ("transformer_engine",),
    "deepspeed": ("deepspeed",),
    "ccl": ("oneccl_bindings_for_pytorch", "torch_ccl"),
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


def is_fp8_available() -> bool:
    if not any(map(_has, _PACKAGES["transformer_engine"] + ("torchao",))):
        return False
    if not families.family("cuda").is_available():
        return False
    return any(d.supports_fp8 for d in current.accelerators())


def check_cuda_fp8_capability() -> bool:
    """Whether the first CUDA GPU can compute in fp8 (compute capability 8.9 or later), read through NVML
    without initialising CUDA; False where there is no CUDA GPU (accelerate raises there)."""
    if not families.family("cuda").is_available():
        return False
    found = [d for d in current.accelerators() if d.kind == "cuda"]
    return bool(found) and found[0].supports_fp8


# accelerate's other probes. A package counts when its module is found *and* its distribution is
# installed (a stray folder named like a package is not the package); where accelerate needs a
# minimum version, the installed version is compared. Nothing here imports the package.
_DISTRIBUTIONS = {  # probe name -> (module, distribution names, minimum version or None)
    "aim": ("aim", ("aim",), None),
    "amdsmi": ("amdsmi", ("amdsmi",), None),
    "boto3": ("boto3", ("boto3",), None),
    "clearml": ("clearml", ("clearml",), None),
    "comet_ml": ("comet_ml", ("comet_ml", "comet-ml"), None),
    "datasets": ("datasets", ("datasets",), None),
    "dvclive": ("dvclive", ("dvclive",), None),
    "import_timer": ("import_timer", ("import_timer", "import-timer"), None),
    "lomo": ("lomo_optim", ("lomo_optim", "lomo-optim"), None),
    "matplotlib": ("matplotlib", ("matplotlib",), None),
    "msamp": ("msamp", ("msamp", "ms-amp"), None),
    "pandas": ("pandas", ("pandas",), None),
    "peft": ("peft", ("peft",), None),
    "pynvml": ("pynvml", ("pynvml", "nvidia-ml-py"), None),
    "pytest": ("pytest", ("pytest",), None),
    "sagemaker": ("sagemaker", ("sagemaker",), None),
    "schedulefree": ("schedulefree", ("schedulefree",), None),
    "swanlab": ("swanlab", ("swanlab",), None),
    "timm": ("timm", ("timm",), None),
    "torchdata": ("torchdata", ("torchdata",), None),
    "torchdata_stateful_dataloader": ("torchdata", ("torchdata",), "0.8.0"),
    "torchvision": ("torchvision", ("torchvision",), None),
    "transformers": ("transformers", ("transformers",), None),
    "triton": ("triton", ("triton", "pytorch-triton", "triton-xpu"), None),
    "4bit_bnb": ("bitsandbytes", ("bitsandbytes",), "0.39.0"),
    "8bit_bnb": ("bitsandbytes", ("bitsandbytes",), "0.37.2"),
    "tqdm": ("tqdm", ("tqdm",), None),
}


def installed_version(module: str, distributions) -> Optional[str]:
    """The version of the first of `distributions` installed, when `module` can be found; else None."""
    if not _has(module):
        return None
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    found = installed_version("numpy", ("numpy",))
    return found is not None and _at_least(found, min_version)


def hf_accelerate_installed() -> bool:
    """Hugging Face's accelerate is installed where this process looks: its distribution, so an
    `accelerate` module that only aliases notebook_accel (the conformance tests') does not count.
    Not cached: a notebook may install it between launches."""
    try:
        importlib.metadata.distribution("accelerate")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _distribution_probe(name: str, module: str, distributions, minimum: Optional[str]):
    def probe() -> bool:
        found = installed_version(module, distributions)
        if found is None:
            return False
        return minimum is None or _at_least(found, minimum)

    probe.__name__ = probe.__qualname__ = f"is_{name}_available"
    return probe


def _at_least(version: str, minimum: str) -> bool:
    from torch.torch_version import TorchVersion  # PEP 440 comparison, as torch ships it

    return TorchVersion(version) >= minimum


for _name, (_module, _dists, _minimum) in _DISTRIBUTIONS.items():
    globals()[f"is_{_name}_available"] = _distribution_probe(_name, _module, _dists, _minimum)


def is_bnb_available(min_version: Optional[str] = None) -> bool:
    found = installed_version("bitsandbytes", ("bitsandbytes",))
    return found is not None and (min_version is None or _at_least(found, min_version))


def is_bitsandbytes_multi_backend_available() -> bool:
    """bitsandbytes installed and built with its multi-backend feature (imports bitsandbytes to ask)."""
    if not is_bnb_available():
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_mlflow_available() -> bool:
    return installed_version("mlflow", ("mlflow", "mlflow-skinny")) is not None


def is_trackio_available() -> bool:
    return sys.version_info >= (3, 10) and installed_version("trackio", ("trackio",)) is not None


def is_rich_available() -> bool:
    """rich installed and asked for (ACCELERATE_ENABLE_RICH), as accelerate decides."""
    from .environment import parse_bool

    if installed_version("rich", ("rich",)) is None:
        return False
    return parse_bool(os.environ.get("ACCELERATE_ENABLE_RICH", "0"))


def is_torchao_available() -> bool:
    found = installed_version("torchao", ("torchao",))
    return found is not None and _at_least(found, "0.6.1")


def is_transformer_engine_mxfp8_available() -> bool:
    """TransformerEngine installed and saying this GPU supports MXFP8 (imports transformer_engine)."""
    if installed_version("transformer_engine", ("transformer_engine", "transformer-engine")) is None:
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support

    return bool(check_mxfp8_support()[0])


def is_megatron_lm_available() -> bool:
    """Megatron-LM asked for (ACCELERATE_USE_MEGATRON_LM) and megatron-core >= 0.8 installed."""
    from .environment import parse_bool

    if not parse_bool(os.environ.get("ACCELERATE_USE_MEGATRON_LM", "0")):
        return False
    found = installed_version("megatron", ("megatron-core",))
    return found is not None and _at_least(found, "0.8.0") and _has("megatron.training")


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

__all__ = sorted(name for name in globals() if name.startswith("is_")) + ["check_cuda_fp8_capability"]
