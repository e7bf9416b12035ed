"""Checkpoints: round trips, per-rank files on real gloo ranks, atomic saves, rotation, sharded models."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from mp import run_ranks
from torch.utils.data import DataLoader

from notebook_accel.checkpointing import (
    CheckpointError,
    load_accelerator_state,
    load_sharded_state_dict,
    next_checkpoint_dir,
    rotate_checkpoints,
    save_accelerator_state,
    save_model,
)
from notebook_accel.state import PartialState
from notebook_accel.utils.dataclasses import ProjectConfiguration

TIMEOUT = 60
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Counter:
    """A registered custom object; counts how often it is asked for its state."""

    def __init__(self, value=0):
        self.value = value
        self.state_dict_calls = 0

    def state_dict(self):
        self.state_dict_calls += 1
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


class ResumableLoader(DataLoader):
    """A real DataLoader that remembers how far it got, as the library's loaders do."""

    def __init__(self, position=0, delay=0.0, fail=False):
        super().__init__(list(range(10)), batch_size=2)
        self.position, self.delay, self.fail = position, delay, fail

    def state_dict(self):
        if self.fail:
            raise OSError("disk full (on purpose)")
        time.sleep(self.delay)  # lets a rank that skips the barrier run ahead, so the test sees it
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def _draws():
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist())


def _trained():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer, scheduler


def test_round_trip_restores_every_piece_and_the_random_streams(tmp_path):
    torch.manual_seed(0)
    model, optimizer, scheduler = _trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    scaler.scale(torch.tensor(1.0))
    scaler.update(128.0)
    counter, loader, plain = Counter(7), ResumableLoader(position=3), DataLoader(list(range(4)))
    out = save_accelerator_state(
        tmp_path / "ckpt", [model.state_dict()], [optimizer], [scheduler], [plain, loader], 0, 1,
        scaler=scaler, custom_objects=[counter],
    )  # fmt: skip
    expected_draws = _draws()
    assert sorted(os.listdir(out)) == [
        "custom_checkpoint_0.pkl", "dl_state_dict_1.bin", "model.safetensors", "optimizer.bin",
        "random_states_0.pkl", "scaler.pt", "scheduler.bin",
    ]  # fmt: skip  (the plain loader at position 0 has no state and is skipped)

    torch.manual_seed(123)
    fresh, fresh_opt, fresh_sched = _trained()
    fresh_scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    fresh_counter, fresh_loader = Counter(0), ResumableLoader(position=0)
    summary = load_accelerator_state(
        out, [fresh], [fresh_opt], [fresh_sched], [plain, fresh_loader], 0,
        scaler=fresh_scaler, custom_objects=[fresh_counter],
    )  # fmt: skip
    assert _draws() == expected_draws
    assert summary["dataloaders"] == 1 and summary["optimizers"] == 1
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    saved, loaded = optimizer.state_dict(), fresh_opt.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    for p, state in saved["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["state"][p][name], state[name]), (p, name)
    assert fresh_sched.last_epoch == scheduler.last_epoch == 3
    assert fresh_sched.get_last_lr() == scheduler.get_last_lr()
    assert fresh_scaler.get_scale() == 128.0
    assert (fresh_counter.value, fresh_loader.position) == (7, 3)


def test_tied_weights_and_pytorch_bin_in_a_checkpoint(tmp_path):
    tied = _Tied()
    second = torch.nn.Linear(3, 3)
    out = save_accelerator_state(tmp_path / "c", [tied, second.state_dict()], [], [], [], 0, 1, safe_serialization=False)
    assert {"pytorch_model.bin", "pytorch_model_1.bin"} <= set(os.listdir(out))
    fresh, fresh_second = _Tied(), torch.nn.Linear(3, 3)
    load_accelerator_state(out, [fresh, fresh_second], [], [], [], 0)
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh.emb.weight, tied.emb.weight) and torch.equal(fresh_second.weight, second.weight)


def test_every_missing_or_mismatched_piece_is_named_and_nothing_changes(tmp_path):
    model, optimizer, scheduler = _trained()
    other_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = save_accelerator_state(tmp_path / "c", [model.state_dict()], [optimizer, other_opt], [], [], 0, 1)
    wrong_model = torch.nn.Linear(4, 2)
    before = wrong_model.weight.clone()
    state_before = random.getstate()
    with pytest.raises(CheckpointError) as info:
        load_accelerator_state(
            out, [wrong_model], [optimizer], [scheduler], [ResumableLoader()], 3, custom_objects=[Counter()]
        )
    message = str(info.value)
    assert str(out) in message
    for piece in (
        "missing keys ['weight', 'bias']", "unexpected keys ['0.bias', '0.weight', '2.bias', '2.weight']",
        "optimizer_1.bin",
        "scheduler.bin is missing", "custom_checkpoint_0.pkl is missing", "dl_state_dict_rank3.bin is missing",
        "random_states_3.pkl is missing",
    ):  # fmt: skip
        assert piece in message, f"{piece!r} not in:\n{message}"
    assert torch.equal(wrong_model.weight, before)
    assert random.getstate() == state_before
    with pytest.raises(CheckpointError, match="No checkpoint folder"):
        load_accelerator_state(tmp_path / "nowhere", [], [], [], [], 0)


def test_a_piece_that_refuses_its_state_is_named(tmp_path):
    model, optimizer, _ = _trained()
    out = save_accelerator_state(tmp_path / "c", [], [optimizer], [], [], 0, 1)
    smaller = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(CheckpointError, match=r"was only partly loaded:\n  - optimizer 0: ValueError"):
        load_accelerator_state(out, [], [smaller], [], [], 0)


_CRASHING_SAVE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from notebook_accel.checkpointing import save_accelerator_state

    class Killer:
        def state_dict(self):
            os.kill(os.getpid(), signal.SIGKILL)  # dies with the model already written

    model = torch.nn.Linear(4, 2)
    torch.nn.init.constant_(model.weight, 2.0)
    save_accelerator_state(sys.argv[1], [model.state_dict()], [], [], [], 0, 1, custom_objects=[Killer()])
    """
)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path):
    folder = tmp_path / "ckpt"
    model, counter = torch.nn.Linear(4, 2), Counter(5)
    torch.nn.init.constant_(model.weight, 1.0)
    save_accelerator_state(folder, [model.state_dict()], [], [], [], 0, 1, custom_objects=[counter])
    files_before = sorted(os.listdir(folder))

    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    child = subprocess.run([sys.executable, "-c", _CRASHING_SAVE, str(folder)], env=env, timeout=TIMEOUT,
                           capture_output=True, text=True)  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr
    staging = tmp_path / ".ckpt.saving"
    assert "model.safetensors" in os.listdir(staging), "the child should have died in the middle of its save"
    assert sorted(os.listdir(folder)) == files_before

    restored, restored_counter = torch.nn.Linear(4, 2), Counter()
    load_accelerator_state(folder, [restored], [], [], [], 0, custom_objects=[restored_counter])
    assert torch.equal(restored.weight, torch.ones(2, 4)) and restored_counter.value == 5

    save_accelerator_state(folder, [model.state_dict()], [], [], [], 0, 1, custom_objects=[Counter(6)])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "the next save clears the crashed one's leftovers"


def test_a_crash_between_the_two_renames_is_recovered(tmp_path):
    folder = tmp_path / "ckpt"
    save_accelerator_state(folder, [], [], [], [], 0, 1, custom_objects=[Counter(1)])
    # The state a crash right after "old aside" leaves: no output folder, the old one beside it.
    os.rename(folder, tmp_path / ".ckpt.old")
    restored = Counter()
    summary = load_accelerator_state(folder, [], [], [], [], 0, custom_objects=[restored])
    assert restored.value == 1 and summary["input_dir"].endswith(".ckpt.old")
    save_accelerator_state(folder, [], [], [], [], 0, 1, custom_objects=[Counter(2)])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    load_accelerator_state(folder, [], [], [], [], 0, custom_objects=[restored])
    assert restored.value == 2


def _save_and_resume_on_rank(folder):
    state = PartialState()
    rank, world = state.process_index, state.num_processes
    torch.manual_seed(rank)
    random.seed(rank)
    np.random.seed(rank)
    model = torch.nn.Linear(3, 2)  # different weights per rank: only the main process's are saved
    counter = Counter(10 + rank)
    loader = ResumableLoader(position=rank + 1, delay=0.5 if rank == 1 else 0.0)
    out = save_accelerator_state(folder, [model.state_dict()], [], [], [loader], rank, world, custom_objects=[counter])
    files = sorted(os.listdir(out))  # right away: the save must be complete on every rank
    after_save = _draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    fresh, fresh_counter, fresh_loader = torch.nn.Linear(3, 2), Counter(), ResumableLoader()
    load_accelerator_state(out, [fresh], [], [], [fresh_loader], rank, custom_objects=[fresh_counter])
    return {
        "files": files, "calls": counter.state_dict_calls, "after_save": after_save, "after_load": _draws(),
        "own_weight": model.weight.tolist(), "loaded_weight": fresh.weight.tolist(),
        "counter": fresh_counter.value, "position": fresh_loader.position,
    }  # fmt: skip


def test_two_ranks_write_their_own_files_and_resume_their_own_streams(tmp_path):
    results = run_ranks(_save_and_resume_on_rank, 2, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    expected = [
        "custom_checkpoint_0.pkl", "dl_state_dict.bin", "dl_state_dict_rank1.bin", "model.safetensors",
        "random_states_0.pkl", "random_states_1.pkl",
    ]  # fmt: skip
    assert [r["files"] for r in results] == [expected, expected]
    assert [r["calls"] for r in results] == [1, 0], "shared pieces are written by the main process only"
    for rank, r in enumerate(results):
        assert r["after_load"] == r["after_save"], f"rank {rank} did not resume its own random streams"
        assert r["loaded_weight"] == results[0]["own_weight"]
        assert (r["counter"], r["position"]) == (10, rank + 1)
    assert results[0]["after_save"] != results[1]["after_save"]


def _one_rank_fails(folder):
    state = PartialState()
    rank = state.process_index
    save_accelerator_state(folder, [], [], [], [], rank, 2, custom_objects=[Counter(1)])
    try:
        save_accelerator_state(folder, [], [], [], [ResumableLoader(fail=rank == 1)], rank, 2, custom_objects=[Counter(2)])
    except CheckpointError as exc:
        message = str(exc)
    else:
        message = None
    state.wait_for_everyone()
    restored = Counter()
    load_accelerator_state(folder, [], [], [], [], rank, custom_objects=[restored])
    return message, restored.value, sorted(os.listdir(os.path.dirname(folder)))


def test_a_failure_on_one_rank_aborts_the_save_on_every_rank(tmp_path):
    results = run_ranks(_one_rank_fails, 2, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    for message, value, listing in results:
        assert message is not None and "rank 1: OSError: disk full (on purpose)" in message
        assert value == 1 and listing == ["ckpt"]


def test_rotation_keeps_the_newest_in_numeric_order(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2, iteration=8)
    removed = []
    for _ in range(4):
        path = next_checkpoint_dir(config)
        save_accelerator_state(path, [], [], [], [], 0, 1, custom_objects=[Counter(config.iteration)])
        removed += [os.path.basename(p) for p in rotate_checkpoints(config)]
        config.iteration += 1
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_10", "checkpoint_11"]
    assert removed == ["checkpoint_8", "checkpoint_9"]
    config.iteration = 11
    with pytest.raises(FileExistsError, match="checkpoint_11 already exists"):
        next_checkpoint_dir(config)
    with pytest.raises(ValueError, match="project_dir"):
        next_checkpoint_dir(ProjectConfiguration(automatic_checkpoint_naming=True))


# -- save_model ---------------------------------------------------------------------------------


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 64)  # 256 kB
        self.mid = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 1000, bias=False)
        self.head.weight = self.emb.weight


def _shard_names(folder):
    return sorted(n for n in os.listdir(folder) if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", n))


def test_save_model_shards_by_size_with_an_index_and_loads_back_exactly(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])  # about 3.2 MB
    written = save_model(model, tmp_path, max_shard_size="1MB")
    shards = _shard_names(tmp_path)
    assert len(shards) >= 3 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert sorted(os.path.basename(p) for p in written) == sorted(shards + ["model.safetensors.index.json"])
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    state = model.state_dict()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    assert list(index["weight_map"]) == list(state)
    per_shard = {}
    for name, file in index["weight_map"].items():
        per_shard[file] = per_shard.get(file, 0) + state[name].nbytes
    assert set(per_shard) == set(shards) and max(per_shard.values()) <= 1_000_000
    loaded = load_sharded_state_dict(tmp_path)
    assert list(loaded) == list(state)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())

    # Everything fits: one file, and the shards of the save before are gone.
    save_model(model, tmp_path, max_shard_size=10**9)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    assert all(torch.equal(load_sharded_state_dict(tmp_path)[k], v) for k, v in state.items())


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "torch"])
@pytest.mark.parametrize("limit", ["100KB", "10MB"], ids=["sharded", "single"])
def test_tied_weights_are_stored_once_and_tied_again(tmp_path, safe, limit):
    model = _Tied()
    save_model(model, tmp_path, max_shard_size=limit, safe_serialization=safe)
    stored = sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path) if not n.endswith(".json"))
    assert stored < 2 * model.emb.weight.nbytes, "the tied tensor was written twice"
    state = load_sharded_state_dict(tmp_path)
    assert state["head.weight"].data_ptr() == state["emb.weight"].data_ptr()
    fresh = _Tied()
    fresh.load_state_dict(state, strict=True)
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.emb.weight, model.emb.weight)


def test_save_model_odd_tensors_and_bad_sizes(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    odd = {"transposed": base.t(), "slice": base[1:3], "empty": torch.zeros(0), "half": base.half()}
    save_model(odd, tmp_path)
    loaded = load_sharded_state_dict(tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in odd.items())
    with pytest.raises(ValueError, match=r"max_shard_size='1 gig'"):
        save_model(odd, tmp_path, max_shard_size="1 gig")
    assert save_model(odd, tmp_path / "other", is_main_process=False) == [] and not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="meta device"):
        save_model({"w": torch.empty(2, device="meta")}, tmp_path)
    with pytest.raises(FileNotFoundError, match="No model weights"):
        load_sharded_state_dict(tmp_path / "other")
