"""Layerwise casting: linear / convolution weights stored in a low precision, cast up for their forward."""

from __future__ import annotations

import torch
import torch.nn as nn

from notebook_accel import big_modeling, hooks
from notebook_accel.big_model.layerwise_casting import LayerwiseCastingHook, attach_layerwise_casting_hooks
from notebook_accel.hooks import ModelHook, add_hook_to_module, remove_hook_from_module


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(1, 2, 3)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))

    def forward(self, x):
        h = self.norm(self.proj(x))
        h = h + self.conv(h.unsqueeze(1)).mean(1).mean(-1, keepdim=True)
        return self.head(h)


class SeesDtype(ModelHook):
    """Records the weight dtype the layer computes with (runs after the casting hook)."""

    def __init__(self):
        self.seen = []

    def pre_forward(self, module, *args, **kwargs):
        self.seen.append(module.weight.dtype)
        return args, kwargs


def _weights(model):
    return {name: p.dtype for name, p in model.named_parameters()}


def test_accelerates_paths_are_these():
    assert hooks.LayerwiseCastingHook is LayerwiseCastingHook
    assert big_modeling.attach_layerwise_casting_hooks is attach_layerwise_casting_hooks


def test_weights_are_stored_low_and_computed_high():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 4)
    # The reference: the same weights rounded to float16, computed in float32.
    reference = Net()
    reference.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    attach_layerwise_casting_hooks(model, storage_dtype=torch.float16, compute_dtype=torch.float32)
    stored = _weights(model)
    assert stored["proj.weight"] == stored["conv.bias"] == stored["head.1.weight"] == torch.float16
    assert stored["norm.weight"] == torch.float32  # not a linear or convolution layer: untouched
    seen = SeesDtype()
    add_hook_to_module(model.proj, seen, append=True)
    with torch.no_grad():
        out = model(x)
    assert seen.seen == [torch.float32]
    assert _weights(model) == stored  # back to storage after the forward
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(x).detach(), atol=1e-2, rtol=0)


def test_skips_by_pattern_and_class():
    model = Net()
    attach_layerwise_casting_hooks(
        model,
        torch.float8_e4m3fn,
        torch.float32,
        skip_modules_pattern=("head\\.1",),
        skip_modules_classes=(nn.Conv1d,),
    )
    stored = _weights(model)
    assert stored["proj.weight"] == stored["head.0.weight"] == torch.float8_e4m3fn
    assert stored["head.1.weight"] == stored["conv.weight"] == torch.float32
    with torch.no_grad():
        model(torch.randn(2, 4))


def test_a_string_pattern_is_one_pattern():
    # accelerate iterates a str pattern character by character ("proj" would skip every name with a "p").
    model = Net()
    attach_layerwise_casting_hooks(model, torch.bfloat16, torch.float32, skip_modules_pattern="proj")
    stored = _weights(model)
    assert stored["proj.weight"] == torch.float32
    assert stored["head.0.weight"] == stored["conv.weight"] == torch.bfloat16


def test_the_hook_composes_with_others_and_comes_off():
    layer = nn.Linear(3, 3)
    add_hook_to_module(layer, SeesDtype())
    attach_layerwise_casting_hooks(layer, torch.float16, torch.float32)
    assert isinstance(layer._hf_hook, hooks.SequentialHook) and layer.weight.dtype == torch.float16
    assert "LayerwiseCastingHook" in repr(layer._hf_hook)
    layer(torch.randn(1, 3))
    remove_hook_from_module(layer)
    assert "_hf_hook" not in layer.__dict__ and layer.weight.dtype == torch.float16
