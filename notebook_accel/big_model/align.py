"""An offloaded module's weights in place for a moment: whether a module is offloaded, and its
weights brought to one device inside a `with` block (accelerate's `align_module_device`)."""

from __future__ import annotations

import contextlib

import torch

from ..utils.other import has_offloaded_params
from . import read_ahead
from .tensors import set_module_tensor_to_device


@contextlib.contextmanager
def align_module_device(module: torch.nn.Module, execution_device=None):
    """Inside, `module`'s own parameters are on one device: an offloading hook loads them (onto
    `execution_device` if given) and offloads them again after; otherwise, with `execution_device`,
    they are moved there and back. Without either, nothing moves."""
    if has_offloaded_params(module):
        hook = module._hf_hook
        hooks = getattr(hook, "hooks", [hook])
        previous = [h.execution_device for h in hooks]
        if execution_device is not None:
            for h in hooks:
                h.execution_device = execution_device
        try:
            hook.pre_forward(module)
            yield
        finally:
            hook.post_forward(module, None)
            for h, device in zip(hooks, previous):
                h.execution_device = device
            read_ahead.give_room_back()  # its lookups may have made room for reads ahead (read_ahead.make_room)
    elif execution_device is not None:
        devices = {name: p.device for name, p in module.named_parameters(recurse=False)}
        try:
            for name in devices:
                set_module_tensor_to_device(module, name, execution_device)
            yield
        finally:
            for name, device in devices.items():
                set_module_tensor_to_device(module, name, device)
    else:
        yield


def get_state_dict_from_offload(
    module: torch.nn.Module,
    module_name: str,
    state_dict: dict,
    device_to_put_offload="cpu",
) -> dict:
    """Fill the entries of `state_dict` that belong to `module` (named `module_name`, a dotted
    tensor name such as "linear2.weight") with its tensors, onloaded to `device_to_put_offload`
    when an offloading hook keeps them elsewhere; a module that is not offloaded stays where it is."""
    prefix = module_name.rpartition(".")[0]  # the module's own name, without ".weight" / ".bias"
    device = device_to_put_offload if has_offloaded_params(module) else None
    with align_module_device(module, device):
        for key, tensor in module.state_dict().items():
            full = f"{prefix}.{key}"
            if full in state_dict:
                state_dict[full] = tensor
    return state_dict
