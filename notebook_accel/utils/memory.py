"""Memory sizes as people write them, freeing memory, and retrying a step with smaller batches."""

from __future__ import annotations

import functools
import gc
import inspect
import re
from decimal import Decimal, InvalidOperation
from numbers import Integral
from typing import Callable, Optional

import torch

from . import families

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "PIB": 2**50,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_EXAMPLES = "e.g. 10GiB, 500MB, 1.5GB, 20KiB, '3 GB', or a whole number of bytes such as 1048576"


def parse_memory_size(size) -> int:
    """A size in bytes from an int or a string such as "10GiB" (2**30-based) or "500MB" (10**3-based)."""

    def bad(reason: str) -> ValueError:
        return ValueError(f"Invalid memory size {size!r}: {reason}. Write it as {_EXAMPLES}.")

    if isinstance(size, bool):
        raise bad("a bool is not a size")
    if isinstance(size, Integral):
        if size < 0:
            raise bad("it is negative")
        return int(size)
    if isinstance(size, float):
        if not size.is_integer() or size < 0:
            raise bad("a float must be a whole, non-negative number of bytes")
        return int(size)
    if not isinstance(size, str):
        raise bad(f"expected an int or a string, not {type(size).__name__}")
    match = _SIZE.match(size)
    if match is None:
        raise bad("expected a non-negative number followed by an optional unit")
    number, unit = match.group(1), match.group(2).upper()
    multiplier = _UNITS.get(unit or "B")
    if multiplier is None:
        raise bad(
            f"unknown unit {match.group(2)!r} (known: {', '.join(k.replace('I', 'i') for k in _UNITS)})"
        )
    try:
        # Decimal, so "1.1GB" is exactly 1_100_000_000 and not one byte short.
        return int(Decimal(number) * multiplier)
    except InvalidOperation:
        raise bad("the number cannot be read") from None


def convert_file_size_to_int(size) -> int:
    """accelerate's name for parse_memory_size: "5MB" -> 5_000_000, "1MiB" -> 1_048_576."""
    return parse_memory_size(size)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Collect garbage (optionally) and return cached accelerator memory to the driver.

    Only caches that already exist are touched: this never initialises a device.
    """
    if garbage_collection:
        gc.collect()
    for family in families.FAMILIES:
        module = family.used_module()  # only caches that exist: never initialise a device here
        if module is None or not hasattr(module, "empty_cache"):
            continue
        try:
            module.empty_cache()
        except Exception:  # a family without a usable device: nothing cached
            pass


def release_memory(*objects):
    """Drop references and free cached memory; use as `a, b = release_memory(a, b)`.

    Returns a list of None of the same length, so the caller's names stop holding the objects.
    """
    released = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return released


_OOM_MESSAGES = (
    "out of memory",  # CUDA, ROCm, XPU, MPS
    "DefaultCPUAllocator: can't allocate memory",  # CPU
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's answer to an oversized batch
    "PT_DEVMEM Allocation failed",  # HPU
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether `exception` says a device ran out of memory (so a smaller batch may fit)."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exception, oom_type):
        return True
    if isinstance(exception, (RuntimeError, MemoryError)):
        text = " ".join(str(a) for a in exception.args)
        return any(message in text for message in _OOM_MESSAGES)
    return False


def find_executable_batch_size(
    function: Optional[Callable] = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Optional[Callable[[], int]] = None,
):
    """Decorator: call `function(batch_size, ...)`, shrinking batch_size to 90% after each
    out-of-memory error (as accelerate does; `reduce_batch_size_fn()` returns the next size instead).

    The decorated function takes batch_size as its first parameter and is called without it. The
    size that worked is kept for later calls. RuntimeError once the size reaches zero (a start of 0
    raises at the first call, as accelerate's does).
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    if not isinstance(starting_batch_size, int) or starting_batch_size < 0:
        raise ValueError(f"starting_batch_size={starting_batch_size!r} must be a non-negative integer.")
    batch_size = starting_batch_size

    def ninety_percent() -> int:
        # 10% smaller each time: halving overshoots the largest size that fits by up to half.
        return int(batch_size * 0.9)

    shrink = reduce_batch_size_fn or ninety_percent

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        nonlocal batch_size
        params = inspect.signature(function).parameters
        variadic = any(p.kind == p.VAR_POSITIONAL for p in params.values())
        if not variadic and len(params) < len(args) + 1:
            passed = ", ".join(f"{p}={v!r}" for p, v in zip(list(params)[1:], args[1:]))
            raise TypeError(
                f"{function.__name__} was called with batch_size as its first argument; the decorator passes "
                f"it. Call {function.__name__}({passed}) instead."
            )
        clear_device_cache(garbage_collection=True)
        while True:
            if batch_size <= 0:
                raise RuntimeError(
                    f"No executable batch size found, reached zero. {function.__name__} ran out of memory at "
                    f"every size tried from starting_batch_size={starting_batch_size} down."
                )
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
            # Freed outside the except block: there the traceback still holds the failed step's tensors.
            clear_device_cache(garbage_collection=True)
            batch_size = shrink()

    return decorator
