"""Streaming a checkpoint into a model, one tensor at a time, following a device map.

A checkpoint is one `.safetensors` / `.bin` / `.pt` file, an index json naming shards, or a folder
holding either. Tensors are memory-mapped from the file and placed one by one, so loading never
holds more than the model's own weights plus one tensor. Tensors mapped to "disk" go to the offload
store; from a safetensors file they are recorded by reference and not copied at all.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import loading_ranks
from .device_map import DevicePlan, device_for, plan_device_map
from .sizes import _as_dtype, _converts, named_module_tensors
from .store import (
    OffloadedWeightsLoader,
    load_offloaded_weight,
    offload_weight,
    safetensors_reference,
    save_offload_index,
)
from .tensors import (
    _owner,
    find_tied_parameters,
    retie_parameters,
    set_module_tensor_to_device,
    to_torch_device,
)
from .weights_files import CheckpointReadError, _WeightsFile, checkpoint_files  # noqa: F401  (public here)

logger = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What `load_checkpoint_in_model` did: names it could not fill, names the model lacks, names offloaded."""

    missing_keys: list = field(default_factory=list)
    unexpected_keys: list = field(default_factory=list)
    offloaded_keys: list = field(default_factory=list)


# -- loading -------------------------------------------------------------------------------------


def _in_modules(name: str, modules) -> bool:
    parts = name.split(".")
    return any(m in parts or name.startswith(m + ".") for m in modules)


def load_checkpoint_in_model(
    model: torch.nn.Module,
    checkpoint,
    device_map=None,
    offload_folder=None,
    dtype=None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: Optional[list] = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> LoadReport:
    """Load `checkpoint` into `model` (which may be on the meta device), tensor by tensor.

    Each tensor goes where `device_map` (a dict, or a checked `DevicePlan`) says (default: where the
    model's tensor already is, or the CPU for meta tensors). Tensors mapped to "disk" are written to `offload_folder` (by reference
    when the checkpoint is safetensors) and stay on meta in the model; buffers of disk modules are
    loaded on the CPU unless `offload_buffers`. `dtype` casts floating tensors, except those of the
    modules named in `keep_in_fp32_modules`. Tied parameters are re-tied afterwards. Missing and
    unexpected keys are listed in the result and logged; with `strict` they raise before anything
    is loaded. `offload_state_dict` is accepted for compatibility: loading already streams, so there
    is nothing to stage on disk. `offload_8bit_bnb` is ignored (bitsandbytes is not supported).

    Sharded (DTensor) parameters, as FSDP2 makes them, take their shard of the checkpoint's full
    tensor (`full_state_dict`, the default), or, with `full_state_dict=False`, the checkpoint's
    tensor as their local shard. With `broadcast_from_rank0` (an initialised torch.distributed
    process group is needed), only rank 0 reads the checkpoint and sends each tensor to the others.
    """
    del offload_state_dict, offload_8bit_bnb  # see the docstring

    if broadcast_from_rank0 and not full_state_dict:
        raise ValueError(
            "broadcast_from_rank0 sends the full tensors from rank 0: it needs full_state_dict=True."
        )
    rank = loading_ranks.process_group_rank() if broadcast_from_rank0 else None
    if device_map is not None:
        # A plan was checked where it was made (load_checkpoint_and_dispatch); a dict is checked here.
        plan = device_map
        if not isinstance(plan, DevicePlan):
            plan = plan_device_map(model, device_map, offload_folder)
        device_map = plan.devices
    dtype = _as_dtype(dtype) if dtype is not None else None
    keep_fp32 = list(keep_in_fp32_modules or [])
    offload_folder = os.fspath(offload_folder) if offload_folder is not None else None
    tied = find_tied_parameters(model)

    current = dict(named_module_tensors(model, recurse=True))
    expected = list(model.state_dict(keep_vars=True))
    allowed = set(expected) | set(current)
    buffers = {name for name, _ in model.named_buffers()}

    if rank is None:
        files = [_WeightsFile(path) for path in checkpoint_files(checkpoint)]  # headers only: fails early
    else:
        files = loading_ranks.broadcast_files(checkpoint, rank)
    provided = {name for f in files for name in f.names}
    unexpected = sorted(provided - allowed)
    tie_partner = {name: group for group in tied for name in group}
    missing = [
        n for n in expected if n not in provided and not any(p in provided for p in tie_partner.get(n, ()))
    ]
    if strict and (missing or unexpected):
        raise ValueError(
            f"The checkpoint {os.fspath(checkpoint)} does not match {type(model).__name__}: missing keys {missing}, "
            f"unexpected keys {unexpected}. Nothing was loaded; pass strict=False to load what matches."
        )

    def placement(name: str):
        if device_map is not None:
            try:
                return device_for(name, device_map)
            except KeyError:  # an unmapped non-persistent buffer: where it is now
                pass
        tensor = current.get(name)
        if tensor is None:
            tensor = model.state_dict(keep_vars=True).get(name)
        return "cpu" if tensor is None or tensor.device.type == "meta" else tensor.device

    index, offloaded, loaded = {}, [], set()
    for weights in files:
        for name in weights.names:
            if name not in allowed:
                continue
            owner, local = _owner(model, name)
            old = getattr(owner, local)
            stored = weights.dtype(name)
            if dtype is None:
                final = old.dtype
            elif stored is not None and _converts(stored):
                final = torch.float32 if keep_fp32 and _in_modules(name, keep_fp32) else dtype
            else:
                final = stored
            device = placement(name)
            if device == "disk" and (offload_buffers or name not in buffers):
                if weights.safetensors:
                    index[name] = safetensors_reference(
                        weights.path, weights.stored[name], final, weights.shape(name)
                    )
                else:
                    offload_weight(weights.read(name).to(final), name, offload_folder, index=index)
                offloaded.append(name)
                loaded.add(name)
                continue
            if device == "disk":
                device = "cpu"
            if device == "meta":
                set_module_tensor_to_device(model, name, "meta", dtype=final)
                loaded.add(name)
                continue
            value = weights.read(name)
            if loading_ranks.is_dtensor(old):
                loading_ranks.load_shard(owner, local, value.to(final), full_state_dict)
                loaded.add(name)
                continue
            if value.dtype == final and str(device) == "cpu":
                # The read tensor maps the file; a copy keeps the model independent of it.
                value = value.clone()
            set_module_tensor_to_device(
                model,
                name,
                device,
                value=value,
                dtype=final if dtype is not None else None,
                clear_cache=False,
            )
            loaded.add(name)
            del value
        weights.close()

    _offload_tied(model, tied, device_map, loaded, index, offloaded, offload_folder)
    retie_parameters(model, tied)
    if index:
        save_offload_index(index, offload_folder)
    if unexpected:
        logger.warning(
            "Some weights of the checkpoint %s were not used when loading it into %s: %s. The checkpoint holds "
            "tensors the model does not have: check that they belong to each other.",
            os.fspath(checkpoint),
            type(model).__name__,
            unexpected,
        )
    if missing:
        logger.warning(
            "Some weights of %s were not in the checkpoint %s and keep their current values: %s.",
            type(model).__name__,
            os.fspath(checkpoint),
            missing,
        )
    return LoadReport(missing_keys=missing, unexpected_keys=unexpected, offloaded_keys=offloaded)


def _offload_tied(model, tied, device_map, loaded, index, offloaded, offload_folder) -> None:
    """Give a disk-mapped tied parameter that the checkpoint omitted the entry of its partner."""
    if device_map is None or offload_folder is None:
        return
    for group in tied:
        source = next((n for n in group if n in loaded), None)
        if source is None:
            continue
        for name in group:
            if name in loaded or device_for(name, device_map) != "disk":
                continue
            if source in index:
                index[name] = dict(index[source])
                if "safetensors_file" not in index[name]:
                    # A disk entry is a file named after the weight: write it under this name too.
                    weight = load_offloaded_weight(
                        os.path.join(offload_folder, f"{source}.dat"), index[source]
                    )
                    offload_weight(weight, name, offload_folder, index=index)
            else:
                owner, local = _owner(model, source)
                offload_weight(getattr(owner, local), name, offload_folder, index=index)
            offloaded.append(name)
            loaded.add(name)


def load_state_dict(checkpoint_file, device_map: Optional[dict] = None) -> dict:
    """The tensors of one weights file (or checkpoint), each on its device in `device_map`.

    Tensors mapped to "disk" (or unmapped) stay on the CPU.
    """
    state = {}
    for path in checkpoint_files(checkpoint_file):
        weights = _WeightsFile(path)
        for name in weights.names:
            tensor = weights.read(name).clone()
            if device_map is not None:
                try:
                    device = device_for(name, device_map)
                except KeyError:
                    device = "cpu"
                if device not in ("cpu", "disk"):
                    tensor = tensor.to(to_torch_device(device))
            state[name] = tensor
        weights.close()
    return state


def load_offloaded_weights(model: torch.nn.Module, index: dict, offload_folder: str) -> None:
    """Load every weight of an offload folder's `index` into `model` on the CPU."""
    if not index:
        return
    loader = OffloadedWeightsLoader(save_folder=offload_folder, index=index)
    for name in index:
        set_module_tensor_to_device(model, name, "cpu", value=loader[name].clone())


def _hook_weights_map(module: torch.nn.Module):
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    for h in hooks:
        weights = getattr(h, "weights_map", None)
        if weights is not None:
            return weights
    return None


def get_state_dict_offloaded_model(model: torch.nn.Module) -> dict:
    """The full state dict of a model with offloaded modules, every tensor on the CPU.

    Tensors left on the meta device by an offload hook are read from the hook's `weights_map`,
    one module at a time.
    """
    state = {}
    prefixes = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    for full_name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.device.type != "meta":
            state[full_name] = tensor.detach().cpu()
            continue
        owner, local = _owner(model, full_name)
        weights = _hook_weights_map(owner)
        if weights is None or local not in weights:
            raise ValueError(
                f"{full_name!r} is on the meta device and its module ({prefixes.get(id(owner), '?')!r}) has no offload "
                f"hook holding its weights; load the checkpoint first."
            )
        state[full_name] = weights[local].detach().cpu()
    return state
