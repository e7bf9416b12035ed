"""accelerate's `utils.modeling` path: model sizes, tied parameters, device maps, moving tensors and
loading checkpoints. The code lives in `notebook_accel/big_model/`; this module only re-exports it
(and a few floor helpers accelerate exports here too)."""

from __future__ import annotations

from ..big_model.align import align_module_device, get_state_dict_from_offload
from ..big_model.device_map import (
    check_device_map,
    check_devices_exist,
    check_tied_parameters_on_same_device,
    clean_device_map,
    device_for,
    get_max_memory,
)
from ..big_model.loading import (
    LoadReport,
    get_state_dict_offloaded_model,
    load_checkpoint_in_model,
    load_offloaded_weights,
    load_state_dict,
)
from ..big_model.planner import (
    calculate_maximum_sizes,
    get_balanced_memory,
    get_module_size_with_ties,
    infer_auto_device_map,
)
from ..big_model.sizes import (
    compute_module_sizes,
    compute_module_total_buffer_size,
    dtype_byte_size,
    get_max_layer_size,
    get_non_persistent_buffers,
    named_module_tensors,
)
from ..big_model.tensors import (
    find_tied_parameters,
    retie_parameters,
    set_module_tensor_to_device,
    to_torch_device,
)
from ..big_model.weights_files import CheckpointReadError, checkpoint_files
from .constants import WEIGHTS_INDEX_NAME
from .memory import convert_file_size_to_int
from .other import (
    check_device_same,
    check_tied_parameters_in_config,
    get_grad_scaler,
    get_mixed_precision_context_manager,
    has_offloaded_params,
    id_tensor_storage,
    is_peft_model,
)

__all__ = [
    "CheckpointReadError",
    "LoadReport",
    "WEIGHTS_INDEX_NAME",
    "align_module_device",
    "calculate_maximum_sizes",
    "check_device_map",
    "check_device_same",
    "check_devices_exist",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "checkpoint_files",
    "clean_device_map",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "device_for",
    "dtype_byte_size",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_grad_scaler",
    "get_max_layer_size",
    "get_max_memory",
    "get_mixed_precision_context_manager",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
    "id_tensor_storage",
    "infer_auto_device_map",
    "is_peft_model",
    "load_checkpoint_in_model",
    "load_offloaded_weights",
    "load_state_dict",
    "named_module_tensors",
    "retie_parameters",
    "set_module_tensor_to_device",
    "to_torch_device",
]
