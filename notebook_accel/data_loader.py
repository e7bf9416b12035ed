"""Sharded, device-placing, exactly resumable data loaders (accelerate's names and semantics).

`prepare_data_loader` turns a user's DataLoader into a `DataLoaderShard` (each process reads its
own batches) or a `DataLoaderDispatcher` (rank 0 reads, every rank gets a slice). Both are still
`torch.utils.data.DataLoader`s, tell GradientState which batch is the last one, and resume mid-epoch
exactly from `state_dict()`; see `DataLoaderStateMixin.state_dict` for the contract.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Callable, Iterable, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from .loader_state import _END, DataLoaderStateMixin, _check_count
from .samplers import (
    BatchSamplerShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    _shuffling_sampler,
    _SkippedStream,
    _with_sampler,
    check_rank,
    check_split_batch_size,
)
from .state import PartialState
from .utils.dataclasses import RNGType
from .utils.operations import (
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    get_data_structure,
    initialize_tensors,
    recursively_apply,
    send_to_device,
    slice_tensors,
)

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "override_even_batches",
    "prepare_data_loader",
    "skip_first_batches",
]


def _rng_types_for(rng_types, generator) -> list:
    types = [RNGType(t.value if isinstance(t, RNGType) else str(t).lower()) for t in (rng_types or [])]
    # No generator to keep in step: syncing "generator" would fail every epoch.
    return [t for t in types if not (t == RNGType.GENERATOR and generator is None)]


class _LocalLoader(DataLoaderStateMixin, DataLoader):
    """A loader that reads its own batches in this process (DataLoaderShard, SkipDataLoader).

    While iterating it is GradientState's active loader, and it prefetches one batch to know which
    batch is last. Batches go to `device` unless it is None. Its process count, total_batch_size
    and padded remainder come from a BatchSamplerShard or IterableDatasetShard when it reads one.
    """

    device = None
    rng_types: tuple = ()
    synchronized_generator = None

    def __len__(self) -> int:
        return max(0, DataLoader.__len__(self) - self.skip_batches)

    def _fetch(self, iterator):
        batch = next(iterator, _END)
        if batch is _END or self.device is None:
            return batch
        return send_to_device(batch, self.device, non_blocking=self._non_blocking)

    def __iter__(self):
        self.begin()
        try:
            iterator = self._open_epoch(sync=True)
            self.remainder = self._padded_remainder()
            current = self._fetch(iterator)
            while current is not _END:
                following = self._fetch(iterator)
                if following is _END:
                    self.end_of_dataloader = True
                self._position += 1
                yield current
                current = following
            self._epoch_done = True
        finally:
            self.end()

    def _padded_remainder(self) -> int:
        sampler, dataset = self._batch_sampler(), self.dataset
        try:
            if isinstance(sampler, BatchSamplerShard):
                if sampler.drop_last or not sampler.even_batches:
                    return 0
                if sampler.batch_size is None:
                    return -1
                samples = len(sampler.sampler)
                if isinstance(sampler.batch_sampler, SkipBatchSampler):  # sharding what a skip left
                    samples = max(0, samples - sampler.batch_sampler.skip_batches * sampler.batch_size)
                return samples % self.total_batch_size
            if isinstance(dataset, IterableDatasetShard):
                return 0 if dataset.drop_last else len(dataset.dataset) % dataset.global_batch_size
        except TypeError:  # no len() to work it out from
            return -1
        return 0  # one process reading every batch: nothing is padded

    def _num_processes(self) -> Optional[int]:
        sampler = self._batch_sampler()
        if isinstance(sampler, BatchSamplerShard):
            return sampler.num_processes
        if isinstance(self.dataset, IterableDatasetShard):
            return self.dataset.num_processes
        return 1

    @property
    def total_batch_size(self) -> int:
        """Samples in one step across all processes."""
        sampler = self._batch_sampler()
        if isinstance(sampler, BatchSamplerShard):
            return sampler.batch_size if sampler.split_batches else sampler.batch_size * sampler.num_processes
        if isinstance(self.dataset, IterableDatasetShard):
            return self.dataset.global_batch_size
        return sampler.batch_size if sampler is not None else self.batch_size


class DataLoaderShard(_LocalLoader):
    """A DataLoader that reads this process's shard, moves batches to `device` and resumes exactly.

    At the start of every epoch the RNGs named in `rng_types` are synchronised across processes
    (with `synchronized_generator` for "generator"), so shuffled shards line up. `skip_batches`
    are skipped by the next iteration only (see DataLoaderStateMixin); `iteration` is the epoch
    it starts at. Every loader here has state_dict() / load_state_dict(); `use_stateful_dataloader`
    only decides whether Accelerator.load_state restores the position inside an epoch (True) or
    replays the saved epoch from its first batch for the caller to skip (False, accelerate's default).
    """

    def __init__(
        self,
        dataset,
        device=None,
        rng_types=None,
        synchronized_generator: Optional[torch.Generator] = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh=None,
        iteration: int = 0,
        **kwargs,
    ) -> None:
        state_args = (skip_batches, use_stateful_dataloader, _drop_last, _non_blocking, torch_device_mesh)
        self._setup_loader(dataset, kwargs, *state_args, iteration)  # in _setup_loader's order
        self.device = device
        self.synchronized_generator = synchronized_generator
        self.rng_types = _rng_types_for(rng_types, synchronized_generator)


class SkipDataLoader(_LocalLoader):
    """A DataLoader without its first `skip_batches` batches, on every iteration (accelerate's class).

    Map-style data is skipped at the sampler, so skipped batches are never loaded. It places and
    shards nothing; preparing it keeps the skip (prepare_data_loader moves it before the sharding),
    and it has the other loaders' bookkeeping: end_of_dataloader, state_dict() / load_state_dict().
    """

    _skips_every_epoch = True

    def __init__(
        self, dataset, skip_batches: int = 0, use_stateful_dataloader: bool = False, **kwargs
    ) -> None:
        self._setup_loader(
            dataset, kwargs, skip_batches=skip_batches, use_stateful_dataloader=use_stateful_dataloader
        )


def _repeat_rows(rows, count: int):
    """The first `count` rows of `rows`, cycling them when there are fewer."""
    have = find_batch_size(rows)
    if have < count:
        rows = concatenate([rows] * math.ceil(count / have))
    return slice_tensors(rows, slice(0, count))


class DataLoaderDispatcher(DataLoaderStateMixin, DataLoader):
    """A DataLoader where only rank 0 reads; every batch is broadcast and each rank keeps a slice.

    Without split_batches rank 0 reads num_processes batches per step and concatenates them (the
    batches must have equal shapes); with it, one batch is cut in num_processes slices. A last
    global batch whose size is not a multiple of num_processes is padded with rows from the first
    global batch, only as many as needed (`remainder` then counts the real rows), so its slices may
    be smaller than the others. Only tensors are broadcast and sliced; other leaves of a batch
    (strings, ...) travel whole to every rank.
    """

    def __init__(
        self,
        dataset,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        slice_fn: Optional[Callable] = None,
        torch_device_mesh=None,
        iteration: int = 0,
        **kwargs,
    ) -> None:
        state_args = (skip_batches, use_stateful_dataloader, _drop_last, _non_blocking, torch_device_mesh)
        self._setup_loader(dataset, kwargs, *state_args, iteration)  # in _setup_loader's order
        self.split_batches = split_batches
        self.slice_fn = slice_tensors if slice_fn is None else slice_fn
        self.rng_types = []  # only rank 0 draws an order: nothing to keep in step
        self.synchronized_generator = None
        if split_batches:
            check_split_batch_size(self._base_batch_size(), self.state.num_processes)

    @property
    def state(self) -> PartialState:
        # Looked up each time: a reset state must not leave this loader holding an emptied one.
        return PartialState()

    def _base_batch_size(self) -> Optional[int]:
        sampler = self._batch_sampler()
        return getattr(sampler, "batch_size", None) if sampler is not None else self.batch_size

    def _drops_last(self) -> bool:
        sampler = self._batch_sampler()
        return bool(self._drop_last or self.drop_last or getattr(sampler, "drop_last", False))

    def __len__(self) -> int:
        whole, n = DataLoader.__len__(self), self.state.num_processes
        if self.split_batches:
            steps = whole
        elif self._drops_last():
            steps = whole // n
        else:
            steps = math.ceil(whole / n)
        return max(0, steps - self.skip_batches)

    @property
    def total_batch_size(self) -> int:
        size = self._base_batch_size()
        return size if self.split_batches else size * self.state.num_processes

    def _num_processes(self) -> int:
        return self.state.num_processes

    def _fetch_global(self, source):
        """Rank 0: the next global batch, or _END."""
        if self.split_batches:
            return next(source, _END)
        batches = []
        for _ in range(self.state.num_processes):
            batch = next(source, _END)
            if batch is _END:
                break
            batches.append(batch)
        if not batches or (len(batches) < self.state.num_processes and self._drops_last()):
            return _END
        if len(batches) == 1:
            return batches[0]
        try:
            return concatenate(batches, dim=0)
        except (RuntimeError, TypeError) as exc:
            raise RuntimeError(
                "DataLoaderDispatcher could not concatenate the batches of one step (they differ in shape or "
                "hold non-tensors). Pass split_batches=True (rank 0 reads one full batch and slices it), or "
                "dispatch_batches=False (each process reads its own batches)."
            ) from exc

    def __iter__(self):
        n, rank = self.state.num_processes, self.state.process_index
        self.begin()
        try:
            if rank != 0:  # rank 0 does the skipping and says when to stop
                resume, self._resume_pending = self._resume_pending, False
                if not resume:  # unused here, but keeps this rank's state_dict well-formed
                    self._epoch_rng = self._capture_rng(with_torch=True)
                self.set_epoch(self.iteration)
                self._position = self._take_skip(resume)
            source = current = following = None
            pad_rows = None
            while True:
                info = [None, None]
                if rank == 0:
                    try:
                        if source is None:
                            source = self._open_epoch(sync=False, skip_scale=1 if self.split_batches else n)
                            current = self._fetch_global(source)
                        following = _END if current is _END else self._fetch_global(source)
                        info = [None if current is _END else get_data_structure(current), following is _END]
                    except Exception as exc:
                        # Tell the other ranks, which would otherwise wait for this batch forever.
                        broadcast_object_list([None, f"{type(exc).__name__}: {exc}"])
                        raise
                broadcast_object_list(info)
                if isinstance(info[1], str):
                    raise RuntimeError(
                        f"DataLoaderDispatcher: rank 0 failed to read the next batch ({info[1]})."
                    )
                if info[0] is None:
                    break
                batch = current if rank == 0 else initialize_tensors(info[0])
                batch = send_to_device(batch, self.state.device, non_blocking=self._non_blocking)
                batch = recursively_apply(broadcast, batch)
                if pad_rows is None:
                    pad_rows = self.slice_fn(batch, slice(0, n), process_index=rank, num_processes=n)
                observed = find_batch_size(batch)
                missing = -observed % n
                if missing:
                    batch = concatenate([batch, _repeat_rows(pad_rows, missing)], dim=0)
                per = (observed + missing) // n
                mine = self.slice_fn(
                    batch, slice(rank * per, (rank + 1) * per), process_index=rank, num_processes=n
                )
                if info[1]:
                    self.end_of_dataloader = True
                    self.remainder = observed if missing else 0
                self._position += 1
                yield mine
                if info[1]:
                    break
                if rank == 0:
                    current = following
            self._epoch_done = True
        finally:
            self.end()


# -- building loaders from a user's DataLoader ------------------------------------------------------


def _loader_kwargs(dataloader: DataLoader) -> dict:
    """The DataLoader settings a rebuilt loader keeps (everything but dataset and batching)."""
    kwargs = {
        "num_workers": dataloader.num_workers,
        "collate_fn": dataloader.collate_fn,
        "pin_memory": dataloader.pin_memory,
        "timeout": dataloader.timeout,
        "worker_init_fn": dataloader.worker_init_fn,
        "multiprocessing_context": dataloader.multiprocessing_context,
        "generator": dataloader.generator,
        "persistent_workers": dataloader.persistent_workers,
    }
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    if getattr(dataloader, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = dataloader.pin_memory_device
    if hasattr(dataloader, "in_order"):
        kwargs["in_order"] = dataloader.in_order
    return kwargs


def prepare_data_loader(
    dataloader: DataLoader,
    device=None,
    num_processes: Optional[int] = None,
    process_index: Optional[int] = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Optional[Iterable] = None,
    dispatch_batches: Optional[bool] = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Optional[Callable] = None,
    use_seedable_sampler: bool = False,
    data_seed: Optional[int] = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh=None,
):
    """This process's view of `dataloader`: a DataLoaderShard, or a DataLoaderDispatcher.

    The dataset, collate_fn, workers, pin_memory, worker_init_fn, generator and the other settings
    are kept; only the batching changes. One process still gets a DataLoaderShard (device
    placement, end_of_dataloader, exact resume). dispatch_batches defaults to True for iterable
    datasets placed on a device. A shuffling sampler without a generator gets its own (a copy of
    the sampler, seeded from the global RNG, rank 0's seed on every rank): unlike accelerate, the
    shards then agree even without rng_types, and the order is part of the loader's state_dict.
    A SkipDataLoader's skip is applied before the sharding (its first batches, not each rank's);
    a prepared loader's pending skip_first_batches is kept for its next iteration.
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare_data_loader takes a torch DataLoader, not {type(dataloader).__name__}.")
    state = PartialState()
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    check_rank(num_processes, process_index)
    dataset = dataloader.dataset
    iterable = isinstance(dataset, IterableDataset)
    always_skip = dataloader.skip_batches if isinstance(dataloader, SkipDataLoader) else 0
    if always_skip and iterable:
        dataset = _SkippedStream(dataset, always_skip * (dataloader.batch_size or 1))
    if dispatch_batches is None:
        dispatch_batches = bool(put_on_device and iterable)
    if dispatch_batches and not put_on_device:
        raise ValueError(
            "dispatch_batches=True sends batches from rank 0 to every device: it needs put_on_device=True."
        )
    if dispatch_batches and not even_batches:
        raise ValueError(
            "even_batches=False is not supported with dispatch_batches=True (rank 0 always pads the last "
            "batch so every rank gets one); use dispatch_batches=False for uneven batches."
        )
    batch_sampler_as_sampler = dataloader.batch_sampler is None and isinstance(
        dataloader.sampler, BatchSampler
    )
    batch_sampler = dataloader.sampler if batch_sampler_as_sampler else dataloader.batch_sampler
    if split_batches:
        size = (
            dataloader.batch_size
            if dataloader.batch_size is not None
            else getattr(batch_sampler, "batch_size", None)
        )
        check_split_batch_size(size, num_processes)

    synchronized_generator = None
    if not iterable:
        inner = batch_sampler.sampler if hasattr(batch_sampler, "sampler") else dataloader.sampler
        new_inner, synchronized_generator = _shuffling_sampler(
            inner, state, num_processes, use_seedable_sampler, data_seed
        )
        if new_inner is not inner and batch_sampler is not None:
            batch_sampler = _with_sampler(batch_sampler, new_inner)
        inner = new_inner
        if always_skip and batch_sampler is not None:
            batch_sampler = SkipBatchSampler(batch_sampler, always_skip)
        elif always_skip:  # no batches: one sample at a time
            inner = SkipBatchSampler(inner, always_skip)

    kwargs = _loader_kwargs(dataloader)
    pending = isinstance(dataloader, DataLoaderStateMixin) and not dataloader._skips_every_epoch
    common = {
        "use_stateful_dataloader": use_stateful_dataloader,
        "_drop_last": dataloader.drop_last,
        "_non_blocking": non_blocking,
        "skip_batches": dataloader.skip_batches if pending else 0,
    }
    if dispatch_batches:
        if iterable:
            kwargs.update(batch_size=dataloader.batch_size, drop_last=dataloader.drop_last)
        elif batch_sampler is None or batch_sampler_as_sampler:
            kwargs.update(sampler=inner if batch_sampler is None else batch_sampler, batch_size=None)
        else:
            kwargs.update(batch_sampler=batch_sampler)
        return DataLoaderDispatcher(
            dataset,
            split_batches=split_batches,
            slice_fn=slice_fn_for_dispatch,
            torch_device_mesh=torch_device_mesh,
            **common,
            **kwargs,
        )

    if iterable:
        if num_processes > 1:
            if dataloader.batch_size is None:
                raise ValueError(
                    "Sharding an IterableDataset needs the DataLoader's batch_size, but it is None: set a batch_size."
                )
            dataset = IterableDatasetShard(
                dataset,
                batch_size=dataloader.batch_size,
                drop_last=dataloader.drop_last,
                num_processes=num_processes,
                process_index=process_index,
                split_batches=split_batches,
            )
        per_process = dataloader.batch_size
        if split_batches and per_process is not None:
            per_process //= num_processes
        kwargs.update(batch_size=per_process, drop_last=dataloader.drop_last)
    else:
        if batch_sampler is None:
            if num_processes > 1:
                raise ValueError(
                    "This DataLoader has batch_size=None and no batch sampler, so there are no batches to share "
                    f"among {num_processes} processes: give it a batch_size or a batch_sampler."
                )
            kwargs.update(sampler=inner, batch_size=None)
        else:
            if num_processes > 1:
                batch_sampler = BatchSamplerShard(
                    batch_sampler, num_processes, process_index, split_batches, even_batches
                )
            if batch_sampler_as_sampler:
                kwargs.update(sampler=batch_sampler, batch_size=None)
            else:
                kwargs.update(batch_sampler=batch_sampler)
    return DataLoaderShard(
        dataset,
        device=(device if device is not None else state.device) if put_on_device else None,
        rng_types=rng_types,
        synchronized_generator=synchronized_generator,
        torch_device_mesh=torch_device_mesh,
        **common,
        **kwargs,
    )


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0):
    """A loader whose next iteration starts after its first `num_batches` batches.

    A DataLoaderShard or DataLoaderDispatcher is returned itself with `skip_batches` set, for its
    next iteration only, so its epoch count and state_dict stay right when the same object is
    iterated again; accelerate returns a new loader that skips on every iteration. Any other
    DataLoader gives, as in accelerate, a new SkipDataLoader over the same dataset and samplers,
    which skips on every iteration (a SkipDataLoader's own skip is kept: the skips add up).
    Skipping happens at the sampler, without loading the skipped data (iterable datasets must
    read it).
    """
    num_batches = _check_count("num_batches", num_batches)
    if isinstance(dataloader, (DataLoaderShard, DataLoaderDispatcher)):
        dataloader.skip_batches = num_batches
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches takes a torch DataLoader, not {type(dataloader).__name__}.")
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        kwargs.update(batch_size=dataloader.batch_size, drop_last=dataloader.drop_last)
    elif dataloader.batch_sampler is not None:
        kwargs.update(batch_sampler=dataloader.batch_sampler)
    else:
        kwargs.update(sampler=dataloader.sampler, batch_size=None)
    if isinstance(dataloader, SkipDataLoader):
        num_batches += dataloader.skip_batches
    return SkipDataLoader(dataloader.dataset, skip_batches=num_batches, **kwargs)


@contextlib.contextmanager
def override_even_batches(loaders: Iterable, even_batches: Optional[bool]):
    """Inside the block, every loader sharded by a BatchSamplerShard uses `even_batches`; after it,
    each gets its own value back (None: nothing changes).

    Loaders that cannot take the override are left as they are, with one UserWarning naming them:
    an iterable dataset shared among processes (IterableDatasetShard always completes its last
    global batch, or drops it) and a DataLoaderDispatcher (rank 0 pads the last batch for every rank).
    """
    if even_batches is None:
        yield
        return
    changed, refused = [], []
    for i, loader in enumerate(loaders):
        sampler = loader._batch_sampler() if isinstance(loader, DataLoaderStateMixin) else loader.batch_sampler
        if isinstance(loader, DataLoaderDispatcher) or isinstance(loader.dataset, IterableDatasetShard):
            refused.append(f"loader {i} ({type(loader).__name__} over {type(loader.dataset).__name__})")
        elif isinstance(sampler, BatchSamplerShard):
            changed.append((sampler, sampler.even_batches))
            sampler.even_batches = bool(even_batches)
    if refused:
        warnings.warn(
            f"join_uneven_inputs(even_batches={even_batches}): overriding even_batches is only supported for "
            f"map-style datasets read by each rank; {', '.join(refused)} keep their batching (iterable datasets "
            "and dispatched batches are always evened out across ranks).",
            UserWarning,
            stacklevel=5,
        )
    try:
        yield
    finally:
        for sampler, value in changed:
            sampler.even_batches = value


def get_sampler(dataloader: DataLoader):
    """The sampler that orders `dataloader`'s samples (the one inside its batch sampler), or None."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"get_sampler takes a torch DataLoader, not {type(dataloader).__name__}.")
    if isinstance(dataloader.sampler, BatchSampler):  # a batch sampler passed as sampler=
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)
