"""Hooks: composition, exact removal, device alignment and weight streaming (on cpu and meta)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from notebook_accel.hooks import (
    AlignDevicesHook,
    CpuOffload,
    ModelHook,
    SequentialHook,
    UserCpuOffloadHook,
    add_hook_to_module,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
    remove_hook_from_module,
)


class PlusOne(ModelHook):
    def pre_forward(self, module, *args, **kwargs):
        return (args[0] + 1,) + args[1:], kwargs


class TimesThree(ModelHook):
    def pre_forward(self, module, *args, **kwargs):
        return (args[0] * 3,) + args[1:], kwargs


class Doubler(ModelHook):
    def post_forward(self, module, output):
        return output * 2


class Recorder(ModelHook):
    def __init__(self):
        self.events = []

    def init_hook(self, module):
        self.events.append("init")
        return module

    def detach_hook(self, module):
        self.events.append("detach")
        return module


def _linear():
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_hooks_compose_in_append_order():
    x = torch.randn(2, 4)
    a, b = _linear(), _linear()
    add_hook_to_module(a, PlusOne())
    add_hook_to_module(a, TimesThree(), append=True)
    add_hook_to_module(b, TimesThree())
    add_hook_to_module(b, PlusOne(), append=True)
    plain = _linear()
    assert isinstance(a._hf_hook, SequentialHook) and len(a._hf_hook.hooks) == 2
    torch.testing.assert_close(a(x), plain((x + 1) * 3))
    torch.testing.assert_close(b(x), plain(x * 3 + 1))
    # A third append flattens into the same sequence.
    add_hook_to_module(a, Doubler(), append=True)
    assert [type(h) for h in a._hf_hook.hooks] == [PlusOne, TimesThree, Doubler]
    torch.testing.assert_close(a(x), plain((x + 1) * 3) * 2)


def test_remove_restores_module_exactly():
    module = _linear()
    x = torch.randn(2, 4)
    before_dict = set(module.__dict__)
    before_state = _state(module)
    expected = module(x)
    add_hook_to_module(module, PlusOne())
    add_hook_to_module(module, Doubler(), append=True)
    assert "forward" in module.__dict__
    assert not torch.allclose(module(x), expected)
    remove_hook_from_module(module)
    assert set(module.__dict__) == before_dict
    assert "forward" not in module.__dict__
    assert module.forward.__func__ is nn.Linear.forward
    torch.testing.assert_close(module(x), expected)
    after_state = module.state_dict()
    assert after_state.keys() == before_state.keys()
    for key, value in before_state.items():
        assert torch.equal(after_state[key], value)


def test_remove_restores_an_instance_level_forward():
    module = _linear()
    custom = lambda x: torch.zeros(1)  # noqa: E731
    module.forward = custom
    add_hook_to_module(module, Doubler())
    assert module(torch.randn(1, 4)).item() == 0.0
    remove_hook_from_module(module)
    assert module.__dict__["forward"] is custom


def test_replacing_a_hook_detaches_the_old_one_and_recurse_reaches_children():
    model = nn.Sequential(_linear(), nn.ReLU(), _linear())
    old, new = Recorder(), Recorder()
    add_hook_to_module(model[0], old)
    add_hook_to_module(model[0], new)
    assert old.events == ["init", "detach"] and new.events == ["init"]
    add_hook_to_module(model[2], Doubler())
    remove_hook_from_module(model, recurse=True)
    assert new.events == ["init", "detach"]
    for sub in model:
        assert (
            "_hf_hook" not in sub.__dict__
            and "_old_forward" not in sub.__dict__
            and "forward" not in sub.__dict__
        )


def test_no_grad_hook_runs_forward_without_grad():
    class NoGrad(ModelHook):
        no_grad = True

    module = _linear()
    add_hook_to_module(module, NoGrad())
    assert not module(torch.randn(2, 4)).requires_grad
    add_hook_to_module(module, Doubler(), append=True)  # any member asking for no_grad wins
    assert not module(torch.randn(2, 4)).requires_grad
    remove_hook_from_module(module)
    assert module(torch.randn(2, 4)).requires_grad


def test_align_devices_hook_moves_weights_and_inputs_to_the_execution_device():
    module = _linear()
    add_hook_to_module(module, AlignDevicesHook(execution_device="meta"))
    assert module.weight.device.type == "meta"
    out = module(torch.randn(2, 4))  # a cpu input must be moved to meta to run at all
    assert out.device.type == "meta" and out.shape == (2, 3)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.full((4,), 0.5), persistent=False)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-1, 1)
            self.norm.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return self.norm(self.linear(x)) * self.scale


def test_offload_hook_streams_weights_and_detach_restores_them():
    model = Normed().eval()
    x = torch.randn(3, 4)
    expected = model(x)
    state = _state(model)
    add_hook_to_module(model, AlignDevicesHook(execution_device="cpu", offload=True, place_submodules=True))
    assert model.linear.weight.device.type == "meta"
    assert model.norm.running_mean.device.type == "cpu"  # buffers not offloaded by default
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)
    assert model.linear.weight.device.type == "meta"  # back on meta after forward
    remove_hook_from_module(model)
    for key, value in state.items():
        assert torch.equal(model.state_dict()[key], value)
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)


def test_after_a_forward_offloaded_tensors_are_the_meta_tensors_they_were_before():
    model = Normed().eval()
    x = torch.randn(3, 4)
    expected = model(x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    hook = AlignDevicesHook("cpu", offload=True, weights_map=weights, offload_buffers=True, place_submodules=True)
    add_hook_to_module(model, hook)
    model.linear.bias.requires_grad_(False)
    before = {name: t for name, t in model.named_parameters()} | dict(model.named_buffers())
    assert {t.device.type for name, t in before.items() if name != "scale"} == {"meta"}
    for _ in range(2):
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)
        after = {name: t for name, t in model.named_parameters()} | dict(model.named_buffers())
        assert all(after[name] is t for name, t in before.items()), after  # the same objects, not new ones
    assert isinstance(model.linear.weight, nn.Parameter) and not model.linear.bias.requires_grad
    # One set by hand to real data before a forward is made meta after it, as before.
    model.linear.weight = nn.Parameter(weights["linear.weight"].clone())
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)
    assert model.linear.weight.device.type == "meta" and isinstance(model.linear.weight, nn.Parameter)


def test_offload_buffers_keeps_non_persistent_buffers_real():
    model = Normed().eval()
    x = torch.randn(3, 4)
    expected = model(x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    hook = AlignDevicesHook(
        "cpu", offload=True, weights_map=weights, offload_buffers=True, place_submodules=True
    )
    add_hook_to_module(model, hook)
    assert model.norm.running_mean.device.type == "meta"
    assert model.scale.device.type == "cpu"  # not in any state dict, so it cannot be offloaded
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)
    assert model.norm.running_var.device.type == "meta"


def test_tied_weights_are_materialised_once_per_call():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(2)
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight
            self.seen = []
            self.tied_map = {}

        def forward(self, x):
            during = {k: dict(v) for k, v in self.tied_map.items()}
            self.seen.append((self.a.weight.data_ptr(), self.b.weight.data_ptr(), during))
            return self.b(self.a(x))

    model = Tied()
    x = torch.randn(2, 4)
    expected = model(x)
    weights = {k: v for k, v in model.state_dict().items()}
    ptr = weights["a.weight"].data_ptr()
    tied_map = model.tied_map = {ptr: {}}
    hook = AlignDevicesHook(
        "cpu", offload=True, weights_map=weights, place_submodules=True, tied_params_map=tied_map
    )
    add_hook_to_module(model, hook)
    model.seen.clear()
    torch.testing.assert_close(model(x), expected)
    a_ptr, b_ptr, during = model.seen[0]
    assert a_ptr == b_ptr and torch.device("cpu") in during[ptr]
    assert tied_map[ptr] == {}  # released after the call


class ReadsChildWeight(nn.Module):
    """Uses a child's weight outside the child's forward: needs the whole subtree preloaded."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return F.linear(x, self.inner.weight) + self.inner(x)


def test_attach_align_device_hook_with_preload_module_classes():
    model = nn.Sequential(ReadsChildWeight(), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    expected = model(x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    attach_align_device_hook(
        model, "cpu", offload=True, weights_map=weights, preload_module_classes=["ReadsChildWeight"]
    )
    assert isinstance(model[0]._hf_hook, AlignDevicesHook) and model[0]._hf_hook.place_submodules
    assert "_hf_hook" not in model[0].inner.__dict__  # the preloaded block owns its subtree
    assert model[0].inner.weight.device.type == "meta"
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)
    remove_hook_from_module(model, recurse=True)
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)


def test_attach_on_blocks_mixes_placed_and_offloaded_blocks():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(2, 4)
    expected = model(x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    attach_align_device_hook_on_blocks(
        model,
        execution_device={"": "cpu", "0": "cpu", "1": "cpu", "2": "cpu"},
        offload={"0": False, "1": False, "2": True},
        weights_map=weights,
    )
    assert model._hf_hook.io_same_device
    assert model[0].weight.device.type == "cpu" and model[2].weight.device.type == "meta"
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)
    assert model[2].weight.device.type == "meta"


def test_attach_execution_device_hook_skips_weightless_and_hooked_modules():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    add_hook_to_module(model[0], Doubler())
    attach_execution_device_hook(model, "cpu")
    assert isinstance(model._hf_hook, AlignDevicesHook)
    assert isinstance(model[0]._hf_hook, Doubler)
    assert "_hf_hook" not in model[1].__dict__


class Logged(nn.Linear):
    """A real Linear that records the devices it is moved to, so the pipeline order is visible."""

    def __init__(self, name, log):
        torch.manual_seed(5)
        super().__init__(4, 4)
        self.name, self.log = name, log

    def to(self, *args, **kwargs):
        self.log.append((self.name, "to", str(torch.device(args[0]) if args else kwargs.get("device"))))
        return super().to(*args, **kwargs)

    def forward(self, x):
        self.log.append((self.name, "forward"))
        return super().forward(x)


def test_cpu_offload_pipeline_offloads_previous_model_before_next_runs():
    log = []
    a, b = Logged("a", log), Logged("b", log)
    hook_a_obj = CpuOffload(execution_device="cpu")
    add_hook_to_module(a, hook_a_obj)
    hook_a = UserCpuOffloadHook(a, hook_a_obj)
    add_hook_to_module(b, CpuOffload(execution_device="cpu", prev_module_hook=hook_a))
    log.clear()
    x = torch.randn(1, 4)
    b(a(x))
    assert log == [
        ("a", "to", "cpu"),  # a goes to the execution device
        ("a", "forward"),
        ("a", "to", "cpu"),  # b's hook sends a back to the offload device first
        ("b", "to", "cpu"),
        ("b", "forward"),
    ]
    hook_a.remove()
    assert "_hf_hook" not in a.__dict__ and "forward" not in a.__dict__
