"""Run models larger than the memory you give them (accelerate's `big_modeling` API).

Build on the meta device (`init_empty_weights`), plan where each block lives (a device map), load
the checkpoint block by block, and let hooks stream offloaded weights (CPU RAM or a disk folder) to
the execution device at forward time.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from contextlib import ExitStack, contextmanager
from typing import Optional, Union

import torch
import torch.nn as nn

from ..utils.environment import parse_bool
from .device_map import DevicePlan, plan_device_map
from .hooks import (
    AlignDevicesHook,
    CpuOffload,
    UserCpuOffloadHook,
    _record_added_attribute,
    add_hook_to_module,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
)
from .layerwise_casting import attach_layerwise_casting_hooks  # noqa: F401  (accelerate's name here)
from .loading import load_checkpoint_in_model
from .planner import get_balanced_memory, infer_auto_device_map
from .store import OffloadedWeightsLoader, extract_submodules_state_dict, lookup, offload_state_dict
from .tensors import find_tied_parameters, retie_parameters

logger = logging.getLogger(__name__)

__all__ = [
    "init_empty_weights",
    "init_on_device",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "load_checkpoint_and_dispatch",
    "attach_layerwise_casting_hooks",
]

_AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


# -- building without memory -------------------------------------------------------------------


@contextmanager
def init_empty_weights(include_buffers: Optional[bool] = None):
    """Build a model with every parameter (and with `include_buffers`, every buffer) on the meta
    device: shapes and dtypes only, no memory, no initialisation cost. `include_buffers` defaults
    to env `ACCELERATE_INIT_INCLUDE_BUFFERS` (false)."""
    with init_on_device(torch.device("meta"), include_buffers=include_buffers) as f:
        yield f


@contextmanager
def init_on_device(device: Union[str, torch.device], include_buffers: Optional[bool] = None):
    """Create every parameter built inside the block directly on `device`.

    With `include_buffers` (default: env `ACCELERATE_INIT_INCLUDE_BUFFERS`) every tensor factory
    targets `device`. Without it only parameters move, because buffers such as position ids or
    rotary frequencies are computed at init and must keep their values.
    """
    if include_buffers is None:
        include_buffers = parse_bool(os.environ.get("ACCELERATE_INIT_INCLUDE_BUFFERS", "false"))
    device = torch.device(device)
    with ExitStack() as stack:
        if device.type == "meta":
            stack.enter_context(_skip_init_on_meta())
        stack.enter_context(device if include_buffers else _parameters_on(device))
        yield


@contextmanager
def _parameters_on(device: torch.device):
    original = nn.Module.register_parameter

    # A layer allocates its weight with torch.empty (untouched pages: no RSS, no time) and we move
    # it to `device` as it is registered, before reset_parameters runs.
    def register_parameter(module, name, param):
        original(module, name, param)
        if param is None:
            return
        current = module._parameters[name]
        if current.device == device:
            return  # already there (e.g. tying to another meta parameter): keep its identity
        moved = current.to(device)
        if type(current) is nn.Parameter:
            module._parameters[name] = nn.Parameter(moved, requires_grad=current.requires_grad)
        else:  # Parameter subclasses (quantised weights) carry their extra state in __dict__
            extra = dict(current.__dict__)
            extra["requires_grad"] = current.requires_grad
            module._parameters[name] = type(current)(moved, **extra)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@contextmanager
def _skip_init_on_meta():
    """Make torch.nn.init's initialisers return meta tensors untouched.

    Initialising a meta tensor does nothing, but the first meta `normal_` in a process imports
    torch._dynamo (about 2 s and 70 MB with torch 2.13), which is most of an empty 7B build.
    """
    originals = {
        name: fn
        for name, fn in vars(nn.init).items()
        if name.endswith("_") and not name.startswith("_") and callable(fn)
    }

    def skipping(fn):
        @functools.wraps(fn)
        def wrapper(tensor, *args, **kwargs):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
                return tensor
            return fn(tensor, *args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(nn.init, name, skipping(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)


# -- offloading a whole model ------------------------------------------------------------------


def _first_param_device(model: nn.Module) -> torch.device:
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def cpu_offload(
    model: nn.Module,
    execution_device: Optional[Union[int, str, torch.device]] = None,
    offload_buffers: bool = False,
    state_dict: Optional[dict] = None,
    preload_module_classes: Optional[list] = None,
) -> nn.Module:
    """Keep the weights in CPU RAM (`state_dict`, by default the model's own) and the modules on
    the meta device; each module's weights go to `execution_device` only for its forward."""
    if state_dict is None:
        state_dict = {name: tensor.to("cpu") for name, tensor in model.state_dict().items()}
    return _offload_modules(model, state_dict, execution_device, offload_buffers, preload_module_classes)


def _offload_modules(model, weights_map, execution_device, offload_buffers, preload_module_classes):
    """Hook every module of `model` to load its weights from `weights_map` only for its forward."""
    if execution_device is None:
        execution_device = _first_param_device(model)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device=execution_device,
        offload=True,
        offload_buffers=offload_buffers,
        weights_map=weights_map,
        preload_module_classes=preload_module_classes,
    )
    return model


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: Optional[Union[int, str, torch.device]] = None,
    prev_module_hook: Optional[UserCpuOffloadHook] = None,
):
    """Move the whole model to `execution_device` when called and leave it there; return
    `(model, hook)` where `hook.offload()` sends it back to the CPU.

    Chain models with `prev_module_hook`: calling model B first offloads model A, so a pipeline
    keeps one model at a time on the accelerator with one transfer per model per run.
    """
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def _has_offload_index(folder) -> bool:
    return folder is not None and os.path.isfile(os.path.join(folder, "index.json"))


def disk_offload(
    model: nn.Module,
    offload_dir: Union[str, os.PathLike],
    execution_device: Optional[Union[int, str, torch.device]] = None,
    offload_buffers: bool = False,
    preload_module_classes: Optional[list] = None,
) -> nn.Module:
    """Write the weights to `offload_dir` (unless it already holds an offload index) and stream
    each module's weights from there to `execution_device` for its forward."""
    offload_dir = os.fspath(offload_dir)
    if not _has_offload_index(offload_dir):
        offload_state_dict(offload_dir, model.state_dict())
    weights_map = OffloadedWeightsLoader(save_folder=offload_dir)
    needed = _persistent_names(model, "", include_buffers=offload_buffers)
    _require_weights(weights_map, needed, f"the offload folder {offload_dir!r}")
    return _offload_modules(model, weights_map, execution_device, offload_buffers, preload_module_classes)


# -- dispatching a device map ------------------------------------------------------------------


def _persistent_names(model: nn.Module, key: str, include_buffers: bool) -> list:
    """State-dict names under `key` that an offload hook will look up in its weights map."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    covered = [
        n for n in model.state_dict(keep_vars=True) if key == "" or n == key or n.startswith(key + ".")
    ]
    return [n for n in covered if include_buffers or n in params]


def _require_weights(weights_map: Mapping, names, where: str) -> None:
    missing = [name for name in names if name not in weights_map]
    if missing:
        raise ValueError(
            f"{len(missing)} offloaded tensor(s) are not in {where}: {', '.join(missing[:20])}"
            + (" ..." if len(missing) > 20 else "")
            + ". Is this offload folder from another model? Use an empty folder."
        )


class _TiedWeights(Mapping):
    """A weights map that answers a missing name with its tied partner's weights.

    Checkpoints store a tied weight once; the hook of the other module still looks it up by its
    own name."""

    def __init__(self, base: Mapping, aliases: dict):
        self.base = base
        self.aliases = aliases  # name -> another name in base, or a tensor

    def __getitem__(self, key):
        return self._get(key, lambda name: self.base[name])

    def mapped(self, key):  # the hooks' lookup: through the loader's kept maps (store.py)
        return self._get(key, lambda name: lookup(self.base, name))

    def _get(self, key, get):
        if key in self.base:
            return get(key)
        target = self.aliases[key]
        return target if isinstance(target, torch.Tensor) else get(target)

    def __contains__(self, key):
        return key in self.aliases or key in self.base

    def __iter__(self):
        yield from self.base
        yield from (k for k in self.aliases if k not in self.base)

    def __len__(self):
        return sum(1 for _ in self)


def _alias_tied(model: nn.Module, weights_map: Mapping, tied_groups, needed) -> Mapping:
    aliases = {}
    for group in tied_groups:
        for name in group:
            if name not in needed or name in weights_map:
                continue
            for partner in group:
                if partner in weights_map:
                    aliases[name] = partner
                    break
                tensor = model.get_parameter(partner)
                if tensor.device.type != "meta":
                    aliases[name] = tensor.detach()
                    break
    return _TiedWeights(weights_map, aliases) if aliases else weights_map


def _guard_moves(model: nn.Module) -> None:
    """Make `.to()` / `.cuda()` on a dispatched model warn, and fail when weights are offloaded
    (the meta placeholders cannot move and the hooks would reload onto the planned devices)."""

    def guarded(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            moving = method.__name__ != "to" or torch._C._nn._parse_to(*args, **kwargs)[0] is not None
            if moving:
                logger.warning("A dispatched model should not be moved: its hooks place each block.")
            if any(p.device.type == "meta" for p in model.parameters()):
                raise RuntimeError(
                    "This model has blocks offloaded to the CPU or disk and cannot be moved; call "
                    "notebook_accel.hooks.remove_hook_from_module(model, recurse=True) first."
                )
            return method(*args, **kwargs)

        return wrapper

    for name in ("to", "cuda"):
        _record_added_attribute(model, name, guarded(getattr(model, name)))


def dispatch_model(
    model: nn.Module,
    device_map,
    main_device: Optional[Union[int, str, torch.device]] = None,
    state_dict: Optional[dict] = None,
    offload_dir: Optional[Union[str, os.PathLike]] = None,
    offload_index: Optional[dict] = None,
    offload_buffers: bool = False,
    skip_keys=None,
    preload_module_classes: Optional[list] = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Place each block of `model` as `device_map` says ({module name: device | "cpu" | "disk"}).

    Blocks on an accelerator stay there; "disk" blocks (and "cpu" blocks when the main device is an
    accelerator) are offloaded and stream their weights to `main_device` at forward time. The model
    returns outputs on the device of its inputs. Sets `model.hf_device_map`. `device_map` may also be
    a `DevicePlan` already checked (`device_map.plan_device_map`).
    """
    # A plan was checked where it was made (load_checkpoint_and_dispatch); a dict is checked here.
    plan = device_map
    if not isinstance(plan, DevicePlan):
        plan = plan_device_map(model, device_map, offload_dir, "offload_dir", offload_index=offload_index)
    disk_modules = plan.disk_modules
    device_map = plan.devices
    devices = set(device_map.values())
    if main_device is None:
        if devices <= {"cpu", "disk"}:
            main_device = "cpu"
        else:
            main_device = next(d for d in device_map.values() if d not in ("cpu", "disk"))

    if not force_hooks and len(devices) == 1 and "disk" not in devices:
        device = next(iter(devices))
        model.to(device)
        model.hf_device_map = dict(device_map)
        return model

    # "mps" shares memory with the CPU, so CPU blocks need no offloading there either.
    offloaded_kinds = ("disk",) if str(main_device) in ("cpu", "mps") else ("cpu", "disk")
    offload = {name: device in offloaded_kinds for name, device in device_map.items()}
    if "cpu" in offloaded_kinds and state_dict is None:
        cpu_modules = [name for name, device in device_map.items() if device == "cpu"]
        if cpu_modules:
            state_dict = extract_submodules_state_dict(model.state_dict(), cpu_modules)
    if disk_modules and offload_index is None and not _has_offload_index(offload_dir):
        offload_state_dict(
            os.fspath(offload_dir), extract_submodules_state_dict(model.state_dict(), disk_modules)
        )

    execution_device = {name: main_device if d in ("cpu", "disk") else d for name, d in device_map.items()}
    execution_device[""] = main_device
    save_folder = os.fspath(offload_dir) if disk_modules else None
    weights_map = None
    if state_dict is not None or save_folder is not None or offload_index is not None:
        weights_map = OffloadedWeightsLoader(
            state_dict=state_dict,
            save_folder=save_folder,
            index=offload_index,
            device=main_device if offload_index is not None else None,
        )

    tied_groups = find_tied_parameters(model)
    if weights_map is not None:
        needed = set()
        for key, is_offloaded in offload.items():
            if is_offloaded:
                needed.update(_persistent_names(model, key, include_buffers=offload_buffers))
        weights_map = _alias_tied(model, weights_map, tied_groups, needed)
        _require_weights(weights_map, sorted(needed), "the offloaded weights (state_dict / offload folder)")

    # Keyed by the storage of each tied weight, so the hooks materialise it once per device.
    tied_params_map = {}
    for group in tied_groups:
        for name in group:
            param = model.get_parameter(name)
            if param.device.type != "meta":  # every meta tensor has data_ptr 0
                tied_params_map[param.data_ptr()] = {}

    attach_align_device_hook_on_blocks(
        model,
        execution_device=execution_device,
        offload=offload,
        offload_buffers=offload_buffers,
        weights_map=weights_map,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=tied_params_map,
    )
    # Placing each block made new Parameter objects; tie the groups again.
    retie_parameters(model, tied_groups)
    if any(offload.values()):
        kinds = " and ".join(sorted(d for d in devices if d in offloaded_kinds))
        logger.warning(
            "Some blocks are offloaded to %s: their parameters sit on the meta device between calls.", kinds
        )
    _guard_moves(model)
    model.hf_device_map = dict(device_map)
    return model


# -- loading and dispatching -------------------------------------------------------------------


def _left_on_meta(model: nn.Module, plan: Optional[DevicePlan], offload_folder, tied_groups) -> list:
    """State-dict names the checkpoint did not provide: still on meta and not in the disk store."""
    on_disk = None
    if plan is not None and plan.disk_modules and _has_offload_index(offload_folder):
        on_disk = OffloadedWeightsLoader(save_folder=os.fspath(offload_folder))
    provided = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.device.type != "meta":
            provided.add(name)
        elif on_disk is not None and plan.device_for(name) == "disk" and name in on_disk:
            provided.add(name)
    missing = []
    for name in model.state_dict(keep_vars=True):
        if name in provided:
            continue
        group = next((g for g in tied_groups if name in g), ())
        if not any(partner in provided for partner in group):
            missing.append(name)
    return missing


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: Union[str, os.PathLike],
    device_map: Optional[Union[str, dict]] = None,
    max_memory: Optional[dict] = None,
    no_split_module_classes: Optional[list] = None,
    offload_folder: Optional[Union[str, os.PathLike]] = None,
    offload_buffers: bool = False,
    dtype: Optional[Union[str, torch.dtype]] = None,
    offload_state_dict: Optional[bool] = None,
    skip_keys=None,
    preload_module_classes: Optional[list] = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Load `checkpoint` (a file, or a folder of shards with an index) into `model` (usually built
    with `init_empty_weights`) and dispatch it.

    `device_map` is a dict, or "auto" / "balanced" / "balanced_low_0" (spread evenly over the
    accelerators, the last one with less on GPU 0) / "sequential" (fill devices in order), planned
    under `max_memory`; blocks that do not fit go to the CPU, then to `offload_folder` on disk.

    `full_state_dict` and `broadcast_from_rank0` are for a model sharded over processes: see
    `load_checkpoint_in_model`.
    """
    made = isinstance(device_map, str)
    if made:
        if device_map not in _AUTO_MAPS:
            raise ValueError(
                f"device_map={device_map!r} is not a plan: use a dict or one of {', '.join(_AUTO_MAPS)}."
            )
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model,
                max_memory=max_memory,
                no_split_module_classes=no_split_module_classes,
                dtype=dtype,
                low_zero=(device_map == "balanced_low_0"),
            )
        device_map = infer_auto_device_map(
            model,
            max_memory=max_memory,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
            offload_buffers=offload_buffers,
        )
    elif device_map is not None and not isinstance(device_map, Mapping):
        raise TypeError(
            f"device_map must be None, a dict or one of {', '.join(_AUTO_MAPS)}; got {type(device_map).__name__}."
        )
    plan = None
    if device_map is not None:
        # Checked once, here; loading and dispatching take the plan as it is.
        hint = ", or give the CPU more room in max_memory" if made else ""
        plan = plan_device_map(model, device_map, offload_folder, hint=hint)
        if offload_state_dict is None and plan.disk_modules:
            offload_state_dict = True

    tied_groups = find_tied_parameters(model)
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=plan,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=bool(offload_state_dict),
        offload_buffers=offload_buffers,
        strict=strict,
        full_state_dict=full_state_dict,
        broadcast_from_rank0=broadcast_from_rank0,
    )
    missing = _left_on_meta(model, plan, offload_folder, tied_groups)
    if missing:
        raise ValueError(
            f"The checkpoint {os.fspath(checkpoint)!r} lacks {len(missing)} tensor(s) the model needs "
            f"(they are still empty, on the meta device): {', '.join(missing[:30])}"
            + (" ..." if len(missing) > 30 else "")
            + ". Check that the checkpoint belongs to this architecture."
        )
    if plan is None:
        return model
    return dispatch_model(
        model,
        device_map=plan,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )


# -- sequence parallelism ----------------------------------------------------------------------


def _refuse_recurrent_layers_under_sequence_parallelism(model: nn.Module) -> None:
    """Raise ValueError for a model with linear-attention layers about to be sharded along the sequence.

    Attention gathers the whole sequence before it mixes tokens, so sharding the sequence is exact
    for it. A linear-attention layer instead carries a state from token to token inside the
    model's own code: each rank would restart that state at its shard, and the gradients would be
    wrong without any error.
    """
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()  # a multimodal model lists its layers in the text config
    layer_types = getattr(config, "layer_types", None) or ()
    recurrent = sorted({kind for kind in layer_types if "linear_attention" in kind})
    if recurrent:
        raise ValueError(
            f"Sequence parallelism cannot shard {type(model).__name__}: its layers of type "
            f"{', '.join(recurrent)} carry a state along the sequence, which every rank would restart "
            "at its own shard (wrong gradients, no error). Use a model with full attention only, or "
            "train without sequence parallelism."
        )
