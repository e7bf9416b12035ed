"""Reading offloaded weights ahead of the forward that needs them.

Disk-offloaded weights are memory maps (one per file, kept open by the loader, store.py,
advised MADV_HUGEPAGE so the kernel reads and maps them 2 MB at a time). A `Prefetcher`, one per
weights map, learns the order in which the map's hooks run on the first forward; when hook k runs,
it looks up the weights of the next `AHEAD` hooks. Those already in the page cache are mapped at
once (MADV_POPULATE_READ: one call, no faults later); those that are not are read on its thread
while the forward computes, so the disk and the CPU work at the same time. Once as many lookups
ahead as a pass makes found everything cached, it steps aside (there it would only move the
forward's own page faults earlier) and samples one page of the weights `AHEAD` hooks on at each
hook to know when to read ahead again. Memory is bounded: at most `AHEAD` hooks' weights are held
ahead, and the hooks give their pages back after their forward
(`OffloadedWeightsLoader.release_pages`), in rounds of `DROP_BATCH` bytes and all by the end of the
outermost forward. Results are the tensors a plain lookup gives: outputs do not change.

It is on by default (`NOTEBOOK_ACCEL_PREFETCH=0` turns it off); benchmarks/prefetch.py has the
figures.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from . import pages, staging
from .store import root_loader

AHEAD = 2  # hooks read ahead of the one running: the bytes added are at most this many blocks
_ATTRIBUTE = "_notebook_accel_prefetcher"
MAKE_ROOM = True  # make_room() on or off (benchmarks/prefetch.py measures both)
# .threads: the forward thread's torch thread count before it made room.
_room = threading.local()
_NOTHING = object()  # the probe of a hook with no weights: always "cached"


def _size(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def wanted(setting: str, execution_device) -> bool:
    """Whether hooks on `execution_device` read ahead; `setting` is NOTEBOOK_ACCEL_PREFETCH."""
    if setting in ("0", "off", "false", "no"):
        return False
    return execution_device is None or str(execution_device).split(":")[0] != "meta"


def make_room(needed: bool) -> None:
    """While the forward waits for the disk, compute with one torch thread fewer when torch has a
    thread for every core: OpenMP's threads spin between operations and keep the reading thread
    off the CPU (a cold forward on 2 cores ran 1.4-1.5x its floor; with room, at its floor).
    Undone by `make_room(False)`, `give_room_back()`, and when the outermost hooked forward of
    this thread ends (`forward_left`), also by an exception. OpenMP's count is per thread, but
    torch also keeps a process-wide default: a thread that starts its first parallel op inside
    such a forward takes up the lowered count."""
    if not (needed and MAKE_ROOM):
        give_room_back()
        return
    if room_made():
        return
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if 1 < threads and threads >= cores:
        torch.set_num_threads(threads - 1)
        _room.threads = threads


def give_room_back() -> None:
    """Restore the thread count `make_room` lowered, unless the forward set another since."""
    threads = getattr(_room, "threads", None)
    if threads is None:
        return
    _room.threads = None
    if torch.get_num_threads() == threads - 1:
        torch.set_num_threads(threads)


def room_made() -> bool:
    return getattr(_room, "threads", None) is not None


def forward_entered() -> None:
    """A hooked module's forward begins on this thread (hooks._hooked_forward)."""
    pages.entered()


def forward_left() -> None:
    """It ended, returned or raised: at the outermost one, a thread given up is given back (a
    forward whose learned order runs past where it stopped still has reads in flight) and the
    pages released in it are dropped."""
    if pages.left():
        give_room_back()


class Prefetcher:
    def __init__(self, release: Optional[Callable] = None, inline: Optional[Callable] = None):
        self._lock = threading.Lock()
        self.order: list = []  # keys in the order their hooks first ran
        self.position: dict = {}
        self._loaders: dict = {}  # key -> (callable returning {name: tensor}, execution device)
        self._pending: dict = {}  # key -> Future
        self._staged: set = set()  # keys whose pending read also copies to the device
        self._reading: set = set()  # keys whose pending future reads from the disk (or copies)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pid = None
        self._stagers: dict = {}  # execution device -> stager (staging.py)
        self.release = release  # the loader's release_pages: a staged tensor's source is let go
        self.inline = inline  # True when lookups only map (the loader's maps_in_place): done here
        # Warm, reading ahead only moves the forward's page faults earlier and costs bookkeeping:
        # once as many lookups ahead as a pass makes (len(order) - 1) in a row found every weight
        # in the page cache, it steps aside (`_quiet`), checking one weight AHEAD hooks on at each
        # take (`_probes`) to come back. Never where weights are copied to a device ahead (a stager).
        self._cached_run = 0
        self._quiet = False
        self._probes: dict = {}  # key -> its largest tensor (a view of a map), or _NOTHING

    def __reduce__(self):  # a copy or an unpickled model learns its own order, on its own thread
        return (Prefetcher, (self.release, self.inline))

    def _executor(self) -> ThreadPoolExecutor:
        # A forked child has the object but not the thread: start afresh there.
        if self._pool is None or self._pid != os.getpid():
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="notebook_accel-prefetch")
            self._pid = os.getpid()
            self._pending = {}
            self._staged = set()
            self._reading = set()
            self._stagers = {}
        return self._pool

    def take(self, key, load: Callable[[], dict], device=None) -> dict:
        """The weights of hook `key` ({name: tensor}), read ahead if they were; and read the next.
        With `device` (the hook's execution device), weights read ahead are also copied there
        ahead where a stager exists for it (CUDA)."""
        with self._lock:
            pool = self._executor()
            self._loaders[key] = (load, device)
            if key not in self.position:
                self.position[key] = len(self.order)
                self.order.append(key)
            future = self._pending.pop(key, None)
            self._staged.discard(key)
            self._reading.discard(key)
            here = self.position[key]
            quiet = self._quiet and self._still_cached(here)
            if self._quiet and not quiet:
                self._quiet, self._cached_run = False, 0  # a miss: a whole pass again before quiet
            if quiet:
                if self._pending:  # read ahead before it stepped aside, for a branch not taken
                    self._let_go(self._wanted(here))
            else:
                reading, waited = self._schedule(pool, here, future)
        if not quiet:
            # Room is made once the forward has waited for a read, and kept while reads are in
            # flight: a forward whose reads keep ahead of it (compute-bound) never loses a thread.
            make_room(reading and (waited or room_made()))
        if future is not None and not future.cancelled():
            found = future.result()  # an error reading ahead is raised here, as a plain read would
            found = found.ready() if isinstance(found, staging.Staged) else found
        else:
            found = load()
        if key not in self._probes and self.inline is not None and self.inline():
            # Views of the loader's maps (never copies, which the probe would keep alive).
            self._probes[key] = max(found.values(), key=_size) if found else _NOTHING
        return found

    def _still_cached(self, here: int) -> bool:
        # The weights AHEAD hooks on (past the end: those the next forward starts with; with no
        # more hooks than AHEAD, a running hook's own), sampled: a miss (the page cache was
        # dropped, or evicted) wakes the read-ahead up.
        probe = self._probes.get(self.order[(here + AHEAD) % len(self.order)])
        return probe is _NOTHING or (probe is not None and pages.resident(probe, samples=1))

    def _wanted(self, here: int) -> list:
        return [self.order[i] for i in range(here + 1, min(here + 1 + AHEAD, len(self.order)))]

    def _let_go(self, wanted: list) -> None:
        # Read-aheads the order no longer reaches (a branch not taken) are let go: bounded memory.
        for stale in [k for k in self._pending if k not in wanted]:
            self._pending.pop(stale).cancel()
            self._staged.discard(stale)
            self._reading.discard(stale)

    def _schedule(self, pool: ThreadPoolExecutor, here: int, future) -> tuple:
        """Look up (and read or copy) the hooks after `here` ahead; (reads in flight, whether the
        running hook's own read was still running)."""
        waited = future is not None and not future.done()  # the forward caught up with the disk
        wanted = self._wanted(here)
        self._let_go(wanted)
        for distance, nxt in enumerate(wanted, 1):
            if nxt not in self._loaders:
                continue
            load_next, device_next = self._loaders[nxt]
            # Quiet only where lookups only map, and never where copies to a device are made ahead.
            may_quiet = self.inline is not None and self._stager(device_next) is None
            # Copied to the device one hook ahead only: device_map plans room for one
            # offloaded layer beside the running one, not AHEAD of them.
            stager = self._stager(device_next) if distance == 1 else None
            if nxt not in self._pending:
                self._pending[nxt] = self._ahead(pool, load_next, stager, may_quiet)
            elif stager is not None and nxt not in self._staged:
                self._pending[nxt] = pool.submit(self._stage, self._pending[nxt], stager)
            if stager is not None:
                self._staged.add(nxt)
            if not self._pending[nxt].done():
                self._reading.add(nxt)
        reading = any(k in self._pending and not self._pending[k].done() for k in self._reading)
        return reading, waited

    def _stager(self, device):
        if device not in self._stagers:
            self._stagers[device] = staging.stager_for(device)
        return self._stagers[device]

    def _ahead(self, pool: ThreadPoolExecutor, load: Callable[[], dict], stager, may_quiet: bool) -> Future:
        # Looked up here where a lookup only maps. Pages already in the page cache are mapped here
        # too, at once: cheap in 2 MB folios, and a hand-off to the thread costs more than that
        # when torch keeps every core busy. Reads from the disk and copies to a device go to the
        # thread, and so do lookups that read or copy (a loader with a device).
        if self.inline is not None and not self.inline():
            self._cached_run = 0
            return pool.submit(lambda: self._read(load(), stager))
        done: Future = Future()
        try:
            tensors = load()
        except Exception as exc:  # raised by the forward that needs them, as a plain read would
            done.set_exception(exc)
            return done
        if stager is None and all(pages.resident(t) for t in tensors.values()):
            done.set_result({name: pages.touch(tensor) for name, tensor in tensors.items()})
            self._cached_run = self._cached_run + 1 if may_quiet else 0
            self._quiet = self._cached_run >= max(1, len(self.order) - 1)
            return done
        self._cached_run = 0
        return pool.submit(self._read, tensors, stager)

    def _read(self, tensors: dict, stager) -> dict:
        tensors = {name: pages.touch(tensor) for name, tensor in tensors.items()}
        return tensors if stager is None else self._stage_now(tensors, stager)

    def _stage(self, earlier: Future, stager):
        return self._stage_now(earlier.result(), stager)  # the pool runs one job at a time, in order

    def _stage_now(self, tensors: dict, stager):
        try:
            return stager.stage(tensors, self.release)
        except torch.OutOfMemoryError:
            return tensors  # no room on the device ahead: the hook copies them when it runs


def for_map(weights_map, device=None) -> Optional[Prefetcher]:
    """The prefetcher of the loader under `weights_map`, made on first use. None where there is
    nothing to do ahead: a map of tensors already in memory, unless `device` (the execution
    device) has a stager to copy them there ahead."""
    root = root_loader(weights_map)
    if root is None or not (root.index or staging.stages(device)):
        return None
    found = root.__dict__.get(_ATTRIBUTE)
    if found is None:
        release = root.release_pages if root.index else None
        found = root.__dict__[_ATTRIBUTE] = Prefetcher(release, root.maps_in_place)  # bound: pickles
    return found
