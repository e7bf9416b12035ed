"""accelerate's `utils.offload` path: the offload store and the lazy weights map. The code lives in
`notebook_accel/big_model/store.py`; this module only re-exports it."""

from __future__ import annotations

from ..big_model.store import (
    INDEX_NAME,
    OffloadedWeightsLoader,
    PrefixedDataset,
    dtype_from_name,
    dtype_name,
    extract_submodules_state_dict,
    load_offload_index,
    load_offloaded_weight,
    lookup,
    offload_state_dict,
    offload_weight,
    root_loader,
    safetensors_reference,
    save_offload_index,
)

__all__ = [
    "INDEX_NAME",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "dtype_from_name",
    "dtype_name",
    "extract_submodules_state_dict",
    "load_offload_index",
    "load_offloaded_weight",
    "lookup",
    "offload_state_dict",
    "offload_weight",
    "root_loader",
    "safetensors_reference",
    "save_offload_index",
]
