"""extract_model_from_parallel (DataParallel in one process, DistributedDataParallel on 2 gloo ranks),
get_model_tp_size and get_mixed_precision_context_manager, at accelerate's paths."""

from __future__ import annotations

import pytest
import torch
from mp import run_ranks

from notebook_accel import AcceleratorState
from notebook_accel.precision import patch_forward_for_autocast
from notebook_accel.utils import (
    AutocastKwargs,
    extract_model_from_parallel,
    get_mixed_precision_context_manager,
    get_model_tp_size,
)
from notebook_accel.utils.operations import convert_outputs_to_fp32

# -- on 2 ranks ---------------------------------------------------------------------------------


def _ddp_unwrapping():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    parent = torch.nn.Sequential(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2)), torch.nn.ReLU())
    kept = extract_model_from_parallel(parent)
    kept_child = type(kept[0]).__name__
    extract_model_from_parallel(parent, recursive=True)
    return {
        "top": extract_model_from_parallel(ddp) is model,
        "kept_child": kept_child,
        "recursive_child": type(parent[0]).__name__,
    }


@pytest.mark.timeout(120)
def test_extract_model_from_parallel_takes_the_module_out_of_ddp_on_two_ranks():
    for out in run_ranks(_ddp_unwrapping, 2, timeout=90):
        assert out == {
            "top": True,
            "kept_child": "DistributedDataParallel",
            "recursive_child": "Linear",
        }


# -- one process --------------------------------------------------------------------------------


class Double(torch.nn.Module):
    def forward(self, x):
        return 2 * x


def test_extract_model_from_parallel_unwraps_data_parallel_and_compile():
    model = Double()
    assert extract_model_from_parallel(model) is model
    assert extract_model_from_parallel(torch.nn.DataParallel(torch.nn.DataParallel(model))) is model
    compiled = torch.compile(model)
    assert extract_model_from_parallel(compiled) is compiled
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    over_parallel = torch.compile(torch.nn.DataParallel(model))
    # Compiled over the DataParallel: a new compiled wrapper around the module inside (as accelerate
    # gives), the one passed in left as it was.
    kept_compiled = extract_model_from_parallel(over_parallel)
    assert isinstance(kept_compiled, type(compiled)) and kept_compiled._orig_mod is model
    assert isinstance(over_parallel._orig_mod, torch.nn.DataParallel)
    assert extract_model_from_parallel(over_parallel, keep_torch_compile=False) is model


def test_get_model_tp_size_reads_both_transformers_layouts():
    from types import SimpleNamespace

    model = Double()
    assert get_model_tp_size(model) is None
    model.tp_size = 2  # transformers < 5
    assert get_model_tp_size(model) == 2
    model.tp_size = None  # transformers 5: a None stub, the degree in the config
    model.config = SimpleNamespace(distributed_config=SimpleNamespace(tp_size=4))
    assert get_model_tp_size(model) == 4
    model.config = SimpleNamespace(distributed_config={"tp_size": 8})  # a config read back from JSON
    assert get_model_tp_size(model) == 8


def test_extract_model_from_parallel_recursive_replaces_wrapped_submodules():
    inner = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.nn.DataParallel(inner), torch.nn.Sequential(torch.nn.DataParallel(Double())))
    assert isinstance(extract_model_from_parallel(model)[0], torch.nn.DataParallel)  # not recursive: untouched
    out = extract_model_from_parallel(torch.nn.DataParallel(model), recursive=True)
    assert out is model and model[0] is inner and isinstance(model[1][0], Double)


def test_extract_model_from_parallel_can_restore_the_forward_mixed_precision_patched():
    model = Double()
    patch_forward_for_autocast(model, "bf16", "cpu")
    assert extract_model_from_parallel(model) is model and "forward" in model.__dict__  # kept by default
    out = extract_model_from_parallel(torch.nn.DataParallel(model), keep_fp32_wrapper=False)
    assert out is model and "forward" not in model.__dict__ and "_original_forward" not in model.__dict__
    assert model(torch.ones(2)).tolist() == [2.0, 2.0]

    # A forward set on the instance comes back as it was; so does one wrapped the way accelerate does.
    def own_forward(x):
        return x + 1

    other = Double()
    other.forward = own_forward
    other._original_forward = other.forward
    other.forward = convert_outputs_to_fp32(other.forward)
    extract_model_from_parallel(other, keep_fp32_wrapper=False)
    assert other.forward is own_forward and "_original_forward" not in other.__dict__


def test_extract_model_from_parallel_names_a_non_module():
    with pytest.raises(TypeError, match="takes a torch.nn.Module, got dict"):
        extract_model_from_parallel({"weight": torch.ones(1)})


def _autocast_now():
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")


def test_get_mixed_precision_context_manager_follows_the_accelerator_state():
    from notebook_accel.utils import modeling

    assert modeling.get_mixed_precision_context_manager is get_mixed_precision_context_manager
    a = torch.ones(2, 2)
    AcceleratorState(mixed_precision="bf16", cpu=True)
    with get_mixed_precision_context_manager(native_amp=False):
        assert not torch.is_autocast_enabled("cpu") and torch.mm(a, a).dtype == torch.float32
    with get_mixed_precision_context_manager(native_amp=True):
        assert _autocast_now() == (True, torch.bfloat16) and torch.mm(a, a).dtype == torch.bfloat16
    with get_mixed_precision_context_manager(True, AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu")
    AcceleratorState._reset_state(reset_partial_state=True)
    AcceleratorState(mixed_precision="fp16", cpu=True)
    with get_mixed_precision_context_manager(native_amp=True):
        assert _autocast_now() == (True, torch.float16)


def test_get_mixed_precision_context_manager_with_no_state_uses_the_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    with get_mixed_precision_context_manager(native_amp=True):
        assert _autocast_now() == (True, torch.float16)
    assert AcceleratorState().mixed_precision == "fp16"


def test_get_mixed_precision_context_manager_with_no_mixed_precision_autocasts_as_accelerate():
    AcceleratorState(mixed_precision="no", cpu=True)
    with get_mixed_precision_context_manager(native_amp=True):  # torch's default dtype for the CPU
        assert _autocast_now() == (True, torch.bfloat16)
    with pytest.raises(TypeError, match=r"AutocastKwargs or None, got \{'enabled': False\}"):
        get_mixed_precision_context_manager(True, {"enabled": False})
