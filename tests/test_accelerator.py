"""Accelerator end to end: the same loop on 1, 2 and 4 real processes (gloo)."""

import pytest
import torch
from accel_targets import (
    accumulated_params,
    metrics_rows,
    reference_params,
    sync_pattern,
    train_with_checkpoint,
)
from mp import run_ranks

from notebook_accel import Accelerator, AcceleratorState, GradientState, PartialState


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, per_rank_batch, accumulation", [(1, 4, 2), (2, 4, 2), (4, 2, 2), (2, 8, 1)])
def test_accumulated_training_equals_single_process_global_batch(world, per_rank_batch, accumulation):
    expected = reference_params(global_batch=world * per_rank_batch * accumulation)
    if world == 1:
        results = [accumulated_params(per_rank_batch, accumulation)]
    else:
        results = run_ranks(accumulated_params, world, per_rank_batch, accumulation, timeout=100)
    for params, syncs, num_processes in results:
        assert num_processes == world
        assert syncs.count(True) == len(syncs) // accumulation
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # every rank ends with the same weights
    for params, _, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_accumulate_sync_pattern_over_five_batches(world):
    patterns = [sync_pattern()] if world == 1 else run_ranks(sync_pattern, world, timeout=100)
    assert patterns == [[False, True, False, True, True]] * world


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gather_for_metrics_drops_even_batches_duplicates(world):
    rows = [metrics_rows()] if world == 1 else run_ranks(metrics_rows, world, timeout=100)
    for got in rows:
        assert len(got) == 99
        assert sorted(got) == [float(i) for i in range(99)]


def _fresh():
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("style", ["stateful", "skip", "count"])
def test_resume_is_bit_identical_in_one_process(tmp_path, style):
    full, full_losses = train_with_checkpoint(str(tmp_path / "unused"), style=style)
    _fresh()
    _, first_losses = train_with_checkpoint(str(tmp_path / "ckpt"), stop_after=17, style=style)  # mid-epoch 2 of 3
    _fresh()
    # different seeds before loading: everything random must come from the checkpoint
    resumed, rest_losses = train_with_checkpoint(str(tmp_path / "ckpt"), resume=True, seed_offset=5, style=style)
    assert len(first_losses) == 17 and len(rest_losses) == 36 - 17
    assert first_losses + rest_losses == full_losses
    assert all(torch.equal(a, b) for a, b in zip(resumed, full))


def _epochs_of_indices(folder, stateful, save_after=None, resume=False, seed=0):
    """Indices a shuffled 64-item loader (16 batches of 4) yields; saves after `save_after` batches of epoch 1."""
    from notebook_accel.utils import DataLoaderConfiguration

    torch.manual_seed(seed)
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    data = torch.utils.data.TensorDataset(torch.arange(64))
    gen = torch.Generator().manual_seed(3 + seed)
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=gen))
    if resume:
        accelerator.load_state(folder)
        return len(loader), [b.tolist() for (b,) in loader]
    epochs = []
    for epoch in range(2):
        epochs.append([])
        for (b,) in loader:
            epochs[-1].append(b.tolist())
            if epoch == 1 and len(epochs[-1]) == save_after:
                accelerator.save_state(folder)
    return len(loader), epochs


@pytest.mark.timeout(60)
def test_load_state_restores_the_position_only_for_a_stateful_loader(tmp_path, caplog):
    """accelerate's contract: without use_stateful_dataloader the resume code skips the done batches
    itself, so load_state must not skip them too. Here the saved epoch replays from its first batch,
    in its saved order; len(loader) is the whole epoch either way (resume code divides by it)."""
    folder = str(tmp_path / "ckpt")
    size, (_, epoch1) = _epochs_of_indices(folder, stateful=False, save_after=6)
    assert size == 16 and len(epoch1) == 16
    _fresh()
    with caplog.at_level("INFO", logger="notebook_accel.checkpointing"):
        size, replayed = _epochs_of_indices(folder, stateful=False, resume=True, seed=9)
    assert size == 16
    assert replayed == epoch1  # the whole saved epoch, same order, though every seed changed
    assert "restarts epoch 1 at its first batch" in caplog.text and "skip_first_batches(loader, 6)" in caplog.text
    _fresh()
    _epochs_of_indices(folder, stateful=True, save_after=6)
    _fresh()
    size, rest = _epochs_of_indices(folder, stateful=True, resume=True, seed=9)
    assert size == 16
    assert rest == epoch1[6:]


@pytest.mark.timeout(60)
def test_set_epoch_to_another_epoch_drops_a_restored_position(tmp_path):
    folder = str(tmp_path / "ckpt")
    _epochs_of_indices(folder, stateful=True, save_after=6)
    _fresh()
    from notebook_accel.utils import DataLoaderConfiguration

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    data = torch.utils.data.TensorDataset(torch.arange(64))
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator()))
    accelerator.load_state(folder)
    assert loader.state_dict()["batches_yielded"] == 6
    loader.set_epoch(1)  # the saved epoch: the position stays
    assert loader.state_dict()["batches_yielded"] == 6
    loader.set_epoch(2)
    batches = [b for (b,) in loader]
    assert len(batches) == 16 and sorted(torch.cat(batches).tolist()) == list(range(64))


@pytest.mark.timeout(60)
def test_fp16_overflow_skips_optimizer_and_scheduler_step():
    accelerator = Accelerator(mixed_precision="fp16")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(2, 4)).sum() * 1e30  # inf once scaled: the step must be skipped
    accelerator.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    assert accelerator.optimizer_step_was_skipped and opt.step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert sched.get_last_lr() == [0.1]
    # one small sample: at scale 32768 a batch of 2 overflows the fp16 bias gradient (2 * 32768 > 65504)
    loss = model(torch.full((1, 4), 0.01)).sum()
    accelerator.backward(loss)
    opt.step()
    sched.step()
    assert not accelerator.optimizer_step_was_skipped
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert sched.get_last_lr() == [0.05]


def test_fp16_two_optimizers_on_one_backward_unscale_with_the_same_scale():
    """An overflow in the first optimizer's gradients must not halve the scale before the second
    unscales (accelerate updates after each step, so the second would step with 2x gradients)."""
    from notebook_accel.utils import GradScalerKwargs

    # 1024: at the default 65536 the fp16 output cast's own gradient overflows, b's too
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    a, b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    opt_a = torch.optim.SGD(a.parameters(), lr=1.0)
    opt_b = torch.optim.SGD(b.parameters(), lr=1.0)
    a, b, opt_a, opt_b = accelerator.prepare(a, b, opt_a, opt_b)
    a_before = [p.detach().clone() for p in a.parameters()]
    b_before = b.weight.detach().clone()
    scale = accelerator.scaler.get_scale()
    x = torch.full((1, 4), 0.01)
    loss = a(x).sum() * 1e30 + b(x).sum()  # inf gradients for a only
    accelerator.backward(loss)
    opt_a.step()
    opt_b.step()
    assert opt_a.step_was_skipped and not opt_b.step_was_skipped
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), a_before))
    step = (b_before - b.weight.detach()) / x  # d sum(b(x)) / d weight = x, lr 1
    assert torch.allclose(step, torch.ones_like(step), rtol=1e-2), step  # 2.0 with the scale halved first
    assert accelerator.scaler.get_scale() == scale / 2  # one overflow, one halving


def test_fp16_scale_is_saved_after_the_due_update(tmp_path):
    accelerator = Accelerator(mixed_precision="fp16")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    scale = accelerator.scaler.get_scale()
    accelerator.backward(model(torch.ones(2, 4)).sum() * 1e30)
    opt.step()
    opt.zero_grad()
    assert accelerator.scaler.state_dict()["scale"] == scale / 2
    accelerator.scaler.load_state_dict({**accelerator.scaler.state_dict(), "scale": 8.0})
    accelerator.backward(model(torch.full((1, 4), 0.01)).sum())
    opt.step()  # the records of the earlier step were cleared: no "step() already called" error
    assert not opt.step_was_skipped and accelerator.scaler.get_scale() == 8.0


def test_prepare_keeps_order_and_types():
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    out = accelerator.prepare(sched, loader, opt, model)
    assert isinstance(out[0], torch.optim.lr_scheduler.LRScheduler) or hasattr(out[0], "scheduler")
    assert isinstance(out[1], torch.utils.data.DataLoader)
    assert isinstance(out[2], torch.optim.Optimizer)
    assert accelerator.unwrap_model(out[3]) is model
    assert accelerator.prepare(model) is model or accelerator.unwrap_model(accelerator.prepare(model)) is model


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="fp32x"):
        Accelerator(mixed_precision="fp32x")
    AcceleratorState._reset_state(reset_partial_state=True)
    from notebook_accel.utils import GradientAccumulationPlugin

    with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
        Accelerator(gradient_accumulation_steps=4, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(TypeError, match="KwargsHandler"):
        Accelerator(kwargs_handlers=[{"find_unused_parameters": True}])
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator()
    with pytest.raises(ValueError, match=r"Item at index 0, `int`"):
        accelerator.register_for_checkpointing(3)
    with pytest.raises(ValueError, match=r"Item at index 1, `int`"):  # the position among all objects
        accelerator.register_for_checkpointing(torch.nn.Linear(1, 1), 3)


def test_triggers_and_clipping_in_one_process():
    accelerator = Accelerator()
    assert not accelerator.check_trigger()
    accelerator.set_trigger()
    assert accelerator.check_trigger() and not accelerator.check_trigger()
    model = accelerator.prepare(torch.nn.Linear(3, 1))
    accelerator.backward(model(torch.full((2, 3), 10.0)).sum())
    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    assert norm > 1.0
    total = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert total <= 1.0 + 1e-5
    assert PartialState().num_processes == 1


def test_prepared_objects_carry_the_mark_and_are_never_wrapped_twice():
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
    prepared = accelerator.prepare(model, opt, sched, loader, [1])
    assert [getattr(o, "_is_accelerate_prepared", False) for o in prepared] == [True] * 4 + [False]
    again = accelerator.prepare(*prepared[:4])
    assert all(a is b for a, b in zip(again, prepared))
    acc = accelerator
    assert [len(r) for r in (acc._models, acc._optimizers, acc._schedulers, acc._dataloaders)] == [1, 1, 1, 1]
    accelerator.free_memory()
    assert accelerator.prepare_model(prepared[0]) is prepared[0] and accelerator._models == [prepared[0]]


@pytest.mark.parametrize("device_map", [{"": "cpu"}, {"a": "cpu", "b": "disk"}])
def test_an_offloaded_8bit_model_is_refused(device_map, monkeypatch):
    import notebook_accel.accelerator as module

    model = torch.nn.Linear(2, 2)
    model.is_loaded_in_8bit, model.hf_device_map = True, device_map
    monkeypatch.setattr(module, "is_bitsandbytes_multi_backend_available", lambda: False)
    with pytest.raises(ValueError, match="CPU or disk offload"):
        Accelerator().prepare_model(model)
    if "disk" not in device_map.values():  # bitsandbytes' CPU backend trains it where it is
        monkeypatch.setattr(module, "is_bitsandbytes_multi_backend_available", lambda: True)
        assert Accelerator().prepare_model(model) is model


def test_unwrap_keeps_compile_over_data_parallel_without_touching_the_training_model():
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(torch.nn.DataParallel(model), backend="eager")
    accelerator = Accelerator()
    kept = accelerator.unwrap_model(compiled, keep_torch_compile=True)
    assert kept is not compiled and kept._orig_mod is model
    assert isinstance(compiled._orig_mod, torch.nn.DataParallel)  # still trains through the wrapper
    assert accelerator.unwrap_model(compiled, keep_torch_compile=False) is model
    x = torch.ones(3, 2)
    torch.testing.assert_close(kept(x), model(x))


def test_save_model_reads_offloaded_weights_back_and_refuses_meta_ones(tmp_path):
    from notebook_accel import load_checkpoint_and_dispatch
    from notebook_accel.utils.modeling import get_state_dict_from_offload

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator = Accelerator()
    accelerator.save_model(model, tmp_path / "full")
    device_map = {"0": "cpu", "1": "disk"}
    load_checkpoint_and_dispatch(model, tmp_path / "full", device_map, offload_folder=tmp_path / "off")
    assert model[1].weight.device.type == "meta"
    got = get_state_dict_from_offload(model[1], "1.weight", {"1.weight": None, "1.bias": None})
    torch.testing.assert_close(got["1.weight"], expected["1.weight"])
    torch.testing.assert_close(got["1.bias"], expected["1.bias"])
    accelerator.save_model(model, tmp_path / "again")
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    load_checkpoint_and_dispatch(fresh, tmp_path / "again")
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, expected[key])
    with torch.device("meta"):
        empty = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="meta device"):
        accelerator.save_model(empty, tmp_path / "meta")


def test_fp8_recipe_kwargs_is_deprecated_and_checks_its_choices(monkeypatch):
    from notebook_accel.utils import FP8RecipeKwargs

    monkeypatch.setenv("ACCELERATE_FP8_OPT_LEVEL", "O1")
    with pytest.warns(FutureWarning, match="deprecated"):
        recipe = FP8RecipeKwargs(backend="msamp")
    assert (recipe.backend, recipe.opt_level, recipe.fp8_format) == ("MSAMP", "O1", None)
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="`backend` must be one of MSAMP or TE"):
        FP8RecipeKwargs(backend="tpu")
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="`opt_level`"):
        FP8RecipeKwargs(backend="MSAMP", opt_level="O3")
