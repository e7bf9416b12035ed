"""set_seed and RNG synchronisation: one process, and real gloo ranks (2 and 4)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from mp import run_ranks

from notebook_accel.state import PartialState
from notebook_accel.utils import is_cuda_available, set_seed, synchronize_rng_state, synchronize_rng_states


def _draws_after_seed(seed):
    torch.manual_seed(seed)
    return torch.rand(3).tolist()


def _sync_on_ranks():
    state = PartialState()
    r = state.process_index
    torch.manual_seed(100 + r)
    generator = torch.Generator().manual_seed(200 + r)
    before = torch.rand(3).tolist()  # differs per rank, so a no-op sync would be caught
    torch.manual_seed(100 + r)
    synchronize_rng_states(["torch", "generator"], generator=generator)
    out = {
        "before": before,
        "torch": torch.rand(3).tolist(),
        "generator": torch.rand(3, generator=generator).tolist(),
    }

    set_seed(42, device_specific=True)
    out["device_specific"] = (random.random(), torch.rand(2).tolist())
    set_seed(42)
    out["shared"] = (random.random(), float(np.random.rand()), torch.rand(2).tolist())
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_synchronize_rng_states_and_set_seed_across_ranks(world_size):
    results = run_ranks(_sync_on_ranks, world_size, timeout=60)
    assert len({tuple(out["before"]) for out in results}) == world_size
    rank0_torch = _draws_after_seed(100)
    gen = torch.Generator().manual_seed(200)
    rank0_generator = torch.rand(3, generator=gen).tolist()
    for rank, out in enumerate(results):
        assert out["torch"] == rank0_torch, f"rank {rank} did not take rank 0's torch state"
        assert out["generator"] == rank0_generator, f"rank {rank} did not take rank 0's generator state"
        random.seed(42 + rank)
        assert out["device_specific"] == (random.random(), _draws_after_seed(42 + rank)[:2])
    random.seed(42)
    np.random.seed(42)
    expected_shared = (random.random(), float(np.random.rand()), _draws_after_seed(42)[:2])
    assert [out["shared"] for out in results] == [expected_shared] * world_size


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    PartialState._reset_state()
    yield
    PartialState._reset_state()


def test_set_seed_seeds_python_numpy_and_torch():
    set_seed(1234)
    first = (random.random(), np.random.rand(), torch.rand(2).tolist())
    random.random(), np.random.rand(), torch.rand(2)
    set_seed(1234)
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == first
    set_seed(1234, device_specific=True)  # one process: index 0, same streams
    assert random.random() == first[0]
    set_seed(1235)
    assert random.random() != first[0]


def test_set_seed_deterministic_turns_on_deterministic_algorithms(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own choice is kept
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        set_seed(0)
        assert not torch.are_deterministic_algorithms_enabled()
        set_seed(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(was)


def test_synchronize_in_one_process_keeps_the_state_and_checks_arguments():
    torch.manual_seed(5)
    generator = torch.Generator().manual_seed(6)
    synchronize_rng_states(["torch", "generator"], generator=generator)
    assert torch.rand(2).tolist() == _draws_after_seed(5)[:2]
    assert (
        torch.rand(1, generator=generator).item()
        == torch.rand(1, generator=torch.Generator().manual_seed(6)).item()
    )
    synchronize_rng_state(None)  # accepted, does nothing
    with pytest.raises(ValueError, match="Unknown rng type 'dice'"):
        synchronize_rng_states(["dice"])
    with pytest.raises(ValueError, match="needs the generator"):
        synchronize_rng_state("generator")


@pytest.mark.skipif(is_cuda_available(), reason="checks the message on machines without CUDA")
def test_synchronize_cuda_without_cuda_says_what_to_do():
    with pytest.raises(RuntimeError, match="no cuda device is usable"):
        synchronize_rng_states(["cuda"])
    assert not torch.cuda.is_initialized()
