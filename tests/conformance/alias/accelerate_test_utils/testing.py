"""Checks and markers the scripts use."""

import contextlib
import unittest

import torch

from notebook_accel.state import AcceleratorState
from notebook_accel.utils import is_bnb_available
from notebook_accel.utils.operations import gather


def are_the_same_tensors(tensor) -> bool:
    """True when every process holds a tensor equal to this one."""
    local = tensor[None].clone().to(AcceleratorState().device)
    everyone = gather(local).cpu()
    return all(torch.equal(row, local[0].cpu()) for row in everyone)


@contextlib.contextmanager
def assert_exception(exception_class, msg=None):
    """The block must raise `exception_class` (with `msg` in its text when given)."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - the check is on the type
        assert isinstance(error, exception_class), f"expected {exception_class}, got {type(error)}: {error}"
        if msg is not None:
            assert msg in str(error), f"expected {msg!r} in {str(error)!r}"
    else:
        raise AssertionError(f"expected {exception_class.__name__}; the block raised nothing")


def require_bnb(test_case):
    return unittest.skipUnless(is_bnb_available(), "needs bitsandbytes")(test_case)


def require_multi_device(test_case):
    return unittest.skipUnless(AcceleratorState().num_processes > 1, "needs several processes")(test_case)
