"""utils/modeling, device_map and loading where they follow accelerate 1.15 (its planner, its names and
arguments), and the planner cases where accelerate is wrong and we are not (each says what accelerate
gives). tests/test_modeling.py holds the rest."""

import json
import os
import warnings
from collections import OrderedDict

import pytest
import torch
from mp import run_ranks
from safetensors.torch import save_file
from torch import nn

from notebook_accel.utils.modeling import (
    compute_module_sizes,
    dtype_byte_size,
    get_module_size_with_ties,
    get_non_persistent_buffers,
    infer_auto_device_map,
    load_checkpoint_in_model,
    named_module_tensors,
    set_module_tensor_to_device,
)

TIMEOUT = 120


class Pair(nn.Module):
    def __init__(self, *modules):
        super().__init__()
        for i, module in enumerate(modules):
            self.add_module(f"l{i}", module)


# -- the planner: accelerate's placement ---------------------------------------------------------


def test_main_devices_keep_room_for_the_largest_layer_left():
    # 64, 72 and 100 bytes
    model = nn.Sequential(OrderedDict(a=nn.Linear(3, 4), b=nn.BatchNorm1d(4), c=nn.Linear(4, 5)))
    # Device 0 keeps 100 bytes for c, though everything would fit on 0 and 1 without it.
    assert infer_auto_device_map(model, {0: 200, 1: 200}) == {"a": 0, "b": 1, "c": 1}
    # Once c is the last layer left, the room kept is for nothing: the whole model fits.
    assert infer_auto_device_map(model, {0: 236, 1: 200}) == {"": 0}


def test_a_tied_holder_is_split_when_the_module_fits_but_not_with_it():
    model = nn.Sequential(
        OrderedDict(a=nn.Linear(2, 2), b=Pair(nn.Linear(2, 2, bias=False), nn.Linear(10, 10)))
    )
    model.b.l0.weight = model.a.weight
    # a (24 bytes) fits on the (non-main) device 1, a with all of b does not: b is opened and l0 goes with a.
    device_map = infer_auto_device_map(model, {0: 1, 1: 100, "cpu": 10_000}, clean_result=False)
    assert device_map == {"a": 1, "b.l0": 1, "b.l1": "cpu"}


def test_get_module_size_with_ties():
    sizes = {"b": 50, "b.w": 0, "c": 30, "c.x": 30, "c.x.w": 0}
    queue = [("b", "B"), ("c", "C")]
    assert get_module_size_with_ties([], 10, sizes, queue) == (10, [], [])
    assert get_module_size_with_ties(["c.x.w", "b.w"], 10, sizes, queue) == (90, ["c", "b"], ["C", "B"])
    # A holder of two tied parameters counts once; a parameter nothing in the queue holds adds nothing.
    assert get_module_size_with_ties(["c.x.w", "c.x.w", "gone.w"], 10, sizes, queue) == (40, ["c"], ["C"])


def test_offloaded_buffers_that_fit_no_accelerator_are_warned_about():
    model = nn.Sequential(OrderedDict(a=nn.Linear(3, 4), b=nn.BatchNorm1d(4), c=nn.Linear(4, 5)))
    for name, size in (("a", 20), ("b", 30), ("c", 30)):
        getattr(model, name).register_buffer("extra", torch.zeros(size))
    # b's and c's buffers (280 bytes) stay on device 0 when they run: with a and the room kept, it has 36.
    with pytest.warns(UserWarning, match="offload_buffers=True"):
        assert infer_auto_device_map(model, {0: 400, "cpu": 10_000}) == {"a": 0, "b": "cpu", "c": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        infer_auto_device_map(model, {0: 400, "cpu": 10_000}, offload_buffers=True)


def test_a_device_that_takes_nothing_is_logged(caplog):
    model = nn.Sequential(OrderedDict(a=nn.Linear(10, 10), b=nn.Linear(10, 10)))
    with caplog.at_level("INFO"):
        assert infer_auto_device_map(model, {0: 100}) == {"": "disk"}
    assert "insufficient memory" in caplog.text and "0: 880 bytes required" in caplog.text


# -- the planner: where accelerate 1.15 is wrong ---------------------------------------------------


def test_a_holder_of_two_tied_parameters_counts_once():
    holder = Pair(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False), nn.Linear(100, 1))
    model = nn.Sequential(OrderedDict(a=nn.Linear(4, 4, bias=False), b=holder))
    model.b.l0.weight = model.a.weight
    model.b.l1.weight = model.a.weight
    assert compute_module_sizes(model)[""] == 468
    # accelerate counts b twice (872 bytes) and sends the whole model to disk.
    assert infer_auto_device_map(model, {0: 10, 1: 500, "cpu": 1000}, ["Pair"]) == {"": 1}


def test_room_is_not_kept_for_a_layer_placed_as_a_tied_holder():
    holder = Pair(nn.Linear(2, 2, bias=False), nn.Linear(10, 10))
    model = nn.Sequential(OrderedDict(a=nn.Linear(2, 2, bias=False), b=nn.Linear(2, 2), c=holder))
    model.c.l0.weight = model.a.weight
    # c (the largest layer) goes with a; accelerate still keeps room for it and sends b to the CPU.
    assert infer_auto_device_map(model, {0: 900, "cpu": 10_000}) == {"": 0}


def test_modules_tied_into_one_holder_go_together():
    holder = Pair(nn.Linear(2, 2), nn.Linear(3, 3))
    model = nn.Sequential(OrderedDict(a=nn.Linear(2, 2), e=nn.Linear(3, 3), h=holder))
    model.h.l0.weight = model.a.weight
    model.h.l1.weight = model.e.weight
    assert infer_auto_device_map(model, {0: 1000}) == {"": 0}  # accelerate: IndexError
    # Ties are followed through the holder: e goes with a and h, where its partner is.
    assert infer_auto_device_map(model, {0: 1, 1: 1000}, clean_result=False) == {"a": 1, "h": 1, "e": 1}


def test_a_tie_is_matched_by_prefix_not_by_substring():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    # "1." is in "2.1.weight.": accelerate takes module 1 for a holder of the tie, and fails (IndexError).
    model[2][1].weight = model[0].weight
    assert infer_auto_device_map(model, {0: 1000}) == {"": 0}


def test_a_split_holder_s_own_parameter_is_its_holder():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(2, 2))
            self.proj = nn.Linear(10, 10)

    model = nn.Sequential(OrderedDict(a=nn.Linear(2, 2), h=Head()))
    model.h.weight = model.a.weight
    # h is split so that its weight goes with a: accelerate then finds no holder for it (IndexError).
    device_map = infer_auto_device_map(model, {0: 1, 1: 100, "cpu": 10_000}, clean_result=False)
    assert device_map == {"a": 1, "h.weight": 1, "h.proj": "cpu"}


def test_fallback_skips_a_layer_tied_to_what_it_cannot_reach():
    big = Pair(nn.Linear(10, 10), nn.Linear(2, 2, bias=False))
    model = nn.Sequential(OrderedDict(big=big, small=nn.Linear(2, 2), last=nn.Linear(3, 3)))
    model.small.weight = model.big.l1.weight
    kwargs = dict(no_split_module_classes=["Pair"], fallback_allocation=True)
    # accelerate's fallback looks for big (the module it is placing) among the others: IndexError.
    assert infer_auto_device_map(model, {0: 500, "cpu": 10_000}, **kwargs) == {"": "cpu"}


# -- sizes, names and arguments --------------------------------------------------------------------


def test_dtype_byte_size_counts_a_bool_as_a_bit_but_sizes_count_the_byte_torch_stores():
    assert dtype_byte_size(torch.bool) == 1 / 8 and dtype_byte_size("float16") == 2
    assert dtype_byte_size(torch.float8_e4m3fn) == 1 and dtype_byte_size(torch.int64) == 8
    module = nn.Module()
    module.register_buffer("mask", torch.ones(16, dtype=torch.bool))
    assert compute_module_sizes(module)["mask"] == 16
    assert compute_module_sizes(module, dtype=torch.bool)["mask"] == 16


def test_non_persistent_buffer_names():
    root = nn.Module()
    root.register_buffer("mask", torch.zeros(1))  # persistent, named like the one below
    root.register_buffer("own", torch.zeros(1), persistent=False)
    root.sub = nn.Module()
    root.sub.register_buffer("mask", torch.zeros(1), persistent=False)
    assert get_non_persistent_buffers(root) == {"own"}
    assert get_non_persistent_buffers(root, recurse=True) == {"own", "mask"}  # accelerate's own names
    assert get_non_persistent_buffers(root, recurse=True, fqns=True) == {"own", "sub.mask"}
    assert root._non_persistent_buffers_set == {"own"}
    kept = [n for n, _ in named_module_tensors(root, recurse=True, remove_non_persistent=True)]
    assert kept == ["mask"]  # the root's persistent mask, not the submodule's


def test_set_module_tensor_to_device_takes_non_blocking_and_clear_cache(monkeypatch):
    from notebook_accel.utils import memory

    cleared = []
    monkeypatch.setattr(memory, "clear_device_cache", lambda *a, **k: cleared.append(1))
    model = nn.Linear(2, 2)
    set_module_tensor_to_device(model, "weight", "cpu", value=torch.ones(2, 2), non_blocking=True)
    set_module_tensor_to_device(model, "bias", "meta", clear_cache=True)
    assert torch.equal(model.weight, torch.ones(2, 2)) and model.bias.is_meta
    assert cleared == []  # only an accelerator has a cache to clear


# -- loading ---------------------------------------------------------------------------------------


def _small():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(a=nn.Linear(3, 4), b=nn.BatchNorm1d(4)))
    model.b.running_mean.fill_(2.0)
    return model


def test_a_flat_index_names_each_tensor_file(tmp_path):
    reference = _small()
    state = reference.state_dict()
    index = {}
    for part in ("a", "b"):
        torch.save({k: v for k, v in state.items() if k.startswith(part)}, tmp_path / f"{part}.bin")
        index.update({k: f"{part}.bin" for k in state if k.startswith(part)})
    (tmp_path / "weights.index.json").write_text(json.dumps(index))
    for checkpoint in (tmp_path / "weights.index.json", tmp_path):
        model = nn.Sequential(OrderedDict(a=nn.Linear(3, 4), b=nn.BatchNorm1d(4)))
        load_checkpoint_in_model(model, checkpoint)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_unused_checkpoint_weights_are_logged(tmp_path, caplog):
    state = _small().state_dict()
    state["extra"] = torch.zeros(2)
    torch.save(state, tmp_path / "w.bin")
    report = load_checkpoint_in_model(_small(), tmp_path / "w.bin")
    assert report.unexpected_keys == ["extra"]
    assert "were not used when loading it into Sequential: ['extra']" in caplog.text


def test_broadcast_from_rank0_needs_a_process_group_and_full_tensors(tmp_path):
    torch.save(_small().state_dict(), tmp_path / "w.bin")
    with pytest.raises(ValueError, match="needs an initialised torch.distributed process group"):
        load_checkpoint_in_model(_small(), tmp_path / "w.bin", broadcast_from_rank0=True)
    with pytest.raises(ValueError, match="needs full_state_dict=True"):
        load_checkpoint_in_model(
            _small(), tmp_path / "w.bin", broadcast_from_rank0=True, full_state_dict=False
        )


def _load_from_rank0(folder):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checkpoint = os.path.join(folder, "w.safetensors" if rank == 0 else "nowhere.safetensors")
    model = nn.Sequential(OrderedDict(a=nn.Linear(3, 4), b=nn.BatchNorm1d(4)))
    model.register_buffer("mask", torch.zeros(5, dtype=torch.bool))
    offload = os.path.join(folder, f"offload{rank}")
    device_map = {"a": "cpu", "b": "disk", "mask": "cpu"}
    report = load_checkpoint_in_model(
        model, checkpoint, device_map, offload_folder=offload, dtype=torch.bfloat16, broadcast_from_rank0=True
    )
    from notebook_accel.utils.offload import OffloadedWeightsLoader

    disk = OffloadedWeightsLoader(save_folder=offload)["b.weight"]
    return model.a.weight.float().tolist(), model.mask.tolist(), disk.float().tolist(), report.offloaded_keys


def test_broadcast_from_rank0_loads_rank0s_checkpoint_everywhere(tmp_path):
    reference = _small()
    state = dict(reference.state_dict(), mask=torch.tensor([True, False, True, True, False]))
    save_file(state, str(tmp_path / "w.safetensors"))  # only rank 0 opens it
    results = run_ranks(_load_from_rank0, 2, str(tmp_path), timeout=TIMEOUT)
    assert results[0] == results[1]
    weight, mask, disk_weight, offloaded = results[0]
    assert mask == state["mask"].tolist()
    assert weight == reference.a.weight.bfloat16().float().tolist()
    assert disk_weight == reference.b.weight.bfloat16().float().tolist() and "b.weight" in offloaded


def _load_sharded(folder, full):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    checkpoint = os.path.join(folder, "full.safetensors" if full else f"rank{rank}.safetensors")
    found = []
    for device in ("cpu", "meta"):  # filled in place, or put in place of a meta shard
        model = nn.Linear(4, 6)
        weight = nn.Parameter(distribute_tensor(torch.zeros(6, 4, device=device), mesh, [Shard(0)]))
        model.weight = weight
        load_checkpoint_in_model(model, checkpoint, full_state_dict=full)
        local = model.weight.to_local()
        found.append(
            (type(model.weight.data).__name__, local.device.type, local.tolist(), model.bias.tolist())
        )
        assert (model.weight is weight) == (device == "cpu")
    return found


@pytest.mark.parametrize("full", [True, False])
def test_sharded_parameters_take_their_shard(tmp_path, full):
    weight, bias = torch.arange(24.0).reshape(6, 4), torch.arange(6.0)
    save_file({"weight": weight, "bias": bias}, str(tmp_path / "full.safetensors"))
    for rank in (0, 1):  # with full_state_dict=False, each rank's file holds its own shard
        shard = {"weight": weight[3 * rank : 3 * rank + 3].contiguous(), "bias": bias}
        save_file(shard, str(tmp_path / f"rank{rank}.safetensors"))
    results = run_ranks(_load_sharded, 2, str(tmp_path), full, timeout=TIMEOUT)
    for rank, found in enumerate(results):
        for kind, device, local, loaded_bias in found:
            assert kind == "DTensor" and device == "cpu" and loaded_bias == bias.tolist()
            assert local == weight[3 * rank : 3 * rank + 3].tolist()
