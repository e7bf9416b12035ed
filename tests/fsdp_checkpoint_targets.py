"""Functions run on real gloo ranks by tests/test_fsdp_checkpoint.py: train the FSDP MLP, save_state,
keep training; a fresh run that loads the checkpoint and trains the same steps; failing saves."""

import torch
from fsdp_targets import _plugin, make_mlp


class Counter:
    """A registered object: checkpointed with everything else; `fail` makes its state_dict raise."""

    def __init__(self):
        self.steps = 0
        self.fail = False

    def state_dict(self):
        if self.fail:
            raise RuntimeError("injected failure while writing the checkpoint")
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _setup(state_dict_type, seed):
    from notebook_accel import Accelerator

    accelerator = Accelerator(fsdp_plugin=_plugin(state_dict_type=state_dict_type))
    model = make_mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, opt, sched, counter


def _steps(accelerator, model, opt, sched, counter, first, count):
    for step in range(first, first + count):
        x, y = batch(step, accelerator.process_index)
        loss = torch.nn.functional.mse_loss(model(x), y) + 1e-3 * torch.rand(())  # the RNG state matters too
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.steps += 1


def _local(value):
    value = value.detach()
    return (value.to_local() if hasattr(value, "to_local") else value).clone()


def _snapshot(accelerator, model, opt, sched, counter):
    """This rank's shards of the parameters and of the optimizer state, exactly."""
    inner = opt.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {
        names[id(p)]: {k: _local(v) for k, v in inner.state[p].items()}
        for group in inner.param_groups
        for p in group["params"]
        if p in inner.state
    }
    return {
        "params": {n: _local(p) for n, p in model.named_parameters()},
        "optim": optim,
        "lr": sched.get_last_lr(),
        "counter": counter.steps,
        "rng": torch.rand(3),
    }


def train_save_continue(folder, state_dict_type, first=3, then=3):
    """Train `first` steps, save, train `then` more: the snapshot after, and the full weights saved."""
    run = _setup(state_dict_type, seed=3)
    accelerator = run[0]
    _steps(*run, 0, first)
    saved = accelerator.get_state_dict(run[1])
    accelerator.save_state(folder)
    listing = sorted(_listing(folder))
    _steps(*run, first, then)
    return {"after": _snapshot(*run), "saved": saved, "listing": listing}


def load_continue(folder, state_dict_type, first=3, then=3):
    """A fresh run (another seed) that loads the checkpoint and trains the same `then` steps."""
    run = _setup(state_dict_type, seed=11)
    accelerator = run[0]
    accelerator.load_state(folder)
    loaded = accelerator.get_state_dict(run[1])
    _steps(*run, first, then)
    return {"after": _snapshot(*run), "loaded": loaded}


def _listing(folder):
    import os

    return [
        os.path.relpath(os.path.join(root, name), folder)
        for root, _, files in os.walk(folder)
        for name in files
    ]


def failing_saves(folder, state_dict_type):
    """A good save, then saves that fail (a pre-hook on rank 1 only; the writer's registered object):
    each raises on every rank, and the good checkpoint is still there and loads."""
    import torch.distributed as dist

    run = _setup(state_dict_type, seed=3)
    accelerator, model = run[0], run[1]
    _steps(*run, 0, 2)
    good = accelerator.get_state_dict(model)
    accelerator.save_state(folder)
    _steps(*run, 2, 2)
    errors = []

    def hook(models, weights, output_dir):
        if dist.get_rank() == 1:
            raise OSError("injected: rank 1 cannot write")

    handle = accelerator.register_save_state_pre_hook(hook)
    try:
        accelerator.save_state(folder)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    handle.remove()
    run[4].fail = dist.get_rank() == 0
    try:
        accelerator.save_state(folder)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    run[4].fail = False

    def load_hook(models, input_dir):
        if dist.get_rank() == 1:
            raise OSError("injected: rank 1 cannot read")

    handle = accelerator.register_load_state_pre_hook(load_hook)
    try:
        accelerator.load_state(folder)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    handle.remove()
    accelerator.load_state(folder)
    return {
        "errors": errors,
        "good": good,
        "loaded": accelerator.get_state_dict(model),
        "listing": sorted(_listing(folder)),
    }


def unshared_folders(folder):
    """save_state where ranks name different folders, then where rank 1 cannot see what rank 0 writes:
    the same error on every rank, and nothing written."""
    import os

    import torch.distributed as dist

    from notebook_accel import fsdp_checkpoint

    accelerator, model = _setup("SHARDED_STATE_DICT", seed=3)[:2]
    rank = dist.get_rank()
    errors = []
    try:
        accelerator.save_state(os.path.join(folder, f"rank{rank}"))
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    if rank == 1:  # rank 1 stands on another machine: rank 0's files are not there
        real = os.path.isfile
        fsdp_checkpoint.os.path.isfile = lambda path: False if ".probe-" in path else real(path)
    try:
        accelerator.save_state(os.path.join(folder, "shared"))
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def load_only(folder, state_dict_type="SHARDED_STATE_DICT"):
    """A fresh run loads the checkpoint: the full weights and AdamW state (gathered on rank 0), and
    how much of inp.weight this rank holds."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    accelerator, model, opt, sched, counter = _setup(state_dict_type, seed=11)
    accelerator.load_state(folder)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "loaded": accelerator.get_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt.optimizer, options=full).get("state", {}),
        "inp_rows": _local(model.inp.weight).shape[0],
        "counter": counter.steps,
    }


def save_only(folder, state_dict_type="SHARDED_STATE_DICT", steps=3):
    """Train, save; the full weights and AdamW state at the save (gathered on rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    run = _setup(state_dict_type, seed=3)
    _steps(*run, 0, steps)
    run[0].save_state(folder)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "saved": run[0].get_state_dict(run[1]),
        "optim": get_optimizer_state_dict(run[1], run[2].optimizer, options=full).get("state", {}),
    }


def automatic_naming(project_dir):
    """ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2) in an FSDP run: three
    saves keep the last two; load_state() with no folder loads the latest."""
    import os

    from notebook_accel import Accelerator
    from notebook_accel.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(fsdp_plugin=_plugin(), project_config=config)
    model = make_mlp(3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    saved = []
    for step in range(3):
        x, y = batch(step, accelerator.process_index)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        accelerator.save_state()
        saved.append(_local(model.inp.weight))
    with torch.no_grad():
        model.inp.weight.zero_()
    accelerator.load_state()
    root = os.path.join(project_dir, "checkpoints")
    return {
        "folders": sorted(os.listdir(root)),
        "restored": torch.equal(_local(model.inp.weight), saved[-1]),
        "iteration": accelerator.project_configuration.iteration,
    }


def fsdp_helpers(folder, state_dict_type):
    """accelerate's save_fsdp_model / save_fsdp_optimizer, then load_fsdp_* into a fresh run: the
    shards of the parameters and of AdamW's state come back exactly."""
    from notebook_accel.utils import (
        load_fsdp_model,
        load_fsdp_optimizer,
        save_fsdp_model,
        save_fsdp_optimizer,
    )

    run = _setup(state_dict_type, seed=3)
    accelerator, model, opt = run[:3]
    _steps(*run, 0, 2)
    plugin = accelerator.state.fsdp_plugin
    save_fsdp_model(plugin, accelerator, model, folder)
    save_fsdp_optimizer(plugin, accelerator, opt, model, folder)
    before = _snapshot(*run)
    fresh = _setup(state_dict_type, seed=11)
    load_fsdp_model(plugin, fresh[0], fresh[1], folder)
    load_fsdp_optimizer(plugin, fresh[0], fresh[2], fresh[1], folder)
    after = _snapshot(*fresh)
    import os

    return {"before": before, "after": after, "files": sorted(os.listdir(folder))}


def ddp_train_save(folder, steps=3):
    """A DDP run (no plugin) trains and saves: what an FSDP run that loads its checkpoint must hold."""
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    model = make_mlp(3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    _steps(accelerator, model, opt, sched, counter, 0, steps)
    accelerator.save_state(folder)
    plain = accelerator.unwrap_model(model)
    names = {id(p): n for n, p in plain.named_parameters()}
    inner = opt.optimizer
    optim = {names[id(p)]: {k: v.clone() for k, v in inner.state[p].items()} for g in inner.param_groups for p in g["params"]}
    return {"saved": {k: v.clone() for k, v in plain.state_dict().items()}, "optim": optim}


def load_with_one_rank_file_corrupt(folder, state_dict_type):
    """Save, damage rank 1's own RNG file, load: what each rank's load_state raised (or "loaded"),
    then a collective every rank must reach (none may be left waiting in the load's collectives)."""
    import os

    import torch
    import torch.distributed as dist

    run = _setup(state_dict_type, seed=3)
    accelerator = run[0]
    _steps(*run, 0, 1)
    accelerator.save_state(folder)
    if accelerator.process_index == 1:
        with open(os.path.join(folder, "random_states_1.pkl"), "wb") as f:
            f.write(b"not a pickle")
    dist.barrier()
    try:
        accelerator.load_state(folder)
        outcome = "loaded"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"outcome": outcome, "after": total.item()}
