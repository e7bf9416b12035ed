"""save_state / load_state keywords: accelerate 1.15's and ours work (load_kwargs, map_location, strict,
trust_pickled_objects); DeepSpeed's and unknown names raise a TypeError naming them, before anything
is written or loaded, so a typo never passes as a quiet no-op."""

from __future__ import annotations

import fractions
import os

import pytest
import torch
from test_checkpoint_safety import Holder  # a registered object; here its value needs full pickle

from notebook_accel import Accelerator
from notebook_accel.checkpointing import CheckpointError, load_options


def _trained(tmp_path, hooks: list):
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    accelerator.register_save_state_pre_hook(lambda *args: hooks.append("save"))
    accelerator.register_load_state_pre_hook(lambda *args: hooks.append("load"))
    return accelerator, model


# -- save_state ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keywords", "named", "deepspeed"),
    [
        ({"safe_serialisation": False}, "safe_serialisation", False),  # a typo
        ({"client_state": {}}, "client_state", True),
        ({"exclude_frozen_parameters": True, "tag": "x"}, "exclude_frozen_parameters', 'tag", True),
    ],
)
def test_save_state_refuses_a_keyword_it_does_not_take_and_writes_nothing(
    tmp_path, keywords, named, deepspeed
):
    hooks = []
    accelerator, _ = _trained(tmp_path, hooks)
    folder = tmp_path / "ckpt"
    with pytest.raises(TypeError, match=r"save_state\(\) does not take") as error:
        accelerator.save_state(str(folder), **keywords)
    assert named in str(error.value)
    assert ("DeepSpeed" in str(error.value)) is deepspeed
    assert not folder.exists() and os.listdir(tmp_path) == [] and hooks == []


def test_save_state_takes_its_own_keywords(tmp_path):
    accelerator, _ = _trained(tmp_path, [])
    accelerator.save_state(output_dir=str(tmp_path / "bin"), safe_serialization=False)
    assert (tmp_path / "bin" / "pytorch_model.bin").is_file()
    assert not (tmp_path / "bin" / "model.safetensors").exists()


# -- load_state ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "named", "deepspeed"),
    [
        (dict(strictt=False), "strictt", False),
        (dict(load_module_strict=False), "load_module_strict", True),
        (dict(load_optimizer_states=False, map_location="cpu"), "load_optimizer_states", True),
        (dict(load_kwargs={"mmap": True}), "mmap", False),
        (dict(load_kwargs={"weights_only": False, "pickle_module": None}), "pickle_module", False),
    ],
)
def test_load_state_refuses_a_keyword_it_does_not_take_and_loads_nothing(tmp_path, call, named, deepspeed):
    hooks = []
    accelerator, model = _trained(tmp_path, hooks)
    accelerator.save_state(str(tmp_path / "ckpt"))
    hooks.clear()
    with torch.no_grad():
        model.weight.zero_()
    with pytest.raises(TypeError, match=r"load_state\(.*\) does not take") as error:
        accelerator.load_state(str(tmp_path / "ckpt"), **call)
    assert named in str(error.value)
    assert ("DeepSpeed" in str(error.value)) is deepspeed
    assert hooks == [] and torch.count_nonzero(model.weight) == 0


def test_load_state_passes_strict_through(tmp_path):
    accelerator, _ = _trained(tmp_path, [])
    accelerator.save_state(str(tmp_path / "ckpt"))
    bigger = Accelerator(cpu=True)
    grown = torch.nn.Sequential()
    grown.add_module("weight_holder", torch.nn.Linear(3, 2))
    bigger.prepare(grown)
    with pytest.raises(CheckpointError, match="missing keys"):
        bigger.load_state(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match="missing keys"):
        bigger.load_state(str(tmp_path / "ckpt"), strict=True)
    bigger.load_state(str(tmp_path / "ckpt"), strict=False)  # mismatched keys are left as they are


@pytest.mark.parametrize(
    "call",
    [
        dict(trust_pickled_objects=True),
        dict(load_kwargs={"weights_only": False}),
        dict(load_kwargs={"weights_only": False, "map_location": "cpu"}, map_location="cpu"),
    ],
)
def test_trust_pickled_objects_directly_or_as_load_kwargs_weights_only_false(tmp_path, call):
    accelerator = Accelerator(cpu=True)
    holder = Holder(fractions.Fraction(2, 3))
    accelerator.register_for_checkpointing(holder)
    accelerator.save_state(str(tmp_path / "ckpt"))
    holder.value = None
    with pytest.raises(CheckpointError, match="trust_pickled_objects"):
        accelerator.load_state(str(tmp_path / "ckpt"), load_kwargs={"weights_only": True})
    assert holder.value is None
    accelerator.load_state(str(tmp_path / "ckpt"), **call)
    assert holder.value == fractions.Fraction(2, 3)


def test_load_options_reads_load_kwargs_under_the_direct_keywords():
    assert load_options(None, {}) == {}
    assert load_options({"map_location": "cpu"}, {}) == {"map_location": "cpu"}
    assert load_options({"map_location": "cpu"}, {"map_location": "on_device"}) == {
        "map_location": "on_device"
    }
    assert load_options({"weights_only": True}, {"strict": False}) == {"strict": False}
    assert load_options({"weights_only": False}, {}) == {"trust_pickled_objects": True}
