"""Forward hooks that move inputs and weights to where a module runs (accelerate's `hooks` API).

A hook wraps one module's `forward`: `pre_forward` may rewrite the arguments, `post_forward` the
output. `AlignDevicesHook` is the workhorse of big-model inference: it sends inputs to the execution
device and, for offloaded modules, streams the weights in from a weights map just before forward and
drops them back onto the meta device right after.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from ..utils.operations import find_device, send_to_device
from . import pages, read_ahead
from .sizes import named_module_tensors
from .store import PrefixedDataset, lookup, root_loader
from .tensors import _owner, set_module_tensor_to_device, to_torch_device

__all__ = [
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "AlignDevicesHook",
    "CpuOffload",
    "UserCpuOffloadHook",
    "attach_execution_device_hook",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
]

# Instance attributes a hook installation adds; remove_hook_from_module deletes every one of them.
_FORWARD_BEFORE = "_notebook_accel_forward_before"
_ADDED_ATTRIBUTES = "_notebook_accel_added_attributes"
_MISSING = object()

DeviceLike = Union[int, str, torch.device]
_UNSET = object()
# Read disk-offloaded weights ahead of their forward (read_ahead.py); "0" turns it off.
PREFETCH = os.environ.get("NOTEBOOK_ACCEL_PREFETCH", "1").strip().lower()


class ModelHook:
    """Base hook: every method is a no-op. `no_grad=True` runs the wrapped forward under no_grad."""

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module: nn.Module, output):
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module


class SequentialHook(ModelHook):
    """Several hooks applied in order (post_forward in the same order, as accelerate does)."""

    def __init__(self, *hooks: ModelHook):
        self.hooks = list(hooks)

    @property
    def no_grad(self) -> bool:
        return any(hook.no_grad for hook in self.hooks)

    def init_hook(self, module):
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module, *args, **kwargs):
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module, output):
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module):
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module

    def __repr__(self) -> str:
        return f"SequentialHook({', '.join(repr(h) for h in self.hooks)})"


def _hooked_forward(module: nn.Module, *args, **kwargs):
    hook = module._hf_hook
    read_ahead.forward_entered()
    try:
        args, kwargs = hook.pre_forward(module, *args, **kwargs)
        if hook.no_grad:
            with torch.no_grad():
                output = module._old_forward(*args, **kwargs)
        else:
            output = module._old_forward(*args, **kwargs)
        return hook.post_forward(module, output)
    finally:
        read_ahead.forward_left()  # the outermost hooked forward over (or raised): a thread given up is back


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Install `hook` on `module` and return the module.

    With `append=True` an existing hook is kept and the new one runs after it (a `SequentialHook`);
    otherwise an existing hook is first removed (detached) and replaced.
    """
    existing = module.__dict__.get("_hf_hook")
    if existing is not None and append:
        # Keep the old hook's state as it is: re-initialising it would reload offloaded weights.
        module = hook.init_hook(module)
        old = existing.hooks if isinstance(existing, SequentialHook) else [existing]
        module._hf_hook = SequentialHook(*old, hook)
        return module
    if existing is not None:
        remove_hook_from_module(module)

    # Remember whether `forward` was an instance attribute so removal can put back exactly that.
    module.__dict__[_FORWARD_BEFORE] = module.__dict__.get("forward", _MISSING)
    old_forward = module.forward
    module._old_forward = old_forward
    module = hook.init_hook(module)
    module._hf_hook = hook
    module.forward = functools.update_wrapper(functools.partial(_hooked_forward, module), old_forward)
    return module


def _record_added_attribute(module: nn.Module, name: str, value) -> None:
    """Set an instance attribute that `remove_hook_from_module` will delete again."""
    added = module.__dict__.setdefault(_ADDED_ATTRIBUTES, {})
    if name not in added:
        added[name] = module.__dict__.get(name, _MISSING)
    module.__dict__[name] = value


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of `module` (and of all submodules with `recurse=True`) and undo the wrapping."""
    hook = module.__dict__.pop("_hf_hook", None)
    if hook is not None:
        hook.detach_hook(module)
    if "_old_forward" in module.__dict__:
        del module.__dict__["_old_forward"]
        before = module.__dict__.pop(_FORWARD_BEFORE, _MISSING)
        if before is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = before
    for name, before in module.__dict__.pop(_ADDED_ATTRIBUTES, {}).items():
        if before is _MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = before
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Detach the hooks of `module` and of every module below it (`remove_hook_from_module(recurse=True)`)."""
    remove_hook_from_module(module, recurse=True)


def _is_meta(device) -> bool:
    return device == "meta" or (isinstance(device, torch.device) and device.type == "meta")


class AlignDevicesHook(ModelHook):
    """Run a module on `execution_device`, optionally streaming offloaded weights in from `weights_map`.

    - inputs are sent to `execution_device`; with `io_same_device` the output goes back to the
      device of the first input tensor;
    - `offload=True`: the module's tensors live on the meta device between calls; before forward each
      is loaded from `weights_map` (a Mapping name -> tensor, names relative to this module), after
      forward they go back to meta. Without a `weights_map` one is made from the current weights.
    - `offload_buffers`: buffers are offloaded too (otherwise they stay on the execution device);
    - `place_submodules`: the hook handles the tensors of all submodules, not just direct ones;
    - `tied_params_map`: {data_ptr of a weights_map value: {device: tensor}} shared by the hooks of
      a model, so a tied weight is materialised once per device while it is in use.
    """

    def __init__(
        self,
        execution_device: Optional[DeviceLike] = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Optional[Mapping] = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: Optional[Union[str, list]] = None,
        tied_params_map: Optional[dict] = None,
    ):
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.input_device = None
        self.original_devices: dict = {}
        self.tied_params_names: set = set()
        self.tied_params_map = tied_params_map
        self._tied_to_release: set = set()
        self._prefetcher = _UNSET  # the weights map's read-ahead (read_ahead.py), found on first use
        self._sources: list = []  # what the weights map gave this forward (released after it)
        self._metas: list = []  # (name, the meta tensor it had before this forward)
        self._device = (_UNSET, None)  # (execution_device, its torch.device) for _already_there

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})"
        )

    def _offloaded_tensors(self, module):
        # Non-persistent buffers are not in any state dict, so they can never be offloaded.
        return named_module_tensors(
            module,
            include_buffers=self.offload_buffers,
            recurse=self.place_submodules,
            remove_non_persistent=True,
        )

    def init_hook(self, module):
        if self.execution_device is not None and _is_meta(self.execution_device):
            self.tied_params_map = None  # planning on meta: nothing is ever materialised
        if not self.offload and self.execution_device is not None:
            for name, _ in named_module_tensors(module, recurse=self.place_submodules):
                set_module_tensor_to_device(
                    module, name, self.execution_device, tied_params_map=self.tied_params_map
                )
            return module
        if not self.offload:
            return module

        self.original_devices = {
            name: tensor.device
            for name, tensor in named_module_tensors(module, recurse=self.place_submodules)
        }
        if self.weights_map is None:
            self.weights_map = {
                name: tensor.to("cpu")
                for name, tensor in named_module_tensors(
                    module, include_buffers=self.offload_buffers, recurse=self.place_submodules
                )
            }
        for name, _ in list(self._offloaded_tensors(module)):
            tensor = getattr(*_owner(module, name))
            if self.tied_params_map is not None and tensor.data_ptr() in self.tied_params_map:
                self.tied_params_names.add(name)
            set_module_tensor_to_device(module, name, "meta")

        if self.execution_device is not None:
            # Buffers that were not offloaded (all of them, or the non-persistent ones) live on the
            # execution device for good: they are small and some are built at init, not loaded.
            for name, tensor in list(named_module_tensors(module, recurse=self.place_submodules)):
                if not isinstance(tensor, nn.Parameter) and tensor.device.type != "meta":
                    set_module_tensor_to_device(
                        module, name, self.execution_device, tied_params_map=self.tied_params_map
                    )
        return module

    def pre_forward(self, module, *args, **kwargs):
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            self._release_tied()  # a forward that raised never reached post_forward
            tied = self.tied_params_map
            # The map's inner keys are torch.device objects (0 and "cuda:0" are one device).
            target = to_torch_device(self.execution_device) if tied is not None else None
            before = list(self._offloaded_tensors(module))
            # Their meta tensors, put back after the forward: cheaper than making new ones.
            self._metas = [(name, t) for name, t in before if t.device.type == "meta"]
            names = [name for name, _ in before]
            values = self._read(names)
            self._sources = list(values.values())  # released after the forward, copied or not
            pages.taking(self._sources)  # released earlier in this forward (run twice, a tie)
            for name in names:
                value = values[name]
                if tied is not None and value.data_ptr() in tied and target not in tied[value.data_ptr()]:
                    self._tied_to_release.add((value.data_ptr(), target))
                set_module_tensor_to_device(
                    module, name, self.execution_device, value=value, tied_params_map=self.tied_params_map
                )
        if self.execution_device is None or (not kwargs and self._already_there(args)):
            return args, kwargs
        return (
            send_to_device(args, self.execution_device),
            send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys),
        )

    def _already_there(self, args: tuple) -> bool:
        # Plain tensors already on the execution device (a block's input, from the block before):
        # what send_to_device would give back unchanged, without its walk (a few us per hook).
        if self._device[0] != self.execution_device:
            try:
                self._device = (self.execution_device, to_torch_device(self.execution_device))
            except ValueError:
                return False  # send_to_device says what is wrong with it
        return all(type(arg) is torch.Tensor and arg.device == self._device[1] for arg in args)

    def _read(self, names: list) -> dict:
        weights_map = self.weights_map
        # Tied weights are looked up by their source pointer (tied_params_map): never staged.
        device = None if self.tied_params_names else self.execution_device
        if self._prefetcher is _UNSET:
            on = read_ahead.wanted(PREFETCH, self.execution_device)
            self._prefetcher = read_ahead.for_map(weights_map, device) if on else None
        if self._prefetcher is None:
            return {name: lookup(weights_map, name) for name in names}
        return self._prefetcher.take(
            self, lambda: {name: lookup(weights_map, name) for name in names}, device
        )

    def _release_tied(self):
        # Forget the tied weights this call materialised, so the next call's loads free them.
        for pointer, device in self._tied_to_release:
            self.tied_params_map[pointer].pop(device, None)
        self._tied_to_release = set()

    def post_forward(self, module, output):
        if self.offload:
            metas, self._metas = self._metas, []
            if len(metas) == len(self._sources):
                for name, meta in metas:
                    owner, local = _owner(module, name)
                    (owner._buffers if local in owner._buffers else owner._parameters)[local] = meta
            else:  # some were not on meta before the forward (set by hand): make meta tensors
                for name, _ in list(self._offloaded_tensors(module)):
                    set_module_tensor_to_device(module, name, "meta")
            loader = root_loader(self.weights_map)
            if loader is not None and loader.index:
                # What the map gave, not the module's tensors: those are copies when the weights
                # went to another device or dtype, and the map's pages would stay in RSS for good.
                loader.release_pages(self._sources)
            self._sources = []
            self._release_tied()
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module):
        if self.offload:
            for name, device in self.original_devices.items():
                if device.type != "meta":
                    set_module_tensor_to_device(module, name, device, value=self.weights_map.get(name, None))
        return module


def _default_execution_device() -> torch.device:
    from ..state import PartialState

    return PartialState().default_device


class CpuOffload(ModelHook):
    """Keep a whole model on the CPU and move it to `execution_device` when it is called.

    With `prev_module_hook` (a `UserCpuOffloadHook`), the previous model of a pipeline is sent back
    to the CPU first, so only one model at a time occupies the accelerator.
    """

    def __init__(
        self,
        execution_device: Optional[DeviceLike] = None,
        prev_module_hook: Optional["UserCpuOffloadHook"] = None,
    ):
        self.prev_module_hook = prev_module_hook
        self.execution_device = _default_execution_device() if execution_device is None else execution_device

    def init_hook(self, module):
        return module.to("cpu")

    def pre_forward(self, module, *args, **kwargs):
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
            from ..utils.memory import clear_device_cache

            clear_device_cache()
        module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


class UserCpuOffloadHook:
    """The handle `cpu_offload_with_hook` returns: `offload()` sends the model back to the CPU now,
    `remove()` takes the hook off the model."""

    def __init__(self, model: nn.Module, hook: ModelHook):
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        remove_hook_from_module(self.model)


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: DeviceLike,
    skip_keys=None,
    preload_module_classes: Optional[list] = None,
    tied_params_map: Optional[dict] = None,
) -> None:
    """Give every submodule that has weights and no hook yet a hook that sends its inputs to
    `execution_device` (used under a module whose own hook places all weights at once)."""
    if "_hf_hook" not in module.__dict__ and len(module.state_dict()) > 0:
        add_hook_to_module(
            module, AlignDevicesHook(execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map)
        )
    if preload_module_classes is not None and module.__class__.__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(
            child, execution_device, skip_keys, preload_module_classes, tied_params_map
        )


@dataclass(frozen=True)
class _HookSettings:
    """The settings attach_align_device_hook(_on_blocks) pass unchanged down the module tree."""

    execution_device: Any = None
    offload: Any = False
    weights_map: Optional[Mapping] = None
    offload_buffers: bool = False
    skip_keys: Any = None
    preload_module_classes: Optional[list] = None
    tied_params_map: Optional[dict] = None

    def hook(self, execution_device, **options) -> AlignDevicesHook:
        """An AlignDevicesHook on `execution_device` with these skip_keys and tied weights."""
        return AlignDevicesHook(
            execution_device, skip_keys=self.skip_keys, tied_params_map=self.tied_params_map, **options
        )

    def preloads(self, module: nn.Module) -> bool:
        return (
            self.preload_module_classes is not None
            and module.__class__.__name__ in self.preload_module_classes
        )


def _child_name(module_name: str, child_name: str) -> str:
    return f"{module_name}.{child_name}" if module_name else child_name


def attach_align_device_hook(
    module: nn.Module,
    execution_device: Optional[DeviceLike] = None,
    offload: bool = False,
    weights_map: Optional[Mapping] = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys=None,
    preload_module_classes: Optional[list] = None,
    tied_params_map: Optional[dict] = None,
) -> None:
    """Attach an `AlignDevicesHook` to every submodule that has direct weights.

    `weights_map` is keyed by names relative to `module` prefixed with `module_name`. A submodule
    whose class is in `preload_module_classes` is offloaded as one unit: its whole subtree loads
    before its forward (needed when a module reads a child's weights outside the child's forward).
    """
    settings = _HookSettings(
        execution_device,
        offload,
        weights_map,
        offload_buffers,
        skip_keys,
        preload_module_classes,
        tied_params_map,
    )
    _attach_align(module, module_name, settings)


def _attach_align(module: nn.Module, module_name: str, settings: _HookSettings) -> None:
    has_direct_tensors = next(iter(named_module_tensors(module)), None) is not None
    full_offload = settings.offload and settings.preloads(module)
    if has_direct_tensors or full_offload:
        prefix = f"{module_name}." if module_name else ""
        weights_map = settings.weights_map
        hook = settings.hook(
            settings.execution_device,
            offload=settings.offload,
            weights_map=PrefixedDataset(weights_map, prefix) if weights_map is not None else None,
            offload_buffers=settings.offload_buffers,
            place_submodules=full_offload,
        )
        add_hook_to_module(module, hook, append=True)
    if full_offload:
        return
    for child_name, child in module.named_children():
        _attach_align(child, _child_name(module_name, child_name), settings)


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device=None,
    offload=False,
    weights_map: Optional[Mapping] = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys=None,
    preload_module_classes: Optional[list] = None,
    tied_params_map: Optional[dict] = None,
) -> None:
    """Attach hooks block by block from a device plan.

    `execution_device` and `offload` are either one value for every block or dicts keyed by module
    name (the keys of a device map). A block that is not offloaded gets one hook placing all its
    weights; an offloaded block streams its weights from `weights_map`. The root module (name "")
    always returns outputs on the device its inputs came from.
    """
    settings = _HookSettings(
        execution_device,
        offload,
        weights_map,
        offload_buffers,
        skip_keys,
        preload_module_classes,
        tied_params_map,
    )
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if not offload:
            add_hook_to_module(
                module, settings.hook(execution_device, io_same_device=True, place_submodules=True)
            )
        else:  # one offloaded block: no module of it is preloaded as a unit
            _attach_align(module, module_name, replace(settings, offload=True, preload_module_classes=None))
        return
    if not isinstance(execution_device, Mapping):
        execution_device = {key: execution_device for key in offload}
    if not isinstance(offload, Mapping):
        offload = {key: offload for key in execution_device}
    _attach_blocks(module, module_name, replace(settings, execution_device=execution_device, offload=offload))


def _attach_blocks(module: nn.Module, module_name: str, settings: _HookSettings) -> None:
    devices, offload, is_root = settings.execution_device, settings.offload, module_name == ""
    if module_name in devices and module_name in offload:
        device = devices[module_name]
        if not offload[module_name]:
            hook = settings.hook(
                device,
                offload_buffers=settings.offload_buffers,
                io_same_device=is_root,
                place_submodules=True,
            )
            add_hook_to_module(module, hook)
            attach_execution_device_hook(
                module, device, skip_keys=settings.skip_keys, tied_params_map=settings.tied_params_map
            )
            return
        _attach_align(module, module_name, replace(settings, execution_device=device, offload=True))
        if "_hf_hook" not in module.__dict__:
            add_hook_to_module(module, settings.hook(device, io_same_device=is_root))
        attach_execution_device_hook(
            module,
            device,
            skip_keys=settings.skip_keys,
            preload_module_classes=settings.preload_module_classes,
            tied_params_map=settings.tied_params_map,
        )
        return
    if is_root:
        add_hook_to_module(module, settings.hook(devices.get(""), io_same_device=True))
    for child_name, child in module.named_children():
        _attach_blocks(child, _child_name(module_name, child_name), settings)
