"""Nested-structure helpers that work in one process: walking, rebuilding, moving, measuring and
padding tensors nested in lists, tuples (namedtuples too) and mappings (accelerate's names; the
collectives in `operations.py` build on them, and it re-exports them at accelerate's path).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping
from numbers import Integral
from typing import Callable

import torch

from . import families
from .dataclasses import TensorInformation


def is_torch_tensor(tensor) -> bool:
    return isinstance(tensor, torch.Tensor)


def is_tensor_information(tensor_info) -> bool:
    return isinstance(tensor_info, TensorInformation)


def is_namedtuple(data) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj, generator):
    """Build a sequence of `obj`'s type from `generator` (namedtuples take positional fields)."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def _rebuild_mapping(original: Mapping, items: dict):
    # type(m)(dict) fails for defaultdict and for mappings with other constructors.
    if isinstance(original, defaultdict):
        return type(original)(original.default_factory, items)
    try:
        return type(original)(items)
    except TypeError:
        return dict(items)


def recursively_apply(func, data, *args, test_type=is_torch_tensor, error_on_other_type=False, **kwargs):
    """Apply `func(leaf, *args, **kwargs)` to every leaf of `data` that passes `test_type`.

    Lists, tuples and mappings are rebuilt with their own type; other leaves are returned as they
    are, or raise TypeError with `error_on_other_type=True`.
    """

    def recurse(item):
        return recursively_apply(
            func, item, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
        )

    if isinstance(data, (tuple, list)):
        return honor_type(data, (recurse(o) for o in data))
    if isinstance(data, Mapping):
        return _rebuild_mapping(data, {k: recurse(v) for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        name = getattr(func, "__name__", repr(func))
        # accelerate's wording, word for word: code (its tests too) compares the message.
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{name}`. Only nested list/tuple/dicts of objects "
            f"that are valid for `{getattr(test_type, '__name__', test_type)}` should be passed."
        )
    return data


def send_to_device(tensor, device, non_blocking: bool = False, skip_keys=None):
    """Move every tensor (and any object with `.to()`) in a nested structure to `device`.

    Mapping keys in `skip_keys` (a name or a list of names) are left where they are.
    """
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    skip_keys = list(skip_keys or [])
    recurse = functools.partial(send_to_device, device=device, non_blocking=non_blocking, skip_keys=skip_keys)
    # A mapping with its own .to() (a tokenizer's BatchEncoding) moves itself, unless keys must stay.
    if isinstance(tensor, Mapping) and skip_keys:
        return _rebuild_mapping(tensor, {k: v if k in skip_keys else recurse(v) for k, v in tensor.items()})
    if is_torch_tensor(tensor) or hasattr(tensor, "to"):
        device = _normalise_device(device)
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:  # a .to() without non_blocking
            return tensor.to(device)
    if isinstance(tensor, (tuple, list)):
        return honor_type(tensor, (recurse(t) for t in tensor))
    if isinstance(tensor, Mapping):
        return _rebuild_mapping(tensor, {k: recurse(v) for k, v in tensor.items()})
    return tensor


def _normalise_device(device):
    # Some vendor plugins (torch_npu, early xpu) cannot resolve a bare family name before first use.
    if isinstance(device, str) and device in families.names() and families.family(device).needs_index:
        return f"{device}:0"
    return device


def get_data_structure(data):
    """The same structure with each tensor replaced by its TensorInformation (shape, dtype)."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def get_shape(data):
    return recursively_apply(lambda t: list(t.shape), data)


def initialize_tensors(data_structure):
    """Empty tensors shaped like a `get_data_structure` result (for receiving a broadcast)."""
    return recursively_apply(
        lambda info: torch.empty(*info.shape, dtype=info.dtype),
        data_structure,
        test_type=is_tensor_information,
    )


def _first(data, pick):
    """`pick(tensor)` for the first tensor of `data` (depth-first, in order) where it is not None."""
    if isinstance(data, (tuple, list)):
        items = data
    elif isinstance(data, Mapping):
        items = data.values()
    elif is_torch_tensor(data):
        return pick(data)
    else:
        return None
    for item in items:
        found = _first(item, pick)
        if found is not None:
            return found
    return None


def _first_batch_dim(data):
    # Non-tensors and 0-d tensors have no batch dimension to offer.
    return _first(data, lambda t: t.shape[0] if t.ndim > 0 else None)


def find_device(data):
    """The device of the first tensor in `data` (nested lists, tuples and dicts, depth-first), or
    None when it holds no tensor. Meant for data whose tensors share one device, as a batch's do."""
    return _first(data, lambda t: t.device)


def find_batch_size(data) -> int:
    """The first dimension of the first tensor (with at least one dimension) in `data`."""
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"Cannot find the batch size of an empty {type(data).__name__}.")
    found = _first_batch_dim(data)
    if found is None:
        raise TypeError(
            f"Cannot find a batch size in {type(data).__name__}: it holds no tensor with a batch dimension "
            "(find_batch_size looks for the first tensor of at least one dimension in lists, tuples and dicts)."
        )
    return found


def ignorant_find_batch_size(data):
    """find_batch_size, or None where there is none to find."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def listify(data):
    """Tensors become (nested) Python lists, on the CPU; bf16 goes through fp32 (.tolist() refuses it)."""

    def _to_list(tensor):
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        return tensor.tolist()

    return recursively_apply(_to_list, data)


def slice_tensors(data, tensor_slice, process_index=None, num_processes=None):
    """`tensor[tensor_slice]` for every tensor in `data` (the process arguments are accepted, unused)."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def concatenate(data, dim: int = 0):
    """Concatenate a list of same-structured nested tensors along `dim`, keeping the structure; a
    list of one batch gives that batch back as it is, tensors or not."""
    if len(data) == 0:
        raise ValueError("concatenate() needs at least one element to concatenate.")
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return _rebuild_mapping(first, {k: concatenate([d[k] for d in data], dim=dim) for k in first.keys()})
    if not is_torch_tensor(first):
        if len(data) == 1:  # one batch: nothing to join, whatever it holds (as accelerate does)
            return first
        raise TypeError(
            f"concatenate() works on tensors (nested in lists, tuples, dicts), not {type(first).__name__}."
        )
    return torch.cat(list(data), dim=dim)


def _is_half_tensor(tensor) -> bool:
    return hasattr(tensor, "dtype") and tensor.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor):
    """fp16 / bf16 tensors in a nested structure become fp32; everything else is left alone."""
    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half_tensor)


class ConvertOutputsToFp32:
    """Wrap a forward so its half-precision outputs come back in fp32 (picklable, unlike a closure)."""

    def __init__(self, model_forward: Callable) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args, **kwargs):
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self):
        raise RuntimeError("Cannot pickle a prepared model with automatic mixed precision; unwrap it first.")


def convert_outputs_to_fp32(model_forward: Callable) -> Callable:
    return ConvertOutputsToFp32(model_forward)


def _count(value, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < least:
        raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}.")
    return int(value)


def pad_input_tensors(tensor, batch_size, num_processes, dim=0):
    """Pad each tensor's `dim` with zeros from `batch_size` rows up to the next multiple of
    `num_processes` (at least `num_processes`), so the batch splits evenly across the processes;
    a batch that already does is returned as it is. E.g. 3 rows for 4 processes become 4, 5 become 8.

    Every tensor must have `batch_size` entries along `dim` (tensors with fewer dimensions are left
    alone). accelerate 1.15 computes sizes that do not always split (4 rows for 4 processes become
    7 there); here the padded size is always a multiple.
    """
    batch_size = _count(batch_size, "batch_size", 0)
    num_processes = _count(num_processes, "num_processes", 1)
    if isinstance(dim, bool) or not isinstance(dim, Integral):
        raise TypeError(f"dim must be an integer, got {dim!r}.")
    target = max(num_processes, -(-batch_size // num_processes) * num_processes) if batch_size else 0

    def _pad_one(t: torch.Tensor) -> torch.Tensor:
        if not -t.ndim <= dim < t.ndim:
            return t
        d = dim % t.ndim
        if t.shape[d] != batch_size:
            raise ValueError(
                f"pad_input_tensors(batch_size={batch_size}, dim={dim}) got a tensor of shape {tuple(t.shape)}: "
                f"every tensor must have {batch_size} entries along dim {dim}."
            )
        if target == batch_size:
            return t
        new_shape = list(t.shape)
        new_shape[d] = target
        padded = t.new_zeros(new_shape)
        padded.narrow(d, 0, batch_size).copy_(t)
        return padded

    return recursively_apply(_pad_one, tensor, error_on_other_type=True)
