"""Helpers with accelerate's public names (`from notebook_accel.utils import gather`, ...)."""

from __future__ import annotations

from .dataclasses import (  # noqa: F401
    AutocastKwargs,
    ComputeEnvironment,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    PrecisionType,
    ProjectConfiguration,
    RNGType,
    TorchDynamoPlugin,
)
from .imports import *  # noqa: F401,F403
from .imports import __dict__ as _imports_dict
from .lazy import lazy_exports

_EXPORTS = {
    # operations
    **{
        name: "operations"
        for name in (
            "send_to_device",
            "recursively_apply",
            "gather",
            "gather_object",
            "broadcast",
            "broadcast_object_list",
            "reduce",
            "pad_across_processes",
            "copy_tensor_to_devices",
            "concatenate",
            "find_batch_size",
            "DistributedOperationException",
            "is_tensor_information",
            "get_data_structure",
            "honor_type",
            "listify",
            "slice_tensors",
            "convert_to_fp32",
        )
    },
    # random
    "find_checkpoint": "checkpoint_files",
    "set_seed": "random",
    "synchronize_rng_states": "random",
    "synchronize_rng_state": "random",
    # memory
    "parse_memory_size": "memory",
    "convert_file_size_to_int": "memory",
    "release_memory": "memory",
    "find_executable_batch_size": "memory",
}

__all__ = sorted(
    list(_EXPORTS)
    + [
        "AutocastKwargs",
        "ComputeEnvironment",
        "DataLoaderConfiguration",
        "DDPCommunicationHookType",
        "DistributedDataParallelKwargs",
        "DistributedType",
        "DynamoBackend",
        "GradientAccumulationPlugin",
        "GradScalerKwargs",
        "InitProcessGroupKwargs",
        "KwargsHandler",
        "PrecisionType",
        "ProjectConfiguration",
        "RNGType",
        "TorchDynamoPlugin",
    ]
    + [n for n in _imports_dict if n.startswith("is_")]
)


__getattr__ = lazy_exports(globals(), _EXPORTS)
