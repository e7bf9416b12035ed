"""The disk offload store and the lazy weights map (notebook_accel.utils.offload)."""

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

from notebook_accel.utils.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offload_index,
    load_offloaded_weight,
    offload_state_dict,
    offload_weight,
    safetensors_reference,
    save_offload_index,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g)
    return {
        "fp32": base,
        "fp16": (base * 3).half(),
        # values fp16 cannot hold and bits a float round trip would change
        "bf16": (base * 1e30).bfloat16(),
        "int64": torch.tensor([[-(2**62), 7, 2**40]], dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "uint8": torch.arange(250, 256, dtype=torch.uint8),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "noncontig": base.t(),
    }


def test_round_trip_is_exact_for_every_dtype(tmp_path):
    index = {}
    tensors = _tensors()
    for name, tensor in tensors.items():
        index = offload_weight(tensor, name, str(tmp_path), index=index)
    save_offload_index(index, str(tmp_path))

    on_disk = load_offload_index(str(tmp_path))
    assert on_disk["bf16"] == {"dtype": "bfloat16", "shape": [3, 5]}
    assert on_disk["int64"] == {"dtype": "int64", "shape": [1, 3]}
    assert os.path.getsize(tmp_path / "bf16.dat") == 15 * 2  # stored as 16-bit words, not widened
    for name, tensor in tensors.items():
        back = load_offloaded_weight(str(tmp_path / f"{name}.dat"), on_disk[name])
        assert back.dtype == tensor.dtype and back.shape == tensor.shape, name
        assert torch.equal(back, tensor), name


def test_bf16_bits_survive_including_nan_payloads(tmp_path):
    bits = torch.tensor([0x7FC1, 0x7F81, -1, 0x0001, -0x8000], dtype=torch.int16)  # NaNs, subnormal, -0
    weight = bits.view(torch.bfloat16)
    index = offload_weight(weight, "w", str(tmp_path))
    back = load_offloaded_weight(str(tmp_path / "w.dat"), index["w"])
    assert torch.equal(back.view(torch.int16), bits)


def test_loaded_weight_is_a_private_map_of_the_file(tmp_path):
    index = offload_weight(torch.arange(6.0), "w", str(tmp_path))
    back = load_offloaded_weight(str(tmp_path / "w.dat"), index["w"])
    back.add_(100)  # copy-on-write: the store is not changed by a caller writing to the tensor
    again = load_offloaded_weight(str(tmp_path / "w.dat"), index["w"])
    assert torch.equal(again, torch.arange(6.0))


def test_wrong_size_file_is_a_clear_error(tmp_path):
    index = offload_weight(torch.ones(10), "w", str(tmp_path))
    with open(tmp_path / "w.dat", "r+b") as f:
        f.truncate(12)
    with pytest.raises(ValueError, match=r"w\.dat should hold 40 bytes .* but it has 12"):
        load_offloaded_weight(str(tmp_path / "w.dat"), index["w"])


def test_weight_names_with_dots_and_meta_rejected(tmp_path):
    index = offload_weight(torch.ones(2), "layers.0.fc.weight", str(tmp_path))
    assert (tmp_path / "layers.0.fc.weight.dat").is_file()
    assert list(index) == ["layers.0.fc.weight"]
    with pytest.raises(ValueError, match="meta device"):
        offload_weight(torch.empty(2, device="meta"), "m", str(tmp_path))


def test_save_offload_index_merges(tmp_path):
    save_offload_index({"a": {"dtype": "float32", "shape": [1]}}, str(tmp_path))
    save_offload_index({"b": {"dtype": "float16", "shape": [2]}}, str(tmp_path))
    assert json.loads((tmp_path / "index.json").read_text()) == {
        "a": {"dtype": "float32", "shape": [1]},
        "b": {"dtype": "float16", "shape": [2]},
    }


def test_offload_state_dict_and_loader_over_the_folder(tmp_path):
    state = {"fc.weight": torch.randn(4, 4), "fc.bias": torch.randn(4).bfloat16()}
    index = offload_state_dict(str(tmp_path), state)
    assert set(index) == set(state)
    loader = OffloadedWeightsLoader(save_folder=str(tmp_path))
    assert sorted(loader) == sorted(state) and len(loader) == 2
    for name, tensor in state.items():
        assert torch.equal(loader[name], tensor)
    with pytest.raises(KeyError):
        loader["nope"]


def test_loader_prefers_memory_and_moves_to_device(tmp_path):
    offload_state_dict(str(tmp_path), {"a": torch.zeros(2), "b": torch.ones(2)})
    in_memory = {"a": torch.full((2,), 5.0)}
    loader = OffloadedWeightsLoader(state_dict=in_memory, save_folder=str(tmp_path), device="meta")
    assert list(loader) == ["a", "b"]
    assert loader["a"] is in_memory["a"]  # in-memory tensors are returned as they are
    assert loader["b"].device.type == "meta"


def test_loader_reads_safetensors_by_reference_without_copying(tmp_path):
    source = tmp_path / "model.safetensors"
    weights = {"enc.weight": torch.randn(8, 8), "enc.bias": torch.randn(8)}
    save_file(weights, str(source))
    folder = tmp_path / "offload"
    index = {name: safetensors_reference(str(source), name) for name in weights}
    index["half"] = safetensors_reference(str(source), "enc.weight", dtype="float16")
    save_offload_index(index, str(folder))

    assert os.listdir(folder) == ["index.json"]  # nothing but the index was written
    assert load_offload_index(str(folder))["enc.bias"]["safetensors_file"] == str(source)
    loader = OffloadedWeightsLoader(save_folder=str(folder))
    assert torch.equal(loader["enc.weight"], weights["enc.weight"])
    assert torch.equal(loader["enc.bias"], weights["enc.bias"])
    assert loader["half"].dtype == torch.float16
    assert torch.equal(loader["half"], weights["enc.weight"].half())
    # A loader travels to another process without its open file handles.
    clone = pickle.loads(pickle.dumps(loader))
    assert torch.equal(clone["enc.bias"], weights["enc.bias"])


def test_loader_needs_something():
    with pytest.raises(ValueError, match="needs a state_dict"):
        OffloadedWeightsLoader()


def test_prefixed_dataset_is_a_mapping_view():
    data = {"a.x": 1, "a.y": 2, "ab.z": 3, "b.x": 4}
    view = PrefixedDataset(data, "a.")
    assert view["x"] == 1 and view["y"] == 2
    assert sorted(view) == ["x", "y"] and len(view) == 2
    assert "x" in view and "z" not in view
    assert dict(view.items()) == {"x": 1, "y": 2}
    with pytest.raises(KeyError):
        view["z"]


def test_extract_submodules_state_dict():
    state = {"enc.w": 1, "enc.b": 2, "encoder.w": 3, "dec.w": 4, "dec": 5}
    assert extract_submodules_state_dict(state, ["enc", "dec"]) == {
        "enc.w": 1,
        "enc.b": 2,
        "dec.w": 4,
        "dec": 5,
    }
    assert extract_submodules_state_dict(state, [""]) == state


def test_a_write_that_fails_leaves_the_last_good_file_and_no_part(tmp_path, monkeypatch):
    index = offload_weight(torch.arange(6.0), "w", str(tmp_path))

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        offload_weight(torch.zeros(6), "w", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["w.dat"]  # the part file is gone
    assert torch.equal(load_offloaded_weight(str(tmp_path / "w.dat"), index["w"]), torch.arange(6.0))
