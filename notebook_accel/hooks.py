"""accelerate's `hooks` path: the forward hooks that move inputs and weights where a module runs.
The code lives in `notebook_accel/big_model/hooks.py` (and the layerwise casting hook in
`big_model/layerwise_casting.py`); this module only re-exports it."""

from __future__ import annotations

from .big_model.hooks import (
    AlignDevicesHook,
    CpuOffload,
    ModelHook,
    SequentialHook,
    UserCpuOffloadHook,
    add_hook_to_module,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
    remove_hook_from_module,
    remove_hook_from_submodules,
)
from .big_model.layerwise_casting import LayerwiseCastingHook

__all__ = [
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "AlignDevicesHook",
    "CpuOffload",
    "UserCpuOffloadHook",
    "LayerwiseCastingHook",
    "attach_execution_device_hook",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
]
