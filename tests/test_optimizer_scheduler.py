"""AcceleratedOptimizer and AcceleratedScheduler: sync-gated steps, passthrough, state round trips,
pickling, and scheduler stepping per process on real 2-rank gloo runs."""

from __future__ import annotations

import pickle

import pytest
import torch
from mp import run_ranks

from notebook_accel.optimizer import AcceleratedOptimizer
from notebook_accel.scheduler import AcceleratedScheduler
from notebook_accel.state import GradientState, PartialState
from notebook_accel.utils.dataclasses import GradientAccumulationPlugin


def _model_and_grads(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    return model


# -- optimizer ----------------------------------------------------------------------------------


def test_step_and_zero_grad_only_on_sync_steps():
    model = _model_and_grads()
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    assert isinstance(optimizer, torch.optim.Optimizer)
    weight = model.weight.detach().clone()
    grad = model.weight.grad.clone()

    GradientState()._set_sync_gradients(False)
    assert optimizer.step() is None
    optimizer.zero_grad()
    assert torch.equal(model.weight, weight) and torch.equal(model.weight.grad, grad)

    GradientState()._set_sync_gradients(True)
    optimizer.step()
    torch.testing.assert_close(model.weight.detach(), weight - 0.5 * grad)
    assert not optimizer.step_was_skipped
    optimizer.zero_grad(set_to_none=False)
    assert torch.equal(model.weight.grad, torch.zeros_like(grad))
    optimizer.zero_grad()
    assert model.weight.grad is None


def test_step_with_closure_returns_its_loss():
    model = torch.nn.Linear(3, 1)
    optimizer = AcceleratedOptimizer(torch.optim.LBFGS(model.parameters(), max_iter=2))
    x, y = torch.randn(6, 3), torch.randn(6, 1)

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    first = optimizer.step(closure)
    assert isinstance(first, torch.Tensor)
    assert optimizer.step(closure).item() < first.item()


def test_passthrough_surface():
    model = _model_and_grads()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = AcceleratedOptimizer(inner)
    assert optimizer.param_groups is inner.param_groups and optimizer.defaults is inner.defaults
    optimizer.param_groups[0]["lr"] = 0.3
    assert inner.param_groups[0]["lr"] == 0.3
    optimizer.step()
    assert optimizer.state is inner.state and "momentum_buffer" in optimizer.state[model.weight]
    extra = torch.nn.Parameter(torch.ones(2))
    optimizer.add_param_group({"params": [extra], "lr": 0.01})
    assert len(inner.param_groups) == 2 and inner.param_groups[1]["params"] == [extra]
    # Hooks register on the wrapped optimizer and fire when it steps.
    fired = []
    inner_hook = optimizer.register_step_post_hook(lambda opt, args, kwargs: fired.append(opt))
    optimizer.step()
    assert fired == [inner]
    inner_hook.remove()
    assert "SGD" in repr(optimizer)
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = optimizer.no_such_thing


class ModalSGD(torch.optim.SGD):
    """A real optimizer with train/eval modes, as schedule-free optimizers have."""

    mode = "train"

    def train(self):
        self.mode = "train"

    def eval(self):
        self.mode = "eval"


def test_train_and_eval_reach_the_wrapped_optimizer():
    inner = ModalSGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    optimizer = AcceleratedOptimizer(inner)
    optimizer.eval()
    assert inner.mode == "eval"
    optimizer.train()
    assert inner.mode == "train"
    plain = AcceleratedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    plain.train()
    plain.eval()  # no modes: nothing to do, no error


def _adam_run(steps, optimizer=None, model=None):
    model = model or _model_and_grads()
    optimizer = optimizer or AcceleratedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    for _ in range(steps):
        optimizer.step()
    return model, optimizer


def test_state_dict_round_trip_continues_identically():
    model, optimizer = _adam_run(3)
    saved = optimizer.state_dict()
    twin = _model_and_grads()
    twin.load_state_dict(model.state_dict())
    twin.weight.grad, twin.bias.grad = model.weight.grad.clone(), model.bias.grad.clone()
    restored = AcceleratedOptimizer(torch.optim.Adam(twin.parameters(), lr=0.5))
    restored.load_state_dict(saved)
    assert restored.param_groups[0]["lr"] == 0.01
    torch.testing.assert_close(
        restored.state[twin.weight]["exp_avg"], optimizer.state[model.weight]["exp_avg"]
    )
    optimizer.step()
    restored.step()
    assert torch.equal(model.weight, twin.weight) and torch.equal(model.bias, twin.bias)


def test_state_follows_params_on_another_device():
    param = torch.nn.Parameter(torch.ones(3, device="meta"))
    inner = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    inner.state[param]["momentum_buffer"] = torch.zeros(3)  # built on the CPU, say from a checkpoint
    AcceleratedOptimizer(inner, device_placement=False)
    assert inner.state[param]["momentum_buffer"].device.type == "cpu"
    AcceleratedOptimizer(inner)
    assert inner.state[param]["momentum_buffer"].device.type == "meta"

    cpu_param = torch.nn.Parameter(torch.ones(3))
    source = torch.optim.SGD([cpu_param], lr=0.1, momentum=0.9)
    cpu_param.grad = torch.ones(3)
    source.step()
    target = AcceleratedOptimizer(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(3, device="meta"))], lr=0.1, momentum=0.9)
    )
    target.load_state_dict(source.state_dict())
    (loaded,) = target.state.values()
    assert loaded["momentum_buffer"].device.type == "meta"


def test_pickle_round_trip_keeps_behaviour():
    model, optimizer = _adam_run(2)
    # A scheduler built on the wrapper patches its step with an unpicklable closure.
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    copy_model, copy_optimizer = pickle.loads(pickle.dumps((model, optimizer)))
    assert isinstance(copy_optimizer, AcceleratedOptimizer) and isinstance(
        copy_optimizer, torch.optim.Optimizer
    )
    torch.testing.assert_close(
        copy_optimizer.state[copy_model.weight]["exp_avg"], optimizer.state[model.weight]["exp_avg"]
    )
    for mine, theirs in zip(copy_model.parameters(), model.parameters()):
        mine.grad = theirs.grad.clone()  # pickling a Parameter drops its .grad
    optimizer.step()
    copy_optimizer.step()
    assert torch.equal(copy_model.weight, model.weight)
    GradientState()._set_sync_gradients(False)  # the copy still reads this process's gradient state
    before = copy_model.weight.detach().clone()
    copy_optimizer.step()
    assert torch.equal(copy_model.weight, before)


# -- scheduler, one process ------------------------------------------------------------------------


def _sched(lr=1.0, gamma=0.5, **kwargs):
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = AcceleratedOptimizer(torch.optim.SGD([param], lr=lr))
    plain = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=gamma)
    return optimizer, AcceleratedScheduler(plain, optimizer, **kwargs)


def test_scheduler_steps_once_per_call_in_one_process():
    for split in (False, True):
        optimizer, scheduler = _sched(split_batches=split)
        for _ in range(3):
            optimizer.step()
            scheduler.step()
        assert scheduler.get_last_lr() == [0.125]


def test_scheduler_skips_a_step_marked_as_overflowed():
    # accelerate's flag, which its tests (and fp16 loops written for it) set on the optimizer.
    optimizer, scheduler = _sched()
    optimizer._is_overflow = True
    assert optimizer.step_was_skipped
    scheduler.step()
    assert scheduler.get_last_lr() == [1.0]
    optimizer._is_overflow = False
    scheduler.step()
    assert scheduler.get_last_lr() == [0.5]


def test_scheduler_waits_while_accumulating():
    GradientState(GradientAccumulationPlugin(num_steps=3, adjust_scheduler=False))
    optimizer, scheduler = _sched()
    for sync in (False, False, True):
        GradientState()._set_sync_gradients(sync)
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr() == [0.5]  # one optimizer step, one scheduler step


def test_adjust_scheduler_only_counts_calls_while_accumulating():
    # As accelerate: accumulating batches leave the schedule alone (it is sized in optimizer steps);
    # adjust_scheduler counts the calls in torch's _step_count, so torch does not warn.
    GradientState(GradientAccumulationPlugin(num_steps=3))  # adjust_scheduler defaults to True
    assert GradientState().adjust_scheduler
    optimizer, scheduler = _sched()
    count = scheduler.scheduler._step_count
    GradientState()._set_sync_gradients(False)
    scheduler.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [1.0]
    assert scheduler.scheduler._step_count == count + 2
    GradientState()._set_sync_gradients(True)
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.5]  # one real step, one scheduler step
    # A checkpoint from an earlier build carried a pending-batch count: it loads, and is ignored.
    _, resumed = _sched()
    resumed.load_state_dict({**scheduler.state_dict(), "_notebook_accel_pending_batches": 2})
    assert resumed.get_last_lr() == [0.5]


def test_step_with_optimizer_false_always_steps():
    optimizer, scheduler = _sched(step_with_optimizer=False)
    optimizer.step()
    GradientState()._set_sync_gradients(False)
    scheduler.step()
    assert scheduler.get_last_lr() == [0.5]


def test_one_cycle_stops_at_its_end_without_raising():
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = AcceleratedOptimizer(torch.optim.SGD([param], lr=0.1))
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer.optimizer, max_lr=1.0, total_steps=4)
    scheduler = AcceleratedScheduler(one_cycle, optimizer)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    assert one_cycle.last_epoch == 4
    with pytest.raises(ValueError):
        one_cycle.step()  # the plain scheduler would have raised


def test_scheduler_passthrough():
    optimizer, scheduler = _sched()
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == scheduler.scheduler.get_last_lr() == [0.5]
    assert scheduler.last_epoch == 1 and scheduler.optimizer is optimizer.optimizer
    saved = scheduler.state_dict()
    assert saved == scheduler.scheduler.state_dict()
    _, other = _sched()
    other.load_state_dict(saved)
    assert other.get_last_lr() == [0.5] and other.last_epoch == 1
    restored = pickle.loads(pickle.dumps(scheduler))
    assert restored.get_last_lr() == [0.5]
    with pytest.raises(AttributeError, match="nope"):
        _ = scheduler.nope


# -- scheduler, two real processes -------------------------------------------------------------------


def _ranked_lrs(split_batches, calls):
    state = PartialState()
    optimizer, scheduler = _sched(gamma=0.9, split_batches=split_batches)
    for _ in range(calls):
        optimizer.step()
        scheduler.step()
    return state.num_processes, scheduler.get_last_lr()[0]


def _ranked_accumulation_and_plateau():
    PartialState()
    GradientState(GradientAccumulationPlugin(num_steps=2))
    optimizer, scheduler = _sched(gamma=0.9)
    for sync in (False, True, False, True):
        GradientState()._set_sync_gradients(sync)
        optimizer.step()
        scheduler.step()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer.optimizer, patience=5)
    wrapped = AcceleratedScheduler(plateau, optimizer)
    wrapped.step(1.0)
    wrapped.step(2.0)  # worse: one bad evaluation, not one per process
    return scheduler.get_last_lr()[0], plateau.num_bad_epochs


def _plain_lr(steps, gamma=0.9):
    optimizer, scheduler = _sched(gamma=gamma)
    optimizer.step()
    for _ in range(steps):
        scheduler.scheduler.step()
    return scheduler.get_last_lr()[0]


@pytest.mark.parametrize("split_batches,factor", [(False, 2), (True, 1)])
def test_scheduler_steps_per_process_on_two_ranks(split_batches, factor):
    calls = 3
    results = run_ranks(_ranked_lrs, 2, split_batches, calls, timeout=60)
    assert [n for n, _ in results] == [2, 2]
    for _, lr in results:
        assert lr == pytest.approx(_plain_lr(factor * calls), rel=1e-12)
        assert lr != pytest.approx(_plain_lr((3 - factor) * calls), rel=1e-6)


def test_accumulation_and_plateau_on_two_ranks():
    results = run_ranks(_ranked_accumulation_and_plateau, 2, timeout=60)
    for lr, bad_epochs in results:
        assert lr == pytest.approx(_plain_lr(2 * 2), rel=1e-12)  # 2 optimizer steps x 2 processes, as accelerate
        assert bad_epochs == 1
