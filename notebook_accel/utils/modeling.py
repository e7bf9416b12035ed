"""Model sizes, tied parameters, device maps and moving single tensors between devices.

Device maps name where each module lives: `{module name: device}`, with integer accelerator ids,
"cpu", "disk" (the offload store) or "meta". A name covers everything under it; the longest
matching prefix wins. Planning lives in `device_map.py` and checkpoint loading in `loading.py`; both
are re-exported here under accelerate's names.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections import defaultdict
from typing import Optional

import torch

from . import current, families
from .constants import WEIGHTS_INDEX_NAME  # noqa: F401  (accelerate exports it here too)
from .lazy import lazy_exports
from .memory import parse_memory_size

_KNOWN_DEVICES = "an integer accelerator id, 'cpu', 'disk', 'meta', 'mps' or a torch device such as 'cuda:1'"


@functools.lru_cache(maxsize=None)
def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_byte_size(dtype):
    """Bytes one element of `dtype` takes (torch.float16 -> 2), as accelerate counts them: a bool is
    one bit, 1/8. Sizes here (`compute_module_sizes`) count a bool as the byte torch stores."""
    dtype = _as_dtype(dtype)
    if dtype == torch.bool:
        return 1 / 8
    return _element_size(dtype)


def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}: pass a torch.dtype or its name, such as 'float16'.")
    return value


def _converts(tensor_dtype: torch.dtype) -> bool:
    # Integer and bool tensors (token ids, masks, counters) keep their dtype when a model is cast.
    return tensor_dtype.is_floating_point or tensor_dtype.is_complex


def get_non_persistent_buffers(module: torch.nn.Module, recurse: bool = False, fqns: bool = False) -> set:
    """Names of the buffers left out of `state_dict`, a new set (the modules' own are not touched).

    With `recurse`, those of every submodule too: by their own name, as accelerate gives them, or
    with `fqns` by their name relative to `module` ("sub.mask").
    """
    names = set(module._non_persistent_buffers_set)
    if recurse:
        for prefix, sub in module.named_modules():
            if prefix:
                names |= {f"{prefix}.{n}" if fqns else n for n in sub._non_persistent_buffers_set}
    return names


def named_module_tensors(
    module: torch.nn.Module,
    include_buffers: bool = True,
    recurse: bool = False,
    remove_non_persistent: bool = False,
):
    """(name, tensor) for the parameters of `module`, then its buffers; a shared tensor appears once."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skip = get_non_persistent_buffers(module, recurse, fqns=True) if remove_non_persistent else set()
        for name, buffer in module.named_buffers(recurse=recurse):
            if name not in skip:
                yield name, buffer


def _tensor_size(name, tensor, dtype_size, special_sizes) -> int:
    if name in special_sizes:
        return tensor.numel() * special_sizes[name]
    if dtype_size is None or not _converts(tensor.dtype):
        return tensor.numel() * _element_size(tensor.dtype)
    return tensor.numel() * dtype_size


def compute_module_sizes(
    model: torch.nn.Module, dtype=None, special_dtypes: Optional[dict] = None, buffers_only: bool = False
) -> dict:
    """Bytes held under each name prefix: every module, every tensor, and "" for the whole model.

    `dtype` is the dtype floating tensors will be loaded in (integer and bool ones keep theirs);
    `special_dtypes` overrides it per tensor name. Meta tensors count as numel * itemsize, and a
    tied tensor counts once, under the first name that holds it.
    """
    dtype_size = _element_size(_as_dtype(dtype)) if dtype is not None else None
    special_sizes = {n: _element_size(_as_dtype(d)) for n, d in (special_dtypes or {}).items()}
    sizes = defaultdict(int)
    tensors = model.named_buffers() if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        size = _tensor_size(name, tensor, dtype_size, special_sizes)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += size
    return dict(sizes)


def compute_module_total_buffer_size(model: torch.nn.Module, dtype=None, special_dtypes=None) -> int:
    """Bytes of all of `model`'s buffers."""
    return compute_module_sizes(model, dtype, special_dtypes, buffers_only=True).get("", 0)


def _layers(modules, no_split_module_classes):
    """(name, module) of the layers: leaf modules, bare tensors and unsplittable blocks."""
    no_split = set(no_split_module_classes or ())
    pending = list(modules)
    while pending:
        name, obj = pending.pop(0)
        children = list(obj.named_children()) if isinstance(obj, torch.nn.Module) else []
        if not children or type(obj).__name__ in no_split:
            yield name, obj
        else:
            pending = [(f"{name}.{n}" if name else n, c) for n, c in children] + pending


def get_max_layer_size(modules, module_sizes: dict, no_split_module_classes) -> tuple:
    """(size, names) of the largest layer in `modules` ((name, module or tensor) pairs).

    A layer is a module without children, a module of a class in `no_split_module_classes`, or a
    bare tensor; `names` lists every layer of that size.
    """
    best, names = 0, []
    for name, _ in _layers(modules, no_split_module_classes):
        size = module_sizes.get(name, 0)
        if size > best:
            best, names = size, [name]
        elif size == best:
            names.append(name)
    return best, names


# -- tied parameters -----------------------------------------------------------------------------


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


def check_tied_parameters_on_same_device(tied_params: list, device_map: dict) -> list:
    """The tie groups whose members the map sends to different devices (also logged as a warning)."""
    split = []
    for group in tied_params:
        devices = {str(device_for(name, device_map)) for name in group}
        if len(devices) > 1:
            split.append(group)
    if split:
        import logging

        logging.getLogger(__name__).warning(
            "Tied parameters are mapped to different devices and will be copied, not shared: %s", split
        )
    return split


# -- moving one tensor ---------------------------------------------------------------------------


def _accelerator_family() -> str:
    found = current.accelerators()
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
        from .memory import clear_device_cache

        del old
        clear_device_cache()


# -- device maps ---------------------------------------------------------------------------------


def device_for(name: str, device_map: dict):
    """The device `device_map` gives the tensor or module `name` (longest matching prefix)."""
    probe = name
    while True:
        if probe in device_map:
            return device_map[probe]
        if not probe:
            raise KeyError(f"The device map gives no device for {name!r}.")
        probe = probe.rsplit(".", 1)[0] if "." in probe else ""


def _check_device_value(key, device) -> None:
    if device in ("disk", "meta", "cpu") or isinstance(device, torch.device):
        return
    try:
        to_torch_device(device) if not isinstance(device, int) else None
    except ValueError:
        raise ValueError(f"device_map[{key!r}] = {device!r} is not a device: use {_KNOWN_DEVICES}.") from None
    if isinstance(device, bool) or (isinstance(device, int) and device < 0):
        raise ValueError(f"device_map[{key!r}] = {device!r} is not a device: use {_KNOWN_DEVICES}.")


# Families whose devices the machine lists by index (xla and neuron have no torch module to count).
_PROBED_KINDS = tuple(f.name for f in families.FAMILIES if f.torch_module is not None)


def check_devices_exist(device_map: dict) -> None:
    """Raise ValueError for a device-map value naming an accelerator this process does not have.

    Without this, weights placed on `0` on a CPU-only machine fail only at forward time, with
    torch's "cannot access accelerator device". Asks hardware.py, which leaves CUDA uninitialised.
    """
    for key, device in device_map.items():
        if device in ("disk", "meta", "cpu") or isinstance(device, bool):
            continue
        target = to_torch_device(device)
        if target.type not in _PROBED_KINDS:  # cpu, meta, xla: nothing to count here
            continue
        have = sorted(a.index for a in current.accelerators() if a.kind == target.type)
        if not have:
            raise ValueError(
                f"device_map[{key!r}] = {device!r}, but this machine has no {target.type} device: map it to "
                "'cpu' or 'disk', or pass device_map='auto'."
            )
        if target.index is not None and target.index not in have:
            raise ValueError(
                f"device_map[{key!r}] = {device!r}, but the {target.type} devices here are {have}: "
                "use one of those, 'cpu' or 'disk'."
            )


def check_device_map(model: torch.nn.Module, device_map: dict) -> None:
    """Raise ValueError unless `device_map` covers every tensor of `model` with a valid device.

    A key that names no module or tensor of `model` is only warned about (UserWarning), as
    accelerate does: it places nothing.
    """
    if not isinstance(device_map, dict):
        raise ValueError(f"A device map is a dict {{module name: device}}, not {type(device_map).__name__}.")
    modules = {name for name, _ in model.named_modules()}
    tensors = [name for name, _ in named_module_tensors(model, recurse=True)]
    known = modules | set(tensors) | set(model.state_dict(keep_vars=True))
    unknown = [key for key in device_map if key not in known]
    if unknown:
        near = sorted(m for m in modules if m and any(m.split(".")[-1] == u.split(".")[-1] for u in unknown))[
            :5
        ]
        hint = f" Modules with a similar last name: {near}." if near else ""
        warnings.warn(
            f"These device_map keys do not match any submodules in {type(model).__name__}, and place nothing: "
            f"{unknown}.{hint} Keys are module or tensor names from model.named_modules() / model.state_dict().",
            UserWarning,
            stacklevel=2,
        )
    for key, device in device_map.items():
        _check_device_value(key, device)
    uncovered = []
    # Non-persistent buffers may go unmapped, as in accelerate: they stay where they are.
    for name in model.state_dict(keep_vars=True):
        try:
            device_for(name, device_map)
        except KeyError:
            if name not in uncovered:
                uncovered.append(name)
    if uncovered:
        raise ValueError(
            f"The device map gives no device for these tensors: {uncovered}. Map them or a module holding them."
        )


def clean_device_map(device_map: dict, module_name: str = "") -> dict:
    """Merge entries into their parent module wherever all of the parent's entries share a device.

    The order of first appearance is kept. Returns `device_map` itself, updated in place.
    """

    def merge(items, prefix):
        # items: [(name, device)] all under `prefix`; returns the merged list.
        devices = {str(d) for _, d in items}
        if len(items) > 1 and len(devices) == 1 and not any(n == prefix for n, _ in items):
            return [(prefix, items[0][1])]
        groups, order = {}, []
        cut = len(prefix) + 1 if prefix else 0
        for name, device in items:
            head = name[cut:].split(".", 1)[0]
            child = f"{prefix}.{head}" if prefix else head
            key = name if name == prefix else child
            if key not in groups:
                groups[key] = []
                order.append(key)
            groups[key].append((name, device))
        merged = []
        for key in order:
            group = groups[key]
            merged.extend(group if len(group) == 1 else merge(group, key))
        return merged

    under = [
        (n, d)
        for n, d in device_map.items()
        if not module_name or n == module_name or n.startswith(module_name + ".")
    ]
    result = merge(under, module_name)
    rest = [(n, d) for n, d in device_map.items() if (n, d) not in under]
    device_map.clear()
    device_map.update(result)
    device_map.update(rest)
    return device_map


_DEVICE_STR = re.compile(r"^[a-z_]+(:\d+)?$")


def get_max_memory(max_memory: Optional[dict] = None) -> dict:
    """{device: bytes} in planning order: accelerator ids, other accelerators, "cpu", then "disk".

    Without `max_memory`: the free memory of each accelerator and the CPU's available memory. With
    one, sizes may be strings ("10GiB", "500MB") or ints, and integer ids need not exist here (a
    plan can be made for another machine).
    """
    if max_memory is None:
        found = {}
        for device in current.accelerators():
            free = device.free_memory if device.free_memory is not None else device.total_memory
            if free is not None:
                key = device.index if device.kind != "mps" else "mps"
                found[key] = int(free)
        found["cpu"] = int(current.ram_available())
        return found
    if not isinstance(max_memory, dict):
        raise ValueError(
            f"max_memory is a dict {{device: size}}, e.g. {{0: '10GiB', 'cpu': '30GiB'}}; got {max_memory!r}."
        )
    parsed = {}
    for key, size in max_memory.items():
        if isinstance(key, bool) or not (
            (isinstance(key, int) and key >= 0) or (isinstance(key, str) and _DEVICE_STR.match(key))
        ):
            raise ValueError(f"max_memory key {key!r} is not a device: use {_KNOWN_DEVICES}.")
        try:
            parsed[key] = parse_memory_size(size)
        except ValueError as exc:
            raise ValueError(f"max_memory[{key!r}]: {exc}") from None
    ids = sorted(k for k in parsed if isinstance(k, int))
    others = [k for k in parsed if isinstance(k, str) and k not in ("cpu", "disk")]
    tail = [k for k in ("cpu", "disk") if k in parsed]
    return {k: parsed[k] for k in ids + others + tail}


# Planning and loading live in their own modules and import this one; they are public here too,
# resolved on first use so that importing either module first works.
_ELSEWHERE = {
    "get_balanced_memory": "device_map",
    "get_module_size_with_ties": "device_map",
    "infer_auto_device_map": "device_map",
    "LoadReport": "loading",
    "CheckpointReadError": "loading",
    "checkpoint_files": "loading",
    "get_state_dict_offloaded_model": "loading",
    "load_checkpoint_in_model": "loading",
    "load_offloaded_weights": "loading",
    "load_state_dict": "loading",
    "convert_file_size_to_int": "memory",
    "id_tensor_storage": "other",
    "is_peft_model": "other",
    "has_offloaded_params": "other",
    "check_device_same": "other",
    "check_tied_parameters_in_config": "other",
    "get_grad_scaler": "other",
    "get_mixed_precision_context_manager": "other",
    "align_module_device": "other",
    "calculate_maximum_sizes": "device_map",
}


__getattr__ = lazy_exports(globals(), _ELSEWHERE)


def __dir__():
    return sorted(list(globals()) + list(_ELSEWHERE))


def get_state_dict_from_offload(
    module: torch.nn.Module,
    module_name: str,
    state_dict: dict,
    device_to_put_offload="cpu",
) -> dict:
    """Fill the entries of `state_dict` that belong to `module` (named `module_name`, a dotted
    tensor name such as "linear2.weight") with its tensors, onloaded to `device_to_put_offload`
    when an offloading hook keeps them elsewhere; a module that is not offloaded stays where it is."""
    from .other import align_module_device, has_offloaded_params

    prefix = module_name.rpartition(".")[0]  # the module's own name, without ".weight" / ".bias"
    device = device_to_put_offload if has_offloaded_params(module) else None
    with align_module_device(module, device):
        for key, tensor in module.state_dict().items():
            full = f"{prefix}.{key}"
            if full in state_dict:
                state_dict[full] = tensor
    return state_dict
