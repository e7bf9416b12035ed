"""Sizes, tied parameters, device maps and checkpoint loading (notebook_accel.utils.modeling)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from notebook_accel.serialization import save_model
from notebook_accel.utils.modeling import (
    check_device_map,
    clean_device_map,
    compute_module_sizes,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
    get_state_dict_offloaded_model,
    infer_auto_device_map,
    load_checkpoint_in_model,
    named_module_tensors,
    retie_parameters,
    set_module_tensor_to_device,
)
from notebook_accel.utils.offload import OffloadedWeightsLoader, load_offload_index

D = 128
LINEAR = (D * D + D) * 4  # 66048 bytes
BLOCK = 2 * LINEAR  # 132096 bytes
HEAD = (D * 10 + 10) * 4  # 5160 bytes


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self, blocks=6):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(D, 10)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TiedLM(nn.Module):
    def __init__(self, vocab=500, blocks=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.lm_head = nn.Linear(D, vocab, bias=False)
        self.lm_head.weight = self.embed.weight


def meta(cls, *args):
    with torch.device("meta"):
        return cls(*args)


# -- sizes ---------------------------------------------------------------------------------------


def test_module_sizes_are_exact_bytes_on_meta_and_real():
    for model in (MLP(), meta(MLP)):
        sizes = compute_module_sizes(model)
        assert sizes["blocks.0.fc1"] == LINEAR and sizes["blocks.0.fc1.bias"] == D * 4
        assert sizes["blocks.3"] == BLOCK and sizes["blocks"] == 6 * BLOCK
        assert sizes["steps"] == 8 and sizes["scratch"] == 16
        assert sizes[""] == 6 * BLOCK + HEAD + 8 + 16


def test_module_sizes_with_dtype_keep_integer_buffers():
    sizes = compute_module_sizes(
        meta(MLP), dtype=torch.float16, special_dtypes={"head.weight": torch.float64}
    )
    assert sizes["blocks.0"] == BLOCK // 2
    assert sizes["steps"] == 8  # int64 buffers are not cast
    assert sizes["head"] == D * 10 * 8 + 10 * 2
    assert compute_module_sizes(meta(MLP), dtype="bfloat16")["blocks"] == 3 * BLOCK


def test_tied_weights_count_once():
    sizes = compute_module_sizes(meta(TiedLM))
    assert sizes["embed"] == 500 * D * 4
    assert "lm_head" not in sizes  # its only weight is the embedding's
    assert sizes[""] == 500 * D * 4 + 3 * BLOCK


def test_max_layer_size_respects_no_split():
    model = meta(MLP)
    sizes = compute_module_sizes(model)
    top = list(model.named_children())
    assert get_max_layer_size(top, sizes, ["Block"]) == (BLOCK, [f"blocks.{i}" for i in range(6)])
    size, names = get_max_layer_size(top, sizes, [])
    assert size == LINEAR and names[0] == "blocks.0.fc1" and len(names) == 12


# -- ties ----------------------------------------------------------------------------------------


def test_find_tied_parameters_works_on_meta_and_retie_restores_identity():
    for model in (TiedLM(), meta(TiedLM)):
        assert find_tied_parameters(model) == [["embed.weight", "lm_head.weight"]]
    assert find_tied_parameters(MLP()) == []
    model = TiedLM()
    model.lm_head.weight = nn.Parameter(torch.zeros_like(model.embed.weight))
    assert find_tied_parameters(model) == []
    retie_parameters(model, [["embed.weight", "lm_head.weight"]])
    assert model.lm_head.weight is model.embed.weight


def test_named_module_tensors():
    model = MLP()
    assert [n for n, _ in named_module_tensors(model)] == ["steps", "scratch"]
    assert [n for n, _ in named_module_tensors(model, remove_non_persistent=True)] == ["steps"]
    names = [n for n, _ in named_module_tensors(model, recurse=True, include_buffers=False)]
    assert names[:2] == ["blocks.0.fc1.weight", "blocks.0.fc1.bias"] and len(names) == 26


# -- set_module_tensor_to_device -----------------------------------------------------------------


def test_set_module_tensor_from_meta_to_cpu_with_dtype():
    model = meta(MLP)
    value = torch.randn(D, D)
    set_module_tensor_to_device(model, "blocks.1.fc2.weight", "cpu", value=value, dtype=torch.float16)
    param = model.blocks[1].fc2.weight
    assert isinstance(param, nn.Parameter) and param.requires_grad
    assert param.device.type == "cpu" and param.dtype == torch.float16
    assert torch.equal(param, value.half())
    set_module_tensor_to_device(model, "steps", "cpu", value=torch.tensor(3), dtype=torch.float16)
    assert model.steps.dtype == torch.int64 and model.steps.item() == 3  # integer buffers keep their dtype
    assert "steps" in dict(model.named_buffers())


def test_set_module_tensor_keeps_requires_grad_and_model_dtype():
    model = MLP()
    model.head.bias.requires_grad_(False)
    set_module_tensor_to_device(model, "head.bias", "cpu", value=torch.ones(10, dtype=torch.float64))
    assert model.head.bias.dtype == torch.float32 and not model.head.bias.requires_grad
    weight = model.head.weight
    set_module_tensor_to_device(model, "head.weight", "cpu")
    assert model.head.weight is weight  # nothing to move: the same parameter object stays
    set_module_tensor_to_device(model, "head.weight", "cpu", dtype=torch.float64)
    assert model.head.weight.dtype == torch.float64 and torch.equal(model.head.weight, weight.double())
    set_module_tensor_to_device(model, "head.weight", "meta")
    assert model.head.weight.is_meta and isinstance(model.head.weight, nn.Parameter)


def test_set_module_tensor_errors_name_the_problem():
    model = meta(MLP)
    with pytest.raises(ValueError, match="meta device .* pass a `value`"):
        set_module_tensor_to_device(model, "head.weight", "cpu")
    with pytest.raises(
        ValueError,
        match=r'shape torch.Size\(\[3\]\) in "weight" \(which has shape torch.Size\(\[10, 128\]\)\)',
    ):
        set_module_tensor_to_device(model, "head.weight", "cpu", value=torch.zeros(3))
    with pytest.raises(ValueError, match="no parameter or buffer named 'weights'"):
        set_module_tensor_to_device(model, "head.weights", "cpu", value=torch.zeros(3))
    with pytest.raises(ValueError, match="no submodule 'tail'"):
        set_module_tensor_to_device(model, "tail.weight", "cpu", value=torch.zeros(3))


def test_tied_params_map_reuses_the_copy_on_a_device():
    model = TiedLM()
    source = torch.randn(500, D)
    tied = {source.data_ptr(): {}}
    set_module_tensor_to_device(model, "embed.weight", "cpu", value=source, tied_params_map=tied)
    set_module_tensor_to_device(model, "lm_head.weight", "cpu", value=source, tied_params_map=tied)
    assert model.lm_head.weight is model.embed.weight


# -- device maps ---------------------------------------------------------------------------------


def test_infer_auto_device_map_with_budgets_and_no_split():
    model = meta(MLP)
    # 2 blocks fit each budget, but both main devices keep room for one offloaded block.
    device_map = infer_auto_device_map(model, {0: "300KB", "cpu": 300_000}, no_split_module_classes=["Block"])
    assert device_map == {
        "blocks.0": 0,
        "blocks.1": "cpu",
        "blocks.2": "disk",
        "blocks.3": "disk",
        "blocks.4": "disk",
        "blocks.5": "disk",
        "head": "disk",
        "steps": "disk",
        "scratch": "disk",
    }
    check_device_map(model, device_map)


def test_infer_auto_device_map_splits_blocks_without_no_split():
    device_map = infer_auto_device_map(meta(MLP), {0: 4 * LINEAR + 100, "cpu": "10MB"})
    # Room is kept on device 0 for one offloaded Linear, so three fit there: block 1 is split.
    assert device_map == {
        "blocks.0": 0, "blocks.1.fc1": 0, "blocks.1.fc2": "cpu",
        **{f"blocks.{i}": "cpu" for i in range(2, 6)}, "head": "cpu", "steps": "cpu", "scratch": "cpu",
    }  # fmt: skip
    check_device_map(meta(MLP), device_map)
    whole = {"blocks": 0, "head": 0, "steps": 0, "scratch": 0}
    assert infer_auto_device_map(meta(MLP), {0: "10MB"}, clean_result=False) == whole
    assert infer_auto_device_map(meta(MLP), {0: "10MB"}) == {"": 0}


def test_whole_model_that_fits_uses_the_whole_budget():
    total = compute_module_sizes(meta(MLP))[""]
    assert infer_auto_device_map(meta(MLP), {0: total, "cpu": "1GB"}, ["Block"]) == {"": 0}
    assert infer_auto_device_map(meta(MLP), {"cpu": total}, ["Block"]) == {"": "cpu"}


def test_disk_takes_what_does_not_fit_and_an_explicit_disk_budget_is_honoured():
    device_map = infer_auto_device_map(meta(MLP), {"cpu": BLOCK}, ["Block"])
    assert set(device_map.values()) == {"disk"}  # the CPU must keep one block free to run disk blocks
    device_map = infer_auto_device_map(meta(MLP), {"cpu": 2 * BLOCK}, ["Block"])
    assert device_map["blocks.0"] == "cpu" and device_map["blocks.1"] == "disk"
    with pytest.raises(ValueError, match="does not fit in max_memory"):
        infer_auto_device_map(meta(MLP), {"cpu": 2 * BLOCK, "disk": BLOCK}, ["Block"])


def test_tied_parameters_land_on_one_device():
    model = meta(TiedLM)
    embed = 500 * D * 4
    device_map = infer_auto_device_map(
        model, {0: embed + BLOCK, 1: 2 * BLOCK, "cpu": "1GB"}, ["Block"], clean_result=False
    )
    assert device_map["embed"] == device_map["lm_head"] == 0
    # Device 0 keeps room for a block (the largest layer left), so the blocks start on device 1.
    assert device_map["blocks.0"] == 1 and device_map["blocks.1"] == 1 and device_map["blocks.2"] == "cpu"


def test_tied_group_too_big_for_a_device_moves_as_a_whole():
    model = meta(TiedLM)
    device_map = infer_auto_device_map(model, {0: 1000, "cpu": "1GB"}, ["Block"])
    assert device_map == {"": "cpu"}


def test_fallback_allocation_fills_an_otherwise_empty_device():
    # Device 0 fits one block, but not with room kept for an offloaded one; the head fits beside that room.
    budgets = {0: BLOCK + HEAD + 10, "cpu": "1GB"}
    assert 0 not in infer_auto_device_map(meta(MLP), budgets, ["Block"]).values()
    device_map = infer_auto_device_map(meta(MLP), budgets, ["Block"], fallback_allocation=True)
    assert device_map == {"blocks": "cpu", "head": 0, "steps": "cpu", "scratch": "cpu"}


def test_check_device_map_errors():
    model = meta(MLP)
    # A key that names nothing places nothing: a warning, as in accelerate.
    with pytest.warns(
        UserWarning, match=r"device_map keys do not match any submodules in MLP.*\['blocks.9'\]"
    ):
        check_device_map(model, {"blocks.9": 0, "": "cpu"})
    with pytest.raises(ValueError, match=r"no device for these tensors: \['head.weight', 'head.bias'\]"):
        check_device_map(model, {"blocks": 0, "steps": "cpu", "scratch": "cpu"})
    with pytest.raises(ValueError, match="'gpu0' is not a device"):
        check_device_map(model, {"": "gpu0"})
    check_device_map(
        model, {"blocks": 0, "head.weight": "disk", "head.bias": "meta", "steps": "cpu", "scratch": 1}
    )


def test_clean_device_map_merges_in_order():
    device_map = {"a.x": 0, "a.y": 0, "b.x": "cpu", "b.y.p": "disk", "b.y.q": "disk", "c": 0}
    assert list(clean_device_map(device_map).items()) == [("a", 0), ("b.x", "cpu"), ("b.y", "disk"), ("c", 0)]
    assert clean_device_map({"a": 1, "b.c": 1}) == {"": 1}


def test_get_max_memory_parses_and_orders():
    assert get_max_memory({"cpu": "1KiB", 1: "2MB", "disk": 5, 0: 10}) == {
        0: 10,
        1: 2_000_000,
        "cpu": 1024,
        "disk": 5,
    }
    with pytest.raises(ValueError, match="'gpu zero' is not a device"):
        get_max_memory({"gpu zero": "1GB"})
    with pytest.raises(ValueError, match=r"max_memory\['cpu'\].*12XB"):
        get_max_memory({"cpu": "12XB"})
    found = get_max_memory()
    assert found["cpu"] > 0 and list(found)[-1] == "cpu"


def test_get_balanced_memory_spreads_over_accelerators():
    model = meta(MLP)
    total = compute_module_sizes(model)[""]
    budgets = get_balanced_memory(model, {0: "10MB", 1: "10MB", "cpu": "10MB"}, ["Block"])
    share = total // 2 + int(1.25 * BLOCK)
    assert budgets == {0: share, 1: 10_000_000, "cpu": 10_000_000}
    device_map = infer_auto_device_map(model, budgets, ["Block"])
    assert device_map["blocks.0"] == 0 and device_map["blocks.5"] == 1
    low = get_balanced_memory(model, {0: "10MB", 1: "10MB", "cpu": "10MB"}, ["Block"], low_zero=True)
    assert low[0] == 0  # device 1 can hold the whole model
    assert get_balanced_memory(model, {"cpu": "1MB"}) == {"cpu": 1_000_000}


# -- loading -------------------------------------------------------------------------------------


def _reference():
    torch.manual_seed(0)
    model = MLP()
    model.steps.fill_(41)
    return model


def _assert_same(model, reference):
    state, expected = model.state_dict(), reference.state_dict()
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("layout", ["safetensors", "bin", "pt", "sharded", "index"])
def test_load_checkpoint_equals_the_state_dict(tmp_path, layout):
    reference = _reference()
    if layout == "safetensors":
        checkpoint = tmp_path / "weights.safetensors"
        save_file(reference.state_dict(), str(checkpoint))
    elif layout in ("bin", "pt"):
        checkpoint = tmp_path / f"weights.{layout}"
        torch.save(reference.state_dict(), str(checkpoint))
    else:
        save_model(reference, str(tmp_path), max_shard_size="200KB")
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
        checkpoint = tmp_path if layout == "sharded" else tmp_path / "model.safetensors.index.json"
    model = meta(MLP)
    report = load_checkpoint_in_model(model, checkpoint, device_map={"": "cpu"})
    assert report.missing_keys == [] and report.unexpected_keys == []
    _assert_same(model, reference)
    assert model.scratch.is_meta  # not in the checkpoint (non-persistent), left alone
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in model.parameters())


def test_load_with_dtype_and_keep_in_fp32(tmp_path):
    reference = _reference()
    save_file(reference.state_dict(), str(tmp_path / "w.safetensors"))
    model = meta(MLP)
    load_checkpoint_in_model(
        model, tmp_path / "w.safetensors", {"": "cpu"}, dtype="float16", keep_in_fp32_modules=["head"]
    )
    assert model.blocks[0].fc1.weight.dtype == torch.float16
    assert torch.equal(model.blocks[0].fc1.weight, reference.blocks[0].fc1.weight.half())
    assert model.head.weight.dtype == torch.float32 and model.steps.dtype == torch.int64


def test_loaded_weights_do_not_map_the_file(tmp_path):
    reference = _reference()
    path = tmp_path / "w.safetensors"
    save_file(reference.state_dict(), str(path))
    model = meta(MLP)
    load_checkpoint_in_model(model, path)
    save_file({"x": torch.zeros(1)}, str(path))  # rewrites the same file in place
    _assert_same(model, reference)


def test_tied_weights_load_once_and_stay_tied(tmp_path):
    torch.manual_seed(1)
    reference = TiedLM()
    save_model(reference, str(tmp_path))  # stores the shared tensor once, with an alias
    model = meta(TiedLM)
    report = load_checkpoint_in_model(model, tmp_path)
    assert report.missing_keys == []
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, reference.embed.weight)
    # A checkpoint that leaves the tied copy out entirely (common in the wild) is not "missing" it.
    state = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "no_head.safetensors"))
    model = meta(TiedLM)
    assert load_checkpoint_in_model(model, tmp_path / "no_head.safetensors").missing_keys == []
    assert model.lm_head.weight is model.embed.weight and not model.embed.weight.is_meta


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    state = _reference().state_dict()
    del state["head.bias"], state["blocks.2.fc1.weight"]
    state["extra.weight"] = torch.zeros(2)
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    model = meta(MLP)
    report = load_checkpoint_in_model(model, path)
    assert report.missing_keys == ["blocks.2.fc1.weight", "head.bias"]
    assert report.unexpected_keys == ["extra.weight"]
    assert model.head.bias.is_meta and not model.head.weight.is_meta
    model = meta(MLP)
    with pytest.raises(
        ValueError, match=r"missing keys \['blocks.2.fc1.weight', 'head.bias'\].*\['extra.weight'\]"
    ):
        load_checkpoint_in_model(model, path, strict=True)
    assert model.head.weight.is_meta  # strict fails before loading anything


def test_truncated_safetensors_names_the_file(tmp_path):
    save_model(_reference(), str(tmp_path), max_shard_size="200KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(
        ValueError, match=rf"Cannot read checkpoint file .*{shard.name}.*truncated or corrupt"
    ):
        load_checkpoint_in_model(meta(MLP), tmp_path)
    garbage = tmp_path / "bad.bin"
    garbage.write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError, match="bad.bin"):
        load_checkpoint_in_model(meta(MLP), garbage)


def test_checkpoint_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint_in_model(meta(MLP), tmp_path / "nothing.safetensors")
    (tmp_path / "a.safetensors").write_bytes(b"")
    (tmp_path / "b.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="several weight files"):
        load_checkpoint_in_model(meta(MLP), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "gone.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        load_checkpoint_in_model(meta(MLP), tmp_path)


def test_disk_without_offload_folder_is_a_clear_error(tmp_path):
    save_file(_reference().state_dict(), str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match=r"sends \['head'\] to 'disk'.*pass offload_folder"):
        load_checkpoint_in_model(
            meta(MLP), tmp_path / "w.safetensors", {"blocks": "cpu", "head": "disk", "steps": "cpu"}
        )
    with pytest.warns(UserWarning, match=r"do not match any submodules in MLP.*\['tail'\]"):
        load_checkpoint_in_model(meta(MLP), tmp_path / "w.safetensors", {"": "cpu", "tail": "cpu"})


def test_disk_offload_from_safetensors_is_by_reference(tmp_path):
    reference = _reference()
    source = tmp_path / "w.safetensors"
    save_file(reference.state_dict(), str(source))
    folder = tmp_path / "offload"
    model = meta(MLP)
    device_map = {"blocks.0": "cpu", "blocks": "disk", "head": "disk", "steps": "disk", "scratch": "cpu"}
    report = load_checkpoint_in_model(model, source, device_map, offload_folder=folder, dtype=torch.float16)
    assert os.listdir(folder) == ["index.json"]
    index = load_offload_index(str(folder))
    assert sorted(index) == sorted(report.offloaded_keys)
    assert "steps" not in index and model.steps.item() == 41  # buffers of disk modules load on the CPU
    assert index["blocks.3.fc1.weight"]["safetensors_file"] == str(source)
    assert index["blocks.3.fc1.weight"]["dtype"] == "float16"
    assert model.blocks[3].fc1.weight.is_meta and not model.blocks[0].fc1.weight.is_meta
    weights = OffloadedWeightsLoader(save_folder=str(folder))
    for name in index:
        assert torch.equal(weights[name], reference.state_dict()[name].half()), name


def test_disk_offload_from_bin_writes_the_store(tmp_path):
    reference = _reference()
    torch.save(reference.state_dict(), str(tmp_path / "w.bin"))
    folder = tmp_path / "offload"
    model = meta(MLP)
    load_checkpoint_in_model(
        model, tmp_path / "w.bin", {"": "disk"}, offload_folder=folder, offload_buffers=True
    )
    index = load_offload_index(str(folder))
    assert len(index) == 27 and index["steps"] == {"dtype": "int64", "shape": []}
    assert (folder / "blocks.5.fc2.bias.dat").is_file()
    weights = OffloadedWeightsLoader(save_folder=str(folder))
    for name, tensor in reference.state_dict().items():
        assert torch.equal(weights[name], tensor), name


def test_tied_partner_on_disk_gets_an_entry(tmp_path):
    torch.manual_seed(2)
    reference = TiedLM()
    state = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    torch.save(state, str(tmp_path / "w.bin"))
    folder = tmp_path / "offload"
    model = meta(TiedLM)
    load_checkpoint_in_model(
        model, tmp_path / "w.bin", {"embed": "disk", "blocks": "cpu", "lm_head": "disk"}, folder
    )
    weights = OffloadedWeightsLoader(save_folder=str(folder))
    assert torch.equal(weights["lm_head.weight"], reference.embed.weight)


def test_state_dict_of_an_offloaded_model_reads_hook_weights(tmp_path):
    reference = _reference()
    model = meta(MLP)
    with pytest.raises(ValueError, match="'steps' is on the meta device"):
        get_state_dict_offloaded_model(model)

    class Hook:  # the attribute contract of an offload hook: a weights map of the module's tensors
        def __init__(self, weights):
            self.weights_map = weights

    state = reference.state_dict()
    for name, module in model.named_modules():
        local = {k[len(name) + 1 :]: v for k, v in state.items() if name and k.startswith(name + ".")}
        module._hf_hook = Hook(local if name else {"steps": state["steps"]})
    got = get_state_dict_offloaded_model(model)
    assert list(got) == list(state) and all(torch.equal(got[k], v) for k, v in state.items())


# -- memory while loading (measured in a child process) --------------------------------------------

_MEMORY_CHILD = textwrap.dedent(
    """
    import json, sys, threading, time
    import torch
    from torch import nn
    from notebook_accel.utils.modeling import load_checkpoint_in_model

    def anon():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024

    checkpoint, mapping, offload = sys.argv[1], sys.argv[2], sys.argv[3]
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(12)])
    base = peak = anon()
    done = False

    def watch():
        global peak
        while not done:
            peak = max(peak, anon())
            time.sleep(0.001)

    thread = threading.Thread(target=watch)
    thread.start()
    load_checkpoint_in_model(model, checkpoint, {"": mapping}, offload_folder=offload)
    done = True
    thread.join()
    peak = max(peak, anon())
    checksum = sum(float(p.double().sum()) for p in model.parameters() if not p.is_meta)
    print(json.dumps({"peak": peak - base, "end": anon() - base, "checksum": checksum}))
    """
)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """A 201 MB fp32 checkpoint in 4 safetensors shards, written shard by shard."""
    folder = tmp_path_factory.mktemp("big")
    weight_map, total, checksum = {}, 0, 0.0
    for shard in range(4):
        g = torch.Generator().manual_seed(shard)
        tensors = {f"{3 * shard + i}.weight": torch.randn(2048, 2048, generator=g) for i in range(3)}
        name = f"model-{shard + 1:05d}-of-00004.safetensors"
        save_file(tensors, str(folder / name))
        weight_map.update({k: name for k in tensors})
        total += sum(t.nbytes for t in tensors.values())
        checksum += sum(float(t.double().sum()) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder, total, checksum


def _measure(checkpoint, mapping, offload):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHILD, str(checkpoint), mapping, str(offload)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_to_cpu_peaks_at_the_model_plus_one_tensor(big_checkpoint, tmp_path):
    folder, total, checksum = big_checkpoint
    tensor = 2048 * 2048 * 4
    result = _measure(folder, "cpu", tmp_path / "unused")
    print(f"cpu load: model {total / 2**20:.1f} MiB, peak anonymous {result['peak'] / 2**20:.1f} MiB")
    assert result["checksum"] == pytest.approx(checksum, rel=1e-9)
    assert result["end"] > 0.95 * total  # the weights really are in process memory
    assert result["peak"] < total + 2 * tensor + 32 * 2**20


def test_loading_to_disk_stays_far_below_the_model(big_checkpoint, tmp_path):
    folder, total, _ = big_checkpoint
    offload = tmp_path / "offload"
    result = _measure(folder, "disk", offload)
    print(f"disk load: model {total / 2**20:.1f} MiB, peak anonymous {result['peak'] / 2**20:.1f} MiB")
    assert result["peak"] < 0.5 * total
    assert os.listdir(offload) == ["index.json"]  # safetensors shards are referenced, not copied
    index = load_offload_index(str(offload))
    assert len(index) == 12 and index["11.weight"]["safetensors_file"] == str(
        folder / "model-00004-of-00004.safetensors"
    )
