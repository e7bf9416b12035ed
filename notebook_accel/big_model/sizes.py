"""How many bytes a model's tensors take: per dtype, per name prefix, per layer.

Sizes feed the device-map planner (`planner.py`) and the memory estimate; nothing here moves data.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Optional

import torch


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
