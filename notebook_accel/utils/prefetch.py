"""Reading offloaded weights ahead of the forward that needs them.

Disk-offloaded weights are memory maps: a forward that touches them pays for the page faults (and,
cold, for the reads) and the hook that drops them pays for the unmap. A `Prefetcher`, one per
weights map, learns the order in which the map's hooks run on the first forward; while hook k runs,
its thread looks up hook k+1's weights and reads them in (one readahead request for each tensor's
whole range, then a touch of every page). At most `AHEAD` hooks are read ahead, so the memory it
adds is bounded by that many blocks. Results are the tensors a plain lookup gives: outputs do not
change.

It is on by default (`NOTEBOOK_ACCEL_PREFETCH=0` turns it off). It pays most where the disk is the
limit (a model offloaded to disk rarely fits the page cache) or a core is free for the thread; with
the weights in the page cache and torch computing on every core, the thread's faults take CPU time
from the forward (benchmarks/prefetch.py has the figures).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

AHEAD = 1  # hooks read ahead of the one running: the bytes added are at most this many blocks
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_ATTRIBUTE = "_notebook_accel_prefetcher"


def wanted(setting: str, execution_device) -> bool:
    """Whether hooks on `execution_device` read ahead; `setting` is NOTEBOOK_ACCEL_PREFETCH."""
    if setting in ("0", "off", "false", "no"):
        return False
    return execution_device is None or str(execution_device).split(":")[0] != "meta"


def touch(tensor: torch.Tensor) -> torch.Tensor:
    """Read a CPU tensor's pages in: one readahead request for its whole range (cold, the disk gets
    it all at once rather than a fault's worth at a time), then one byte of every page."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        return tensor
    _madvise(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 3)  # MADV_WILLNEED
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    flat[::_PAGE].sum()
    return tensor


def drop_pages(start: int, end: int) -> None:
    """MADV_DONTNEED on the whole pages inside [start, end): for a file mapping nobody wrote to, the
    pages leave the process's RSS and are read again from the page cache when next touched."""
    first = -(-start // _PAGE) * _PAGE
    last = end - end % _PAGE
    if last > first:
        _madvise(first, last - first, 4)  # MADV_DONTNEED


_libc_madvise = None


def _madvise(address: int, size: int, advice: int) -> None:
    global _libc_madvise
    if _libc_madvise is None:
        _libc_madvise = _load_madvise()
    if _libc_madvise:
        start = address - address % _PAGE
        _libc_madvise(start, size + (address - start), advice)


def _load_madvise():
    try:
        import ctypes

        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return madvise
    except (OSError, AttributeError):  # no libc madvise: the faults read as they come
        return False


class Prefetcher:
    def __init__(self):
        self._lock = threading.Lock()
        self.order: list = []  # keys in the order their hooks first ran
        self.position: dict = {}
        self._loaders: dict = {}  # key -> callable returning {name: tensor}
        self._pending: dict = {}  # key -> Future
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pid = None

    def __reduce__(self):  # a copy or an unpickled model learns its own order, on its own thread
        return (Prefetcher, ())

    def _executor(self) -> ThreadPoolExecutor:
        # A forked child has the object but not the thread: start afresh there.
        if self._pool is None or self._pid != os.getpid():
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="notebook_accel-prefetch")
            self._pid = os.getpid()
            self._pending = {}
        return self._pool

    def take(self, key, load: Callable[[], dict]) -> dict:
        """The weights of hook `key` ({name: tensor}), read ahead if they were; and read the next."""
        with self._lock:
            pool = self._executor()
            self._loaders[key] = load
            if key not in self.position:
                self.position[key] = len(self.order)
                self.order.append(key)
            future = self._pending.pop(key, None)
            here = self.position[key]
            wanted = [self.order[i] for i in range(here + 1, min(here + 1 + AHEAD, len(self.order)))]
            # Read-aheads the order no longer reaches (a branch not taken) are let go: bounded memory.
            for stale in [k for k in self._pending if k not in wanted]:
                self._pending.pop(stale).cancel()
            for nxt in wanted:
                if nxt not in self._pending and nxt in self._loaders:
                    self._pending[nxt] = pool.submit(self._read, self._loaders[nxt])
        if future is not None and not future.cancelled():
            return future.result()  # an error reading ahead is raised here, as a plain read would
        return load()

    @staticmethod
    def _read(load: Callable[[], dict]) -> dict:
        return {name: touch(tensor) for name, tensor in load().items()}

    def release(self, tensors: list, pages: Optional[Callable] = None) -> None:
        """On the thread: `pages(tensors)` (the loader's release_pages), then drop them (unmapping)."""
        with self._lock:
            self._executor().submit(_release, tensors, pages)


def _release(tensors: list, pages: Optional[Callable]) -> None:
    if pages is not None:
        pages(tensors)
    tensors.clear()


def for_map(weights_map) -> Optional[Prefetcher]:
    """The prefetcher of the disk-backed map under `weights_map`, made on first use; None for a map
    of tensors already in memory (nothing to read ahead)."""
    from .offload import root_loader

    root = root_loader(weights_map)
    if root is None or not root.index:
        return None
    found = root.__dict__.get(_ATTRIBUTE)
    if found is None:
        found = root.__dict__[_ATTRIBUTE] = Prefetcher()
    return found
