"""Memory sizes, release_memory, and find_executable_batch_size against real allocator errors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from notebook_accel.utils import (
    convert_file_size_to_int,
    find_executable_batch_size,
    parse_memory_size,
    release_memory,
)
from notebook_accel.utils.memory import clear_device_cache, should_reduce_batch_size


@pytest.mark.parametrize("parse", [parse_memory_size, convert_file_size_to_int])
@pytest.mark.parametrize(
    "text, expected",
    [
        ("10GiB", 10 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("1.1GB", 1_100_000_000),  # not one byte short from float rounding
        ("20KiB", 20 * 2**10),
        ("3 GB", 3 * 10**9),
        ("2mib", 2 * 2**20),
        ("1TB", 10**12),
        ("512B", 512),
        ("1024", 1024),
        (" 0 ", 0),
        (4096, 4096),
        (2.0, 2),
    ],
)
def test_memory_sizes_parse_to_bytes(parse, text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize("parse", [parse_memory_size, convert_file_size_to_int])
@pytest.mark.parametrize("bad", ["10 gigs", "-5GB", "", "GiB", None, "10G", "1.2.3MB", -1, True, 1.5, "nan"])
def test_malformed_sizes_name_the_value_and_show_examples(parse, bad):
    with pytest.raises(ValueError) as info:
        parse(bad)
    message = str(info.value)
    assert repr(bad) in message
    assert "10GiB" in message and "500MB" in message


def test_release_memory_drops_references():
    a, b = torch.ones(1000), [torch.zeros(10)]
    ref_a, ref_b = weakref.ref(a), weakref.ref(b[0])
    a, b = release_memory(a, b)
    assert a is None and b is None
    gc.collect()
    assert ref_a() is None and ref_b() is None
    assert release_memory() == []
    clear_device_cache(garbage_collection=True)
    assert not torch.cuda.is_initialized()


def test_should_reduce_batch_size_recognises_out_of_memory_errors():
    assert should_reduce_batch_size(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert should_reduce_batch_size(torch.OutOfMemoryError("anything"))
    try:
        torch.empty(2**50, dtype=torch.uint8)  # beyond any address space: a real CPU allocator error
    except RuntimeError as exc:
        assert should_reduce_batch_size(exc)
    else:
        pytest.fail("allocating 1 PiB succeeded")
    assert not should_reduce_batch_size(RuntimeError("shape mismatch"))
    assert not should_reduce_batch_size(ValueError("out of memory"))


def test_find_executable_batch_size_shrinks_on_real_cpu_oom_and_remembers():
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def step(batch_size, scale):
        tried.append(batch_size)
        # Above 8 rows each "row" asks for 1 PiB: the CPU allocator refuses, as it would for a real OOM.
        row_bytes = 2**50 if batch_size > 8 else 16
        return torch.empty(batch_size * row_bytes, dtype=torch.uint8).numel() * scale

    assert step(2) == 8 * 16 * 2
    # 90% of the last size each time, as accelerate does.
    assert tried == [64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19, 17, 15, 13, 11, 9, 8]
    assert step(scale=1) == 8 * 16 and tried[-1] == 8  # the working size is kept
    assert step.__name__ == "step"


def test_find_executable_batch_size_gives_up_at_zero_and_passes_other_errors():
    tried = []

    def always_oom(batch_size):
        tried.append(batch_size)
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(RuntimeError, match="No executable batch size found"):
        find_executable_batch_size(always_oom, starting_batch_size=8)()
    assert tried == [8, 7, 6, 5, 4, 3, 2, 1]

    @find_executable_batch_size(starting_batch_size=16)
    def broken(batch_size):
        tried.append(batch_size)
        raise ValueError("a bug, not memory")

    tried.clear()
    with pytest.raises(ValueError, match="a bug"):
        broken()
    assert tried == [16]

    @find_executable_batch_size
    def needs_no_size(batch_size, model):
        return batch_size

    with pytest.raises(TypeError, match=r"Call needs_no_size\(model='m'\) instead"):
        needs_no_size(32, "m")
    assert needs_no_size("m") == 128


def test_find_executable_batch_size_uses_a_custom_reduction():
    sizes = iter([10, 3])
    tried = []

    @find_executable_batch_size(starting_batch_size=20, reduce_batch_size_fn=lambda: next(sizes))
    def step(batch_size):
        tried.append(batch_size)
        if batch_size > 3:
            raise RuntimeError("XPU out of memory.")
        return batch_size

    assert step() == 3 and tried == [20, 10, 3]
    # A start of 0 raises at the call, as accelerate's does; a negative one at once.
    never_called = find_executable_batch_size(lambda batch_size: tried.append(batch_size), starting_batch_size=0)
    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        never_called()
    assert tried == [20, 10, 3]
    with pytest.raises(ValueError, match="starting_batch_size=-1"):
        find_executable_batch_size(lambda batch_size: None, starting_batch_size=-1)
