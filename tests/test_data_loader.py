"""Data loaders in one process: the sampler tables (the spec, written by hand), shards of iterable
datasets, end_of_dataloader, skipping, prepare_data_loader's checks and exact resume."""

from __future__ import annotations

import mp  # noqa: F401  (its forkserver preloads torch, so loader workers start fast)
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, TensorDataset

from notebook_accel.data_loader import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    SkipDataLoader,
    prepare_data_loader,
    skip_first_batches,
)
from notebook_accel.state import GradientState, PartialState


@pytest.fixture(autouse=True)
def fresh_state():
    PartialState._reset_state()
    GradientState._reset_state()
    yield
    PartialState._reset_state()
    GradientState._reset_state()


# -- BatchSamplerShard: batch size 3 on 2 ranks, batch i to rank i % 2 ---------------------------

R0 = [[0, 1, 2], [6, 7, 8], [12, 13, 14]]
R1 = [[3, 4, 5], [9, 10, 11], [15, 16, 17]]
NO_SPLIT = {
    # (items, drop_last, even_batches): [rank 0 batches, rank 1 batches]
    (24, False, True): [R0 + [[18, 19, 20]], R1 + [[21, 22, 23]]],
    (24, False, False): [R0 + [[18, 19, 20]], R1 + [[21, 22, 23]]],
    (24, True, True): [R0 + [[18, 19, 20]], R1 + [[21, 22, 23]]],
    (24, True, False): [R0 + [[18, 19, 20]], R1 + [[21, 22, 23]]],
    (21, False, True): [R0 + [[18, 19, 20]], R1 + [[0, 1, 2]]],
    (21, False, False): [R0 + [[18, 19, 20]], R1],
    (21, True, True): [R0, R1],
    (21, True, False): [R0, R1],
    (22, False, True): [R0 + [[18, 19, 20]], R1 + [[21, 0, 1]]],
    (22, False, False): [R0 + [[18, 19, 20]], R1 + [[21]]],
    (22, True, True): [R0, R1],
    (22, True, False): [R0, R1],
    (20, False, True): [R0 + [[18, 19, 0]], R1 + [[1, 2, 3]]],
    (20, False, False): [R0 + [[18, 19]], R1],
    (20, True, True): [R0, R1],
    (20, True, False): [R0, R1],
}


def _shards(items, batch_size, drop_last, ranks=2, **kwargs):
    batch_sampler = BatchSampler(range(items), batch_size=batch_size, drop_last=drop_last)
    return [BatchSamplerShard(batch_sampler, ranks, r, **kwargs) for r in range(ranks)]


@pytest.mark.parametrize("case", sorted(NO_SPLIT), ids=lambda c: f"n{c[0]}-drop{int(c[1])}-even{int(c[2])}")
def test_batch_sampler_shard_tables(case):
    items, drop_last, even = case
    shards = _shards(items, 3, drop_last, even_batches=even)
    assert [list(s) for s in shards] == NO_SPLIT[case]
    assert [len(s) for s in shards] == [len(b) for b in NO_SPLIT[case]]


S0 = [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]]
S1 = [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]
SPLIT = {
    # batch size 4, cut in two slices of 2
    (24, False, True): [S0 + [[20, 21]], S1 + [[22, 23]]],
    (24, False, False): [S0 + [[20, 21]], S1 + [[22, 23]]],
    (24, True, True): [S0 + [[20, 21]], S1 + [[22, 23]]],
    (24, True, False): [S0 + [[20, 21]], S1 + [[22, 23]]],
    (22, False, True): [S0 + [[20, 21]], S1 + [[0, 1]]],
    (22, False, False): [S0 + [[20, 21]], S1],
    (22, True, True): [S0, S1],
    (22, True, False): [S0, S1],
    (21, False, True): [S0 + [[20, 0]], S1 + [[1, 2]]],
    (21, False, False): [S0 + [[20]], S1],
    (21, True, True): [S0, S1],
    (21, True, False): [S0, S1],
    (20, False, True): [S0, S1],
    (20, False, False): [S0, S1],
    (20, True, True): [S0, S1],
    (20, True, False): [S0, S1],
}


@pytest.mark.parametrize("case", sorted(SPLIT), ids=lambda c: f"n{c[0]}-drop{int(c[1])}-even{int(c[2])}")
def test_batch_sampler_shard_split_tables(case):
    items, drop_last, even = case
    shards = _shards(items, 4, drop_last, split_batches=True, even_batches=even)
    assert [list(s) for s in shards] == SPLIT[case]
    assert [len(s) for s in shards] == [len(b) for b in SPLIT[case]]


def test_split_batches_needs_a_divisible_batch_size():
    with pytest.raises(ValueError, match=r"batch_size=3 is not a multiple of num_processes=2"):
        _shards(21, 3, False, split_batches=True)


def test_batch_sampler_shard_edge_cases():
    # Fewer items than one global batch: the fill cycles the start of the data.
    assert [list(s) for s in _shards(2, 3, False)] == [[[0, 1, 0]], [[1, 0, 1]]]
    assert [list(s) for s in _shards(2, 3, False, even_batches=False)] == [[[0, 1]], []]
    assert [list(s) for s in _shards(2, 3, True)] == [[], []]
    assert [list(s) for s in _shards(2, 4, False, split_batches=True)] == [[[0, 1]], [[0, 1]]]
    # Four ranks: the last round has one batch; three ranks take the data's first batches.
    four = _shards(10, 2, False, ranks=4)
    assert [list(s) for s in four] == [[[0, 1], [8, 9]], [[2, 3], [0, 1]], [[4, 5], [2, 3]], [[6, 7], [4, 5]]]
    # Batches without a batch_size: whole batches from the start fill the missing ranks.
    varying = [[0], [1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    even = [BatchSamplerShard(varying, 2, r) for r in range(2)]
    uneven = [BatchSamplerShard(varying, 2, r, even_batches=False) for r in range(2)]
    assert [list(s) for s in even] == [[[0], [4, 5], [10]], [[1, 2, 3], [6, 7, 8, 9], [0]]]
    assert [list(s) for s in uneven] == [[[0], [4, 5], [10]], [[1, 2, 3], [6, 7, 8, 9]]]
    assert [len(s) for s in even + uneven] == [3, 3, 3, 2]
    with pytest.raises(ValueError, match="process_index=2"):
        BatchSamplerShard(BatchSampler(range(4), 2, False), 2, 2)


# -- IterableDatasetShard ------------------------------------------------------------------------


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


@pytest.mark.parametrize(
    "items, batch_size, drop_last, split, expected",
    [
        (
            21,
            3,
            False,
            False,
            [[0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20], [3, 4, 5, 9, 10, 11, 15, 16, 17, 0, 1, 2]],
        ),
        (21, 3, True, False, [[0, 1, 2, 6, 7, 8, 12, 13, 14], [3, 4, 5, 9, 10, 11, 15, 16, 17]]),
        (
            24,
            3,
            False,
            False,
            [[0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20], [3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23]],
        ),
        (
            22,
            4,
            False,
            True,
            [[0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21], [2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 0, 1]],
        ),
        (22, 4, True, True, [[0, 1, 4, 5, 8, 9, 12, 13, 16, 17], [2, 3, 6, 7, 10, 11, 14, 15, 18, 19]]),
        (2, 3, False, False, [[0, 1, 0], [1, 0, 1]]),
        (2, 3, True, False, [[], []]),
    ],
)
def test_iterable_dataset_shard_tables(items, batch_size, drop_last, split, expected):
    shards = [
        IterableDatasetShard(
            Stream(items), batch_size, drop_last, num_processes=2, process_index=r, split_batches=split
        )
        for r in range(2)
    ]
    assert [list(s) for s in shards] == expected
    assert [len(s) for s in shards] == [len(e) for e in expected]


def test_iterable_dataset_shard_split_needs_a_divisible_batch_size():
    with pytest.raises(ValueError, match=r"batch_size=3 is not a multiple of num_processes=2"):
        IterableDatasetShard(Stream(8), batch_size=3, num_processes=2, split_batches=True)


# -- SeedableRandomSampler -----------------------------------------------------------------------


def test_seedable_random_sampler_depends_only_on_seed_and_epoch():
    torch.manual_seed(1)
    a = SeedableRandomSampler(range(30), data_seed=5)
    torch.manual_seed(2)  # the global RNG has no say
    b = SeedableRandomSampler(range(30), data_seed=5)
    first = list(a)
    assert first == list(b) and sorted(first) == list(range(30))
    assert list(a) != first  # iterating to the end moved it to epoch 1
    a.set_epoch(0)
    assert list(a) == first
    b.set_epoch(3)
    c = SeedableRandomSampler(range(30), data_seed=5)
    c.set_epoch(3)
    assert list(b) == list(c) != first


# -- DataLoaderShard in one process --------------------------------------------------------------


def _numbers(n=10):
    return TensorDataset(torch.arange(n))


def test_shard_is_a_dataloader_and_knows_its_last_batch():
    loader = DataLoaderShard(_numbers(10), batch_size=4)
    assert isinstance(loader, DataLoader) and len(loader) == 3
    gradient_state = GradientState()
    for _ in range(2):  # and again on the next iteration
        flags, active = [], []
        for _ in loader:
            flags.append(loader.end_of_dataloader)
            active.append(gradient_state.active_dataloader is loader and gradient_state.end_of_dataloader)
        assert flags == [False, False, True] and active == flags
        assert gradient_state.active_dataloader is None and gradient_state.remainder == -1
    assert loader.remainder == 0 and loader.total_batch_size == 4 and loader.total_dataset_length == 10


def test_early_break_unregisters_from_gradient_state():
    loader = DataLoaderShard(_numbers(10), batch_size=2)
    gradient_state = GradientState()
    for _ in loader:
        assert gradient_state.active_dataloader is loader
        break
    assert gradient_state.active_dataloader is None
    assert gradient_state.dataloader_references == [None]
    assert loader.iteration == 0  # an unfinished epoch does not count


def test_put_on_device_moves_every_batch():
    # The meta device is real and observable on a CPU-only machine.
    loader = prepare_data_loader(
        DataLoader(_numbers(6), batch_size=3), device=torch.device("meta"), put_on_device=True
    )
    assert type(loader) is DataLoaderShard
    assert [batch[0].device.type for batch in loader] == ["meta", "meta"]


def test_prepare_keeps_the_loader_settings():
    def collate(items):
        return torch.stack([t[0] for t in items]) * 10

    def init_worker(worker_id):
        return None

    generator = torch.Generator().manual_seed(3)
    source = DataLoader(_numbers(8), batch_size=4, shuffle=True, collate_fn=collate, worker_init_fn=init_worker,
                        generator=generator, timeout=0, pin_memory=False)  # fmt: skip
    loader = prepare_data_loader(source, num_processes=2, process_index=1, rng_types=["generator"])
    assert (
        loader.collate_fn is collate
        and loader.worker_init_fn is init_worker
        and loader.generator is generator
    )
    assert isinstance(loader.batch_sampler, BatchSamplerShard) and loader.synchronized_generator is generator
    assert loader.batch_sampler.sampler.generator is generator
    batch = next(iter(loader))
    assert batch.shape == (4,) and all(int(v) % 10 == 0 for v in batch)
    assert len(loader) == 1 and loader.total_batch_size == 8


def test_prepare_rejects_bad_input_with_the_values():
    with pytest.raises(ValueError, match=r"batch_size=3 is not a multiple of num_processes=2"):
        prepare_data_loader(
            DataLoader(_numbers(), batch_size=3), num_processes=2, process_index=0, split_batches=True
        )
    with pytest.raises(ValueError, match=r"batch_size=None"):
        prepare_data_loader(DataLoader(_numbers(), batch_size=None), split_batches=True)
    with pytest.raises(ValueError, match=r"batch_size=None"):
        prepare_data_loader(DataLoader(_numbers(), batch_size=None), num_processes=2, process_index=0)
    with pytest.raises(ValueError, match=r"process_index=2"):
        prepare_data_loader(DataLoader(_numbers(), batch_size=2), num_processes=2, process_index=2)
    with pytest.raises(ValueError, match="put_on_device"):
        prepare_data_loader(DataLoader(_numbers(), batch_size=2), dispatch_batches=True)
    with pytest.raises(TypeError, match="list"):
        prepare_data_loader([1, 2, 3])


def test_prepare_shards_an_iterable_dataset():
    source = DataLoader(Stream(21), batch_size=3)
    loaders = [prepare_data_loader(source, num_processes=2, process_index=r) for r in range(2)]
    batches = [[b.tolist() for b in loader] for loader in loaders]
    assert batches == [
        [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
        [[3, 4, 5], [9, 10, 11], [15, 16, 17], [0, 1, 2]],
    ]
    assert [loader.remainder for loader in loaders] == [3, 3] and loaders[0].total_batch_size == 6


def test_skip_first_batches_skips_once():
    plain = DataLoader(_numbers(10), batch_size=2)
    skipped = skip_first_batches(plain, num_batches=3)
    assert isinstance(skipped, DataLoader) and len(skipped) == 2
    assert [b[0].tolist() for b in skipped] == [[6, 7], [8, 9]]
    # A plain loader gives a new SkipDataLoader, which skips on every iteration, as in accelerate.
    assert isinstance(skipped, SkipDataLoader) and len(skipped) == 2 and len(list(skipped)) == 2
    assert skip_first_batches(skipped, 1).skip_batches == 4  # the skips add up

    shard = prepare_data_loader(DataLoader(_numbers(10), batch_size=2))
    assert skip_first_batches(shard, 4) is shard
    flags = [(b[0].tolist(), shard.end_of_dataloader) for b in shard]
    assert flags == [([8, 9], True)] and shard.iteration == 1
    assert len(list(shard)) == 5  # a prepared loader skips on its next iteration only
    assert skip_first_batches(shard, 3) is shard
    again = prepare_data_loader(shard)  # preparing it again keeps that pending skip
    assert [b[0].tolist() for b in again] == [[6, 7], [8, 9]] and len(list(again)) == 5

    stream = skip_first_batches(DataLoader(Stream(7), batch_size=2), 2)
    assert [b.tolist() for b in stream] == [[4, 5], [6]]
    with pytest.raises(ValueError, match="num_batches=-1"):
        skip_first_batches(plain, -1)


def test_skip_data_loader_skips_every_iteration_and_preparing_it_keeps_the_skip():
    loader = SkipDataLoader(_numbers(10), batch_size=2, skip_batches=3)
    assert loader.base_dataloader is loader and not hasattr(SkipDataLoader, "base_dataloader")
    for _ in range(2):
        assert len(loader) == 2
        flags = [(b[0].tolist(), loader.end_of_dataloader) for b in loader]
        assert flags == [([6, 7], False), ([8, 9], True)]
    assert loader.iteration == 2
    # Prepared for 2 ranks, it skips its own first 3 batches, then shares the rest.
    ranks = [prepare_data_loader(loader, num_processes=2, process_index=r) for r in range(2)]
    for _ in range(2):
        assert [[b[0].tolist() for b in shard] for shard in ranks] == [[[6, 7]], [[8, 9]]]
    assert [shard.remainder for shard in ranks] == [0, 0] and len(ranks[0]) == 1
    # An iterable dataset's skip is as many items as the skipped batches held.
    stream = prepare_data_loader(SkipDataLoader(Stream(9), batch_size=2, skip_batches=1), num_processes=2)
    assert [b.tolist() for b in stream] == [[2, 3], [6, 7]] and len(stream) == 2
    # A shuffled loader behind a SkipBatchSampler is prepared without touching the user's samplers.
    data = _numbers(12)
    inner = BatchSampler(RandomSampler(data), 3, False)
    users = SkipBatchSampler(inner, 1)
    prepared = prepare_data_loader(DataLoader(data, batch_sampler=users))
    assert len(list(prepared)) == 3
    assert users.batch_sampler is inner and inner.sampler.generator is None


def test_set_epoch_reaches_a_batch_sampler_and_the_sampler_inside_it():
    class EpochBatches(BatchSampler):
        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

    data = list(range(16))
    sampler = SeedableRandomSampler(data)
    batches = EpochBatches(sampler, 4, False)
    for cls in (DataLoaderShard, DataLoaderDispatcher):
        loader = cls(data, batch_sampler=batches)
        loader.set_epoch(3)
        assert batches.epoch == sampler.epoch == 3
        skipped = skip_first_batches(loader, 1)
        next(iter(skipped))
        assert skipped.iteration == 3 and sampler.epoch == 3


def test_dispatcher_in_one_process():
    loader = prepare_data_loader(
        DataLoader(_numbers(7), batch_size=3), put_on_device=True, dispatch_batches=True
    )
    assert isinstance(loader, DataLoaderDispatcher) and isinstance(loader, DataLoader)
    seen = [(b[0].tolist(), loader.end_of_dataloader) for b in loader]
    assert seen == [([0, 1, 2], False), ([3, 4, 5], False), ([6], True)]
    assert len(loader) == 3 and loader.remainder == 0


# -- exact resume --------------------------------------------------------------------------------


class Counted(Dataset):
    """Records every index it loads, to prove skipped batches are never read."""

    def __init__(self, n):
        self.n, self.loaded = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        self.loaded.append(index)
        return torch.tensor([index]), torch.tensor(float(index) * 0.5)


def _collect(loader, total, state_at=None):
    out, state = [], None
    while len(out) < total:
        for batch in loader:
            out.append(batch[0].clone())
            if len(out) == state_at:
                state = loader.state_dict()
            if len(out) == total:
                break
    return out, state


def _assert_continues(full, head, tail, state_at):
    assert len(head) == state_at and len(full) == len(head) + len(tail)
    assert all(torch.equal(a, b) for a, b in zip(full[:state_at], head))
    assert all(torch.equal(a, b) for a, b in zip(full[state_at:], tail)), "resumed batches differ"


def _prepared(seed, dataset, **kwargs):
    torch.manual_seed(seed)
    return prepare_data_loader(
        DataLoader(dataset, batch_size=3, shuffle=True), rng_types=["generator"], **kwargs
    )


@pytest.mark.parametrize("seedable", [False, True], ids=["generator", "seedable"])
def test_exact_resume_mid_epoch(seedable):
    kwargs = {"use_seedable_sampler": True} if seedable else {}
    per_epoch = 7  # 20 items in batches of 3
    state_at, total = per_epoch + 3, 2 * per_epoch + 4  # 1 epoch + 3 batches; 2.5 epochs
    full, _ = _collect(_prepared(0, Counted(20), **kwargs), total)
    epochs = [torch.cat(full[i * per_epoch : (i + 1) * per_epoch]).flatten().tolist() for i in range(2)]
    assert sorted(epochs[0]) == list(range(20)) and epochs[0] != epochs[1]
    head, state = _collect(_prepared(0, Counted(20), **kwargs), state_at, state_at=state_at)
    assert state["epoch"] == 1 and state["batches_yielded"] == 3

    fresh_data = Counted(20)
    fresh = _prepared(99 if not seedable else 0, fresh_data, **kwargs)  # fresh objects, other global RNG
    torch.manual_seed(12345)
    fresh.load_state_dict(state)
    # len() stays the whole epoch after a restore, as in accelerate (its resume code divides by it)
    assert fresh.state_dict()["batches_yielded"] == 3 and len(fresh) == per_epoch
    tail, _ = _collect(fresh, total - state_at)
    _assert_continues(full, head, tail, state_at)
    # Only the batches it yielded (and one prefetched) were read; the 3 skipped ones were not.
    assert len(fresh_data.loaded) <= 3 * (len(tail) + 1)


def test_exact_resume_of_a_global_rng_sampler_with_a_checkpointer_restoring_the_global_rng():
    def build():
        data = _numbers(20)
        return DataLoaderShard(data, batch_sampler=BatchSampler(RandomSampler(data), 3, False))

    torch.manual_seed(0)
    full, _ = _collect(build(), 18)
    torch.manual_seed(0)
    head, state = _collect(build(), 10, state_at=10)
    saved_global = torch.get_rng_state()  # what a checkpointer saves next to the loader state
    assert state["rng_state"]["torch"] is not None and state["rng_state"]["sampler"] is None

    torch.manual_seed(777)
    fresh = build()
    fresh.load_state_dict(state)
    torch.set_rng_state(saved_global)
    tail, _ = _collect(fresh, 8)
    _assert_continues(full, head, tail, 10)


def test_state_at_the_last_batch_points_to_the_next_epoch():
    loader = _prepared(0, _numbers(9))
    states = [loader.state_dict() for _ in loader]
    assert [(s["epoch"], s["batches_yielded"]) for s in states] == [(0, 1), (0, 2), (1, 0)]
    assert states[-1]["rng_state"].get("torch") is None
    expected = [b[0].clone() for b in loader]  # epoch 1

    fresh = _prepared(5, _numbers(9))
    fresh.load_state_dict(states[-1])
    assert all(torch.equal(a, b[0]) for a, b in zip(expected, fresh)) and fresh.iteration == 2


def test_exact_resume_of_the_dispatcher_in_one_process():
    def build(seed):
        torch.manual_seed(seed)
        source = DataLoader(_numbers(20), batch_size=3, shuffle=True)
        return prepare_data_loader(source, put_on_device=True, dispatch_batches=True)

    full, _ = _collect(build(0), 17)
    head, state = _collect(build(0), 9, state_at=9)
    fresh = build(4)
    fresh.load_state_dict(state)
    tail, _ = _collect(fresh, 8)
    _assert_continues(full, head, tail, 9)


def test_load_state_dict_names_what_does_not_match():
    loader = prepare_data_loader(DataLoader(_numbers(), batch_size=2), num_processes=2, process_index=0)
    state = loader.state_dict()
    single = prepare_data_loader(DataLoader(_numbers(), batch_size=2))
    with pytest.raises(ValueError, match=r"num_processes=2.*num_processes=1"):
        single.load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        single.load_state_dict({"epoch": 0})


def test_exact_resume_with_persistent_workers():
    def build(seed):
        torch.manual_seed(seed)
        source = DataLoader(_numbers(16), batch_size=2, shuffle=True, num_workers=2, persistent_workers=True,
                            multiprocessing_context="forkserver")  # fmt: skip
        return prepare_data_loader(source, rng_types=["generator"])

    full, _ = _collect(build(0), 20)
    head, state = _collect(build(0), 11, state_at=11)
    fresh = build(8)
    fresh.load_state_dict(state)
    tail, _ = _collect(fresh, 9)
    _assert_continues(full, head, tail, 11)


class EpochStream(IterableDataset):
    """Yields a different slice of numbers in every epoch it is told about."""

    def __init__(self):
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        start = 100 * (self.epochs[-1] if self.epochs else -1)
        return iter(range(start, start + 4))


def test_set_epoch_reaches_an_iterable_dataset_through_its_shard():
    data = EpochStream()
    loader = prepare_data_loader(DataLoader(data, batch_size=1), num_processes=2, process_index=1)
    assert isinstance(loader.dataset, IterableDatasetShard)
    assert [b.tolist() for b in loader] == [[1], [3]] and [b.tolist() for b in loader] == [[101], [103]]
    loader.set_epoch(5)
    assert [b.tolist() for b in loader] == [[501], [503]]
    assert data.epochs == [0, 1, 5, 5]  # set_epoch(5), then the iteration's own
