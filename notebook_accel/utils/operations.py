"""Nested-structure helpers and the collectives a training loop calls (accelerate's names).

Every collective works on tensors nested in lists, tuples (namedtuples too), and mappings. In a
single process each one returns its input (reduce returns a copy, so callers may modify it, and
gather_object a list, as it does across ranks).
With `ACCELERATE_DEBUG_MODE=1`, gather / reduce / broadcast first compare every rank's shapes
and raise `DistributedOperationException` on all ranks instead of hanging.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Callable

import torch

from . import families
from .current import current_state
from .dataclasses import DistributedType


class DistributedOperationException(Exception):
    """A collective was called with inputs that cannot work together across ranks."""


@dataclass
class TensorInformation:
    shape: torch.Size
    dtype: torch.dtype


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
        raise TypeError(
            f"Unsupported type {type(data).__name__} passed to {name}: only tensors nested in "
            f"lists, tuples and dicts (leaves passing {getattr(test_type, '__name__', test_type)}) are accepted."
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


def _first_batch_dim(data):
    # Depth-first, in order; non-tensors and 0-d tensors have no batch dimension to offer.
    if isinstance(data, (tuple, list)):
        items = data
    elif isinstance(data, Mapping):
        items = data.values()
    elif is_torch_tensor(data):
        return data.shape[0] if data.ndim > 0 else None
    else:
        return None
    for item in items:
        found = _first_batch_dim(item)
        if found is not None:
            return found
    return None


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
    """Concatenate a list of same-structured nested tensors along `dim`, keeping the structure."""
    if len(data) == 0:
        raise ValueError("concatenate() needs at least one element to concatenate.")
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return _rebuild_mapping(first, {k: concatenate([d[k] for d in data], dim=dim) for k in first.keys()})
    if not is_torch_tensor(first):
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


# -- collectives --------------------------------------------------------------------------------


def _active_state():
    """The PartialState when collectives must communicate, else None (single process)."""
    state = current_state()
    return state if state is not None and state.use_distributed else None


def _describe(data):
    # Tensors by shape and dtype, other leaves by type name: small, picklable, comparable.
    return recursively_apply(
        lambda x: TensorInformation(x.shape, x.dtype) if is_torch_tensor(x) else type(x).__name__,
        data,
        test_type=lambda _: True,
    )


def _summary(description, with_dtype: bool) -> str:
    text = recursively_apply(
        lambda info: f"{info.shape} {info.dtype}" if with_dtype else info.shape,
        description,
        test_type=is_tensor_information,
    )
    return str(text)


def _verify_same_shapes(operation: str, data, state) -> None:
    """Debug mode: every rank shares its shapes; a mismatch raises on all ranks, never hangs."""
    mine = _describe(data)
    if state.distributed_type == DistributedType.XLA:
        everyone = _xla_gather_object(mine)
    else:
        everyone = [None] * state.num_processes
        torch.distributed.all_gather_object(everyone, mine)
    if all(d == everyone[0] for d in everyone[1:]):
        return
    shapes = [_summary(d, with_dtype=False) for d in everyone]
    with_dtype = len(set(shapes)) == 1  # shapes agree, so types or dtypes differ: show them
    listing = ", ".join(f"rank {i}: {_summary(d, with_dtype)}" for i, d in enumerate(everyone))
    raise DistributedOperationException(
        f"Cannot {operation}: every rank must pass the same shapes{' and dtypes' if with_dtype else ''}, "
        f"got {listing}. Make them equal first, e.g. tensor = pad_across_processes(tensor, dim=0) "
        "(pad the dimension that differs), or use gather_object for ragged Python data."
    )


def _all_gather_into(output: torch.Tensor, tensor: torch.Tensor) -> None:
    # torch 2.13 deprecates all_gather_into_tensor for all_gather_single; older torch lacks the latter.
    fn = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    fn(output, tensor)


def _gather_one(tensor: torch.Tensor, state) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor.clone()[None]
    if state.distributed_type == DistributedType.XLA:
        return _xla_all_gather(tensor)
    # Gathering is not differentiable; torch 2.13's all_gather_single fails on inputs that need grad.
    tensor = tensor.detach().contiguous()
    output = tensor.new_empty((state.num_processes * tensor.shape[0],) + tuple(tensor.shape[1:]))
    _all_gather_into(output, tensor)
    return output


def gather(tensor):
    """Concatenate each rank's tensors along dim 0, on every rank (0-d tensors become 1-d)."""
    state = _active_state()
    if state is None:
        return tensor
    if state.debug:
        _verify_same_shapes("gather", tensor, state)
    return recursively_apply(_gather_one, tensor, state, error_on_other_type=True)


def gather_object(object: Any):
    """Gather picklable objects from every rank, on every rank, in rank order.

    A list or tuple is concatenated across ranks (rank 0's items first); anything else becomes one
    item per rank. A single process gets `list(object)` or `[object]`.
    """
    is_sequence = isinstance(object, (list, tuple))
    state = _active_state()
    if state is None:
        return list(object) if is_sequence else [object]
    if state.distributed_type == DistributedType.XLA:
        per_rank = _xla_gather_object(object)
    else:
        per_rank = [None] * state.num_processes
        torch.distributed.all_gather_object(per_rank, object)
    if is_sequence:
        return [item for items in per_rank for item in items]
    return per_rank


def copy_tensor_to_devices(tensor=None) -> torch.Tensor:
    """Give every rank a copy of the tensor that exactly one rank holds; the others pass None.

    Unlike `broadcast`, the receiving ranks need not know its shape or dtype.
    """
    state = _active_state()
    if state is None:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices(None) in a single process: there is no tensor to copy.")
        return tensor
    if tensor is not None and not is_torch_tensor(tensor):
        raise TypeError(f"copy_tensor_to_devices takes a tensor or None, not {type(tensor).__name__}.")
    mine = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
    if state.distributed_type == DistributedType.XLA:
        everyone = _xla_gather_object(mine)
    else:
        everyone = [None] * state.num_processes
        torch.distributed.all_gather_object(everyone, mine)
    owners = [rank for rank, info in enumerate(everyone) if info is not None]
    if len(owners) != 1:
        raise ValueError(
            f"copy_tensor_to_devices needs the tensor on exactly one rank and None on the others; "
            f"ranks {owners or 'none'} passed one."
        )
    shape, dtype = everyone[owners[0]]
    if tensor is None:
        tensor = torch.zeros(shape, dtype=dtype, device=state.device)
    return broadcast(tensor, from_process=owners[0])


def _check_source(from_process, num_processes: int) -> None:
    if isinstance(from_process, bool) or not isinstance(from_process, Integral):
        raise TypeError(f"from_process must be a rank number, not {type(from_process).__name__}.")
    if not 0 <= from_process < num_processes:
        raise ValueError(f"from_process={from_process!r} is not a rank of this {num_processes}-process job.")


def _broadcast_one(tensor: torch.Tensor, src: int) -> torch.Tensor:
    if tensor.is_contiguous():
        torch.distributed.broadcast(tensor, src=src)
        return tensor
    buffer = tensor.contiguous()
    torch.distributed.broadcast(buffer, src=src)
    return tensor.copy_(buffer)


def broadcast(tensor, from_process: int = 0):
    """Overwrite every rank's tensors with those of `from_process` (in place where possible)."""
    state = _active_state()
    if state is None:
        return tensor
    _check_source(from_process, state.num_processes)
    if state.debug:
        _verify_same_shapes("broadcast", tensor, state)
    if state.distributed_type == DistributedType.XLA:
        return recursively_apply(_xla_broadcast, tensor, from_process, error_on_other_type=True)
    return recursively_apply(_broadcast_one, tensor, from_process, error_on_other_type=True)


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Replace the items of `object_list` with `from_process`'s, in place; returns the list."""
    if not isinstance(object_list, list):
        raise TypeError(
            f"broadcast_object_list fills a list in place; got {type(object_list).__name__}. "
            "Wrap the objects in a list of the same length on every rank."
        )
    state = _active_state()
    if state is None:
        return object_list
    _check_source(from_process, state.num_processes)
    if state.distributed_type == DistributedType.XLA:
        object_list[:] = _xla_broadcast_object(list(object_list), from_process)
    else:
        torch.distributed.broadcast_object_list(object_list, src=from_process)
    return object_list


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def reduce(tensor, reduction: str = "mean", scale: float = 1.0):
    """Sum, average, max or min each tensor across ranks, times `scale`; returns new tensors.

    "mean" divides the sum by the number of processes, so integer tensors come back as floats.
    """
    if reduction not in _REDUCE_OPS:
        hint = (
            ' (accelerate\'s "none" summed without averaging: pass "sum" for that)'
            if reduction == "none"
            else ""
        )
        raise ValueError(f"reduction={reduction!r} is not one of {sorted(_REDUCE_OPS)}{hint}.")
    state = _active_state()
    if state is not None and state.debug:
        _verify_same_shapes(f'reduce (reduction="{reduction}")', tensor, state)
    op_name = _REDUCE_OPS[reduction]

    def _reduce_one(t: torch.Tensor) -> torch.Tensor:
        result = t.clone()
        if state is not None:
            if state.distributed_type == DistributedType.XLA:
                result = _xla_all_reduce(op_name.lower(), result)
            else:
                torch.distributed.all_reduce(result, op=getattr(torch.distributed.ReduceOp, op_name))
        if reduction == "mean":
            result = result / (state.num_processes if state is not None else 1)
        if scale != 1.0:
            result = result * scale
        return result

    return recursively_apply(_reduce_one, tensor, error_on_other_type=True)


def _verify_same_ndims(data, dim: int, state) -> None:
    """Debug mode: padding needs tensors with the same number of dimensions on every rank."""
    mine = _describe(data)
    if state.distributed_type == DistributedType.XLA:
        everyone = _xla_gather_object(mine)
    else:
        everyone = [None] * state.num_processes
        torch.distributed.all_gather_object(everyone, mine)
    ndims = [str(recursively_apply(lambda i: len(i.shape), d, test_type=is_tensor_information)) for d in everyone]
    if len(set(ndims)) == 1:
        return
    listing = ", ".join(f"rank {i}: {_summary(d, with_dtype=False)}" for i, d in enumerate(everyone))
    raise DistributedOperationException(
        f"Cannot pad_across_processes(dim={dim}): every rank's tensors must have the same number of "
        f"dimensions, got {listing}. Reshape them so only the size along dim {dim} differs."
    )


def pad_across_processes(tensor, dim: int = 0, pad_index=0, pad_first: bool = False):
    """Pad each tensor along `dim` to the largest size any rank has, so it can be gathered.

    Padding is filled with `pad_index`, after the data or (`pad_first=True`) before it. Tensors
    with fewer than `dim + 1` dimensions are returned as they are.
    """
    state = _active_state()
    if state is not None and state.debug:
        _verify_same_ndims(tensor, dim, state)

    def _pad_one(t: torch.Tensor) -> torch.Tensor:
        if state is None or getattr(t, "is_nested", False) or not -t.ndim <= dim < t.ndim:
            return t
        d = dim % t.ndim
        sizes = _gather_one(torch.tensor([t.shape[d]], device=t.device), state)
        max_size = int(sizes.max().item())
        if max_size == t.shape[d]:
            return t
        new_shape = list(t.shape)
        new_shape[d] = max_size
        padded = t.new_full(new_shape, pad_index)
        start = max_size - t.shape[d] if pad_first else 0
        index = [slice(None)] * t.ndim
        index[d] = slice(start, start + t.shape[d])
        padded[tuple(index)] = t
        return padded

    return recursively_apply(_pad_one, tensor, error_on_other_type=True)


# -- the XLA boundary: the only calls into torch_xla, which cannot run on machines without it ----


def _xla_all_gather(tensor):
    import torch_xla.core.xla_model as xm

    return xm.all_gather(tensor, dim=0)


def _xla_gather_object(obj) -> list:
    import torch_xla.core.xla_model as xm

    return xm.mesh_reduce("notebook_accel.gather_object", obj, list)


def _xla_broadcast(tensor, src: int):
    import torch_xla.core.xla_model as xm

    return xm.mesh_reduce("notebook_accel.broadcast", tensor, lambda per_rank: per_rank[src])


def _xla_broadcast_object(objects: list, src: int) -> list:
    import torch_xla.core.xla_model as xm

    return xm.mesh_reduce("notebook_accel.broadcast_object_list", objects, lambda per_rank: per_rank[src])


def _xla_all_reduce(op: str, tensor):
    import torch_xla.core.xla_model as xm

    return xm.all_reduce(op, tensor)
