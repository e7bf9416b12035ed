"""Enums and small configuration records shared across the package (accelerate's names)."""

from __future__ import annotations

import enum


class _StrEnum(str, enum.Enum):
    """A str enum whose members compare equal to their plain string value."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


class DistributedType(_StrEnum):
    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_XPU = "MULTI_XPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    XLA = "XLA"
    # Never chosen by us; present so user code that compares against them keeps working.
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    MEGATRON_LM = "MEGATRON_LM"


class PrecisionType(_StrEnum):
    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class ComputeEnvironment(_StrEnum):
    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class RNGType(_StrEnum):
    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    GENERATOR = "generator"


class ReduceOp(_StrEnum):
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"


def parse_mixed_precision(value) -> str:
    """'no' | 'fp16' | 'bf16' | 'fp8' (None means 'no'); anything else raises naming the value."""
    if value is None:
        return "no"
    text = str(value.value if isinstance(value, enum.Enum) else value).strip().lower()
    if text in PrecisionType.list():
        return text
    raise ValueError(
        f"Unknown mixed_precision {value!r}: choose one of {PrecisionType.list()} "
        "(for example mixed_precision='bf16')."
    )
