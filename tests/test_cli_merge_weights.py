"""`notebook-accel merge-weights`: a sharded checkpoint that 2 real gloo ranks saved, merged by the command
in its own process, equals the model's full weights exactly; bad paths are named before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from notebook_accel import notebook_launcher
from notebook_accel.launch.sinks import ListSink

SCRIPT = os.path.join(os.path.dirname(sys.executable), "notebook-accel")
TIMEOUT = 120


def merge(*argv):
    return subprocess.run([SCRIPT, "merge-weights", *argv], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A sharded save_state of the FSDP MLP from 2 ranks, and its full weights at the save."""
    from fsdp_checkpoint_targets import save_only

    folder = tmp_path_factory.mktemp("fsdp") / "ckpt"
    results = notebook_launcher(
        save_only, (str(folder),), num_processes=2, use_port="auto", cpu=True, sinks=[ListSink()], timeout=TIMEOUT
    )
    return folder, results[0]["saved"]


def assert_equal_weights(merged: dict, full: dict):
    assert sorted(merged) == sorted(full)
    for name, tensor in full.items():
        assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], tensor), name


@pytest.mark.timeout(TIMEOUT + 90)
def test_merge_weights_writes_the_full_model_as_safetensors(saved, tmp_path):
    from fsdp_targets import make_mlp
    from safetensors.torch import load_file

    folder, full = saved
    shards = folder / "pytorch_model_fsdp_0"
    done = merge(str(shards), str(tmp_path / "merged"))
    assert done.returncode == 0, done.stderr
    path = tmp_path / "merged" / "model.safetensors"
    assert f"Merged weights saved to {path}" in done.stdout
    merged = load_file(str(path))
    assert_equal_weights(merged, full)
    model = make_mlp(seed=99)  # other weights until the merged ones are loaded
    model.load_state_dict(merged)
    assert_equal_weights(model.state_dict(), full)
    assert (shards / ".metadata").is_file()  # kept without --remove_checkpoint_dir


@pytest.mark.timeout(TIMEOUT + 90)
def test_unsafe_serialization_and_remove_checkpoint_dir(saved, tmp_path):
    import shutil

    folder, full = saved
    copy = tmp_path / "pytorch_model_fsdp_0"
    shutil.copytree(folder / "pytorch_model_fsdp_0", copy)
    done = merge(str(copy), str(tmp_path / "out"), "--unsafe_serialization", "--remove_checkpoint_dir")
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path / "out") == ["pytorch_model.bin"]
    assert_equal_weights(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True), full)
    assert not copy.exists()


@pytest.mark.timeout(TIMEOUT + 90)
def test_bad_paths_are_named_and_nothing_is_written(saved, tmp_path):
    folder, _ = saved
    shards = folder / "pytorch_model_fsdp_0"
    # The checkpoint folder above the shards: not a DCP folder, and the message says which to pass.
    done = merge(str(folder), str(tmp_path / "a"))
    assert done.returncode == 1
    assert f"{folder} is not a torch.distributed.checkpoint folder (no .metadata)" in done.stderr
    assert f"pass {shards}" in done.stderr
    missing = tmp_path / "nowhere"
    done = merge(str(missing), str(tmp_path / "b"))
    assert done.returncode == 1 and f"checkpoint directory {missing} does not exist" in done.stderr
    target = tmp_path / "taken"
    target.write_text("not a folder")
    done = merge(str(shards), str(target))
    assert done.returncode == 1 and f"output path {target} is a file; pass a folder" in done.stderr
    assert target.read_text() == "not a folder"
    done = merge(str(shards), str(shards / "merged"), "--remove_checkpoint_dir")
    assert done.returncode == 1 and f"is inside {shards}" in done.stderr
    assert (shards / ".metadata").is_file() and not (shards / "merged").exists()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
