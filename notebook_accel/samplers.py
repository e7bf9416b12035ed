"""Samplers that split one loader's data across processes, and a loader's place in its epoch.

The samplers and shards keep accelerate's names; `DataLoaderStateMixin` is the epoch, position and
RNG bookkeeping that DataLoaderShard and DataLoaderDispatcher share (exact resume lives there).
`notebook_accel.data_loader` re-exports the public names; import from there.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, List, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from .state import GradientState
from .utils.random import synchronize_rng_states


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


def _check_rank(num_processes, process_index) -> None:
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
            f"but batch_size={batch_size} is not a multiple of num_processes={num_processes}. Use a batch "
            f"size that is (e.g. {multiple}), or split_batches=False to give each process whole batches."
        )


def _fill(indices: list, pool: list, size: int) -> list:
    """`indices` completed to `size` items with items of `pool`, cycling it if it is short."""
    out = list(indices)
    while len(out) < size and pool:
        out.extend(pool[: size - len(out)])
    return out


class BatchSamplerShard(BatchSampler):
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
        _check_rank(num_processes, process_index)
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        if split_batches:
            check_split_batch_size(self.batch_size, num_processes)

    @property
    def sampler(self):
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

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
        _check_rank(num_processes, process_index)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"IterableDatasetShard(batch_size={batch_size!r}): pass a whole number >= 1.")
        if split_batches:
            check_split_batch_size(batch_size, num_processes)
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
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


class SkipBatchSampler(BatchSampler):
    """`batch_sampler` without its first `skip_batches` batches, on every iteration."""

    def __init__(self, batch_sampler, skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)

    @property
    def sampler(self):
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.skip_batches:
                yield batch

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip_batches)


# -- the position of a loader in its epoch (used by DataLoaderShard and DataLoaderDispatcher) ------

STATE_FORMAT = 1
_END = object()


class _IndexSource:
    """The loader's index sampler: a stream the loader prepared for this epoch, else the base sampler.

    torch's iterators call iter() on it once (twice with workers) while being built; all of those
    calls must see the same prepared stream, so the loader clears it only after building.
    """

    def __init__(self, base) -> None:
        self.base = base
        self.stream = None

    def __iter__(self):
        return self.stream if self.stream is not None else iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


def _advance(iterator, count: int) -> int:
    """Drop up to `count` items of `iterator`; returns how many there were."""
    dropped = 0
    for _ in range(count):
        if next(iterator, _END) is _END:
            break
        dropped += 1
    return dropped


def _peeked(iterator):
    # Pulling the first item runs the sampler's random draws now, inside the RNG window.
    first = next(iterator, _END)
    return iter(()) if first is _END else itertools.chain((first,), iterator)


def _sampler_chain(loader) -> list:
    """The loader's samplers from the outermost (batch) sampler to the innermost one."""
    current = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    chain = []
    while current is not None and all(current is not seen for seen in chain) and len(chain) < 8:
        chain.append(current)
        inner = getattr(current, "batch_sampler", None)  # not `or`: an empty sampler is falsy
        current = inner if inner is not None else getattr(current, "sampler", None)
    return chain


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r}: pass a whole number >= 0.")
    return value


class DataLoaderStateMixin:
    """Epoch bookkeeping shared by DataLoaderShard and DataLoaderDispatcher.

    `end_of_dataloader` is True exactly while the last batch of an iteration is out;
    `remainder` is the number of real samples in the last global batch when it was padded with
    duplicates (so gather_for_metrics can drop them), 0 when nothing was padded, -1 when unknown.
    `skip_batches` is how many batches the next iteration skips (once; accelerate skips on every
    iteration of a loader built with skip_batches); `len()` counts without them. A position
    restored by load_state_dict is kept apart from it (`_resume_skip`), so `len()` after a resume
    is the whole epoch, as in accelerate, and an explicit skip_first_batches replaces it.
    """

    def _init_state(self, skip_batches: int) -> None:
        self.end_of_dataloader = False
        self.remainder = -1
        self.iteration = 0
        self.skip_batches = _check_count("skip_batches", skip_batches)
        self._position = 0  # batches of epoch `iteration` consumed (skipped ones included)
        self._epoch_rng = None  # RNG states the current epoch's order was drawn from
        self._resume_pending = False
        self._resume_skip = 0  # batches a restored position skips; skip_batches wins when set
        self._iterating = False
        self._epoch_done = False
        is_map_style = not isinstance(self.dataset, IterableDataset)
        self._index_source = _IndexSource(DataLoader._index_sampler.fget(self)) if is_map_style else None

    @property
    def _index_sampler(self):
        source = self.__dict__.get("_index_source")
        return source if source is not None else DataLoader._index_sampler.fget(self)

    @property
    def gradient_state(self) -> GradientState:
        return GradientState()

    # -- epochs -------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use `epoch` from now on, and pass it to the sampler (or, failing that, the dataset).

        Moving a restored loader to another epoch drops the restored position: it belonged to the
        saved epoch, and that epoch's order is not the one this epoch draws."""
        if self._resume_pending and epoch != self.iteration and not self._iterating:
            self._resume_pending, self._epoch_rng, self._resume_skip, self._position = False, None, 0, 0
        self.iteration = epoch
        for sampler in _sampler_chain(self):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
                return
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def begin(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1
        self._epoch_done = False
        self._iterating = True
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        self._iterating = False
        gradient_state = self.gradient_state
        if self in getattr(gradient_state, "dataloader_references", ()):
            gradient_state._remove_dataloader(self)
        self.skip_batches = 0
        self._resume_skip = 0
        if self._epoch_done or self.end_of_dataloader:
            self.iteration += 1
            self._position = 0
            self._epoch_rng = None

    def _innermost_sampler(self):
        chain = _sampler_chain(self)
        return chain[-1] if chain else None

    def _generators(self) -> dict:
        sampler_gen = getattr(self._innermost_sampler(), "generator", None)
        loader_gen = self.generator if self.generator is not sampler_gen else None
        return {"sampler": sampler_gen, "loader": loader_gen}

    def _capture_rng(self, with_torch: bool) -> dict:
        states = {k: (g.get_state() if g is not None else None) for k, g in self._generators().items()}
        if with_torch:
            states["torch"] = torch.get_rng_state()
        return states

    def _apply_generators(self, states: dict) -> None:
        sampler = self._innermost_sampler()
        for key, generator in self._generators().items():
            state = states.get(key)
            if state is None:
                continue
            if generator is None and key == "sampler" and isinstance(sampler, SeedableRandomSampler):
                continue  # reseeded from initial_seed + epoch on every iteration anyway
            if generator is None:
                raise ValueError(
                    f"This loader's state has a {key} generator, but the loader it is loaded into has none. "
                    "Build the loader the same way as the one that was saved (prepare_data_loader gives a "
                    "shuffling sampler its own generator)."
                )
            generator.set_state(state)

    def _open_epoch(self, sync: bool, skip_scale: int = 1):
        """The underlying DataLoader iterator for this epoch, past the batches to skip.

        A fresh epoch synchronises the RNGs and records their states; a resumed one restores the
        recorded states instead, regenerates the same order and skips at the sampler (no data is
        loaded for skipped batches, except from iterable datasets). The global torch RNG is put
        back afterwards, so a checkpointer's mid-epoch restore of it still holds.
        """
        resume, self._resume_pending = self._resume_pending, False
        if not resume:
            if sync and self.rng_types:
                synchronize_rng_states(self.rng_types, self.synchronized_generator)
            self._epoch_rng = self._capture_rng(with_torch=True)
        self.set_epoch(self.iteration)
        skip = self._take_skip(resume) * skip_scale
        outside = torch.get_rng_state() if resume else None
        try:
            if resume:
                self._apply_generators(self._epoch_rng)
                torch.set_rng_state(self._epoch_rng["torch"])
            if self._index_source is not None:
                stream = iter(self._index_source.base)
                skipped = _advance(stream, skip)
                self._index_source.stream = _peeked(stream)
                try:
                    iterator = DataLoader.__iter__(self)
                finally:
                    self._index_source.stream = None
            else:
                iterator = DataLoader.__iter__(self)
                skipped = None
        finally:
            if outside is not None:
                torch.set_rng_state(outside)
        if skipped is None:
            skipped = _advance(iterator, skip)
        self._position = skipped // skip_scale
        return iterator

    def _take_skip(self, resume: bool) -> int:
        """Batches this iteration skips: an explicit skip_first_batches, else a restored position."""
        skip = self.skip_batches or (self._resume_skip if resume else 0)
        self._resume_skip = 0
        return skip

    # -- exact resume -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume this loader bit-identically, as a picklable dict.

        - "format": 1
        - "epoch": the epoch the next batch belongs to (the loader's `iteration`)
        - "batches_yielded": batches of that epoch already consumed (skipped ones included); 0 at
          an epoch boundary, including while the last batch of an epoch is out
        - "rng_state": dict of CPU uint8 tensors (or None): "sampler" (the shuffling sampler's
          generator), "loader" (the DataLoader's generator, when it is a different object) and,
          mid-epoch only, "torch" (the global RNG). Mid-epoch these are the states at the START
          of the epoch, after the cross-rank sync, from which the epoch's order is regenerated; at
          a boundary they are the generators' current states (the global RNG is then left to the
          checkpointer, like every other global RNG). With "torch" present and batches_yielded 0,
          the next iteration replays that epoch from its first batch (see `_restart_epoch`)
        - "data_seed": a SeedableRandomSampler's initial seed, else None
        - "num_processes", "total_batch_size": checked on load (None when not known)
        """
        if self._iterating and self.end_of_dataloader:
            epoch, position = self.iteration + 1, 0
        elif self._epoch_rng is not None and (self._position > 0 or self._resume_pending):
            epoch, position = self.iteration, self._position
        else:
            epoch, position = self.iteration, 0
        # A loaded state not iterated yet keeps its epoch's start states, even at position 0.
        pending = self._resume_pending and not self._iterating
        rng = self._epoch_rng if position > 0 or pending else self._capture_rng(with_torch=False)
        sampler = self._innermost_sampler()
        return {
            "format": STATE_FORMAT,
            "epoch": epoch,
            "batches_yielded": position,
            "rng_state": {k: (v.clone() if v is not None else None) for k, v in rng.items()},
            "data_seed": sampler.initial_seed if isinstance(sampler, SeedableRandomSampler) else None,
            "num_processes": self._num_processes(),
            "total_batch_size": self._safe_total_batch_size(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration continue right after the last batch `state` had consumed."""
        missing = [k for k in ("epoch", "batches_yielded", "rng_state") if k not in state]
        if missing:
            raise ValueError(f"Not a data loader state: missing {missing} (got keys {sorted(state)}).")
        if state.get("format", STATE_FORMAT) != STATE_FORMAT:
            raise ValueError(f"Data loader state format {state.get('format')!r} is not {STATE_FORMAT}.")
        if self._iterating:
            raise RuntimeError("load_state_dict() was called while this loader is being iterated.")
        for key, mine in (
            ("num_processes", self._num_processes()),
            ("total_batch_size", self._safe_total_batch_size()),
        ):
            theirs = state.get(key)
            if theirs is not None and mine is not None and theirs != mine:
                raise ValueError(
                    f"This data loader state was saved with {key}={theirs}, but this loader has {key}={mine}: "
                    "the saved position would land on different samples. Resume with the same setup."
                )
        sampler = self._innermost_sampler()
        if state.get("data_seed") is not None and isinstance(sampler, SeedableRandomSampler):
            sampler.initial_seed = state["data_seed"]
        self.iteration = _check_count("epoch", state["epoch"])
        position = _check_count("batches_yielded", state["batches_yielded"])
        rng = dict(state["rng_state"] or {})
        self.skip_batches = 0
        if position > 0 and rng.get("torch") is None:
            raise ValueError("A mid-epoch data loader state needs rng_state['torch']; this one has none.")
        if rng.get("torch") is not None:  # mid-epoch, or an epoch to replay from its start
            self._position, self._epoch_rng, self._resume_pending = position, rng, True
            self._resume_skip = position
        else:
            self._apply_generators(rng)
            self._position, self._epoch_rng, self._resume_pending = 0, None, False
            self._resume_skip = 0

    def _restart_epoch(self) -> int:
        """After load_state_dict: replay the restored epoch from its first batch, in the same order.

        This is what load_state does for a loader prepared without use_stateful_dataloader, as in
        accelerate, whose resume code then skips with skip_first_batches(loader, n) or by counting
        batches. Returns the position that was dropped (0 when the state was at an epoch boundary).
        """
        dropped, self._resume_skip, self._position = self._resume_skip, 0, 0
        return dropped

    def _num_processes(self) -> Optional[int]:
        return None

    def _safe_total_batch_size(self) -> Optional[int]:
        try:
            return self.total_batch_size
        except (AttributeError, TypeError):
            return None

    @property
    def total_dataset_length(self) -> int:
        if hasattr(self.dataset, "total_length"):
            return self.dataset.total_length
        return len(self.dataset)
