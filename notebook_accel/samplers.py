"""Samplers that split one loader's data across processes (accelerate's names and semantics),
the skips a prepared SkipDataLoader keeps, and the shuffling sampler a prepared loader draws from.

A loader's place in its epoch (exact resume) lives in loader_state.py.
`notebook_accel.data_loader` re-exports the public names; import from there.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Iterator, List, Optional

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler

from .utils.operations import broadcast_object_list


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order depends only on `initial_seed + epoch`.

    Every rank with the same seed and epoch draws the same permutation, and a resumed run
    regenerates any epoch's order from those two integers. `initial_seed` is `data_seed`, or
    `torch.initial_seed()` when none is given (prepare_data_loader makes it agree across ranks).
    Iterating to the end moves to the next epoch, so standalone use reshuffles each epoch.
    """

    def __init__(
        self,
        data_source,
        replacement: bool = False,
        num_samples: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        data_seed: Optional[int] = None,
    ) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=generator)
        self.initial_seed = int(data_seed) if data_seed is not None else torch.initial_seed()
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)


def check_rank(num_processes, process_index) -> None:
    """Raise a ValueError unless `process_index` is a rank of a `num_processes`-process job."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r}: pass a whole number >= 1.")
    if not isinstance(process_index, int) or not 0 <= process_index < num_processes:
        raise ValueError(f"process_index={process_index!r} is not a rank of a {num_processes}-process job.")


def check_split_batch_size(batch_size, num_processes: int) -> None:
    """Raise a ValueError naming both numbers unless `batch_size` splits evenly into the processes."""
    if batch_size is None:
        raise ValueError(
            "split_batches=True slices each batch among the processes, but this loader has batch_size=None "
            "(no batch size to split). Give the DataLoader a batch_size, or use split_batches=False."
        )
    if batch_size % num_processes != 0:
        multiple = max(1, math.ceil(batch_size / num_processes)) * num_processes
        raise ValueError(
            f"split_batches=True slices each batch of {batch_size} samples into {num_processes} equal parts, "
            f"so batch_size must be a round multiple of num_processes; batch_size={batch_size} is not a "
            f"multiple of num_processes={num_processes}. Use a batch size that is (e.g. {multiple}), or "
            "split_batches=False to give each process whole batches."
        )


def _set_share(share, batch_size, num_processes: int, process_index: int, split_batches: bool) -> None:
    """Check and record which part of the data a shard (of batches or of a dataset) is: rank
    `process_index`'s of `num_processes`, by whole batches or, with split_batches, within each."""
    check_rank(num_processes, process_index)
    if split_batches:
        check_split_batch_size(batch_size, num_processes)
    share.batch_size = batch_size
    share.num_processes = num_processes
    share.process_index = process_index
    share.split_batches = split_batches


def _fill(indices: list, pool: list, size: int) -> list:
    """`indices` completed to `size` items with items of `pool`, cycling it if it is short."""
    out = list(indices)
    while len(out) < size and pool:
        out.extend(pool[: size - len(out)])
    return out


class _WrappedBatchSampler(BatchSampler):
    """A batch sampler built on another one: exposes its sampler and its full length."""

    @property
    def sampler(self):
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)


class BatchSamplerShard(_WrappedBatchSampler):
    """This process's share of the batches of `batch_sampler`.

    Without split_batches, batch i goes to rank i % num_processes: each "round" of num_processes
    batches makes one global batch. With even_batches, an incomplete last round (or a short last
    batch) is completed with indices from the start of the epoch, so every rank gets the same
    number of full batches; without it the ranks may differ by one batch and the short batch stays
    short. With split_batches, every batch is cut into num_processes equal slices (batch_size must
    be a multiple of num_processes). When the wrapped sampler drops its last incomplete batch
    (drop_last), an incomplete last round is dropped too, so every step is a full global batch
    (accelerate's rule). `len()` is exact.
    """

    def __init__(
        self,
        batch_sampler,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        batch_size = getattr(batch_sampler, "batch_size", None)
        _set_share(self, batch_size, num_processes, process_index, split_batches)
        self.batch_sampler = batch_sampler
        self.even_batches = even_batches
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))

    def _num_indices(self) -> Optional[int]:
        try:
            return len(self.sampler)
        except TypeError:
            return None

    def __len__(self) -> int:
        total, n, rank = len(self.batch_sampler), self.num_processes, self.process_index
        if self.split_batches:
            if self.drop_last or self.even_batches:
                return total
            indices = self._num_indices()
            short = 0 if indices is None else indices % self.batch_size
            if short == 0:
                return total
            # The short last batch reaches only the ranks whose slice starts inside it.
            return total - 1 + (1 if short > rank * (self.batch_size // n) else 0)
        if self.drop_last:
            return total // n
        if self.even_batches:
            return math.ceil(total / n)
        return total // n + (1 if rank < total % n else 0)

    def __iter__(self) -> Iterator[List[int]]:
        if self.split_batches:
            return self._iter_split()
        return self._iter_rounds()

    def _iter_split(self):
        size, per = self.batch_size, self.batch_size // self.num_processes
        lo, hi = self.process_index * per, (self.process_index + 1) * per
        first = None
        for batch in self.batch_sampler:
            batch = list(batch)
            if first is None:
                first = batch
            if len(batch) == size:
                yield batch[lo:hi]
            elif not self.drop_last:  # the short last batch
                if self.even_batches:
                    yield _fill(batch, first, size)[lo:hi]
                elif batch[lo:hi]:
                    yield batch[lo:hi]

    def _iter_rounds(self):
        n, rank, size = self.num_processes, self.process_index, self.batch_size
        head: list = []  # the first round's batches: the "start of the data" that fills the tail
        round_: list = []
        held = None  # a full round ending in a short batch: the last one, unless more batches come
        for i, batch in enumerate(self.batch_sampler):
            batch = list(batch)
            if held is not None:
                yield held[rank]
                held = None
            if i < n:
                head.append(batch)
            round_.append(batch)
            if len(round_) == n:
                if size is not None and len(batch) < size:
                    held = round_
                else:
                    yield round_[rank]
                round_ = []
        if held is not None:
            round_ = held
        if not round_ or self.drop_last:
            return
        if not self.even_batches:
            if rank < len(round_):
                yield round_[rank]
            return
        if size is None:
            # Batches of unknown size: the missing ranks take whole batches from the start.
            missing = rank - len(round_)
            yield round_[rank] if missing < 0 else head[missing % len(head)]
            return
        flat = _fill([i for b in round_ for i in b], [i for b in head for i in b], n * size)
        yield flat[rank * size : (rank + 1) * size]


class IterableDatasetShard(IterableDataset):
    """This process's share of an iterable dataset, cut in global batches.

    Items are read in global batches of `batch_size * num_processes` (or `batch_size` with
    split_batches) and each process keeps its slice of every global batch. An incomplete last
    global batch is dropped with drop_last, else completed with the first items of the data.
    `len()` counts the items this process yields (accelerate's ignores split_batches there).
    """

    def __init__(
        self,
        dataset,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"IterableDatasetShard(batch_size={batch_size!r}): pass a whole number >= 1.")
        _set_share(self, batch_size, num_processes, process_index, split_batches)
        self.dataset = dataset
        self.drop_last = drop_last
        self.epoch = 0

    @property
    def global_batch_size(self) -> int:
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    @property
    def total_length(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        size, per = self.global_batch_size, self.global_batch_size // self.num_processes
        rounds = len(self.dataset) / size
        return (math.floor(rounds) if self.drop_last else math.ceil(rounds)) * per

    def __iter__(self):
        size = self.global_batch_size
        per = size // self.num_processes
        lo, hi = self.process_index * per, (self.process_index + 1) * per
        first, current = None, []
        for item in self.dataset:
            current.append(item)
            if len(current) == size:
                yield from current[lo:hi]
                if first is None:
                    first = current
                current = []
        if current and not self.drop_last:
            yield from _fill(current, first if first is not None else list(current), size)[lo:hi]


class SkipBatchSampler(_WrappedBatchSampler):
    """`batch_sampler` without its first `skip_batches` batches, on every iteration."""

    def __init__(self, batch_sampler, skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)

    def __iter__(self):
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.skip_batches:
                yield batch

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip_batches)


class _SkippedStream(IterableDataset):
    """`dataset` without its first `count` items, on every pass: a prepared SkipDataLoader's skip
    over an iterable dataset, applied before the items are shared among processes."""

    def __init__(self, dataset, count: int) -> None:
        self.dataset = dataset
        self.count = count

    def __iter__(self):
        return itertools.islice(iter(self.dataset), self.count, None)

    def __len__(self) -> int:
        return max(0, len(self.dataset) - self.count)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


def _with_sampler(batch_sampler, sampler):
    """A copy of `batch_sampler` whose indices come from `sampler`; wrappers (a shard, a skip) are
    copied down to the batch sampler that holds the sampler, so the caller's objects stay as they are."""
    out = copy.copy(batch_sampler)
    if isinstance(out, _WrappedBatchSampler):
        out.batch_sampler = _with_sampler(out.batch_sampler, sampler)
    else:
        out.sampler = sampler
    return out


# -- the shuffling sampler a prepared loader uses --------------------------------------------------


def _agreed_seed(state, num_processes: int, seed: int) -> int:
    # Ranks may have different global RNGs (set_seed(device_specific=True)); rank 0's seed wins.
    if state.use_distributed and num_processes == state.num_processes:
        return broadcast_object_list([seed])[0]
    return seed


def _shuffling_sampler(sampler, state, num_processes, use_seedable_sampler, data_seed):
    """(sampler to use, its generator): a copy when it had to change, never the user's object."""
    if (
        use_seedable_sampler
        and isinstance(sampler, RandomSampler)
        and not isinstance(sampler, SeedableRandomSampler)
    ):
        seed = (
            data_seed if data_seed is not None else _agreed_seed(state, num_processes, torch.initial_seed())
        )
        sampler = SeedableRandomSampler(
            sampler.data_source,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=sampler.generator if sampler.generator is not None else torch.Generator(),
            data_seed=seed,
        )
    if not hasattr(sampler, "generator"):
        return sampler, None
    if sampler.generator is None:
        # Its own generator, seeded from the global RNG (so set_seed decides the order) and equal on
        # every rank, makes the order part of the loader's state instead of the global RNG's.
        seed = _agreed_seed(state, num_processes, int(torch.empty((), dtype=torch.int64).random_().item()))
        sampler = copy.copy(sampler)
        sampler.generator = torch.Generator()
        sampler.generator.manual_seed(seed)
    return sampler, sampler.generator

