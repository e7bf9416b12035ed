"""A loader's place in its epoch: the epoch, position and RNG bookkeeping behind exact resume.

`DataLoaderStateMixin` is shared by DataLoaderShard and DataLoaderDispatcher (data_loader.py);
its `state_dict` docstring is the contract of a saved loader position.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from .samplers import SeedableRandomSampler
from .state import GradientState
from .utils.random import synchronize_rng_states

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


class _PreparedStream:
    """This epoch's sampler stream, past `skip` indices, started only when first pulled.

    torch's loader iterator draws its base seed from the loader's generator before the sampler's
    first draw; a stream that waits for its first pull keeps that order, so a prepared loader
    shuffles exactly as the plain DataLoader it came from. `prime()` makes the first pull happen
    now (inside the loader's RNG window) if the iterator has not pulled already.
    """

    def __init__(self, stream, skip: int) -> None:
        self._stream, self._skip = stream, skip
        self._head: list = []
        self.skipped = None

    def prime(self) -> None:
        if self.skipped is None:
            self.skipped = _advance(self._stream, self._skip)
            first = next(self._stream, _END)
            if first is not _END:
                self._head.append(first)

    def __iter__(self):
        return self

    def __next__(self):
        self.prime()
        if self._head:
            return self._head.pop()
        return next(self._stream)


def _sampler_chain(loader) -> list:
    """The loader's samplers from the outermost (batch) sampler to the innermost one."""
    current = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    chain = []
    while current is not None and all(current is not seen for seen in chain) and len(chain) < 8:
        chain.append(current)
        inner = getattr(current, "batch_sampler", None)  # not `or`: an empty sampler is falsy
        current = inner if inner is not None else getattr(current, "sampler", None)
    return chain


class _LoaderItself:
    """`loader.base_dataloader`: accelerate's loaders wrap the DataLoader they read from and keep it
    there; ours are that DataLoader themselves. Looked up on a class, it raises AttributeError, as
    accelerate's does (the attribute only exists on a loader)."""

    def __get__(self, loader, owner=None):
        if loader is None:
            raise AttributeError(f"base_dataloader is set on {owner.__name__} objects, not on the class.")
        return loader


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
    iteration of a loader built with skip_batches; SkipDataLoader, `_skips_every_epoch`, does too);
    `len()` counts without them. A position restored by load_state_dict is kept apart from it
    (`_resume_skip`), so `len()` after a resume is the whole epoch, as in accelerate, and an
    explicit skip_first_batches replaces it.
    """

    _skips_every_epoch = False
    base_dataloader = _LoaderItself()

    def _setup_loader(
        self,
        dataset,
        loader_kwargs: dict,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh=None,
        iteration: int = 0,
    ) -> None:
        """Set up a loader: the keywords every loader here takes (accelerate's names), and
        `loader_kwargs` for torch's DataLoader. The mixin has no __init__ of its own, as accelerate's
        has none: each loader's __init__ lists these keywords and passes them on."""
        if torch_device_mesh is not None:
            raise NotImplementedError(
                f"{type(self).__name__}(torch_device_mesh=...): tensor-parallel loading is not supported."
            )
        DataLoader.__init__(self, dataset, **loader_kwargs)
        self.use_stateful_dataloader = use_stateful_dataloader
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self._init_state(skip_batches)
        self.iteration = _check_count("iteration", iteration)

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
        """Use `epoch` from now on, and pass it to every sampler that takes it (a batch sampler and
        the sampler inside it, as accelerate does), or, failing that, to the dataset.

        Moving a restored loader to another epoch drops the restored position: it belonged to the
        saved epoch, and that epoch's order is not the one this epoch draws."""
        if self._resume_pending and epoch != self.iteration and not self._iterating:
            self._resume_pending, self._epoch_rng, self._resume_skip, self._position = False, None, 0, 0
        self.iteration = epoch
        takers = [sampler for sampler in _sampler_chain(self) if hasattr(sampler, "set_epoch")]
        for sampler in takers:
            sampler.set_epoch(epoch)
        if not takers and hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        self.reset()
        self._epoch_done = False
        self._iterating = True
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        self._iterating = False
        gradient_state = self.gradient_state
        if self in getattr(gradient_state, "dataloader_references", ()):
            gradient_state._remove_dataloader(self)
        if not self._skips_every_epoch:
            self.skip_batches = 0
        self._resume_skip = 0
        if self._epoch_done or self.end_of_dataloader:
            self.iteration += 1
            self._position = 0
            self._epoch_rng = None

    def _batch_sampler(self):
        """The batch sampler, also when the user passed it as `sampler` (with batch_size=None)."""
        return self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler

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
                stream = _PreparedStream(iter(self._index_source.base), skip)
                self._index_source.stream = stream
                try:
                    iterator = DataLoader.__iter__(self)
                finally:
                    self._index_source.stream = None
                stream.prime()
                skipped = stream.skipped
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
        """Batches this iteration skips: an explicit skip_first_batches, else a restored position.

        A SkipDataLoader takes the further of its own skip and the restored position (which counts
        the batches it skipped)."""
        restored = self._resume_skip if resume else 0
        skip = max(self.skip_batches, restored) if self._skips_every_epoch else self.skip_batches or restored
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
        if not self._skips_every_epoch:
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
