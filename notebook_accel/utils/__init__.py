"""Helpers with accelerate's public names (`from notebook_accel.utils import gather`, ...)."""

from __future__ import annotations

from . import imports as _imports
from .dataclasses import (  # noqa: F401
    AutocastKwargs,
    ComputeEnvironment,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    PrecisionType,
    ProjectConfiguration,
    RNGType,
    TorchDynamoPlugin,
)
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
    **{
        name: "fsdp_plugin"
        for name in ("enable_fsdp_ram_efficient_loading", "disable_fsdp_ram_efficient_loading", "model_has_dtensor")
    },
    **{
        name: "fsdp_files"
        for name in ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")
    },
    "set_seed": "random",
    "synchronize_rng_states": "random",
    "synchronize_rng_state": "random",
    # memory
    "parse_memory_size": "memory",
    "convert_file_size_to_int": "memory",
    "release_memory": "memory",
    "find_executable_batch_size": "memory",
    # accelerate's checkpoint file names and version gates, as its utils exports them
    **{
        name: "constants"
        for name in (
            "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION", "MODEL_NAME", "OPTIMIZER_NAME", "PROFILE_PATTERN_NAME",
            "RNG_STATE_NAME", "SAFE_MODEL_NAME", "SAFE_WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_NAME",
            "SAFE_WEIGHTS_PATTERN_NAME", "SAMPLER_NAME", "SCALER_NAME", "SCHEDULER_NAME",
            "TORCH_DISTRIBUTED_OPERATION_TYPES", "TORCH_LAUNCH_PARAMS", "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME",
            "WEIGHTS_PATTERN_NAME", "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
        )
    },
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
        "FullyShardedDataParallelPlugin",
        "GradientAccumulationPlugin",
        "GradScalerKwargs",
        "InitProcessGroupKwargs",
        "KwargsHandler",
        "PrecisionType",
        "ProjectConfiguration",
        "RNGType",
        "TorchDynamoPlugin",
    ]
    + list(_imports.__all__)
)
# The probes load on first use: the few that ask the machine's devices import hardware.py.
_EXPORTS.update({name: "imports" for name in _imports.__all__})


# -- accelerate's other public helper names (the public-surface test lists them) ---------------------
_SURFACE = {
    **{
        name: "operations"
        for name in (
            "TensorInformation",
            "convert_outputs_to_fp32",
            "ignorant_find_batch_size",
            "initialize_tensors",
            "is_namedtuple",
            "is_torch_tensor",
            "find_device",
            "pad_input_tensors",
            "CannotPadNestedTensorWarning",
        )
    },
    **{
        name: "modeling"
        for name in (
            "check_device_map",
            "check_tied_parameters_on_same_device",
            "compute_module_sizes",
            "dtype_byte_size",
            "find_tied_parameters",
            "get_balanced_memory",
            "get_max_layer_size",
            "get_max_memory",
            "infer_auto_device_map",
            "load_checkpoint_in_model",
            "load_offloaded_weights",
            "load_state_dict",
            "named_module_tensors",
            "align_module_device",
            "retie_parameters",
            "set_module_tensor_to_device",
        )
    },
    **{
        name: "offload"
        for name in (
            "OffloadedWeightsLoader",
            "PrefixedDataset",
            "extract_submodules_state_dict",
            "load_offloaded_weight",
            "offload_state_dict",
            "offload_weight",
            "save_offload_index",
        )
    },
    **{
        name: "dataclasses"
        for name in ("ProfileKwargs", "LoggerType", "PROFILE_PATTERN_NAME", "FP8RecipeKwargs")
    },
    **{name: "versions" for name in ("compare_versions", "is_torch_version")},
    **{
        name: "other"
        for name in (
            "wait_for_everyone",
            "is_port_in_use",
            "get_pretty_name",
            "merge_dicts",
            "recursive_getattr",
            "convert_bytes",
            "is_compiled_module",
            "get_module_children_bottom_up",
            "id_tensor_storage",
            "is_peft_model",
            "get_current_device_type",
            "has_compiled_regions",
            "has_offloaded_params",
            "get_model_tp_size",
            "check_os_kernel",
            "check_tied_parameters_in_config",
            "get_grad_scaler",
            "get_mixed_precision_context_manager",
            "extract_model_from_parallel",
            "compile_regions",
            "get_gpu_info",
            "load",
        )
    },
    "calculate_maximum_sizes": "modeling",
    **{
        name: "env_flags"
        for name in (
            "str_to_bool",
            "parse_flag_from_env",
            "parse_choice_from_env",
            "get_int_from_env",
            "patch_environment",
            "clear_environment",
            "convert_dict_to_env_variables",
            "purge_accelerate_environment",
            "get_cpu_distributed_information",
        )
    },
}
_EXPORTS.update(_SURFACE)
# Work done once on the main process asks the PartialState: it lives above the floor, in
# notebook_accel/main_process.py, and is exported here (accelerate's path) on first use.
_MAIN_PROCESS = ("save", "tqdm", "clean_state_dict_for_safetensors", "merge_fsdp_weights")
__all__ = sorted(set(__all__) | set(_SURFACE) | set(_MAIN_PROCESS))
_siblings = lazy_exports(globals(), _EXPORTS)


def __getattr__(name: str):
    if name in _MAIN_PROCESS:
        from .. import main_process

        value = globals()[name] = getattr(main_process, name)
        return value
    return _siblings(name)
