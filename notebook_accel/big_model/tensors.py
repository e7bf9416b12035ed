"""Tied parameters, and putting one parameter or buffer on a device.

A device-map value names a device: an integer accelerator id (of this machine's accelerator
family, from hardware.py), "cpu", "meta", or a torch device; "disk" is the offload store, not a
torch device.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch

from .sizes import _as_dtype, _converts

_KNOWN_DEVICES = "an integer accelerator id, 'cpu', 'disk', 'meta', 'mps' or a torch device such as 'cuda:1'"


def find_tied_parameters(model: torch.nn.Module, **kwargs) -> list:
    """Groups of parameter names that share one Parameter object, e.g. [["embed.weight", "head.weight"]].

    Identity is what ties, so this works on the meta device too. Groups and their names are sorted.
    """
    names_by_param = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param[id(param)].append(name)
    return sorted(sorted(set(names)) for names in names_by_param.values() if len(set(names)) > 1)


def _get(model: torch.nn.Module, dotted: str):
    obj = model
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _owner(model: torch.nn.Module, tensor_name: str):
    """(module, local name) of the module holding `tensor_name`."""
    if "." not in tensor_name:
        return model, tensor_name
    path, local = tensor_name.rsplit(".", 1)
    try:
        return _get(model, path), local
    except AttributeError:
        raise ValueError(
            f"{type(model).__name__} has no submodule {path!r} (looking for {tensor_name!r})."
        ) from None


def retie_parameters(model: torch.nn.Module, tied_params: list) -> None:
    """Make every name of each group in `tied_params` hold the same Parameter again.

    Loading replaces Parameter objects one by one, which unties them. The group's first member
    that has data (not on the meta device) is the one kept.
    """
    for group in tied_params:
        params = [_owner(model, name) for name in group]
        values = [module._parameters.get(local) for module, local in params]
        source = next((v for v in values if v is not None and v.device.type != "meta"), values[0])
        for module, local in params:
            module._parameters[local] = source


# -- moving one tensor ---------------------------------------------------------------------------


def _accelerator_family() -> str:
    from ..hardware import accelerators

    found = accelerators()
    return found[0].kind if found else "cuda"


def to_torch_device(device) -> torch.device:
    """torch.device for a device-map value: 0 -> cuda:0 (or this machine's accelerator family)."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool):
        raise ValueError(f"Invalid device {device!r}: expected {_KNOWN_DEVICES}.")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"Invalid device {device!r}: accelerator ids are non-negative.")
        return torch.device(_accelerator_family(), device)
    if device == "disk":
        raise ValueError("'disk' is not a torch device: tensors mapped to 'disk' live in the offload store.")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Invalid device {device!r}: expected {_KNOWN_DEVICES}.") from None


def set_module_tensor_to_device(
    module: torch.nn.Module,
    tensor_name: str,
    device,
    value=None,
    dtype=None,
    fp16_statistics=None,
    tied_params_map: Optional[dict] = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put the parameter or buffer `tensor_name` (dotted, relative to `module`) on `device`.

    `value` replaces its data (shapes must match); without one, the current data moves, which a
    meta tensor cannot do. The result is converted to `dtype` (default: the tensor's current
    dtype), except integer and bool tensors, which keep theirs. A parameter stays a parameter of
    the same class with the same requires_grad. `tied_params_map` ({value.data_ptr(): {torch.device:
    tensor}}; 0 and "cuda:0" are one key) lets tied weights reuse the copy already made on `device`:
    only sources whose data_ptr has a slot are recorded. `non_blocking` copies asynchronously where
    the devices allow it. With `clear_cache`, replacing a tensor that was on an accelerator returns
    the accelerator's cached memory to the driver.
    """
    if value is not None and not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    owner, name = _owner(module, tensor_name)
    is_buffer = name in owner._buffers
    if name not in owner._parameters and not is_buffer:
        raise ValueError(
            f"{type(owner).__name__} ({tensor_name!r}) has no parameter or buffer named {name!r}."
        )
    old = getattr(owner, name)
    target = to_torch_device(device)
    if old is None:
        raise ValueError(f"{tensor_name!r} is registered as None; there is nothing to move.")
    if value is None and old.device.type == "meta" and target.type != "meta":
        raise ValueError(
            f"{tensor_name!r} is on the meta device (it has no data): pass a `value` to put on {device}."
        )

    if value is not None and tied_params_map is not None and value.device.type != "meta":
        shared = tied_params_map.get(value.data_ptr(), {}).get(target)
        if shared is not None:
            (owner._buffers if is_buffer else owner._parameters)[name] = shared
            return

    if value is None:
        new = old.detach()
    else:
        new = value.detach()
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(
                f'Trying to set a tensor of shape {new.shape} in "{name}" (which has shape {old.shape}), '
                f"this looks incorrect."
            )
    want = _as_dtype(dtype) if dtype is not None else (old.dtype if value is not None else None)
    if (
        want is not None
        and new.dtype != want
        and (_converts(new.dtype) or (dtype is None and value is not None))
    ):
        new = new.to(want, non_blocking=non_blocking)
    new = new.to(target, non_blocking=non_blocking)
    if value is None and new.dtype == old.dtype and new.device == old.device:
        return  # already there: keep the same object, so ties and optimizer references hold

    if is_buffer:
        owner._buffers[name] = new
    else:
        old_param = owner._parameters[name]
        cls = type(old_param)
        requires_grad = old_param.requires_grad and (new.is_floating_point() or new.is_complex())
        if cls is torch.nn.Parameter:
            param = torch.nn.Parameter(new, requires_grad=requires_grad)
        else:  # a Parameter subclass: keep its class and its extra attributes
            param = cls(new, requires_grad=requires_grad)
            param.__dict__.update(old_param.__dict__)
        if fp16_statistics is not None:
            param.SCB = fp16_statistics.to(target, non_blocking=non_blocking)
        owner._parameters[name] = param
        new = param
        del old_param
    if value is not None and tied_params_map is not None and value.device.type != "meta":
        slot = tied_params_map.get(value.data_ptr())
        if slot is not None:
            slot[target] = new
    # Only what the replaced tensor held on an accelerator is worth giving back: a tensor coming from
    # the CPU or meta (the offload hooks, at every forward) frees nothing there, and emptying the
    # cache would only make the next allocations ask the driver again.
    if clear_cache and target.type not in ("cpu", "meta") and old.device.type not in ("cpu", "meta"):
        from ..utils.memory import clear_device_cache

        del old
        clear_device_cache()
