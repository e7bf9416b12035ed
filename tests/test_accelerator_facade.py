"""The Accelerator facade beyond the training loop of test_accelerator.py: exact resume on 2 ranks,
checkpoint rotation, save_model, mixed precision, torch.compile, kwargs handlers, loader
configurations, join_uneven_inputs, collectives, decorators and trackers (1 process in-process,
2 and 4 real gloo ranks)."""

import glob
import json
import os
from datetime import timedelta

import pytest
import torch
from accel_facade_targets import (
    facade_on_ranks,
    interrupted_then_uninterrupted,
    loaders_join_and_trackers,
    make_data,
    make_model,
    resumed,
)
from mp import run_ranks

from notebook_accel import Accelerator, AcceleratorState, GradientState
from notebook_accel.utils import (
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
)

TIMEOUT = 90


def _reset():
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_state():
    _reset()
    yield
    _reset()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _prepared_counts(accelerator):
    return [len(accelerator._models), len(accelerator._optimizers), len(accelerator._schedulers), len(accelerator._dataloaders)]


# -- exact resume on 2 ranks ----------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_resume_on_two_ranks_is_bit_identical(tmp_path):
    folder = str(tmp_path / "ckpt")
    # 48 samples, batch 4, 2 ranks: 6 steps an epoch, so step 8 is mid-epoch 2 of 3.
    first = run_ranks(interrupted_then_uninterrupted, 2, folder, 8, timeout=TIMEOUT)
    rest = run_ranks(resumed, 2, folder, timeout=TIMEOUT)
    for rank in range(2):
        interrupted, full = first[rank]
        finished = rest[rank]
        assert len(interrupted["losses"]) == 8 and len(full["losses"]) == 18
        assert interrupted["losses"] + finished["losses"] == full["losses"], f"rank {rank}"
        assert all(torch.equal(a, b) for a, b in zip(finished["params"], full["params"])), f"rank {rank}"
        assert finished["meter"] == full["meter"] and finished["meter"]["count"] == 18
        assert finished["lr"] == full["lr"]
    # the ranks drew different dropout masks (device_specific seeds) and still agree on the weights
    assert first[0][1]["losses"] != first[1][1]["losses"]
    assert all(torch.equal(a, b) for a, b in zip(rest[0]["params"], rest[1]["params"]))


# -- automatic checkpoint naming ------------------------------------------------------------------


def _rotating_accelerator(project_dir):
    config = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_config=config)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def _train_step(accelerator, model, opt):
    x, y = make_data(8).tensors
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()


def test_automatic_naming_keeps_the_last_two_and_resumes_from_the_latest(tmp_path):
    accelerator, model, opt = _rotating_accelerator(tmp_path)
    saved = []
    for _ in range(4):
        _train_step(accelerator, model, opt)
        saved.append((accelerator.save_state(), _params(model)))
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3"]
    assert saved[-1][0] == str(root / "checkpoint_3")
    assert accelerator.save_iteration == 4

    _reset()
    accelerator, model, opt = _rotating_accelerator(tmp_path)  # a fresh run: iteration 0
    # checkpoint_0 would sort before checkpoint_3 and be rotated away the moment it was written
    with pytest.raises(FileExistsError, match=r"checkpoint_3 is newer.*iteration to 4"):
        accelerator.save_state()
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3"]
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), saved[-1][1]))
    accelerator.load_state()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved[-1][1]))
    assert accelerator.save_iteration == 4
    latest = (root / "checkpoint_3" / "model.safetensors").read_bytes()
    _train_step(accelerator, model, opt)
    assert accelerator.save_state() == str(root / "checkpoint_4")
    assert sorted(os.listdir(root)) == ["checkpoint_3", "checkpoint_4"]
    assert (root / "checkpoint_3" / "model.safetensors").read_bytes() == latest


# -- the 2-rank facade: handlers, no_sync, save_model, collectives, decorators --------------------


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("facade"))
    return run_ranks(facade_on_ranks, 2, root, timeout=TIMEOUT)


@pytest.mark.timeout(120)
def test_ddp_kwargs_and_process_group_kwargs_reach_torch(on_two_ranks):
    for r in on_two_ranks:
        assert r["num_processes"] == 2 and r["is_ddp"]
        assert r["find_unused_parameters"] is True
        assert r["backend"] == "gloo"
        if r["timeout"] is not None:  # where torch lets us read it back
            assert r["timeout"] == timedelta(seconds=77)
        # the parameter outside forward did not stop DDP's backward; it simply got no gradient
        assert r["unused_grad"] is None


@pytest.mark.timeout(120)
def test_comm_hook_runs_only_on_synced_backwards_and_no_sync_skips_the_all_reduce(on_two_ranks):
    for r in on_two_ranks:
        # the user's own state object is the one the hook counts in
        assert r["hook_calls_after_no_sync"] == 0
        assert r["hook_calls_after_sync"] >= 1
    grads = on_two_ranks[0]["no_sync_grads"]
    assert grads.shape[0] == 2 and not torch.equal(grads[0], grads[1])  # each rank kept its own
    grads = on_two_ranks[0]["sync_grads"]
    assert torch.equal(grads[0], grads[1])  # averaged across ranks
    local = on_two_ranks[0]["no_sync_grads"]
    torch.testing.assert_close(grads[0], (local[0] + local[1]) / 2)


@pytest.mark.timeout(120)
def test_get_state_dict_and_save_model_on_two_ranks(on_two_ranks):
    main, other = on_two_ranks
    assert main["unwrapped_is_original"] and other["unwrapped_is_original"]
    assert main["state_dict_keys"] == ["unused.bias", "unused.weight", "used.bias", "used.weight"]
    # only the main process wrote: sharded files and an index
    assert other["wrote_files"] == []
    shards = [f for f in main["wrote_files"] if f.endswith(".safetensors")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in main["wrote_files"]
    assert set(main["index_weight_map"]) == set(main["state_dict_keys"])
    for r in on_two_ranks:
        assert set(r["reloaded"]) == set(r["state_dict"])
        assert all(torch.equal(r["reloaded"][k], v) for k, v in r["state_dict"].items())


@pytest.mark.timeout(120)
def test_collectives_through_the_facade(on_two_ranks):
    for r in on_two_ranks:
        assert r["reduce_sum"].tolist() == [3.0]
        assert r["reduce_mean"].tolist() == [1.5]
        assert r["gathered"].tolist() == [0, 0, 1, 10]
    assert on_two_ranks[0]["padded"].tolist() == [10, -1]
    assert on_two_ranks[1]["padded"].tolist() == [10, 11]


@pytest.mark.timeout(120)
def test_decorators_ordering_splitting_and_print(on_two_ranks):
    main, other = on_two_ranks
    assert (main["on_main"], other["on_main"]) == ("main ran on 0", None)
    assert (main["on_process_1"], other["on_process_1"]) == (None, "1 ran on 1")
    assert (main["on_process_1_decorator"], other["on_process_1_decorator"]) == (None, "decorated ran on 1")
    # main_process_first: rank 1 entered its block only after rank 0 had written the file
    assert main["flag_seen_on_entry"] is False and other["flag_seen_on_entry"] is True
    assert (main["share"], other["share"]) == ([0, 1, 2], [3, 4])
    assert (main["padded_share"], other["padded_share"]) == ([0, 1, 2], [3, 4, 4])
    assert main["printed"] == "hello from the facade\n" and other["printed"] == ""


@pytest.mark.timeout(120)
def test_free_memory_forgets_prepared_objects(on_two_ranks):
    for r in on_two_ranks:
        assert r["prepared_models_before_free"] == 1
        assert r["prepared_after_free"] == [0, 0, 0, 0]


# -- loader configurations, join_uneven_inputs and trackers on 2 and 4 ranks ----------------------


@pytest.fixture(scope="module", params=[2, 4])
def loaders_on_ranks(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"loaders{request.param}")
    return request.param, root, run_ranks(loaders_join_and_trackers, request.param, str(root), timeout=TIMEOUT)


@pytest.mark.timeout(150)
def test_split_and_dispatched_batches_cover_the_data(loaders_on_ranks):
    world, _, results = loaders_on_ranks
    for r in results:
        mine, seen = r["split"]
        assert [len(b) for b in mine] == [8 // world] * 2  # each global batch of 8 split across ranks
        assert sorted(seen) == list(range(16))
        assert r["dispatch_type"] == "DataLoaderDispatcher"
        mine, seen = r["dispatch"]
        assert [len(b) for b in mine] == [2] * (8 // world)  # every rank still gets batch_size rows
        assert sorted(seen) == list(range(16))
    # rank i gets global batch i of each round, in order
    assert results[1]["split"][0][0] == list(range(8 // world, 2 * 8 // world))


@pytest.mark.timeout(150)
def test_even_batches_false_gives_ranks_different_counts(loaders_on_ranks):
    world, _, results = loaders_on_ranks
    uneven = [r["uneven"][0] for r in results]
    assert sorted(results[0]["uneven"][1]) == list(range(18))  # every sample once, none repeated
    counts = [len(batches) for batches in uneven]
    assert sum(counts) == 5 and counts[0] > counts[-1]
    even = [r["even"][0] for r in results]
    assert len({len(batches) for batches in even}) == 1  # even_batches=True: the same count everywhere
    assert set(results[0]["even"][1]) == set(range(18)) and len(results[0]["even"][1]) > 18


@pytest.mark.timeout(150)
def test_join_uneven_inputs_finishes_and_leaves_ranks_in_agreement(loaders_on_ranks):
    world, _, results = loaders_on_ranks
    assert [r["join_steps"] for r in results] == [3] + [2] * (world - 1)
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["join_params"], results[0]["join_params"]))
    assert all(r["even_batches_after_join"] is False for r in results)


@pytest.mark.timeout(150)
def test_jsonl_tracker_writes_on_the_main_process_only(loaders_on_ranks):
    world, root, results = loaders_on_ranks
    assert results[0]["trackers"] == ["jsonl"]
    assert all(r["trackers"] == [] for r in results[1:])
    lines = (root / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["step"], r["loss"], r["rank"]) for r in records] == [(0, 1.0, 0), (1, 0.5, 0), (2, 1 / 3, 0)]
    assert json.loads((root / "run" / "config.json").read_text()) == {"lr": 0.05, "world": world}


# -- trackers in one process ----------------------------------------------------------------------


def test_jsonl_and_tensorboard_trackers_through_the_facade(tmp_path):
    pytest.importorskip("tensorboard")
    accelerator = Accelerator(log_with=["jsonl", "tensorboard"], project_dir=str(tmp_path))
    accelerator.init_trackers("run", config={"lr": 0.1})
    accelerator.log({"loss": 1.0}, step=1)
    accelerator.log({"loss": 0.25}, step=2)
    jsonl = accelerator.get_tracker("jsonl")
    assert jsonl.name == "jsonl"
    assert accelerator.get_tracker("jsonl", unwrap=True) is jsonl.tracker
    with pytest.raises(ValueError, match="wandb"):
        accelerator.get_tracker("wandb")
    accelerator.end_training()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 0.25)]
    events = glob.glob(str(tmp_path / "run" / "**" / "events.out.tfevents.*"), recursive=True)
    assert events and any(os.path.getsize(e) > 0 for e in events)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(tmp_path / "run")).Reload().Scalars("loss")
    assert [(s.step, s.value) for s in scalars] == [(1, 1.0), (2, 0.25)]


# -- mixed precision and torch.compile in one process ---------------------------------------------


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_reduced_precision_training_on_cpu(precision, dtype):
    accelerator = Accelerator(mixed_precision=precision)
    original = make_model()
    seen = []
    original[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    opt = torch.optim.SGD(original.parameters(), lr=0.05)
    model, opt = accelerator.prepare(original, opt)
    x, y = make_data(16).tensors
    losses = []
    for _ in range(6):
        out = model(x)
        assert out.dtype == torch.float32  # outputs come back in fp32
        loss = torch.nn.functional.mse_loss(out, y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert set(seen) == {dtype}
    assert losses[-1] < losses[0]
    assert (accelerator.scaler is not None) == (precision == "fp16")
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert unwrapped is original and "forward" not in original.__dict__
    seen.clear()
    unwrapped(x)
    assert seen == [torch.float32]


def test_fp8_on_cpu_is_refused_at_construction_and_leaves_no_state_behind():
    with pytest.raises(ValueError, match=r"fp8.*(NVIDIA GPU|compute capability|torchao)"):
        Accelerator(mixed_precision="fp8")
    # the kernel is not poisoned: the precision the message suggests works right after
    assert Accelerator(mixed_precision="bf16").mixed_precision == "bf16"


def test_dynamo_eager_compiles_trains_unwraps_and_checkpoints(tmp_path):
    accelerator = Accelerator(dynamo_backend="eager")
    original = make_model()
    opt = torch.optim.SGD(original.parameters(), lr=0.05)
    model, opt = accelerator.prepare(original, opt)
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and model._orig_mod is original
    x, y = make_data(16).tensors
    before = _params(original)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not all(torch.equal(a, b) for a, b in zip(original.parameters(), before))
    assert accelerator.unwrap_model(model, keep_torch_compile=False) is original
    assert accelerator.unwrap_model(model) is model  # accelerate's default keeps the compiled wrapper
    # the user's keys (no "_orig_mod." prefix), so save_state / load_state round-trip a compiled model
    assert set(accelerator.get_state_dict(model)) == set(original.state_dict())
    trained = _params(original)
    accelerator.save_state(str(tmp_path / "ckpt"))
    with torch.no_grad():
        for p in original.parameters():
            p.zero_()
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(original.parameters(), trained))


def test_dynamo_plugin_reads_accelerate_variables_and_compiles_regions(monkeypatch):
    from notebook_accel.utils import TorchDynamoPlugin

    variables = {
        "BACKEND": "EAGER",
        "MODE": "reduce-overhead",
        "USE_FULLGRAPH": "true",
        "USE_DYNAMIC": "false",
        "USE_REGIONAL_COMPILATION": "yes",
    }
    for name, value in variables.items():
        monkeypatch.setenv("ACCELERATE_DYNAMO_" + name, value)
    plugin = TorchDynamoPlugin()
    assert (plugin.backend, plugin.mode, plugin.fullgraph) == ("eager", "reduce-overhead", True)
    assert plugin.dynamic is False and plugin.use_regional_compilation is True
    # to_kwargs: what differs from the class's defaults, whatever the environment says
    changed = {"backend": "eager", "mode": "reduce-overhead", "fullgraph": True}
    assert plugin.to_kwargs() == {**changed, "dynamic": False, "use_regional_compilation": True}
    explicit = TorchDynamoPlugin(backend="eager", mode="default", dynamic=True)  # unset ones still read
    assert explicit.to_kwargs() == {
        "backend": "eager",
        "fullgraph": True,
        "dynamic": True,
        "use_regional_compilation": True,
    }

    blocks = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)]))
    regional = TorchDynamoPlugin(backend="eager", use_regional_compilation=True)
    compiled = Accelerator(dynamo_plugin=regional).prepare(blocks)
    assert compiled._orig_mod is blocks
    assert all(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in compiled[0])


# -- kwargs handlers, clipping and unscaling in one process ---------------------------------------


def test_grad_scaler_kwargs_reach_the_scaler():
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
    assert accelerator.scaler.get_scale() == 1024.0


@pytest.mark.parametrize(
    "handlers, kind",
    [
        ([DistributedDataParallelKwargs(), DistributedDataParallelKwargs(find_unused_parameters=True)], "DistributedDataParallelKwargs"),
        ([GradScalerKwargs(), GradScalerKwargs(init_scale=2.0)], "GradScalerKwargs"),
        ([InitProcessGroupKwargs(), InitProcessGroupKwargs(timeout=timedelta(seconds=5))], "InitProcessGroupKwargs"),
    ],
)
def test_two_handlers_of_one_kind_are_refused(handlers, kind):
    with pytest.raises(ValueError, match=f"two {kind}"):
        Accelerator(kwargs_handlers=handlers)


def test_init_process_group_kwargs_in_one_process_are_accepted():
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=77))])
    assert accelerator.init_handler.timeout == timedelta(seconds=77)
    assert accelerator.reduce(torch.tensor([2.0])).tolist() == [2.0]


def test_fp16_gradients_are_unscaled_exactly_once():
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    accelerator.backward(model(torch.full((2, 4), 0.01)).sum())
    scaled = [p.grad.clone() for p in model.parameters()]
    assert all(torch.count_nonzero(g) > 0 for g in scaled)
    accelerator.clip_grad_value_(model.parameters(), 1e6)  # no clipping: only the unscale shows
    accelerator.clip_grad_value_(model.parameters(), 1e6)
    accelerator.unscale_gradients()
    unscaled = [p.grad.clone() for p in model.parameters()]
    for got, s in zip(unscaled, scaled):
        assert torch.equal(got, s / 1024)  # a power of two: exact
    before = _params(model)
    opt.step()  # the scaler must not unscale a second time
    assert not opt.step_was_skipped
    for p, b, g in zip(model.parameters(), before, unscaled):
        torch.testing.assert_close(p.detach(), b - 0.1 * g)
    # after the next backward, the new gradients are unscaled again (once)
    opt.zero_grad()
    accelerator.backward(model(torch.full((2, 4), 0.01)).sum())
    scale = accelerator.scaler.get_scale()
    scaled = [p.grad.clone() for p in model.parameters()]
    accelerator.clip_grad_value_(model.parameters(), 1e-4)
    for p, s in zip(model.parameters(), scaled):
        assert torch.equal(p.grad, (s / scale).clamp(-1e-4, 1e-4))


def test_get_state_dict_and_free_memory_in_one_process():
    accelerator = Accelerator()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    loader = torch.utils.data.DataLoader(make_data(8), batch_size=4)
    prepared = accelerator.prepare(model, opt, sched, loader)
    state = accelerator.get_state_dict(prepared[0])
    assert set(state) == set(model.state_dict())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert _prepared_counts(accelerator) == [1, 1, 1, 1]
    accelerator.free_memory()
    assert _prepared_counts(accelerator) == [0, 0, 0, 0]


# -- gradient accumulation settings ---------------------------------------------------------------


def test_gradient_accumulation_steps_setter_and_sync_gradients():
    accelerator = Accelerator(gradient_accumulation_steps=2)
    assert accelerator.gradient_accumulation_steps == 2
    accelerator.gradient_accumulation_steps = 3
    assert accelerator.gradient_accumulation_steps == 3
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    x, y = make_data(8).tensors
    plain = make_model()
    torch.nn.functional.mse_loss(plain(x), y).backward()

    assert accelerator.sync_gradients  # outside accumulate: every step syncs
    pattern = []
    for _ in range(6):
        with accelerator.accumulate(model):
            pattern.append(accelerator.sync_gradients)
    assert pattern == [False, False, True, False, False, True]

    before = _params(model)
    with accelerator.accumulate(model):  # step 7: not a sync step
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        for got, want in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(got.grad, want.grad / 3)  # loss divided by the steps
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))  # no step, grads kept
    assert all(p.grad is not None for p in model.parameters())

    accelerator.sync_gradients = True
    assert accelerator.gradient_state.sync_gradients
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


# -- bad input ------------------------------------------------------------------------------------


def test_prepare_rejects_a_device_placement_list_of_the_wrong_length():
    accelerator = Accelerator()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="device_placement has 1 entries for 2 objects"):
        accelerator.prepare(model, opt, device_placement=[True])
    out_model, out_opt = accelerator.prepare(model, opt, device_placement=[False, True])
    assert accelerator.unwrap_model(out_model) is model and out_opt.optimizer is opt


@pytest.mark.parametrize(  # FSDP: tests/test_fsdp.py
    "plugin",
    ["deepspeed_plugin", "deepspeed_plugins", "megatron_lm_plugin", "torch_tp_plugin", "parallelism_config"],
)
def test_unsupported_plugins_are_named(plugin):
    with pytest.raises(NotImplementedError, match=plugin):
        Accelerator(**{plugin: object()})
