"""Big-model API: meta init, dispatch with cpu/disk offload, whole-model offload, checkpoint loading."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from notebook_accel.big_modeling import (
    _refuse_recurrent_layers_under_sequence_parallelism,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
)
from notebook_accel.hooks import remove_hook_from_module

ATOL = 1e-5


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(8, 16)
        self.batchnorm = nn.BatchNorm1d(16)
        self.linear2 = nn.Linear(16, 16)
        self.linear3 = nn.Linear(16, 4)

    def forward(self, x):
        x = torch.relu(self.batchnorm(self.linear1(x)))
        return self.linear3(torch.relu(self.linear2(x)))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        t = x.shape[1]
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj(attn @ v)
        return x + self.mlp(x)


class TinyLM(nn.Module):
    """Transformer-shaped: embeddings tied to the output head, a position buffer, two blocks."""

    def __init__(self, vocab=50, d=16, n_blocks=2, max_len=12):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.register_buffer("positions", torch.linspace(-0.5, 0.5, max_len * d).view(max_len, d))
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids) + self.positions[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def _mlp():
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.batchnorm.running_mean.uniform_(-1, 1)
        model.batchnorm.running_var.uniform_(0.5, 2)
    return model.eval()


def _lm():
    torch.manual_seed(0)
    return TinyLM().eval()


def _inputs(model):
    torch.manual_seed(1)
    if isinstance(model, TinyLM):
        return torch.randint(0, 50, (2, 7))
    return torch.randn(5, 8)


LM_MAP = {
    "embed": "cpu",
    "positions": "cpu",
    "blocks.0": "disk",
    "blocks.1": "cpu",
    "norm": "disk",
    "lm_head": "disk",
}
MLP_MAP = {"linear1": "cpu", "batchnorm": "disk", "linear2": "disk", "linear3": "cpu"}


@pytest.mark.parametrize("make, device_map", [(_mlp, MLP_MAP), (_lm, LM_MAP)], ids=["mlp", "lm"])
def test_dispatch_mixing_cpu_and_disk_matches_plain_model(tmp_path, make, device_map):
    model = make()
    x = _inputs(model)
    expected = model(x)
    dispatch_model(model, device_map, offload_dir=tmp_path)
    assert model.hf_device_map == device_map
    assert (tmp_path / "index.json").is_file()
    disk_params = [
        n
        for n, p in model.named_parameters()
        if any(n.startswith(k + ".") for k, d in device_map.items() if d == "disk")
    ]
    assert disk_params and all(model.get_parameter(n).device.type == "meta" for n in disk_params)
    for _ in range(2):  # streaming leaves nothing behind that changes the next call
        out = model(x)
        assert out.device.type == "cpu"
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert all(model.get_parameter(n).device.type == "meta" for n in disk_params)


@pytest.mark.parametrize("whole", [False, True], ids=["every-block", "root"])
def test_dispatch_with_everything_on_disk_streams_from_the_folder(tmp_path, whole):
    # As in accelerate: an all-"disk" map is dispatched with hooks (it used to be refused).
    model = _lm()
    x = _inputs(model)
    expected = model(x)
    device_map = {"": "disk"} if whole else dict.fromkeys(LM_MAP, "disk")
    dispatch_model(model, device_map, offload_dir=tmp_path)
    assert (tmp_path / "index.json").is_file()
    assert all(p.device.type == "meta" for p in model.parameters())
    for _ in range(2):
        torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=0)


def test_dispatch_streams_cpu_blocks_to_a_distinct_main_device():
    # "cpu:0" is a different device string from "cpu": the accelerator code path, runnable here.
    model = _lm()
    x = _inputs(model)
    expected = model(x)
    device_map = {
        "embed": "cpu:0",
        "positions": "cpu:0",
        "blocks": "cpu",
        "norm": "cpu:0",
        "lm_head": "cpu:0",
    }
    dispatch_model(model, device_map, main_device="cpu:0")
    assert model.blocks[0].qkv.weight.device.type == "meta"  # cpu blocks are offloaded, not placed
    torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=0)
    assert model.blocks[1].mlp[0].weight.device.type == "meta"


def test_tied_weights_stay_tied_after_dispatch(tmp_path):
    model = _lm()
    x = _inputs(model)
    expected = model(x)
    dispatch_model(
        model,
        {"embed": "cpu", "positions": "cpu", "blocks": "cpu", "norm": "cpu", "lm_head": "disk"},
        offload_dir=tmp_path,
    )
    assert model.lm_head.weight is model.embed.weight
    torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=0)

    # All placed, none offloaded (force_hooks): the tie survives forward passes too.
    model = _lm()
    dispatch_model(
        model,
        {"embed": "cpu", "positions": "cpu", "blocks": "cpu", "norm": "cpu", "lm_head": "cpu"},
        force_hooks=True,
    )
    assert model.lm_head.weight is model.embed.weight
    torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=0)
    assert model.lm_head.weight is model.embed.weight
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()


def test_dispatched_model_restores_after_removing_hooks(tmp_path):
    model = _mlp()
    x = _inputs(model)
    expected = model(x)
    dispatch_model(model, MLP_MAP, offload_dir=tmp_path)
    assert "to" in model.__dict__
    remove_hook_from_module(model, recurse=True)
    assert "to" not in model.__dict__ and "forward" not in model.__dict__
    assert all(p.device.type == "cpu" for p in model.parameters())
    torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=0)


def test_moving_an_offloaded_model_raises(tmp_path):
    model = _mlp()
    dispatch_model(model, MLP_MAP, offload_dir=tmp_path)
    with pytest.raises(RuntimeError, match="offloaded"):
        model.to("cpu")


def test_single_device_map_just_moves_the_model():
    model = _mlp()
    dispatch_model(model, {"": "cpu"})
    assert model.hf_device_map == {"": "cpu"} and "_hf_hook" not in model.__dict__


@pytest.mark.parametrize("make", [_mlp, _lm], ids=["mlp", "lm"])
def test_cpu_offload_matches_plain_model(make):
    model = make()
    x = _inputs(model)
    expected = model(x)
    cpu_offload(model, execution_device="cpu")
    assert all(p.device.type == "meta" for p in model.parameters())
    torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=0)
    assert all(p.device.type == "meta" for p in model.parameters())
    remove_hook_from_module(model, recurse=True)
    torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("make", [_mlp, _lm], ids=["mlp", "lm"])
def test_disk_offload_matches_plain_model(tmp_path, make):
    model = make()
    x = _inputs(model)
    expected = model(x)
    disk_offload(model, tmp_path, execution_device="cpu", offload_buffers=True)
    index = json.loads((tmp_path / "index.json").read_text())
    assert set(model.state_dict()) <= set(index)
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=0)


def test_disk_offload_refuses_a_folder_from_another_model(tmp_path):
    disk_offload(_mlp(), tmp_path, execution_device="cpu")
    with pytest.raises(ValueError, match="not in the offload folder"):
        disk_offload(_lm(), tmp_path, execution_device="cpu")


def test_cpu_offload_with_hook_pipeline_returns_first_model_to_cpu():
    a, b = _mlp(), nn.Linear(4, 3)
    x = _inputs(a)
    expected = b(a(x))
    a, hook_a = cpu_offload_with_hook(a, execution_device="cpu")
    b, hook_b = cpu_offload_with_hook(b, execution_device="cpu", prev_module_hook=hook_a)
    assert hook_b.hook.prev_module_hook is hook_a
    torch.testing.assert_close(b(a(x)), expected)
    hook_a.remove()
    hook_b.remove()
    assert "_hf_hook" not in a.__dict__ and "_hf_hook" not in b.__dict__


def test_init_empty_weights_puts_parameters_on_meta():
    with init_empty_weights():
        model = TinyLM()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.positions.device.type == "cpu"  # buffers keep their computed values
    assert model.lm_head.weight is model.embed.weight
    with init_empty_weights(include_buffers=True):
        model = TinyLM()
    assert model.positions.device.type == "meta"
    with init_on_device("meta"):
        layer = nn.Linear(3, 3)
    assert layer.weight.device.type == "meta"
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone after the block


SEVEN_B = textwrap.dedent(
    """
    import json, resource, time
    import torch, torch.nn as nn
    from notebook_accel.big_modeling import init_empty_weights

    def rss():
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(4096, 4096, bias=False) for _ in range(4))
            self.gate = nn.Linear(4096, 11008, bias=False)
            self.up = nn.Linear(4096, 11008, bias=False)
            self.down = nn.Linear(11008, 4096, bias=False)
            self.norm1, self.norm2 = nn.LayerNorm(4096), nn.LayerNorm(4096)

    class Llama7B(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32000, 4096)
            self.layers = nn.ModuleList(Layer() for _ in range(32))
            self.norm = nn.LayerNorm(4096)
            self.lm_head = nn.Linear(4096, 32000, bias=False)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter
    start_rss, _ = rss()
    t0 = time.perf_counter()
    with init_empty_weights():
        model = Llama7B()
    seconds = time.perf_counter() - t0
    end_rss, peak = rss()
    n = sum(p.numel() for p in model.parameters())
    meta = all(p.device.type == "meta" for p in model.parameters())
    print(json.dumps({"params": n, "meta": meta, "seconds": seconds, "growth": end_rss - start_rss,
                      "peak_growth": peak - start_rss}))
    """
)


def test_init_empty_weights_7b_architecture_stays_under_100_mb():
    result = subprocess.run(
        [sys.executable, "-c", SEVEN_B],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print("init_empty_weights 7B:", report)
    assert report["params"] > 6_500_000_000 and report["meta"]
    assert report["peak_growth"] < 100 * 2**20
    assert report["growth"] < 100 * 2**20


# -- load_checkpoint_and_dispatch ---------------------------------------------------------------


def _lm_checkpoint(tmp_path, drop=()):
    model = _lm()
    state = {
        k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" and k not in drop
    }
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    return model, path


@pytest.mark.parametrize("plan", ["auto", "sequential", "balanced"])
def test_load_checkpoint_and_dispatch_under_a_budget_offloads_to_disk(tmp_path, plan):
    reference, path = _lm_checkpoint(tmp_path)
    x = _inputs(reference)
    expected = reference(x)
    with init_empty_weights():
        model = TinyLM()
    model = load_checkpoint_and_dispatch(
        model,
        path,
        device_map=plan,
        max_memory={"cpu": 20_000},
        offload_folder=tmp_path / "offload",
        no_split_module_classes=["Block"],
    )
    assert "disk" in model.hf_device_map.values() and "cpu" in model.hf_device_map.values()
    torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=0)


def test_load_checkpoint_and_dispatch_with_dict_and_none(tmp_path):
    reference, path = _lm_checkpoint(tmp_path)
    x = _inputs(reference)
    expected = reference(x)
    with init_empty_weights():
        model = TinyLM()
    model = load_checkpoint_and_dispatch(model, path, device_map=LM_MAP, offload_folder=tmp_path / "off")
    assert model.hf_device_map == LM_MAP
    torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=0)
    with init_empty_weights():
        model = TinyLM()
    model = load_checkpoint_and_dispatch(model, path)
    assert all(p.device.type == "cpu" for p in model.parameters()) and "_hf_hook" not in model.__dict__
    torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=0)


# -- errors -------------------------------------------------------------------------------------


def test_unknown_module_in_device_map_is_named(tmp_path):
    # As in accelerate, a key that names no module is warned about, not refused: it places nothing.
    model = _lm()
    bad = dict(LM_MAP, **{"blocks.7": "cpu"})
    with pytest.warns(UserWarning, match=r"blocks\.7"):
        dispatch_model(model, bad, offload_dir=tmp_path)
    assert model.hf_device_map == bad


def test_disk_plan_without_offload_folder_raises(tmp_path):
    with pytest.raises(ValueError, match="offload_dir"):
        dispatch_model(_lm(), LM_MAP)
    _, path = _lm_checkpoint(tmp_path)
    with init_empty_weights():
        model = TinyLM()
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_and_dispatch(model, path, device_map=LM_MAP)
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_and_dispatch(model, path, device_map="auto", max_memory={"cpu": 12_000})


def test_checkpoint_missing_keys_are_listed(tmp_path):
    _, path = _lm_checkpoint(tmp_path, drop=("blocks.1.proj.weight", "norm.bias"))
    with init_empty_weights():
        model = TinyLM()
    with pytest.raises(ValueError) as info:
        load_checkpoint_and_dispatch(model, path, device_map={"": "cpu"})
    message = str(info.value)
    assert "blocks.1.proj.weight" in message and "norm.bias" in message


def test_bad_device_map_string_raises():
    with pytest.raises(ValueError, match="balanced_low_0"):
        load_checkpoint_and_dispatch(_lm(), "unused.safetensors", device_map="everywhere")


def test_a_device_this_machine_lacks_is_named_before_anything_moves(tmp_path):
    """On a CPU-only machine (as here) an accelerator id fails at dispatch, not at the first forward."""
    from notebook_accel.hardware import accelerators

    have = sorted(a.index for a in accelerators() if a.kind == "cuda")
    bad = dict(LM_MAP, **{"blocks.1": 0 if not have else len(have)})
    expected = "no cuda device" if not have else rf"the cuda devices here are \[{', '.join(map(str, have))}\]"
    model = _lm()
    with pytest.raises(ValueError, match=rf"device_map\['blocks\.1'\] = {bad['blocks.1']}, but .*{expected}"):
        dispatch_model(model, bad, offload_dir=tmp_path)
    assert "_hf_hook" not in model.__dict__ and all(p.device.type == "cpu" for p in model.parameters())
    _, path = _lm_checkpoint(tmp_path)
    with init_empty_weights():
        empty = TinyLM()
    with pytest.raises(ValueError, match=expected):
        load_checkpoint_and_dispatch(empty, path, device_map=bad, offload_folder=tmp_path / "off")
    assert not (tmp_path / "off").exists()  # nothing was written before the error


def test_sequence_parallelism_refuses_layers_with_a_recurrent_state():
    # A multimodal model lists its layers in its text config.
    text = SimpleNamespace(layer_types=["full_attention", "linear_attention", "linear_attention"])
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))
    with pytest.raises(ValueError, match="of type linear_attention carry a state"):
        _refuse_recurrent_layers_under_sequence_parallelism(model)
    plain = SimpleNamespace(config=SimpleNamespace(layer_types=["sliding_attention", "full_attention"]))
    _refuse_recurrent_layers_under_sequence_parallelism(plain)
    _refuse_recurrent_layers_under_sequence_parallelism(nn.Linear(2, 2))  # no config at all


def test_a_device_map_is_checked_once_where_it_is_received(tmp_path, monkeypatch):
    # load_checkpoint_and_dispatch checks the map it received, then hands the frozen plan on:
    # loading and dispatching do not check it again.
    import dataclasses

    from notebook_accel.big_model import device_map as plans

    checked = []
    check = plans.check_device_map
    monkeypatch.setattr(plans, "check_device_map", lambda model, dm: checked.append(dict(dm)) or check(model, dm))
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    x = torch.randn(4, 2)
    expected = model(x)
    device_map = {"0": "cpu", "1": "disk"}
    load_checkpoint_and_dispatch(model, tmp_path / "model.safetensors", device_map, offload_folder=tmp_path / "off")
    assert checked == [device_map]
    torch.testing.assert_close(model(x), expected)
    plan = plans.plan_device_map(model, device_map, tmp_path / "off")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.offload_folder = None
    with pytest.raises(TypeError):
        plan.devices["0"] = "disk"
    with pytest.raises(ValueError, match=r"sends \['1'\] to 'disk'.*pass offload_folder"):
        plans.plan_device_map(model, device_map)
