"""What prepare produced lives in one registry (prepared.py): accelerate's `Accelerator._models`, ... are
views of it, and checkpointing reads it, never the Accelerator's private attributes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from notebook_accel import Accelerator
from notebook_accel.prepared import Prepared

PACKAGE = Path(__file__).resolve().parents[1] / "notebook_accel"


def _loop():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = torch.utils.data.DataLoader(torch.arange(8.0), batch_size=2)
    return accelerator, accelerator.prepare(model, optimizer, scheduler, loader)


def test_accelerates_private_lists_are_the_registrys():
    accelerator, (model, optimizer, scheduler, loader) = _loop()
    registry = accelerator._prepared
    assert registry.models == [model] and accelerator._models is registry.models
    assert accelerator._optimizers is registry.optimizers and registry.optimizers == [optimizer]
    assert accelerator._schedulers is registry.schedulers and registry.schedulers == [scheduler]
    assert accelerator._dataloaders is registry.dataloaders and registry.dataloaders == [loader]
    assert accelerator._custom_objects is registry.custom_objects == []
    replaced = [model]
    accelerator._optimizers = replaced  # accelerate's code assigns these lists; it still works
    assert registry.optimizers is replaced
    # prepared again: kept once, never wrapped twice
    assert accelerator.prepare(model) is model and registry.models == [model]


def test_free_memory_forgets_what_was_prepared_but_keeps_registered_objects_and_hooks():
    accelerator, (model, *_) = _loop()
    holder = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=1.0), lambda _: 1.0)
    accelerator.register_for_checkpointing(holder)
    accelerator.register_save_state_pre_hook(lambda *args: None)
    accelerator.free_memory()
    registry = accelerator._prepared
    assert [registry.models, registry.optimizers, registry.schedulers, registry.dataloaders] == [
        [],
        [],
        [],
        [],
    ]
    assert registry.custom_objects == [holder] and len(accelerator._save_model_state_pre_hook) == 1


def test_pre_hooks_are_kept_by_the_registry_in_order_and_removed_by_their_handle():
    registry = Prepared()
    calls = []
    first = registry.add_state_pre_hook("save", lambda *args: calls.append(("first", args)))
    registry.add_state_pre_hook("save", lambda *args: calls.append(("second", args)))
    registry.add_state_pre_hook("load", lambda *args: calls.append(("load", args)))
    registry.run_state_pre_hooks("save", 1, 2)
    assert calls == [("first", (1, 2)), ("second", (1, 2))]
    first.remove()
    calls.clear()
    registry.run_state_pre_hooks("save", 3)
    assert calls == [("second", (3,))]
    with pytest.raises(TypeError, match="register_load_state_pre_hook takes a function"):
        registry.add_state_pre_hook("load", "not a function")
    accelerator = Accelerator(cpu=True)
    handle = accelerator.register_load_state_pre_hook(print)
    assert list(accelerator._load_model_state_pre_hook.values()) == [print]
    assert list(accelerator._prepared.pre_hooks["load"].values()) == [print]
    handle.remove()
    assert accelerator._load_model_state_pre_hook == {}


def test_register_for_checkpointing_names_each_object_without_a_state_dict():
    registry = Prepared()
    with pytest.raises(ValueError, match=r"index 1, `int`"):
        registry.register_for_checkpointing(torch.nn.Linear(1, 1), 3)
    assert registry.custom_objects == []
    registry.keep("x", "models")
    registry.keep("x", "models")
    assert registry.models == ["x"]


def test_checkpointing_reads_the_registry_not_the_accelerators_private_attributes():
    for name in ("checkpointing.py", "fsdp_checkpoint.py"):
        source = (PACKAGE / name).read_text()
        assert re.findall(r"\b(?:acc|accelerator)\._\w+", source) == [], name
    # The FSDP path is a branch of checkpointing's save / load, not its door: it never calls back up.
    assert not re.search(
        r"^\s*from \. import .*checkpointing\b|from \.checkpointing",
        (PACKAGE / "fsdp_checkpoint.py").read_text(),
        re.M,
    )
    assert "fsdp_checkpoint.save_pieces" in (PACKAGE / "checkpointing.py").read_text()
