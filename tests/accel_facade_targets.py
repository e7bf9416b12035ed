"""Functions run on real gloo ranks by tests/test_accelerator_facade.py (through tests/mp.py).

Each one builds its own Accelerator and returns plain observations (tensors, lists, dicts), which
the tests then compare across ranks and against what a correct facade must give.
"""

import contextlib
import io
import json
import os
from datetime import timedelta

import torch
from accel_targets import make_data as _make_data
from accel_targets import make_model  # noqa: F401  (the facade tests' model is the same)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def make_data(n=48, features=4, seed=0):
    return _make_data(n, features, seed)


def _reset_training_state():
    """A fresh Accelerator in the same process, keeping the process group (PartialState)."""
    from notebook_accel import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


class LossMeter:
    """A user object registered for checkpointing: its sums must resume exactly too.

    It sums the loss averaged across ranks, so it holds the same value on every rank: registered
    objects are shared state, saved by the main process (as in accelerate) like the model.
    """

    def __init__(self):
        self.total, self.count = 0.0, 0

    def update(self, value: float) -> None:
        self.total += value
        self.count += 1

    def state_dict(self) -> dict:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.count = state["total"], state["count"]


# -- exact resume on N ranks ----------------------------------------------------------------------


def train_resumable(folder, stop_after=None, resume=False, epochs=3, seed_offset=0):
    """Shuffled loader, dropout (a different stream per rank), AdamW, a scheduler and a LossMeter.

    With stop_after: save_state after that many steps and stop. With resume: load_state first and
    finish. seed_offset changes every seed, so a resumed run must take all randomness from the files.
    """
    from notebook_accel import Accelerator
    from notebook_accel.utils import DataLoaderConfiguration, set_seed

    # use_stateful_dataloader: load_state puts the loader back mid-epoch (accelerate's flag for it)
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    set_seed(1234 + seed_offset, device_specific=True)
    model = make_model(seed=7 + seed_offset, dropout=0.3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=40)
    gen = torch.Generator().manual_seed(99 + seed_offset)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=4, shuffle=True, generator=gen)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    meter = LossMeter()
    accelerator.register_for_checkpointing(meter)
    start_epoch = 0
    if resume:
        accelerator.load_state(folder)
        start_epoch = loader.state_dict()["epoch"]
    losses, done = [], 0
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
            meter.update(accelerator.reduce(loss.detach(), "mean").item())
            done += 1
            if stop_after is not None and done == stop_after:
                accelerator.save_state(folder)
                return {"losses": losses}
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return {"losses": losses, "params": params, "meter": meter.state_dict(), "lr": sched.get_last_lr()}


def interrupted_then_uninterrupted(folder, stop_after):
    """The interrupted run (writes the checkpoint), then in the same processes the full run."""
    interrupted = train_resumable(folder, stop_after=stop_after)
    _reset_training_state()
    full = train_resumable(os.path.join(folder, "unused"))
    return interrupted, full


def resumed(folder):
    return train_resumable(folder, resume=True, seed_offset=5)


# -- the facade's collectives, decorators, DDP handlers, no_sync and save_model -------------------


def counting_allreduce_hook(state, bucket):
    """A DDP comm hook that counts its calls in the user's `state` and then all-reduces as usual."""
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


class WithUnused(torch.nn.Module):
    """`unused` never takes part in forward: DDP without find_unused_parameters would fail."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.used = torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def facade_on_ranks(root):
    """Everything the 2-rank facade tests check, observed in one launch."""
    import torch.distributed as dist

    from notebook_accel import Accelerator
    from notebook_accel.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    hook_state = {"calls": 0}
    accelerator = Accelerator(
        kwargs_handlers=[
            DistributedDataParallelKwargs(
                find_unused_parameters=True, comm_hook=counting_allreduce_hook, comm_state=hook_state
            ),
            InitProcessGroupKwargs(timeout=timedelta(seconds=77)),
        ]
    )
    rank = accelerator.process_index
    out = {"rank": rank, "num_processes": accelerator.num_processes, "backend": dist.get_backend()}
    group = dist.distributed_c10d._get_default_group()
    try:
        out["timeout"] = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):  # private torch surface: None means "cannot observe"
        out["timeout"] = None

    # DDP handler, comm hook and no_sync.
    original = WithUnused()
    model = accelerator.prepare(original)
    out["is_ddp"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    out["find_unused_parameters"] = getattr(model, "find_unused_parameters", None)
    x = torch.full((2, 4), float(rank + 1))  # different data per rank: different local gradients
    with accelerator.no_sync(model):
        model(x).sum().backward()
    out["hook_calls_after_no_sync"] = hook_state["calls"]
    out["no_sync_grads"] = accelerator.gather(_grads(model).unsqueeze(0))
    model.zero_grad()
    model(x).sum().backward()
    out["hook_calls_after_sync"] = hook_state["calls"]
    out["sync_grads"] = accelerator.gather(_grads(model).unsqueeze(0))
    out["unused_grad"] = original.unused.weight.grad

    # get_state_dict / unwrap_model through DDP.
    out["unwrapped_is_original"] = accelerator.unwrap_model(model) is original
    out["state_dict_keys"] = sorted(accelerator.get_state_dict(model))
    out["state_dict"] = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}

    # save_model: each rank names its own folder, so a write by any rank but the main one shows.
    target = os.path.join(root, f"model_rank{rank}")
    accelerator.save_model(model, target, max_shard_size="32B")
    out["wrote_files"] = sorted(os.listdir(target)) if os.path.isdir(target) else []
    main_dir = os.path.join(root, "model_rank0")
    with open(os.path.join(main_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    from safetensors.torch import load_file

    reloaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        reloaded.update(load_file(os.path.join(main_dir, shard)))
    out["index_weight_map"] = index["weight_map"]
    out["reloaded"] = reloaded

    # Collectives.
    t = torch.tensor([float(rank + 1)])
    out["reduce_sum"] = accelerator.reduce(t, "sum")
    out["reduce_mean"] = accelerator.reduce(t, "mean")
    out["padded"] = accelerator.pad_across_processes(torch.arange(rank + 1) + 10, pad_index=-1)
    out["gathered"] = accelerator.gather(torch.tensor([rank, rank * 10]))

    # Decorators.
    out["on_main"] = accelerator.on_main_process(lambda: f"main ran on {rank}")()
    out["on_process_1"] = accelerator.on_process(lambda: f"1 ran on {rank}", process_index=1)()

    @accelerator.on_process(process_index=1)
    def decorated():
        return f"decorated ran on {rank}"

    out["on_process_1_decorator"] = decorated()

    # main_process_first: the main process finishes its block before the others start theirs.
    flag = os.path.join(root, "written_by_main")
    with accelerator.main_process_first():
        out["flag_seen_on_entry"] = os.path.exists(flag)
        if accelerator.is_main_process:
            with open(flag, "w") as f:
                f.write("main")

    with accelerator.split_between_processes(list(range(5))) as share:
        out["share"] = share
    with accelerator.split_between_processes(list(range(5)), apply_padding=True) as share:
        out["padded_share"] = share

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        accelerator.print("hello from the facade")
    out["printed"] = buffer.getvalue()

    # free_memory forgets what prepare kept.
    out["prepared_models_before_free"] = len(accelerator._models)
    accelerator.free_memory()
    out["prepared_after_free"] = [
        len(accelerator._models), len(accelerator._optimizers), len(accelerator._schedulers), len(accelerator._dataloaders)
    ]
    accelerator.wait_for_everyone()
    return out


# -- data loader configurations, join_uneven_inputs and trackers on N ranks -----------------------


def _indices(n):
    return torch.utils.data.TensorDataset(torch.arange(n))


def _batches(accelerator, loader):
    """Per-rank batches (lists of indices) and, gathered across ranks, every index seen."""
    mine = [batch[0].tolist() for batch in loader]
    seen = []
    for per_rank in _gather_object(accelerator, mine):
        for batch in per_rank:
            seen.extend(batch)
    return mine, seen


def _gather_object(accelerator, obj):
    import torch.distributed as dist

    out = [None] * accelerator.num_processes
    dist.all_gather_object(out, obj)
    return out


def loaders_join_and_trackers(root):
    from notebook_accel import Accelerator
    from notebook_accel.utils import DataLoaderConfiguration

    out = {}
    accelerator = Accelerator(split_batches=True)
    out["rank"], world = accelerator.process_index, accelerator.num_processes
    loader = accelerator.prepare(torch.utils.data.DataLoader(_indices(16), batch_size=8))
    out["split"] = _batches(accelerator, loader)

    _reset_training_state()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = accelerator.prepare(torch.utils.data.DataLoader(_indices(16), batch_size=2))
    out["dispatch_type"] = type(loader).__name__
    out["dispatch"] = _batches(accelerator, loader)

    _reset_training_state()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    loader = accelerator.prepare(torch.utils.data.DataLoader(_indices(18), batch_size=4))
    out["uneven"] = _batches(accelerator, loader)

    _reset_training_state()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=True))
    loader = accelerator.prepare(torch.utils.data.DataLoader(_indices(18), batch_size=4))
    out["even"] = _batches(accelerator, loader)

    # join_uneven_inputs: rank 0 has more batches than the others; without Join the extra
    # backward's all-reduce would wait forever for the ranks that are done.
    _reset_training_state()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    data = make_data(n=4 * (2 * world + 1))  # 2 batches each, plus one more for rank 0
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
    steps = 0
    with accelerator.join_uneven_inputs([model]):
        for x, y in loader:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            steps += 1
    out["join_steps"] = steps
    out["join_params"] = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    out["even_batches_after_join"] = accelerator.even_batches

    # Trackers: every rank calls them; only the main process writes.
    _reset_training_state()
    accelerator = Accelerator(log_with="jsonl", project_dir=root)
    accelerator.init_trackers("run", config={"lr": 0.05, "world": world})
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1), "rank": accelerator.process_index}, step=step)
    out["trackers"] = [t.name for t in accelerator.trackers]
    accelerator.end_training()
    return out
