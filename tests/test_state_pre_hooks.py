"""Accelerator.register_save_state_pre_hook / register_load_state_pre_hook: called with the documented
arguments in save_state / load_state, able to change what is saved and loaded; one process, and 2 gloo
ranks through notebook_launcher."""

import os

import pytest
import surface_targets as targets
import torch

from notebook_accel import Accelerator
from notebook_accel.checkpointing import CheckpointError
from notebook_accel.launch import ListSink, notebook_launcher
from notebook_accel.utils import ProjectConfiguration


@pytest.fixture(scope="module", autouse=True)
def _stop_the_warm_server_afterwards():
    yield
    from notebook_accel.launch.warm import WarmServer

    WarmServer.shutdown()


@pytest.mark.timeout(180)
def test_pre_hooks_run_on_both_ranks_and_what_the_main_process_writes_is_saved(tmp_path):
    folder = str(tmp_path / "ckpt")
    results = notebook_launcher(
        targets.state_pre_hooks_run, (folder,), num_processes=2, use_port="auto", sinks=[ListSink()]
    )
    assert sorted(r["rank"] for r in results) == [0, 1]
    for seen in results:
        count, keys, name, exists = seen["save"]
        assert (count, keys, exists) == (1, ["bias", "weight"], True)
        assert name != "ckpt" and "ckpt" in name  # the folder being written, not yet the checkpoint
        assert "extra.txt" in seen["files"]
        assert seen["load"] == (1, True, "written by the hook")
        assert seen["bias"] == [7.0]  # the edited weights were saved and loaded back on every rank


def _prepared(seed: int):
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    return accelerator, model


def test_save_hook_gets_models_weights_and_the_folder_and_can_edit_the_weights(tmp_path):
    accelerator, model = _prepared(0)
    calls = []

    def hook(models, weights, output_dir):
        calls.append((list(models), [sorted(w) for w in weights], output_dir, sorted(os.listdir(output_dir))))
        weights[0]["weight"] = torch.zeros(2, 3)
        with open(os.path.join(output_dir, "config.json"), "w") as f:
            f.write("{}")

    handle = accelerator.register_save_state_pre_hook(hook)
    saved = accelerator.save_state(str(tmp_path / "one"))
    ((models, weight_keys, output_dir, listing),) = calls
    assert models == [model] and weight_keys == [["bias", "weight"]]
    assert os.path.dirname(output_dir) == str(tmp_path) and output_dir != saved
    assert listing == []  # called before anything is written
    assert "config.json" in os.listdir(saved) and not os.path.exists(output_dir)
    assert model.weight.abs().sum() > 0  # the model itself is untouched

    fresh, fresh_model = _prepared(1)
    fresh.load_state(saved)
    assert fresh_model.weight.tolist() == [[0.0] * 3] * 2 and fresh_model.bias.tolist() == model.bias.tolist()

    handle.remove()
    accelerator.save_state(str(tmp_path / "two"))
    assert len(calls) == 1 and "config.json" not in os.listdir(tmp_path / "two")


def test_hooks_that_take_a_model_over_save_and_load_it_themselves(tmp_path):
    accelerator, model = _prepared(0)

    def save_hook(models, weights, output_dir):
        torch.save(weights.pop(0), os.path.join(output_dir, "mine.pt"))

    def load_hook(models, input_dir):
        seen.append(input_dir)
        models.pop(0).load_state_dict(torch.load(os.path.join(input_dir, "mine.pt")))

    seen = []
    accelerator.register_save_state_pre_hook(save_hook)
    saved = accelerator.save_state(str(tmp_path / "ckpt"))
    files = os.listdir(saved)
    assert "mine.pt" in files and not any(f.startswith("model") for f in files)

    fresh, fresh_model = _prepared(1)
    with pytest.raises(CheckpointError, match="model 0"):  # without the load hook the model file is missing
        fresh.load_state(saved)
    fresh.register_load_state_pre_hook(load_hook)
    fresh.load_state(saved)
    assert seen == [saved] and fresh_model.weight.tolist() == model.weight.tolist()


def test_load_hook_gets_the_resolved_folder_with_automatic_naming(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.save_state()
    calls = []
    accelerator.register_load_state_pre_hook(lambda models, input_dir: calls.append((len(models), input_dir)))
    accelerator.load_state()
    assert calls == [(1, os.path.join(str(tmp_path), "checkpoints", "checkpoint_0"))]


def test_a_failing_save_hook_leaves_the_previous_checkpoint(tmp_path):
    accelerator, _ = _prepared(0)
    folder = str(tmp_path / "ckpt")
    accelerator.save_state(folder)
    before = sorted(os.listdir(folder))

    def broken(models, weights, output_dir):
        raise RuntimeError("hook broke")

    accelerator.register_save_state_pre_hook(broken)
    with pytest.raises(CheckpointError, match="hook broke"):
        accelerator.save_state(folder)
    assert sorted(os.listdir(folder)) == before and os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.parametrize("register", ["register_save_state_pre_hook", "register_load_state_pre_hook"])
def test_registering_a_non_function_names_it(register):
    accelerator = Accelerator(cpu=True)
    with pytest.raises(TypeError, match=rf"{register} takes a function, got 'not a hook'"):
        getattr(accelerator, register)("not a hook")
