"""Data loaders on real gloo ranks (2 and 4): shard coverage, RNG sync, end_of_dataloader,
remainder, dispatching, skipping and exact resume."""

from __future__ import annotations

import pytest
import torch
from mp import run_ranks
from torch.utils.data import DataLoader, Dataset, TensorDataset

from notebook_accel.data_loader import (
    DataLoaderDispatcher,
    DataLoaderShard,
    prepare_data_loader,
    skip_first_batches,
)
from notebook_accel.state import GradientState, PartialState
from notebook_accel.utils.operations import gather


def _numbers(n):
    return TensorDataset(torch.arange(n))


# -- each rank's work (module level, so the children can import it) --------------------------------


def _epochs_on_rank(items, batch_size, rng_types, own_generator):
    state = PartialState()
    torch.manual_seed(100 + state.process_index)  # ranks start with different global RNGs
    # A generator seeded differently on each rank: only the per-epoch sync can line the ranks up.
    generator = torch.Generator().manual_seed(7 + state.process_index) if own_generator else None
    source = DataLoader(_numbers(items), batch_size=batch_size, shuffle=True, generator=generator)
    loader = prepare_data_loader(source, rng_types=rng_types)
    gradient_state = GradientState()
    epochs = []
    for _ in range(2):
        batches, flags = [], []
        for (batch,) in loader:
            batches.append(batch.tolist())
            flags.append(gradient_state.end_of_dataloader)
        epochs.append((batches, flags))
    return {
        "epochs": epochs,
        "len": len(loader),
        "is_shard": isinstance(loader, DataLoaderShard) and isinstance(loader, DataLoader),
        "unregistered": gradient_state.active_dataloader is None,
    }


def _metrics_on_rank(items, batch_size, dispatch, split):
    source = DataLoader(_numbers(items), batch_size=batch_size)
    loader = prepare_data_loader(source, put_on_device=True, dispatch_batches=dispatch, split_batches=split)
    gradient_state = GradientState()
    rows, remainders = [], []
    for (batch,) in loader:
        gathered = gather(batch)
        if gradient_state.end_of_dataloader:
            remainders.append(gradient_state.remainder)
            if gradient_state.remainder > 0:  # what gather_for_metrics does
                gathered = gathered[: gradient_state.remainder]
        rows.append(gathered)
    return torch.cat(rows).tolist(), remainders, type(loader).__name__


def _dispatch_vs_shard_on_rank():
    out = {}
    for dispatch in (False, True):
        source = DataLoader(_numbers(24), batch_size=4, shuffle=True)
        loader = prepare_data_loader(source, put_on_device=True, split_batches=True, dispatch_batches=dispatch,
                                     use_seedable_sampler=True, data_seed=7)  # fmt: skip
        out[type(loader).__name__] = [[batch.tolist() for (batch,) in loader] for _ in range(2)]
    return out


def _skip_and_break_on_rank(dispatch):
    source = DataLoader(_numbers(20), batch_size=2, shuffle=True)
    loader = prepare_data_loader(source, rng_types=["generator"], use_seedable_sampler=True, data_seed=3,
                                 put_on_device=dispatch, dispatch_batches=dispatch)  # fmt: skip
    full = [batch.tolist() for (batch,) in loader]
    loader.set_epoch(0)
    skipped = skip_first_batches(loader, num_batches=2)
    part = [batch.tolist() for (batch,) in skipped]
    for _ in loader:
        break
    gradient_state = GradientState()
    return {
        "full": full,
        "part": part,
        "is_loader": isinstance(skipped, DataLoader),
        "unregistered": gradient_state.active_dataloader is None
        and gradient_state.dataloader_references == [None],
    }


def _collect(loader, total, state_at=None):
    out, state = [], None
    while len(out) < total:
        for (batch,) in loader:
            out.append(batch.tolist())
            if len(out) == state_at:
                state = loader.state_dict()
            if len(out) == total:
                break
    return out, state


def _resume_on_rank(dispatch, total, state_at):
    rank = PartialState().process_index

    def build(seed):
        torch.manual_seed(seed + rank)
        source = DataLoader(_numbers(40), batch_size=2, shuffle=True)
        return prepare_data_loader(
            source, rng_types=["generator"], put_on_device=dispatch, dispatch_batches=dispatch
        )

    full, _ = _collect(build(0), total)
    head, state = _collect(build(0), state_at, state_at=state_at)
    fresh = build(1000)  # fresh objects, different global RNGs
    torch.manual_seed(4242 + rank)
    fresh.load_state_dict(state)
    tail, _ = _collect(fresh, total - state_at)
    return {"full": full, "head": head, "tail": tail, "state": (state["epoch"], state["batches_yielded"])}


class _Corrupt(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, index):
        if index == 5:
            raise KeyError(f"sample {index} is corrupt")
        return torch.tensor(index)


def _corrupt_dispatch_on_rank():
    loader = prepare_data_loader(
        DataLoader(_Corrupt(), batch_size=2), put_on_device=True, dispatch_batches=True
    )
    try:
        for _ in loader:
            pass
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# -- checks in the parent ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world_size, items, batch_size, rng_types, own_generator",
    [(2, 21, 3, ["generator"], False), (4, 21, 2, ["generator"], True), (2, 22, 3, None, False)],
    ids=["2ranks", "4ranks-own-generators", "2ranks-no-rng-types"],
)
def test_shards_cover_the_data_once_in_the_same_order(
    world_size, items, batch_size, rng_types, own_generator
):
    results = run_ranks(_epochs_on_rank, world_size, items, batch_size, rng_types, own_generator, timeout=60)
    orders = []
    for epoch in range(2):
        per_rank = [r["epochs"][epoch][0] for r in results]
        assert len({len(b) for b in per_rank}) == 1, (
            "even_batches gives every rank the same number of batches"
        )
        # Round k of the global order is batch k of rank 0, then of rank 1, ...
        order = [i for step in zip(*per_rank) for batch in step for i in batch]
        real, padding = order[:items], order[items:]
        assert sorted(real) == list(range(items)), f"epoch {epoch}: the shards overlap or miss samples"
        assert 0 < len(padding) < world_size * batch_size and padding == real[: len(padding)]
        for r in results:
            flags = r["epochs"][epoch][1]
            assert flags == [False] * (len(flags) - 1) + [True]
        orders.append(real)
    assert orders[0] != orders[1], "the order did not change between epochs"
    assert all(r["is_shard"] and r["unregistered"] and r["len"] == len(r["epochs"][0][0]) for r in results)


@pytest.mark.parametrize(
    "dispatch, split", [(False, False), (False, True), (True, False), (True, True)],
    ids=["shard", "shard-split", "dispatch", "dispatch-split"],
)  # fmt: skip
def test_remainder_lets_gathered_metrics_drop_the_padding(dispatch, split):
    results = run_ranks(_metrics_on_rank, 4, 99, 8, dispatch, split, timeout=60)
    for rows, remainders, kind in results:
        assert kind == ("DataLoaderDispatcher" if dispatch else "DataLoaderShard")
        assert remainders == [3], "99 samples in steps of 32 (or 8) leave 3 real samples at the end"
        assert rows == list(range(99)), "99 samples in must give 99 rows out, in order"


def test_dispatcher_gives_the_same_batches_as_the_shard_loader():
    results = run_ranks(_dispatch_vs_shard_on_rank, 2, timeout=60)
    for rank, out in enumerate(results):
        assert out["DataLoaderDispatcher"] == out["DataLoaderShard"], f"rank {rank}"
    for epoch in range(2):
        steps = zip(*[out["DataLoaderShard"][epoch] for out in results])
        assert sorted(i for step in steps for batch in step for i in batch) == list(range(24))
    assert results[0]["DataLoaderShard"][0] != results[0]["DataLoaderShard"][1]


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatch"])
def test_skip_first_batches_and_early_break(dispatch):
    results = run_ranks(_skip_and_break_on_rank, 2, dispatch, timeout=60)
    assert results[0]["full"] != results[1]["full"]
    for out in results:
        assert len(out["full"]) == 5 and out["part"] == out["full"][2:]
        assert out["is_loader"] and out["unregistered"]


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatch"])
def test_exact_resume_on_two_ranks(dispatch):
    # 40 items in batches of 2 on 2 ranks: 10 batches per rank and epoch.
    total, state_at = 25, 13  # 2.5 epochs; 1 epoch + 3 batches
    results = run_ranks(_resume_on_rank, 2, dispatch, total, state_at, timeout=60)
    assert results[0]["full"] != results[1]["full"]
    for rank, out in enumerate(results):
        assert out["state"] == (1, 3)
        full = [torch.tensor(b) for b in out["full"]]
        continued = [torch.tensor(b) for b in out["head"] + out["tail"]]
        assert len(full) == len(continued) == total
        assert all(torch.equal(a, b) for a, b in zip(full, continued)), f"rank {rank}: resumed batches differ"
        epoch0 = sorted(i for r in results for b in r["full"][:10] for i in b)
        assert epoch0 == list(range(40))


def test_dispatcher_is_a_dataloader_on_every_rank():
    results = run_ranks(_metrics_on_rank, 2, 7, 2, True, True, timeout=60)
    # 7 samples, batch 2 split in 1 + 1: the last batch (one sample) is padded with sample 0.
    assert [r[0] for r in results] == [list(range(7))] * 2 and [r[1] for r in results] == [[1]] * 2
    assert issubclass(DataLoaderDispatcher, DataLoader)


def test_a_read_error_on_rank_0_reaches_every_rank_instead_of_hanging():
    rank0, rank1 = run_ranks(_corrupt_dispatch_on_rank, 2, timeout=30)
    assert rank0 == "KeyError: 'sample 5 is corrupt'"
    assert (
        rank1.startswith("RuntimeError: DataLoaderDispatcher: rank 0 failed")
        and "sample 5 is corrupt" in rank1
    )
