"""accelerate's path for its collectives and nested-structure helpers (`notebook_accel.utils.operations`).

The collectives ask the process's PartialState, so they live above state.py, in collectives.py;
the nested-structure helpers live in structures.py. Both are importable from here, as in accelerate.
"""

from __future__ import annotations

from ..collectives import (  # noqa: F401  (accelerate's names at accelerate's path)
    TENSOR_INT_TO_DTYPE,
    TENSOR_TYPE_TO_INT,
    CannotPadNestedTensorWarning,
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    chained_operation,
    copy_tensor_to_devices,
    gather,
    gather_object,
    gather_tensor_shape,
    pad_across_processes,
    reduce,
    verify_operation,
)
from .dataclasses import TensorInformation  # noqa: F401
from .structures import (  # noqa: F401  (accelerate's names at accelerate's path)
    ConvertOutputsToFp32,
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    find_batch_size,
    find_device,
    get_data_structure,
    get_shape,
    honor_type,
    ignorant_find_batch_size,
    initialize_tensors,
    is_namedtuple,
    is_tensor_information,
    is_torch_tensor,
    listify,
    pad_input_tensors,
    recursively_apply,
    send_to_device,
    slice_tensors,
)
