"""Device maps: `{module name: device}`, checked once where they are made or first received.

A name covers everything under it; the longest matching prefix wins. Values are integer
accelerator ids, "cpu", "disk" (the offload store) or "meta". `plan_device_map` checks a map against a
model and this machine, and returns a frozen `DevicePlan`: loading and dispatching take that and
check nothing again.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

import torch

from ..utils import families
from ..utils.memory import parse_memory_size
from .sizes import named_module_tensors
from .tensors import _KNOWN_DEVICES, to_torch_device


def _machine():
    from .. import hardware  # imported when a map is checked: importing big_model stays cheap

    return hardware


def device_for(name: str, device_map: dict):
    """The device `device_map` gives the tensor or module `name` (longest matching prefix)."""
    probe = name
    while True:
        if probe in device_map:
            return device_map[probe]
        if not probe:
            raise KeyError(f"The device map gives no device for {name!r}.")
        probe = probe.rsplit(".", 1)[0] if "." in probe else ""


def _check_device_value(key, device) -> None:
    if device in ("disk", "meta", "cpu") or isinstance(device, torch.device):
        return
    try:
        to_torch_device(device) if not isinstance(device, int) else None
    except ValueError:
        raise ValueError(f"device_map[{key!r}] = {device!r} is not a device: use {_KNOWN_DEVICES}.") from None
    if isinstance(device, bool) or (isinstance(device, int) and device < 0):
        raise ValueError(f"device_map[{key!r}] = {device!r} is not a device: use {_KNOWN_DEVICES}.")


# Families whose devices the machine lists by index (xla and neuron have no torch module to count).
_PROBED_KINDS = tuple(f.name for f in families.FAMILIES if f.torch_module is not None)


def check_devices_exist(device_map: dict) -> None:
    """Raise ValueError for a device-map value naming an accelerator this process does not have.

    Without this, weights placed on `0` on a CPU-only machine fail only at forward time, with
    torch's "cannot access accelerator device". Asks hardware.py, which leaves CUDA uninitialised.
    """
    for key, device in device_map.items():
        if device in ("disk", "meta", "cpu") or isinstance(device, bool):
            continue
        target = to_torch_device(device)
        if target.type not in _PROBED_KINDS:  # cpu, meta, xla: nothing to count here
            continue
        have = sorted(a.index for a in _machine().accelerators() if a.kind == target.type)
        if not have:
            raise ValueError(
                f"device_map[{key!r}] = {device!r}, but this machine has no {target.type} device: map it to "
                "'cpu' or 'disk', or pass device_map='auto'."
            )
        if target.index is not None and target.index not in have:
            raise ValueError(
                f"device_map[{key!r}] = {device!r}, but the {target.type} devices here are {have}: "
                "use one of those, 'cpu' or 'disk'."
            )


def check_device_map(model: torch.nn.Module, device_map: dict) -> None:
    """Raise ValueError unless `device_map` covers every tensor of `model` with a valid device.

    A key that names no module or tensor of `model` is only warned about (UserWarning), as
    accelerate does: it places nothing.
    """
    if not isinstance(device_map, dict):
        raise ValueError(f"A device map is a dict {{module name: device}}, not {type(device_map).__name__}.")
    modules = {name for name, _ in model.named_modules()}
    tensors = [name for name, _ in named_module_tensors(model, recurse=True)]
    known = modules | set(tensors) | set(model.state_dict(keep_vars=True))
    unknown = [key for key in device_map if key not in known]
    if unknown:
        near = sorted(m for m in modules if m and any(m.split(".")[-1] == u.split(".")[-1] for u in unknown))[
            :5
        ]
        hint = f" Modules with a similar last name: {near}." if near else ""
        warnings.warn(
            f"These device_map keys do not match any submodules in {type(model).__name__}, and place nothing: "
            f"{unknown}.{hint} Keys are module or tensor names from model.named_modules() / model.state_dict().",
            UserWarning,
            stacklevel=2,
        )
    for key, device in device_map.items():
        _check_device_value(key, device)
    uncovered = []
    # Non-persistent buffers may go unmapped, as in accelerate: they stay where they are.
    for name in model.state_dict(keep_vars=True):
        try:
            device_for(name, device_map)
        except KeyError:
            if name not in uncovered:
                uncovered.append(name)
    if uncovered:
        raise ValueError(
            f"The device map gives no device for these tensors: {uncovered}. Map them or a module holding them."
        )


def clean_device_map(device_map: dict, module_name: str = "") -> dict:
    """Merge entries into their parent module wherever all of the parent's entries share a device.

    The order of first appearance is kept. Returns `device_map` itself, updated in place.
    """

    def merge(items, prefix):
        # items: [(name, device)] all under `prefix`; returns the merged list.
        devices = {str(d) for _, d in items}
        if len(items) > 1 and len(devices) == 1 and not any(n == prefix for n, _ in items):
            return [(prefix, items[0][1])]
        groups, order = {}, []
        cut = len(prefix) + 1 if prefix else 0
        for name, device in items:
            head = name[cut:].split(".", 1)[0]
            child = f"{prefix}.{head}" if prefix else head
            key = name if name == prefix else child
            if key not in groups:
                groups[key] = []
                order.append(key)
            groups[key].append((name, device))
        merged = []
        for key in order:
            group = groups[key]
            merged.extend(group if len(group) == 1 else merge(group, key))
        return merged

    under = [
        (n, d)
        for n, d in device_map.items()
        if not module_name or n == module_name or n.startswith(module_name + ".")
    ]
    result = merge(under, module_name)
    rest = [(n, d) for n, d in device_map.items() if (n, d) not in under]
    device_map.clear()
    device_map.update(result)
    device_map.update(rest)
    return device_map


_DEVICE_STR = re.compile(r"^[a-z_]+(:\d+)?$")


def get_max_memory(max_memory: Optional[dict] = None) -> dict:
    """{device: bytes} in planning order: accelerator ids, other accelerators, "cpu", then "disk".

    Without `max_memory`: the free memory of each accelerator and the CPU's available memory. With
    one, sizes may be strings ("10GiB", "500MB") or ints, and integer ids need not exist here (a
    plan can be made for another machine).
    """
    if max_memory is None:
        found = {}
        machine = _machine()
        for device in machine.accelerators():
            free = device.free_memory if device.free_memory is not None else device.total_memory
            if free is not None:
                key = device.index if device.kind != "mps" else "mps"
                found[key] = int(free)
        found["cpu"] = int(machine.ram_available())
        return found
    if not isinstance(max_memory, dict):
        raise ValueError(
            f"max_memory is a dict {{device: size}}, e.g. {{0: '10GiB', 'cpu': '30GiB'}}; got {max_memory!r}."
        )
    parsed = {}
    for key, size in max_memory.items():
        if isinstance(key, bool) or not (
            (isinstance(key, int) and key >= 0) or (isinstance(key, str) and _DEVICE_STR.match(key))
        ):
            raise ValueError(f"max_memory key {key!r} is not a device: use {_KNOWN_DEVICES}.")
        try:
            parsed[key] = parse_memory_size(size)
        except ValueError as exc:
            raise ValueError(f"max_memory[{key!r}]: {exc}") from None
    ids = sorted(k for k in parsed if isinstance(k, int))
    others = [k for k in parsed if isinstance(k, str) and k not in ("cpu", "disk")]
    tail = [k for k in ("cpu", "disk") if k in parsed]
    return {k: parsed[k] for k in ids + others + tail}


def check_tied_parameters_on_same_device(tied_params: list, device_map: dict) -> list:
    """The tie groups whose members the map sends to different devices (also logged as a warning)."""
    split = []
    for group in tied_params:
        devices = {str(device_for(name, device_map)) for name in group}
        if len(devices) > 1:
            split.append(group)
    if split:
        import logging

        logging.getLogger(__name__).warning(
            "Tied parameters are mapped to different devices and will be copied, not shared: %s", split
        )
    return split


@dataclass(frozen=True)
class DevicePlan:
    """A device map checked against its model and this machine (`plan_device_map`), read-only."""

    devices: Mapping  # {module or tensor name: device}
    offload_folder: Optional[str] = None  # where "disk" entries live; None when nothing goes there

    @property
    def disk_modules(self) -> list:
        return [name for name, device in self.devices.items() if device == "disk"]

    def device_for(self, name: str):
        return device_for(name, self.devices)


def plan_device_map(
    model: torch.nn.Module,
    device_map: Mapping,
    offload_folder=None,
    folder_argument: str = "offload_folder",
    hint: str = "",
    offload_index: Optional[dict] = None,
) -> DevicePlan:
    """Check `device_map` once: it covers `model` with valid devices this machine has, and "disk"
    entries have a folder or an `offload_index` (`folder_argument` names the caller's argument in
    the message; `hint` adds a way out). Raises ValueError naming the first bad entry."""
    check_device_map(model, device_map)
    check_devices_exist(device_map)
    disk = [name for name, device in device_map.items() if device == "disk"]
    if disk and offload_folder is None and offload_index is None:
        raise ValueError(
            f"The device map sends {disk[:5]} to 'disk', but no {folder_argument} was given to hold them: "
            f"pass {folder_argument}='some/folder' (a folder for their weights){hint}."
        )
    folder = os.fspath(offload_folder) if offload_folder is not None else None
    return DevicePlan(MappingProxyType(dict(device_map)), folder)
