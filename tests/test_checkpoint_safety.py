"""Checkpoint safety: tampered and corrupt files are refused, saves are durable and a killed save is found."""

from __future__ import annotations

import fractions
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader

from notebook_accel.checkpointing import (
    CheckpointError,
    list_checkpoints,
    load_accelerator_state,
    next_checkpoint_dir,
    save_accelerator_state,
)
from notebook_accel.serialization import load_sharded_state_dict, save_model
from notebook_accel.utils.dataclasses import ProjectConfiguration

TIMEOUT = 60  # the conftest's autouse fixture already clears launcher variables for the children


class Holder:
    """A registered object; its state may hold any value."""

    def __init__(self, value=None):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


class Loader(DataLoader):
    """A real DataLoader with a saved position, as the library's prepared loaders have."""

    def __init__(self, position=0):
        super().__init__(list(range(10)), batch_size=2)
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class MakesFolder:
    """Unpickling it creates a folder: the stand-in for any code a tampered file could run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _pieces(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    return model, optimizer, scheduler


def _save(folder, position=3, value=7):
    model, optimizer, scheduler = _pieces(0)
    save_accelerator_state(
        folder,
        [model.state_dict()],
        [optimizer],
        [scheduler],
        [Loader(position)],
        0,
        1,
        custom_objects=[Holder(value)],
    )
    return model


def _load(folder, **kwargs):
    model, optimizer, scheduler = _pieces(1)
    loader, holder = Loader(), Holder()
    load_accelerator_state(
        folder, [model], [optimizer], [scheduler], [loader], 0, custom_objects=[holder], **kwargs
    )
    return model, loader, holder


# -- 4: loading runs no code ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["dl_state_dict.bin", "scheduler.bin", "custom_checkpoint_0.pkl", "optimizer.bin"]
)
@pytest.mark.parametrize("how", ["torch.save", "raw pickle"])
def test_a_tampered_file_is_refused_and_runs_no_code(tmp_path, name, how):
    folder, marker = tmp_path / "ckpt", str(tmp_path / "code-ran")
    _save(folder)
    if how == "torch.save":
        torch.save({"state": MakesFolder(marker)}, folder / name)
    else:
        (folder / name).write_bytes(pickle.dumps(MakesFolder(marker), protocol=2))
    model, optimizer, scheduler = _pieces(1)
    before, loader, holder = model.weight.clone(), Loader(), Holder()

    with pytest.raises(CheckpointError) as error:
        load_accelerator_state(
            folder, [model], [optimizer], [scheduler], [loader], 0, custom_objects=[holder]
        )
    assert not os.path.exists(marker), "loading the checkpoint ran code from the file"
    message = str(error.value)
    assert str(folder / name) in message
    assert "weights_only=False" not in message
    assert torch.equal(model.weight, before) and (loader.position, holder.value) == (0, None), (
        "nothing changes"
    )


def test_an_object_that_needs_pickle_loads_only_with_trust(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    model, optimizer, scheduler = _pieces(0)
    with caplog.at_level(logging.WARNING):
        save_accelerator_state(
            folder, [model.state_dict()], [], [], [], 0, 1, custom_objects=[Holder(fractions.Fraction(1, 3))]
        )
    assert "custom_checkpoint_0.pkl" in caplog.text and "trust_pickled_objects=True" in caplog.text
    fresh, holder = torch.nn.Linear(4, 2), Holder("untouched")

    with pytest.raises(CheckpointError) as error:
        load_accelerator_state(folder, [fresh], [], [], [], 0, custom_objects=[holder])
    message = str(error.value)
    assert "custom_checkpoint_0.pkl" in message and "fractions.Fraction" in message
    assert "trust_pickled_objects=True" in message
    assert holder.value == "untouched" and not torch.equal(fresh.weight, model.weight)

    load_accelerator_state(
        folder, [fresh], [], [], [], 0, custom_objects=[holder], trust_pickled_objects=True
    )
    assert holder.value == fractions.Fraction(1, 3) and torch.equal(fresh.weight, model.weight)


def test_accelerator_load_state_passes_the_opt_in_through(tmp_path):
    from notebook_accel.accelerator import Accelerator

    accelerator = Accelerator(cpu=True)
    holder = Holder(fractions.Fraction(2, 3))
    accelerator.register_for_checkpointing(holder)
    accelerator.save_state(str(tmp_path / "ckpt"))
    holder.value = None
    with pytest.raises(CheckpointError, match="trust_pickled_objects"):
        accelerator.load_state(str(tmp_path / "ckpt"))
    assert holder.value is None
    accelerator.load_state(str(tmp_path / "ckpt"), trust_pickled_objects=True)
    assert holder.value == fractions.Fraction(2, 3)


@pytest.mark.parametrize(
    "name", ["optimizer.bin", "dl_state_dict.bin", "random_states_0.pkl", "model.safetensors"]
)
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_file_is_named_and_called_corrupt(tmp_path, name, damage):
    folder = tmp_path / "ckpt"
    _save(folder)
    path = folder / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"garbage, not a checkpoint\n" * 4)
    with pytest.raises(CheckpointError) as error:
        _load(folder)
    message = str(error.value)
    assert f"{path} is corrupt" in message, message
    cause = re.search(r"is corrupt or not a checkpoint file \((\w+): (.+)\)", message)
    assert cause and cause.group(2) != cause.group(1), "torch's own cause is kept"
    assert "weights_only" not in message and "trusted source" not in message, message


def test_every_file_the_project_writes_is_plain_data(tmp_path):
    folder = tmp_path / "ckpt"
    _save(folder)
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            torch.load(folder / name, weights_only=True)  # raises on anything but plain data
    model, loader, holder = _load(folder)
    assert (loader.position, holder.value) == (3, 7)


# -- 5: durable saves -----------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fsynced fds through /proc")
def test_a_save_fsyncs_files_and_staging_before_the_renames_and_the_parent_after(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    _save(folder)  # the second save below sets this one aside, then swaps the new one in
    events, real_fsync, real_rename = [], os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", str(src), str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    _save(folder, position=4)

    staging = str(tmp_path / ".ckpt.saving")
    swap = events.index(("rename", staging, str(folder)))
    synced_before = {e[1] for e in events[:swap] if e[0] == "fsync"}
    written = {os.path.join(staging, n) for n in os.listdir(folder)}
    assert written and written <= synced_before, written - synced_before
    assert staging in synced_before
    assert ("rename", str(folder), str(tmp_path / ".ckpt.old")) in events[:swap]
    assert ("fsync", str(tmp_path)) in events[swap:]


_KILLED_BETWEEN_RENAMES = textwrap.dedent(
    """
    import os, signal, sys
    sys.path[:0] = [sys.argv[2]]
    from test_checkpoint_safety import _save
    real_rename = os.rename

    def rename(src, dst):
        if str(src).endswith(".saving"):  # the old folder is aside, the new one not yet in place
            os.kill(os.getpid(), signal.SIGKILL)
        real_rename(src, dst)

    os.rename = rename
    _save(sys.argv[1], position=9, value=9)
    """
)


def _run_child(script, *args):
    return subprocess.run(
        [sys.executable, "-c", script, *args], timeout=TIMEOUT, capture_output=True, text=True
    )


def test_a_save_killed_between_the_renames_is_found_and_said(tmp_path, caplog):
    from notebook_accel.checkpointing import find_checkpoint as from_checkpointing
    from notebook_accel.utils import find_checkpoint

    assert find_checkpoint is from_checkpointing
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    _save(folder, position=3, value=7)
    child = _run_child(_KILLED_BETWEEN_RENAMES, str(folder), os.path.dirname(__file__))
    assert child.returncode == -signal.SIGKILL, child.stderr
    old = tmp_path / "checkpoints" / ".checkpoint_0.old"
    assert not folder.exists() and old.is_dir()

    with caplog.at_level(logging.WARNING):
        assert find_checkpoint(str(folder)) == str(old)
    assert "interrupted" in caplog.text and str(old) in caplog.text
    assert find_checkpoint(str(tmp_path / "never-saved")) is None
    assert list_checkpoints(config) == [str(old)]
    with pytest.raises(FileExistsError):
        next_checkpoint_dir(config)  # iteration 0 would overwrite the recovered checkpoint
    _, loader, holder = _load(list_checkpoints(config)[-1])
    assert (loader.position, holder.value) == (3, 7)

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _save(folder, position=5, value=5)
    assert "interrupted" in caplog.text
    assert sorted(os.listdir(folder.parent)) == ["checkpoint_0"]
    assert find_checkpoint(str(folder)) == str(folder)


_KILLED_MID_SAVE_MODEL = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from notebook_accel.checkpointing import save_model
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # one shard of the new save in place, the others not
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    torch.manual_seed(2)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    os.replace = replace
    save_model(model, sys.argv[1], max_shard_size="600KB")
    """
)


def test_save_model_killed_midway_never_mixes_two_saves(tmp_path):
    torch.manual_seed(1)
    first = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    save_model(first, tmp_path, max_shard_size="600KB")
    expected = first.state_dict()

    child = _run_child(_KILLED_MID_SAVE_MODEL, str(tmp_path))
    assert child.returncode == -signal.SIGKILL, child.stderr
    loaded = load_sharded_state_dict(tmp_path)
    mixed = [k for k, v in expected.items() if not torch.equal(loaded[k], v)]
    assert not mixed, f"tensors of the killed save were read: {mixed}"

    torch.manual_seed(3)
    second = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    written = save_model(second, tmp_path, max_shard_size="600KB")
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in written)
    loaded = load_sharded_state_dict(tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in second.state_dict().items())
