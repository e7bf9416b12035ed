"""Functions run on real gloo ranks by tests/test_fsdp.py (through notebook_launcher): the same small
MLP trained with FSDP2 and with DDP, and the inputs FSDP refuses."""

import torch
from accel_targets import make_data


class Block(torch.nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        x = self.inp(x)
        if hasattr(self, "scale"):  # a non-persistent buffer (rank-0 loading must bring it)
            x = x * self.scale
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def make_mlp(seed=3):
    torch.manual_seed(seed)
    return MLP()


def _plugin(**overrides):
    from notebook_accel.utils import FullyShardedDataParallelPlugin

    settings = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Block"]}
    settings.update(overrides)
    return FullyShardedDataParallelPlugin(**settings)


def is_block(module):
    """A wrap policy as a plain callable: a module -> whether it gets its own fully_shard."""
    return isinstance(module, Block)


def _reduces_gradients(model) -> bool:
    """Whether this backward reduced gradients across ranks: FSDP's or DDP's own flag (torch internals)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.require_backward_grad_sync
    return all(m._get_fsdp_state()._fsdp_param_group.reduce_grads for m in model.modules() if hasattr(m, "_get_fsdp_state"))


def _get_registry(module):
    from torch.distributed._composable.contract import _get_registry

    return _get_registry(module) or {}


def _rank0_model(seed, scale):
    """The MLP as cpu_ram_efficient_loading expects it: real on rank 0, on meta (buffers too) elsewhere."""
    from notebook_accel import PartialState, init_empty_weights

    if PartialState().is_main_process:
        model = make_mlp(seed)
    else:
        with init_empty_weights(include_buffers=True):
            model = make_mlp(seed + 1)  # other values: only rank 0's may reach the shards
    model.register_buffer("scale", torch.tensor(scale), persistent=False)
    return model


def train(use_fsdp=True, optimizer="before", accumulation=1, clip=None, epochs=2, overrides=None, scale=None):
    """Train the MLP (AdamW, batch 4 per rank) and report what the tests compare across runs.

    optimizer: "before" (built on the unsharded model, prepared with it), "separately" (prepared
    in an earlier prepare call than the model) or "after" (built on the prepared model).
    scale: a non-persistent buffer multiplying the input layer's output; with cpu_ram_efficient_loading
    the model is real only on rank 0."""
    from notebook_accel import Accelerator
    from notebook_accel.utils import model_has_dtensor

    fsdp_plugin = _plugin(**(overrides or {})) if use_fsdp else None
    accelerator = Accelerator(gradient_accumulation_steps=accumulation, fsdp_plugin=fsdp_plugin)
    if fsdp_plugin is not None and fsdp_plugin.cpu_ram_efficient_loading:
        model = _rank0_model(3, scale)
    else:
        model = make_mlp()
        if scale is not None:
            model.register_buffer("scale", torch.tensor(scale), persistent=False)
    on_meta = sum(p.numel() for p in model.parameters() if p.is_meta)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=4)
    if optimizer == "before":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model, opt, loader = accelerator.prepare(model, opt, loader)
    elif optimizer == "separately":
        opt = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=0.01))
        model, loader = accelerator.prepare(model, loader)
    else:
        model = accelerator.prepare(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        opt, loader = accelerator.prepare(opt, loader)
    in_optimizer = {id(p) for group in opt.param_groups for p in group["params"]}
    norms, losses, syncs, reduces = [], [], [], []
    for _ in range(epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                syncs.append(accelerator.sync_gradients)
                reduces.append(_reduces_gradients(model))
                if clip is not None and accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
                opt.step()
                opt.zero_grad()
                losses.append(float(accelerator.gather_for_metrics(loss.detach()).mean()))
    state = accelerator.get_state_dict(model)
    return {
        "state": {k: v.detach().clone() for k, v in state.items()},
        "norms": norms,
        "losses": losses,
        "syncs": syncs,
        "reduces": reduces,
        "distributed_type": str(accelerator.distributed_type),
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
        "optimizer_has_model_params": all(id(p) in in_optimizer for p in model.parameters()),
        "local_numel": sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters()),
        "unwrapped_is_model": accelerator.unwrap_model(model) is model,
        "is_fsdp2": accelerator.is_fsdp2,
        "sharded": sorted(name for name, m in model.named_modules() if type(m).__name__.startswith("FSDP")),
        "checkpointed": sorted(name for name, m in model.named_modules() if "checkpoint" in _get_registry(m)),
        "on_meta_before": on_meta,
        "has_dtensor": model_has_dtensor(accelerator.unwrap_model(model)),
        "buffers": {name: b.tolist() for name, b in model.named_buffers()},
    }


def rank0_on_meta():
    """cpu_ram_efficient_loading with rank 0's model built on meta: the error each rank raises."""
    from notebook_accel import Accelerator, init_empty_weights

    accelerator = Accelerator(fsdp_plugin=_plugin(cpu_ram_efficient_loading=True))
    with init_empty_weights():
        model = make_mlp()
    try:
        accelerator.prepare(model)
    except ValueError as exc:
        return str(exc)
    return None


def bad_inputs():
    """Each model FSDP refuses, prepared on a real 2-rank run: the error messages, by case."""
    from notebook_accel import Accelerator

    accelerator = Accelerator(fsdp_plugin=_plugin())
    messages = {}

    def attempt(name, model, accel=accelerator):
        try:
            accel.prepare(model)
        except (ValueError, TypeError) as exc:
            messages[name] = str(exc)
        else:
            messages[name] = None

    mapped = make_mlp()
    mapped.hf_device_map = {"inp": "cpu", "blocks": "cpu", "out": "disk"}
    attempt("device_map", mapped)

    from notebook_accel.big_modeling import cpu_offload

    attempt("offload_hooks", cpu_offload(make_mlp(), execution_device=torch.device("cpu")))

    from notebook_accel import AcceleratorState

    no_blocks = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    attempt("missing_class", no_blocks)

    attempt("ddp", torch.nn.parallel.DistributedDataParallel(make_mlp()))
    messages["distributed_type"] = str(AcceleratorState().distributed_type)
    return messages


def mixed_precision_step():
    """One bf16 step with FSDP: the policy mapped from mixed_precision and the output dtype."""
    from notebook_accel import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=_plugin())
    model = accelerator.prepare(make_mlp())
    policy = accelerator.state.fsdp_plugin.mixed_precision_policy
    with accelerator.autocast():
        out = model(torch.randn(3, 4))
    out.float().sum().backward()
    grads = sorted({str(p.grad.dtype) for p in model.parameters()})
    return {"param_dtype": str(policy.param_dtype), "out_dtype": str(out.dtype), "grad_dtypes": grads}


def from_launch_config():
    """Accelerator() with no plugin, in ranks launched from a config file that says distributed_type: FSDP."""
    import os

    from notebook_accel import Accelerator

    accelerator = Accelerator()
    plugin = accelerator.state.fsdp_plugin
    model = accelerator.prepare(make_mlp())
    return {
        "use_fsdp": os.environ.get("ACCELERATE_USE_FSDP"),
        "distributed_type": str(accelerator.distributed_type),
        "policy": plugin.auto_wrap_policy,
        "classes": plugin.transformer_cls_names_to_wrap,
        "reshard_after_forward": plugin.reshard_after_forward,
        "state_dict_type": plugin.state_dict_type.name,
        "sharded": sorted(name for name, m in model.named_modules() if type(m).__name__.startswith("FSDP")),
    }


def fp16_overflow_on_one_rank():
    """fp16 with FSDP: an inf in rank 1's gradient shard only; every rank must skip that step."""
    import torch.distributed as dist

    from notebook_accel import Accelerator

    accelerator = Accelerator(mixed_precision="fp16", fsdp_plugin=_plugin())
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    skipped, changed = [], []
    for step in range(3):
        before = [p.detach().to_local().clone() for p in model.parameters()]
        loss = model(torch.full((4, 4), 0.01)).float().mean() * 1e-3  # small: scaled gradients fit fp16
        accelerator.backward(loss)
        if step == 0 and dist.get_rank() == 1:
            model.inp.weight.grad.to_local().fill_(float("inf"))
        opt.step()
        opt.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
        changed.append(any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters())))
    return {"skipped": skipped, "changed": changed, "scale": accelerator.scaler.get_scale()}


def sync_nesting():
    """FSDP's reduce flag inside no_sync, inside trigger_sync_in_backward nested in it, and after."""
    from notebook_accel import Accelerator

    accelerator = Accelerator(fsdp_plugin=_plugin())
    model = accelerator.prepare(make_mlp())
    seen = []
    with accelerator.no_sync(model):
        seen.append(_reduces_gradients(model))
        loss = model(torch.ones(2, 4)).sum()
        with accelerator.trigger_sync_in_backward(model):
            seen.append(_reduces_gradients(model))
            accelerator.backward(loss)
        seen.append(_reduces_gradients(model))
    seen.append(_reduces_gradients(model))
    return seen


def save_full_model(folder):
    """save_model of a sharded model (full weights, written by rank 0), then save_state (sharded)."""
    from notebook_accel import Accelerator

    accelerator = Accelerator(fsdp_plugin=_plugin())
    model = accelerator.prepare(make_mlp())
    accelerator.save_model(model, folder)
    return accelerator.save_state(folder + "/state")


class WideBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(1024, 2048)
        self.down = torch.nn.Linear(2048, 1024)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def host_memory_per_step(blocks=6, steps=6):
    """FSDP (each WideBlock, then the root) with AdamW built before prepare: this rank's RssAnon above
    a baseline taken before the model exists, at its peak during prepare (sampled every 1 ms) and
    after each step, and the full model's size in bytes."""
    import threading

    from torch.distributed.fsdp import fully_shard

    from notebook_accel import Accelerator

    accelerator = Accelerator(fsdp_plugin=_plugin(transformer_cls_names_to_wrap=["WideBlock"]))
    fully_shard(torch.nn.Linear(2, 2))  # torch's imports and device mesh: not counted
    base = _rss_anon()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[WideBlock() for _ in range(blocks)])
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peak, done = [_rss_anon()], threading.Event()

    def sample():
        while not done.wait(0.001):
            peak[0] = max(peak[0], _rss_anon())

    sampler = threading.Thread(target=sample)
    sampler.start()
    model, opt = accelerator.prepare(model, opt)
    done.set()
    sampler.join()
    prepare_peak = max(peak[0], _rss_anon()) - base
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(accelerator.process_index))
    after = []
    for _ in range(steps):
        accelerator.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        after.append(_rss_anon() - base)
    return {"after": after, "model_bytes": size, "prepare_peak": prepare_peak}
