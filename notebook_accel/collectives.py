"""The collectives a training loop calls (accelerate's names), and their debug-mode checks.

Every collective works on tensors nested in lists, tuples (namedtuples too), and mappings. In a
single process each one returns its input (reduce returns a copy, so callers may modify it, and
gather_object a list, as it does across ranks).
With `ACCELERATE_DEBUG_MODE=1`, gather / reduce / broadcast first compare every rank's shapes
and raise `DistributedOperationException` on all ranks instead of hanging.
They ask the process's PartialState, so they sit above state.py; accelerate's path
(`notebook_accel.utils.operations`) re-exports them with the nested-structure helpers.
"""

from __future__ import annotations

import functools
import warnings
from numbers import Integral
from typing import Any

import torch

from .state import PartialState
from .utils.dataclasses import DistributedType, TensorInformation
from .utils.structures import (
    is_tensor_information,
    is_torch_tensor,
    recursively_apply,
)


class DistributedOperationException(Exception):
    """A collective was called with inputs that cannot work together across ranks."""


class CannotPadNestedTensorWarning(UserWarning):
    """pad_across_processes met a nested (ragged) tensor, which it leaves as it is."""


# accelerate's integer codes for dtypes, as gather_tensor_shape reports them.
TENSOR_TYPE_TO_INT = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
TENSOR_INT_TO_DTYPE = {code: dtype for dtype, code in TENSOR_TYPE_TO_INT.items()}


# -- collectives --------------------------------------------------------------------------------


def _active_state():
    """The PartialState when collectives must communicate, else None (single process)."""
    state = PartialState()
    return state if state.use_distributed else None


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


def _from_every_rank(obj, state) -> list:
    """Each rank's picklable `obj`, in rank order, on every rank."""
    if state.distributed_type == DistributedType.XLA:
        return _xla_gather_object(obj)
    everyone = [None] * state.num_processes
    torch.distributed.all_gather_object(everyone, obj)
    return everyone


def _verify_same_shapes(operation: str, data, state) -> None:
    """Debug mode: every rank shares its shapes and devices; a mismatch raises on all ranks, never hangs."""
    devices = set()
    recursively_apply(lambda t: devices.add(t.device), data)
    misplaced = sorted(str(d) for d in devices if d.type != state.device.type)
    shared = _from_every_rank((_describe(data), misplaced), state)
    wrong = [f"rank {i}: {', '.join(where)}" for i, (_, where) in enumerate(shared) if where]
    if wrong:
        raise DistributedOperationException(
            f"Cannot {operation}: every rank's tensors must be on the run's device type ({state.device.type}), "
            f"got tensors on {'; '.join(wrong)}. Move them first, e.g. send_to_device(data, accelerator.device)."
        )
    everyone = [description for description, _ in shared]
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


def _operation_name(function) -> str:
    return f"{function.__module__}.{function.__qualname__}"


def verify_operation(function):
    """Decorate a collective: in debug mode (`ACCELERATE_DEBUG_MODE=1`) on several processes, its
    tensors (the `tensor` keyword, else the first argument) are first compared across ranks. Tensors
    off the run's device type, or shapes or dtypes that differ between ranks, raise
    DistributedOperationException on every rank, naming what each rank passed, instead of hanging.
    Otherwise the function is called as it is.
    """
    operation = _operation_name(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        state = _active_state()
        if state is None or not state.debug:
            return function(*args, **kwargs)
        if "tensor" in kwargs:
            tensor = kwargs["tensor"]
        elif args:
            tensor = args[0]
        else:
            raise TypeError(
                f"{operation} was called without arguments: verify_operation checks its `tensor` keyword or its "
                "first argument."
            )
        _verify_same_shapes(f"run {operation}", tensor, state)
        return function(*args, **kwargs)

    return wrapper


def chained_operation(function):
    """Decorate an operation built on checked collectives: a DistributedOperationException raised
    inside it is raised again naming this operation, with the original as its cause."""
    operation = _operation_name(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except DistributedOperationException as exc:
            raise DistributedOperationException(f"Error while calling {operation}: {exc}") from exc

    return wrapper


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
    per_rank = _from_every_rank(object, state)
    if is_sequence:
        return [item for items in per_rank for item in items]
    return per_rank


def _single_owner(tensor, state, caller: str) -> tuple:
    """(rank, shape, dtype) of the tensor that exactly one rank passes; every rank raises otherwise."""
    if tensor is None:
        mine = None
    elif is_torch_tensor(tensor):
        mine = (tuple(tensor.shape), tensor.dtype)
    else:
        mine = type(tensor).__name__
    everyone = _from_every_rank(mine, state)
    bad = [f"rank {rank}: {info}" for rank, info in enumerate(everyone) if isinstance(info, str)]
    if bad:
        raise TypeError(f"{caller} takes a tensor or None on each rank, got {', '.join(bad)}.")
    owners = [rank for rank, info in enumerate(everyone) if info is not None]
    if len(owners) != 1:
        raise ValueError(
            f"{caller} needs the tensor on exactly one rank and None on the others; "
            f"ranks {owners or 'none'} passed one."
        )
    return (owners[0], *everyone[owners[0]])


def gather_tensor_shape(tensor):
    """Every rank learns the shape and dtype of the tensor that exactly one rank holds (the others
    pass None): returns (shape as a 1-d int64 tensor on this process's device, the dtype's code in
    TENSOR_TYPE_TO_INT). Dtypes without a code raise TypeError; copy_tensor_to_devices takes any.
    (accelerate 1.15 gives the sizes as an int32 column of shape (ndim, 1) and drops sizes of 0.)"""
    state = _active_state()
    if state is None:
        if not is_torch_tensor(tensor):
            raise ValueError(f"gather_tensor_shape in a single process needs a tensor, got {tensor!r}.")
        shape, dtype, device = tuple(tensor.shape), tensor.dtype, tensor.device
    else:
        _, shape, dtype = _single_owner(tensor, state, "gather_tensor_shape")
        device = state.device
    if dtype not in TENSOR_TYPE_TO_INT:
        raise TypeError(
            f"gather_tensor_shape has no code for {dtype}: it codes {', '.join(map(str, TENSOR_TYPE_TO_INT))}."
        )
    return torch.tensor(shape, dtype=torch.int64, device=device), TENSOR_TYPE_TO_INT[dtype]


def copy_tensor_to_devices(tensor=None) -> torch.Tensor:
    """Give every rank a copy of the tensor that exactly one rank holds; the others pass None.

    Unlike `broadcast`, the receiving ranks need not know its shape or dtype.
    """
    state = _active_state()
    if state is None:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices(None) in a single process: there is no tensor to copy.")
        return tensor
    owner, shape, dtype = _single_owner(tensor, state, "copy_tensor_to_devices")
    if tensor is None:
        tensor = torch.zeros(shape, dtype=dtype, device=state.device)
    return broadcast(tensor, from_process=owner)


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
    everyone = _from_every_rank(_describe(data), state)
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
        if getattr(t, "is_nested", False):
            warnings.warn(
                "pad_across_processes cannot pad a nested tensor (its rows differ in length); it is left as it is.",
                CannotPadNestedTensorWarning,
                stacklevel=4,
            )
            return t
        if state is None or not -t.ndim <= dim < t.ndim:
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


def wait_for_everyone() -> None:
    """Barrier across all processes (`PartialState().wait_for_everyone()`); a no-op alone."""
    PartialState().wait_for_everyone()


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
