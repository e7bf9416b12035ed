"""Autocast and the gradient scaler for the run's device and mixed precision (accelerate's
`get_grad_scaler` and `get_mixed_precision_context_manager`).

They ask the process's state, so they sit above state.py; accelerate's paths
(`notebook_accel.utils.other`, `notebook_accel.utils.modeling`) re-export them."""

from __future__ import annotations

import contextlib

import torch

from .state import AcceleratorState, PartialState
from .utils.dataclasses import AutocastKwargs


def get_grad_scaler(distributed_type=None, **kwargs):
    """A torch.amp.GradScaler for this process's device type (its PartialState's device); `kwargs` go to the scaler."""
    if str(distributed_type) == "FSDP":
        raise NotImplementedError("FSDP's sharded grad scaler: notebook_accel trains with DDP, not FSDP")
    return torch.amp.GradScaler(PartialState().device.type, **kwargs)


_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs=None):
    """With `native_amp`, torch.autocast on the AcceleratorState's device type in its mixed
    precision: float16 for "fp16", bfloat16 for "bf16" and "fp8", torch's default for the device
    with "no" (as accelerate); without it, a null context. `autocast_kwargs` is an AutocastKwargs."""
    if autocast_kwargs is None:
        kwargs = {}
    elif isinstance(autocast_kwargs, AutocastKwargs):
        kwargs = autocast_kwargs.to_kwargs()
    else:
        raise TypeError(f"autocast_kwargs must be an AutocastKwargs or None, got {autocast_kwargs!r}.")
    if not native_amp:
        return contextlib.nullcontext()
    state = AcceleratorState()
    dtype = _AUTOCAST_DTYPES.get(state.mixed_precision)
    if dtype is not None:
        kwargs["dtype"] = dtype
    return torch.autocast(device_type=state.device.type, **kwargs)
