"""The page cache and this process's maps of it: `madvise`, `mincore`, and pages given back in rounds.

Offloaded weights are file maps (store.py). Here: mapping a tensor's pages in at once (`touch`),
asking whether they are cached (`resident`), 2 MB folios (`advise_huge`), and MADV_DONTNEED on the
pages a hook is done with (`drop_later`), at once outside a hooked forward, and inside one in
rounds of `DROP_BATCH` bytes and at the end of the outermost forward (`entered` / `left`, which
the read-ahead calls for the hooks). The state is per thread: each forward thread has its own.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Pages released inside a forward are dropped in rounds of at least this many bytes: every
# MADV_DONTNEED interrupts each core running the process to flush its TLB, and one call per tensor
# cost about 2 ms of a 37 ms forward of benchmarks/offload.py's dispatched model.
DROP_BATCH = 32 << 20
# .depth: hooked forwards running on this thread; .held: {start: (end, tensor)} released in them
# and not yet dropped; .held_bytes: their size.
_room = threading.local()


def touch(tensor: torch.Tensor) -> torch.Tensor:
    """Read a CPU tensor's pages in and map them, so the forward that uses it takes no fault."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        return tensor
    size = tensor.numel() * tensor.element_size()
    # MADV_POPULATE_READ (Linux 5.14+) reads and maps the range in one call, in the mapping's folio
    # size (2 MB under advise_huge); MADV_WILLNEED first would read in small folios instead.
    if _madvise(tensor.data_ptr(), size, 22) != 0:
        _madvise(tensor.data_ptr(), size, 3)  # MADV_WILLNEED: the disk gets the whole range at once
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        flat[::_PAGE].sum()
    return tensor


def resident(tensor: torch.Tensor, samples: int = 4) -> bool:
    """Whether a CPU tensor's pages are in memory, judged by `samples` pages spread over it (mincore
    walks every page it is asked about: all of a 16 MB tensor took 0.15 ms). A file leaves the page
    cache in large runs (2 MB folios), so a sample tells; a miss only makes the read synchronous.
    True where it cannot be told."""
    size = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or size == 0 or _mincore() is False:
        return True
    import ctypes

    address = tensor.data_ptr()
    first = address - address % _PAGE
    last = address + size - 1
    last -= last % _PAGE
    step = max(_PAGE, (last - first) // samples // _PAGE * _PAGE)
    flag = ctypes.c_ubyte()
    page = first
    if samples == 1:  # the middle page alone
        page = last = first + (last - first) // 2 // _PAGE * _PAGE
    while True:
        if _mincore()(page, 1, ctypes.byref(flag)) != 0:
            return True
        if not flag.value & 1:
            return False
        if page == last:
            return True
        page = min(page + step, last)


_libc_mincore = None


def _mincore():
    global _libc_mincore
    if _libc_mincore is None:
        try:
            import ctypes

            _libc_mincore = ctypes.CDLL(None, use_errno=True).mincore
            _libc_mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        except Exception:  # Windows has no CDLL(None): every page counts as resident
            _libc_mincore = False
    return _libc_mincore


def drop_pages(start: int, end: int) -> None:
    """MADV_DONTNEED on the whole pages inside [start, end): for a file mapping nobody wrote to, the
    pages leave the process's RSS and are read again from the page cache when next touched."""
    first = -(-start // _PAGE) * _PAGE
    last = end - end % _PAGE
    if last > first:
        _madvise(first, last - first, 4)  # MADV_DONTNEED


def drop_later(start: int, end: int, tensor: torch.Tensor) -> None:
    """`drop_pages(start, end)`, at once outside a hooked forward; inside one, together with other
    ranges once DROP_BATCH bytes wait or the outermost forward ends. `tensor` (a view of the range)
    is held until then, so its mapping cannot be unmapped and the address reused first."""
    if not getattr(_room, "depth", 0):
        drop_pages(start, end)
        return
    held = _room.__dict__.setdefault("held", {})  # start -> (end, tensor)
    before = held[start][0] if start in held else start  # released twice: counted once
    held[start] = (max(end, before), tensor)
    _room.held_bytes = getattr(_room, "held_bytes", 0) + max(0, end - before)
    if _room.held_bytes >= DROP_BATCH:
        drop_held()


def drop_held() -> None:
    """Drop what `drop_later` holds for this thread, adjoining ranges in one call."""
    held = getattr(_room, "held", None)
    _room.held, _room.held_bytes = {}, 0
    if not held:
        return
    ranges = sorted((low, high) for low, (high, _) in held.items())
    start, end = ranges[0]
    for low, high in ranges[1:]:
        if low <= end:  # adjoining or overlapping: the pages between are released too
            end = max(end, high)
        else:  # a gap may hold other memory: never dropped
            drop_pages(start, end)
            start, end = low, high
    drop_pages(start, end)


def taking(tensors) -> None:
    """A hook is about to use `tensors`: the held ranges of the same tensors (released earlier in
    this forward: a module run twice, a tied weight) are dropped now, as releasing at once would
    have, so their whole pages show the file's values again whatever a run before wrote to them
    (the partial pages at a tensor's ends keep such writes, as they always did). By start address:
    the loader's tensors of different keys never overlap (separate files, or safetensors' checked
    layout). A hook around this one still using the same tensor reads it back from the page cache."""
    held = getattr(_room, "held", None)
    if not held:
        return
    for tensor in tensors:
        found = held.pop(tensor.data_ptr(), None)
        if found is not None:
            _room.held_bytes -= found[0] - tensor.data_ptr()
            drop_pages(tensor.data_ptr(), found[0])


def advise_huge(address: int, size: int) -> None:
    """MADV_HUGEPAGE on a file mapping: pages read in from then on come as 2 MB folios where the
    file system allows, each mapped (and later dropped) in one step rather than 512. Without it a
    warm forward of a disk-offloaded model spent about a third of its time faulting and unmapping."""
    if size >= 2 << 20:
        _madvise(address, size, 14)


_libc_madvise = None


def _madvise(address: int, size: int, advice: int) -> None:
    global _libc_madvise
    if _libc_madvise is None:
        _libc_madvise = _load_madvise()
    if _libc_madvise:
        start = address - address % _PAGE
        return _libc_madvise(start, size + (address - start), advice)
    return -1


def _load_madvise():
    if not sys.platform.startswith("linux"):  # the advice numbers here are Linux's
        return False
    try:
        import ctypes

        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return madvise
    except Exception:  # no libc madvise: the faults read as they come
        return False


def entered() -> None:
    """A hooked module's forward begins on this thread."""
    _room.depth = getattr(_room, "depth", 0) + 1


def left() -> bool:
    """It ended, returned or raised; True at the outermost one, whose end drops what is held."""
    _room.depth = max(0, getattr(_room, "depth", 1) - 1)
    if _room.depth:
        return False
    drop_held()
    return True
