"""Mixed precision on this CPU: bf16 / fp16 autocast forwards, a real fp16 GradScaler step with an
overflow, and the hardware checks as a pure decision over capability values."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch

from notebook_accel.optimizer import AcceleratedOptimizer
from notebook_accel.precision import (
    AutocastForward,
    autocast_context,
    check_precision_supported,
    make_grad_scaler,
    patch_forward_for_autocast,
    precision_problem,
    prepare_fp8_model,
    restore_forward,
)
from notebook_accel.scheduler import AcceleratedScheduler
from notebook_accel.utils.dataclasses import AutocastKwargs, GradScalerKwargs

CPU = torch.device("cpu")


class TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.second = torch.nn.Linear(16, 2)

    def forward(self, x, scale=1.0):
        return {"out": self.second(torch.relu(self.first(x))) * scale, "count": 3}


def _record_dtypes(module):
    seen = []
    module.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_patched_forward_computes_in_half_and_returns_fp32(precision, dtype):
    torch.manual_seed(0)
    model = TwoLayer()
    seen = _record_dtypes(model.first)
    x = torch.randn(4, 8)
    expected = model(x)["out"]
    assert seen == [torch.float32]

    patch_forward_for_autocast(model, precision, CPU)
    out = model(x, scale=2.0)
    assert seen[-1] == dtype  # the layer really ran in half precision
    assert out["out"].dtype == torch.float32 and out["count"] == 3
    torch.testing.assert_close(out["out"], expected * 2, atol=0.1, rtol=0.05)
    loss = out["out"].pow(2).mean()
    assert loss.dtype == torch.float32
    loss.backward()
    assert model.first.weight.grad is not None and model.first.weight.grad.dtype == torch.float32
    # Signature tools see the original parameters, and the original stays reachable.
    assert list(inspect.signature(model.forward).parameters) == ["x", "scale"]
    assert model._original_forward.__func__ is TwoLayer.forward

    restore_forward(model)
    assert "forward" not in model.__dict__ and "_original_forward" not in model.__dict__
    assert model.forward.__func__ is TwoLayer.forward
    model(x)
    assert seen[-1] == torch.float32


def test_patch_twice_replaces_and_keeps_a_hooked_forward():
    model = TwoLayer()
    calls = []

    def hooked(x, scale=1.0):  # an instance-level forward, as offload hooks install
        calls.append(1)
        return TwoLayer.forward(model, x, scale)

    model.forward = hooked
    patch_forward_for_autocast(model, "fp16", CPU)
    patch_forward_for_autocast(model, "bf16", "cpu")
    seen = _record_dtypes(model.first)
    model(torch.randn(2, 8))
    assert seen == [torch.bfloat16] and calls == [1]
    assert isinstance(model.forward, AutocastForward) and model.forward.original is hooked
    restore_forward(model)
    assert model.forward is hooked


def test_patched_model_deepcopies_and_pickles():
    torch.manual_seed(0)
    model = patch_forward_for_autocast(TwoLayer(), "bf16", CPU)
    x = torch.randn(3, 8)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.second.bias.add_(10.0)
    # The copy runs its own weights under autocast; the original is untouched.
    assert (twin(x)["out"] - model(x)["out"]).mean().item() == pytest.approx(10.0, abs=0.2)
    seen = _record_dtypes(twin.first)
    twin(x)
    assert seen == [torch.bfloat16]

    restored = pickle.loads(pickle.dumps(model))
    assert isinstance(restored.forward, AutocastForward) and restored.forward.module is restored
    torch.testing.assert_close(restored(x)["out"], model(x)["out"])
    restore_forward(restored)
    assert restored(x)["out"].dtype == torch.float32


def test_no_and_fp8_leave_forward_alone():
    model = TwoLayer()
    assert patch_forward_for_autocast(model, "no", CPU) is model
    assert "forward" not in model.__dict__
    patch_forward_for_autocast(model, "fp8", CPU)
    assert "forward" not in model.__dict__


def test_autocast_context_switches_cpu_autocast():
    with autocast_context("no", CPU):
        assert not torch.is_autocast_enabled("cpu")
    with autocast_context("fp8", CPU):
        assert not torch.is_autocast_enabled("cpu")
    with autocast_context("bf16", CPU):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast_context("fp16", "cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    with autocast_context("bf16", CPU, AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="fp32"):
        autocast_context("fp32", CPU)


def test_make_grad_scaler_only_for_fp16():
    assert make_grad_scaler("no", CPU) is None and make_grad_scaler("bf16", CPU) is None
    scaler = make_grad_scaler("fp16", CPU, GradScalerKwargs(init_scale=128.0, growth_interval=7))
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.get_scale() == 128.0 and scaler.get_growth_interval() == 7
    assert make_grad_scaler("fp16", CPU).get_scale() == 65536.0


def _fp16_setup(optimizer_cls=torch.optim.SGD, **opt_kwargs):
    torch.manual_seed(0)
    model = patch_forward_for_autocast(torch.nn.Linear(4, 2), "fp16", CPU)
    scaler = make_grad_scaler("fp16", CPU, GradScalerKwargs(init_scale=256.0))
    optimizer = AcceleratedOptimizer(optimizer_cls(model.parameters(), lr=0.1, **opt_kwargs), scaler=scaler)
    scheduler = AcceleratedScheduler(
        torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=0.5), optimizer
    )
    return model, scaler, optimizer, scheduler


def _train_step(model, scaler, optimizer, scheduler, loss_factor=1.0):
    x = torch.randn(8, 4)
    loss = model(x).pow(2).mean() * loss_factor
    scaler.scale(loss).backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_fp16_training_step_and_overflow_skip_on_cpu():
    model, scaler, optimizer, scheduler = _fp16_setup()
    before = copy.deepcopy(model.state_dict())
    _train_step(model, scaler, optimizer, scheduler)
    assert not optimizer.step_was_skipped
    assert not torch.equal(model.weight, before["weight"])
    assert scheduler.get_last_lr() == [pytest.approx(0.05)]
    assert scaler.get_scale() == 256.0

    # A huge loss overflows the scaled fp32 gradients: the step, and the scheduler, are skipped.
    before = copy.deepcopy(model.state_dict())
    _train_step(model, scaler, optimizer, scheduler, loss_factor=1e38)
    assert optimizer.step_was_skipped
    assert torch.equal(model.weight, before["weight"]) and torch.equal(model.bias, before["bias"])
    assert scheduler.get_last_lr() == [pytest.approx(0.05)]
    assert scaler.get_scale() == 128.0

    _train_step(model, scaler, optimizer, scheduler)
    assert not optimizer.step_was_skipped
    assert not torch.equal(model.weight, before["weight"])
    assert scheduler.get_last_lr() == [pytest.approx(0.025)]


def test_fp16_overflow_is_seen_with_a_fused_optimizer():
    # A fused optimizer is called even on an overflow and skips inside its kernel.
    model, scaler, optimizer, scheduler = _fp16_setup(torch.optim.Adam, fused=True)
    assert getattr(optimizer.optimizer, "_step_supports_amp_scaling", False)
    x = torch.randn(8, 4)
    scaler.scale(model(x).pow(2).mean()).backward()
    model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    optimizer.step()
    scheduler.step()
    assert optimizer.step_was_skipped
    assert torch.equal(model.weight, before)
    assert scheduler.get_last_lr() == [pytest.approx(0.1)]


# -- hardware decisions -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,fragments",
    [
        (("bf16", "cuda", (7, 0)), ["bf16", "7.0", "8.0", "fp16"]),
        (("bf16", "cuda", (7, 5)), ["bf16", "7.5"]),
        (("fp8", "cuda", (8, 6), True), ["fp8", "8.9", "8.6"]),
        (("fp8", "cuda", (9, 0), False), ["fp8", "torchao", "pip install torchao"]),
        (("fp8", "cuda", None, True), ["fp8", "8.9"]),
        (("fp8", "cpu"), ["fp8", "cpu", "bf16"]),
        (("fp8", "mps", None, True), ["fp8", "mps"]),
        (("fp16", "xla"), ["fp16", "bf16"]),
        (("bf16", "mps", None, False, True, False), ["bf16", "mps", "fp16"]),
        (("fp16", "cpu", None, False, False), ["fp16", "cpu", torch.__version__]),
    ],
)
def test_precision_problem_names_precision_device_and_remedy(args, fragments):
    message = precision_problem(*args)
    assert message is not None
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    "args",
    [
        ("no", "cpu"),
        ("bf16", "cpu"),
        ("fp16", "cpu"),
        ("bf16", "cuda", (8, 0)),
        ("fp16", "cuda", (7, 0)),
        ("fp8", "cuda", (8, 9), True),
        ("fp8", "cuda", (9, 0), True),
        ("bf16", "xla"),
        ("bf16", "mps", None, False, True, True),
    ],
)
def test_precision_problem_accepts_what_the_hardware_does(args):
    assert precision_problem(*args) is None


def test_check_precision_supported_on_this_cpu():
    for precision in ("no", "bf16", "fp16", "BF16"):
        check_precision_supported(precision, CPU)
    check_precision_supported("fp16", "cpu")
    with pytest.raises(ValueError, match=r"fp8.*cpu"):
        check_precision_supported("fp8", CPU)
    with pytest.raises(ValueError, match="int4"):
        check_precision_supported("int4", CPU)


def test_prepare_fp8_model_refuses_here():
    with pytest.raises(ValueError, match="fp8") as raised:
        prepare_fp8_model(torch.nn.Linear(16, 16))
    with pytest.raises(ValueError) as direct:
        check_precision_supported("fp8", CPU)
    assert str(raised.value) == str(direct.value)
