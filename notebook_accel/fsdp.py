"""FSDP2 through Accelerator.prepare: torch's `fully_shard` on the submodules an auto-wrap policy
picks, then on the root; optimizers re-pointed at the sharded (DTensor) parameters; no_sync,
gradient clipping and the full state dict for sharded models.

The plugin (what the user sets) is `utils/fsdp_plugin.py`; Accelerator calls the functions here.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import platform
import re
import weakref

import torch

from .utils.dataclasses import DistributedType
from .utils.env_flags import parse_flag_from_env
from .utils.fsdp_plugin import FullyShardedDataParallelPlugin


def resolve_plugin(plugin):
    """The plugin passed, or one built from FSDP_* when ACCELERATE_USE_FSDP is true, or None;
    checked against this machine before any state exists."""
    if plugin is None:
        if not parse_flag_from_env("ACCELERATE_USE_FSDP"):
            return None
        plugin = FullyShardedDataParallelPlugin()
    if not isinstance(plugin, FullyShardedDataParallelPlugin):
        raise TypeError(
            f"fsdp_plugin must be a FullyShardedDataParallelPlugin, got {type(plugin).__name__}: {plugin!r}."
        )
    if plugin.cpu_offload and not _has_accelerator():
        raise ValueError(
            "FullyShardedDataParallelPlugin(cpu_offload=True) offloads sharded parameters from an accelerator "
            "to host memory, and this machine has no accelerator (torch's CPUOffloadPolicy cannot run on CPU "
            "only). Set cpu_offload=False (or FSDP_OFFLOAD_PARAMS=false): on CPU the parameters are in host "
            "memory already."
        )
    return plugin


def setup(plugin, state) -> None:
    """Record the plugin on the AcceleratorState (mixed precision mapped to its policy)."""
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    if state.num_processes > 1:
        state.distributed_type = DistributedType.FSDP
    elif state.is_main_process:
        print("FSDP on one process shards nothing: the model trains unsharded (launch 2+ processes to shard).")


def sharding(state) -> bool:
    """Whether models of this run are sharded: an FSDP plugin and more than one process."""
    return getattr(state, "fsdp_plugin", None) is not None and state.num_processes > 1


def _has_accelerator() -> bool:
    probe = getattr(torch, "accelerator", None)
    return bool(probe is not None and probe.is_available())


def is_fsdp_model(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())


# -- checking a model before anything runs ---------------------------------------------------------
def check_model(model: torch.nn.Module, plugin) -> list:
    """The submodules that get their own fully_shard (children before parents); raises for models FSDP
    cannot take: dispatched along a device map, carrying offload hooks, already in DDP."""
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        raise ValueError(
            f"FSDP was asked to shard a model already wrapped in {type(model).__name__}; pass the plain module "
            "(model.module) to accelerator.prepare, which shards it instead of replicating it."
        )
    if getattr(model, "hf_device_map", None):
        raise ValueError(
            "FSDP cannot shard a model dispatched with a device map (hf_device_map is set: "
            f"{_short(model.hf_device_map)}); load it without device_map and let FSDP shard it across processes."
        )
    hooked = [name or "<root>" for name, m in model.named_modules() if hasattr(m, "_hf_hook")]
    if hooked:
        raise ValueError(
            f"FSDP cannot shard a model with big_modeling offload / dispatch hooks (on {', '.join(hooked[:5])}); "
            "remove them (notebook_accel.hooks.remove_hook_from_module(model, recurse=True)) or load the model "
            "without cpu_offload / disk_offload / dispatch_model."
        )
    if plugin.cpu_ram_efficient_loading and _world_size() == 1 and meta_parameters(model):
        raise ValueError(
            "cpu_ram_efficient_loading=True and this one process's model has parameters on the meta device "
            f"({', '.join(meta_parameters(model)[:3])}); on one process it is rank 0: build the real model."
        )
    ignored = ignored_parameters(model, plugin)
    wrapped = [m for m in _wrap_candidates(model, plugin) if not _all_ignored(m, ignored)]
    if plugin.activation_checkpointing and not wrapped:
        raise ValueError(
            "activation_checkpointing=True checkpoints the submodules the auto_wrap_policy selects, and "
            f"auto_wrap_policy={_policy_name(plugin)!r} selects none in {type(model).__name__}; use "
            "transformer_based_wrap (with transformer_cls_names_to_wrap) or size_based_wrap."
        )
    return wrapped


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _policy_name(plugin) -> str:
    policy = plugin.auto_wrap_policy
    return policy if isinstance(policy, str) else getattr(policy, "__name__", repr(policy))


def _wrap_candidates(model, plugin) -> list:
    policy = plugin.auto_wrap_policy
    if policy == "no_wrap":
        return []
    if policy == "transformer_based_wrap":
        return _by_class(model, plugin)
    if policy == "size_based_wrap":
        return _by_size(model, plugin.min_num_params)
    return _by_callable(model, policy)


def _post_order(model) -> list:
    """Submodules, children before parents, the root excluded."""
    out = []

    def visit(module):
        for child in module.children():
            visit(child)
            out.append(child)

    visit(model)
    return list(dict.fromkeys(out))  # a module reachable twice is sharded once


def _by_class(model, plugin) -> list:
    names = plugin.transformer_cls_names_to_wrap or list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(
            "auto_wrap_policy='transformer_based_wrap' needs transformer_cls_names_to_wrap (the layer class names, "
            f"e.g. {_class_names(model)[:3]}), and {type(model).__name__} has no _no_split_modules to default to."
        )
    present = set(_class_names(model))
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(
            f"transformer_cls_names_to_wrap names {missing}, which {type(model).__name__} does not contain; "
            f"its module classes are: {', '.join(_class_names(model))}."
        )
    return [m for m in _post_order(model) if type(m).__name__ in names]


def _class_names(model) -> list:
    return list(dict.fromkeys(type(m).__name__ for m in model.modules()))


def _by_size(model, min_num_params: int) -> list:
    """torch's size rule: a module is wrapped when the parameters not yet wrapped below it reach the minimum."""
    if min_num_params <= 0:
        return []
    wrapped = []

    def remaining(module) -> int:
        count = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            count += remaining(child)
        if module is not model and count >= min_num_params:
            wrapped.append(module)
            return 0
        return count

    remaining(model)
    return wrapped


def _by_callable(model, policy) -> list:
    try:
        torch_style = "recurse" in inspect.signature(policy).parameters
    except (TypeError, ValueError):
        torch_style = False
    chosen = []
    for module in _post_order(model):
        if torch_style:
            numel = sum(p.numel() for p in module.parameters())
            take = policy(module=module, recurse=False, nonwrapped_numel=numel)
        else:
            take = policy(module)
        if take:
            chosen.append(module)
    return chosen


def ignored_parameters(model, plugin) -> set:
    spec = plugin.ignored_modules
    if spec is None:
        return set()
    if isinstance(spec, str):
        pattern = re.compile(spec)
        modules = [m for name, m in model.named_modules() if pattern.fullmatch(name)]
        if not modules:
            raise ValueError(
                f"ignored_modules={spec!r} matches no module name of {type(model).__name__}; names look like "
                f"{[n for n, _ in model.named_modules() if n][:5]}."
            )
    else:
        modules = list(spec)
        own = {id(m) for m in model.modules()}
        strangers = [type(m).__name__ for m in modules if id(m) not in own]
        if strangers:
            raise ValueError(f"ignored_modules has modules that are not part of the model: {strangers}.")
    return {p for m in modules for p in m.parameters()}


def _all_ignored(module, ignored: set) -> bool:
    params = list(module.parameters())
    return bool(params) and all(p in ignored for p in params)


# -- sharding -----------------------------------------------------------------------------------------
def shard_model(model, plugin, wrapped: list, param_map: dict, optimizers=(), device=None) -> torch.nn.Module:
    """fully_shard each of `wrapped`, then the root. `param_map` records each replaced parameter
    (id -> (weak reference, sharded parameter)); `optimizers` (prepared, or in the same prepare call)
    are re-pointed after each fully_shard, so each unsharded parameter is freed as its module is sharded
    rather than the whole model staying beside its shards until the end. With cpu_ram_efficient_loading
    the shards are built empty on `device` and filled from rank 0 (optimizers re-pointed after that)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if plugin.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for module in wrapped:
            checkpoint(module)
    slots = [(m, name, p) for m in model.modules() for name, p in m._parameters.items() if p is not None]
    inner = [getattr(optimizer, "optimizer", optimizer) for optimizer in optimizers]
    own = {id(p) for _, _, p in slots}
    for optimizer in inner:  # refused before anything is sharded
        if any(id(p) in own and optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(_stepped(optimizer))
    offload = plugin.cpu_offload
    kwargs = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "offload_policy": offload
        if isinstance(offload, OffloadPolicy)
        else (CPUOffloadPolicy() if offload else OffloadPolicy()),
    }
    ignored = ignored_parameters(model, plugin)
    if ignored:
        kwargs["ignored_params"] = ignored
    if plugin.cpu_ram_efficient_loading:
        on_cpu = torch.device(device or "cpu").type == "cpu"
    else:
        on_cpu = all(p.device.type == "cpu" for _, _, p in slots)
    if on_cpu:  # before sharding too: freeing the unsharded parameters would raise the threshold at once
        return_freed_host_memory()
    from_rank0 = _take_rank0_weights(model) if plugin.cpu_ram_efficient_loading else None
    slots = [(m, name, weakref.ref(p)) for m, name, p in slots]  # no strong reference past its sharding
    for target in [*wrapped, model]:
        fully_shard(target, **kwargs)
        if from_rank0 is None:  # with rank-0 loading the parameters are replaced once more, below
            slots = _record_replaced(slots, param_map)
            for optimizer in inner:
                repoint_optimizer(optimizer, param_map)
    if from_rank0 is not None:
        _load_rank0_weights(model, device, *from_rank0)
        _record_replaced(slots, param_map)
        for optimizer in inner:
            repoint_optimizer(optimizer, param_map)
    if on_cpu:
        return_freed_host_memory()
    return model


def _record_replaced(slots: list, param_map: dict) -> list:
    """Record in `param_map` the slots whose parameter fully_shard replaced; return the others."""
    left = []
    for module, name, ref in slots:
        old, new = ref(), module._parameters.get(name)
        if old is None:
            continue
        if new is not None and new is not old:
            param_map[id(old)] = (ref, new)
        else:
            left.append((module, name, ref))
    return left


def _stepped(optimizer) -> str:
    return (
        f"{type(optimizer).__name__} has already stepped on the unsharded parameters, so its state "
        "cannot follow them into shards; prepare the model and the optimizer before the first step."
    )


# -- cpu_ram_efficient_loading: only rank 0 holds the real weights -----------------------------------
def meta_parameters(model) -> list:
    return [name for name, p in model.named_parameters() if p.is_meta]


def check_rank0_weights(model) -> None:
    """Raise on every rank (before any collective that would hang) when rank 0's model is on meta."""
    import torch.distributed as dist

    found = [meta_parameters(model)[:3] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)  # a few names, so every rank raises the same error
    if found[0]:
        shown = ", ".join(found[0])
        raise ValueError(
            "cpu_ram_efficient_loading=True fills every rank's shards from rank 0's weights, but rank 0's model "
            f"has parameters on the meta device ({shown}); build the real model on rank 0 (the main process) "
            "and use init_empty_weights() only on the other ranks."
        )


def _take_rank0_weights(model) -> tuple:
    """Rank 0's full state dict (empty elsewhere) and every rank's buffers, then the model moved to
    meta so that fully_shard builds empty shards."""
    import torch.distributed as dist

    check_rank0_weights(model)
    full = dict(model.state_dict()) if dist.get_rank() == 0 else {}
    buffers = dict(model.named_buffers())
    model.to("meta")
    return full, buffers


def _load_rank0_weights(model, device, full: dict, buffers: dict) -> None:
    """Materialise the empty shards on `device`, scatter rank 0's tensors into them, then give every
    rank rank 0's buffers (non-persistent ones are in no state dict; other ranks may hold them on meta)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device or torch.device("cpu"))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    full.clear()
    owners = {name: module for name, module in model.named_modules()}
    for name, buffer in model.named_buffers():
        module_name, _, leaf = name.rpartition(".")
        kept = buffers.get(name)
        if kept is not None and not kept.is_meta:
            buffer = kept.to(buffer.device)
            owners[module_name]._buffers[leaf] = buffer
        dist.broadcast(buffer, src=0)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def repoint_optimizer(optimizer, param_map: dict) -> None:
    """Replace, in the optimizer's groups, parameters that fully_shard replaced by their sharded ones."""
    if not param_map:
        return
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            entry = param_map.get(id(p))
            if entry is None or entry[0]() is not p:
                continue
            if optimizer.state.get(p):
                raise ValueError(_stepped(optimizer))
            params[i] = entry[1]


# -- host memory ------------------------------------------------------------------------------------------
# glibc malloc serves a request at or above M_MMAP_THRESHOLD with its own mmap, unmapped on free; smaller ones come
# from heaps that keep freed memory. The threshold starts at 128 KiB but rises to the size of every mmapped chunk
# freed (up to 32 MiB), so after the first step FSDP's per-step buffers (a block's unsharded parameters and
# gradients, MiBs each) come from the heaps, which fragment and keep them: on CPU a sharded rank then held more
# than a DDP rank. A fixed threshold (which also stops the rise) hands them back at each free; it costs a page
# fault per page touched in those buffers every step (BENCHMARKS.md, FSDP).
MMAP_THRESHOLD_ENV = "NOTEBOOK_ACCEL_MMAP_THRESHOLD"
MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3


def return_freed_host_memory(threshold=None) -> bool:
    """Fix glibc's mmap threshold for this process (bytes: `threshold`, else NOTEBOOK_ACCEL_MMAP_THRESHOLD, else
    MMAP_THRESHOLD; 0 leaves malloc alone) and trim what its heaps hold free now. Whether it was applied."""
    if threshold is None:
        threshold = int(os.environ.get(MMAP_THRESHOLD_ENV, MMAP_THRESHOLD))
    if threshold <= 0 or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        applied = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)) == 1
        libc.malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        return False
    return applied


# -- the training step ----------------------------------------------------------------------------------
@contextlib.contextmanager
def no_sync(model, sync: bool = False):
    """Inside, FSDP's reduce-scatter of gradients is off (sync=True: on); the setting outside it
    (trigger_sync_in_backward nests in no_sync) is restored on exit."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    outside = getattr(model, _SYNC_FLAG, True)
    _set_sync(model, sync)
    try:
        yield
    finally:
        _set_sync(model, outside)


_SYNC_FLAG = "_notebook_accel_gradient_sync"  # torch's FSDPModule has a setter for it, no getter


def _set_sync(model, sync: bool) -> None:
    model.set_requires_gradient_sync(sync)
    object.__setattr__(model, _SYNC_FLAG, sync)


def clip_grad_norm_(parameters, max_norm, norm_type=2):
    """torch's clip_grad_norm_; with DTensor gradients the norm (a replicated DTensor) comes back as a tensor."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm


def full_state_dict(model) -> dict:
    """The full (unsharded) state dict on CPU on rank 0, {} elsewhere; every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

