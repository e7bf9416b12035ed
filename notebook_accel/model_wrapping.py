"""Wrapping a prepared model for the run (DDP, torch.compile) and unwrapping it back to the user's module.

Accelerator.prepare_model places the model and patches its forward for mixed precision, then hands it
here; Accelerator.unwrap_model and get_state_dict undo the wrappers with `unwrap_model`.
"""

from __future__ import annotations

import contextlib

import torch

from . import precision
from .utils.dataclasses import DistributedDataParallelKwargs, DistributedType, TorchDynamoPlugin

# The distributed types whose models train under DistributedDataParallel.
DDP_TYPES = (
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_HPU,
)


def uses_ddp(state) -> bool:
    """Whether models of this (Accelerator)State's run are wrapped in DistributedDataParallel."""
    return state.use_distributed and state.distributed_type in DDP_TYPES


def wrap_model(
    model: torch.nn.Module,
    state,
    ddp_handler: DistributedDataParallelKwargs | None = None,
    dynamo_plugin: TorchDynamoPlugin | None = None,
    evaluation_mode: bool = False,
) -> torch.nn.Module:
    """`model` in DistributedDataParallel (when the run is distributed, it trains and has trainable
    parameters), then compiled (when `dynamo_plugin` names a backend)."""
    if not evaluation_mode and uses_ddp(state) and any(p.requires_grad for p in model.parameters()):
        model = _ddp(model, state, ddp_handler)
    if dynamo_plugin is not None and dynamo_plugin.backend not in ("no", None):
        model = torch.compile(model, **dynamo_plugin.to_compile_kwargs())
    return model


def _ddp(model, state, ddp_handler):
    kwargs = ddp_handler.to_kwargs() if ddp_handler else {}
    hook, hook_state = kwargs.pop("comm_hook", None), kwargs.pop("comm_state", None)
    # DDP takes device ids only for single-device modules on an accelerator.
    ids = [state.local_process_index] if state.device.type not in ("cpu", "meta") else None
    model = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=ids, output_device=ids[0] if ids else None, **kwargs
    )
    if hook is not None:
        model.register_comm_hook(hook_state, hook)
    return model


def unwrap_model(model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
    """The user's module: without DDP (and torch.compile unless keep_torch_compile and it wraps
    the module directly); keep_fp32_wrapper=False also restores the original forward."""
    compiled = getattr(model, "_orig_mod", None)
    inner = compiled if compiled is not None else model
    while isinstance(inner, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        inner = inner.module
    if not keep_fp32_wrapper:
        precision.restore_forward(inner)
    if keep_torch_compile and compiled is not None and inner is compiled:
        return model
    return inner


@contextlib.contextmanager
def sync_in_next_backward(model):
    """Make the next backward of a DDP model all-reduce gradients even inside `no_sync`.

    After several forwards under `no_sync`, DDP's reducer expects no reduction; flipping its two sync
    flags and preparing the reducer with no unused outputs makes the coming backward reduce.
    Outside DDP (one process, or a model not wrapped) this does nothing.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        yield
        return
    saved = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = saved
