"""Planning where each module of a model lives: `infer_auto_device_map` and `get_balanced_memory`.

The plan follows accelerate's: devices are filled in order (accelerator ids, then "cpu", then
"disk"), walking a queue of the model's modules in definition order. A module that does not fit
is split into its children unless it is a leaf or of a class in `no_split_module_classes`; one
that cannot be split moves to the next device. A module goes together with the modules holding
the parameters tied to it; when those do not fit, the tied holders are split first.

The main devices (the first accelerator, and the CPU) always keep room for the largest layer
still to place, the one that may be offloaded below them and brought there to run.
"""

from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch

from ..utils.other import check_tied_parameters_in_config
from .device_map import clean_device_map, get_max_memory
from .sizes import compute_module_sizes, get_max_layer_size
from .tensors import find_tied_parameters

logger = logging.getLogger(__name__)


def _as_list(classes) -> list:
    if classes is None:
        return []
    if isinstance(classes, str):
        return [classes]
    return list(classes)


def _inside(entry: str, name: str) -> bool:
    return entry == "" or name == entry or name.startswith(entry + ".")


def _children(name: str, obj) -> list:
    """The entries a module splits into: its own parameters, its children, its own buffers."""
    prefix = f"{name}." if name else ""
    parts = (
        list(obj.named_parameters(recurse=False))
        + list(obj.named_children())
        + list(obj.named_buffers(recurse=False))
    )
    return [(prefix + n, o) for n, o in parts]


def _splittable(obj, no_split) -> bool:
    return (
        isinstance(obj, torch.nn.Module)
        and type(obj).__name__ not in no_split
        and any(True for _ in obj.children())
    )


def _holder(tensor_name: str, modules: list) -> Optional[int]:
    """Index of the entry of `modules` ((name, module or tensor) pairs) that holds `tensor_name`, or
    None; a split module's own parameter is an entry of its own (accelerate fails on one)."""
    return next((i for i, (n, _) in enumerate(modules) if _inside(n, tensor_name) and n), None)


def get_module_size_with_ties(tied_params, module_size, module_sizes, modules_to_treat) -> tuple:
    """(size, names, modules): `module_size` plus the entries of `modules_to_treat` that hold
    `tied_params` (parameters tied to the module, held outside it), which must go with it.

    A holder counts once, less its tied parameters (the module already counts them); holders come
    in the order of `tied_params`, and a tied parameter no entry holds adds nothing.
    """
    names, modules, size = [], [], module_size
    for tensor_name in tied_params:
        i = _holder(tensor_name, modules_to_treat)
        if i is None:
            continue
        name, module = modules_to_treat[i]
        if name not in names:
            names.append(name)
            modules.append(module)
            size += module_sizes.get(name, 0)
        size -= module_sizes.get(tensor_name, 0)
    return size, names, modules


class _Planner:
    """One run of the placement: the queue of entries left, and what each device holds."""

    def __init__(self, model, budgets, sizes, ties, no_split, options):
        self.budgets, self.sizes, self.ties, self.no_split = budgets, sizes, ties, no_split
        self.verbose, self.offload_buffers, self.fallback = options
        self.devices = list(budgets) + ([] if "disk" in budgets else ["disk"])
        self.gpus = [d for d in self.devices if d not in ("cpu", "disk")]
        # The devices an offloaded layer is brought to, to run: they keep room for the largest one.
        self.main = ["mps"] if "mps" in self.gpus else self.gpus[:1] + ["cpu"]
        self.queue = _children("", model)
        self.used = {d: 0 for d in self.devices}
        self.buffers = {}  # device -> bytes of buffers of the modules placed there
        self.short = {}  # device -> what the first entry it could not take needed there
        self.tried = {}  # device -> names a fallback already picked for it (so it ends)
        self.device_map = {}
        self.index = 0
        self.layer_size, self.layer_names = get_max_layer_size(self.queue, sizes, no_split)

    def _say(self, text: str) -> None:
        if self.verbose:
            print(text)

    def _largest_layer(self) -> None:
        modules = [(n, o) for n, o in self.queue if isinstance(o, torch.nn.Module)]
        self.layer_size, self.layer_names = get_max_layer_size(modules, self.sizes, self.no_split)

    def _tied_outside(self, *names: str) -> list:
        """The parameters tied to one inside `names` but held outside them."""
        outside = []
        for group in self.ties:
            inside = [any(_inside(name, n) for name in names) for n in group]
            if any(inside) and not all(inside):
                outside += [n for n, held in zip(group, inside) if not held]
        return outside

    def _with_ties(self, name: str, size: int, outside: list) -> tuple:
        """(size, names, modules): `name` with the queue entries holding its ties, and theirs in turn.

        The first round is accelerate's; the next ones take the ties of the holders it brings, which
        would otherwise be left in the queue with a partner already placed (accelerate fails there).
        """
        total, names, modules = get_module_size_with_ties(outside, size, self.sizes, self.queue)
        while True:
            rest = [(n, o) for n, o in self.queue if n not in names]
            more = get_module_size_with_ties(self._tied_outside(name, *names), 0, self.sizes, rest)
            if not more[1]:
                return total, names, modules
            total += more[0]
            names, modules = names + more[1], modules + more[2]

    def run(self) -> dict:
        while self.queue:
            name, obj = self.queue.pop(0)
            # The largest layer still to place may have been this one.
            self.layer_names = [n for n in self.layer_names if not _inside(name, n)]
            if not self.layer_names:
                self._largest_layer()
            self._treat(name, obj)
        return self.device_map

    def _treat(self, name: str, obj) -> None:
        size = self.sizes.get(name, 0)
        outside = self._tied_outside(name)
        device = self.devices[self.index]
        limit = self.budgets.get(device)  # None: the disk without a budget
        reserve = self.layer_size if device in self.main else 0
        if limit is not None:
            limit -= reserve
        total, tied_names, tied_modules = self._with_ties(name, size, outside)
        used = self.used[device]
        if limit is None or used + total <= limit:
            self._place(name, obj, device, total, tied_names)
            return
        if outside and used + size <= limit and self._split_tied(name, obj, tied_names, tied_modules):
            return
        if used + size >= limit and _splittable(obj, self.no_split):
            self._say(f"{name} ({size} bytes) does not fit in {device!r} ({limit - used} left): splitting it")
            self.queue[:0] = _children(name, obj)
            self._largest_layer()
            return
        if used == 0 and self.fallback and device != "disk" and self._fall_back(name, obj, device, total):
            return
        if used == 0:
            self.short[device] = total + reserve
        self._say(f"{name} ({total} bytes with its ties) does not fit in {device!r}: next device")
        self.used[device] += reserve
        self.index += 1
        self.queue.insert(0, (name, obj))
        if self.index == len(self.devices):
            raise ValueError(
                f"The model does not fit in max_memory: nothing is left for {name!r} and what follows it. Raise a "
                f"budget, or leave 'disk' out of max_memory so the rest is offloaded to disk without a limit."
            )

    def _place(self, name, obj, device, total, tied_names) -> None:
        self._say(f"{name} ({total} bytes with its ties {tied_names}) -> {device!r}")
        self.used[device] += total
        self.device_map[name] = device
        for tied in tied_names:
            i = next((k for k, (n, _) in enumerate(self.queue) if n == tied), None)
            if i is not None:
                self.queue.pop(i)
            self.device_map[tied] = device
        # The largest layer left may have gone with them (accelerate keeps room for it still).
        self.layer_names = [n for n in self.layer_names if not any(_inside(t, n) for t in tied_names)]
        if not self.layer_names:
            self._largest_layer()
        if not self.offload_buffers and isinstance(obj, torch.nn.Module):
            held = sum(self.sizes.get(f"{name}.{b}", 0) for b, _ in obj.named_buffers())
            self.buffers[device] = self.buffers.get(device, 0) + held

    def _split_tied(self, name, obj, tied_names, tied_modules) -> bool:
        """Split the first tied holder that can be, so that part of it may go with `name`."""
        for tied, module in zip(tied_names, tied_modules):
            if not _splittable(module, self.no_split):
                continue
            self._say(f"{name} fits but not with {tied_names}: splitting {tied}")
            i = next(k for k, (n, _) in enumerate(self.queue) if n == tied)
            self.queue[i : i + 1] = _children(tied, module)
            self.queue.insert(0, (name, obj))
            self._largest_layer()
            return True
        return False

    def _fall_back(self, name, obj, device, total) -> bool:
        """Put on `device`, still empty, the first entry (depth first) that fits beside the room kept."""
        limit = self.budgets[device] - max(self.layer_size, total)
        tried = self.tried.setdefault(device, set())
        search = list(self.queue)
        while search:
            entry, module = search.pop(0)
            outside = self._tied_outside(entry)
            # Every holder of its ties must be at hand to count: accelerate fails on one it passed.
            reachable = entry not in tried and all(_holder(p, search) is not None for p in outside)
            size = get_module_size_with_ties(outside, self.sizes.get(entry, 0), self.sizes, search)[0]
            if reachable and size <= limit:
                tried.add(entry)
                self._open_to(entry)
                i = next(k for k, (n, _) in enumerate(self.queue) if n == entry)
                found = self.queue.pop(i)
                self._say(f"fallback: {entry} -> {device!r}")
                self.queue[:0] = [found, (name, obj)]
                return True
            if _splittable(module, self.no_split):
                search[:0] = _children(entry, module)
        return False

    def _open_to(self, entry: str) -> None:
        """Split the queue entries above `entry` until it is an entry itself."""
        while not any(n == entry for n, _ in self.queue):
            i = next(k for k, (n, _) in enumerate(self.queue) if _inside(n, entry))
            parent, module = self.queue[i]
            self.queue[i : i + 1] = _children(parent, module)

    def warn_about_buffers(self) -> None:
        """Buffers of offloaded modules stay on the execution device: warn when no accelerator has room."""
        offloaded = self.buffers.get("cpu", 0) + self.buffers.get("disk", 0)
        if self.offload_buffers or not offloaded or not self.gpus:
            return
        if any(self.budgets.get(g, 0) >= offloaded + self.used.get(g, 0) for g in self.gpus):
            return
        warnings.warn(
            f"Current model requires {offloaded} bytes of buffer for offloaded layers, which seems does not fit "
            f"any accelerator's remaining memory: the buffers stay on the execution device. If it runs out of "
            f"memory, pass offload_buffers=True.",
            stacklevel=3,
        )

    def report_short(self) -> None:
        if not self.short:
            return
        lines = "\n".join(f"  - {device}: {need} bytes required" for device, need in self.short.items())
        logger.info(
            "No module could be placed on these devices, for insufficient memory:\n%s\nEach needs at least "
            "that much (in this plan) to take one; raise its budget or change the model's split.",
            lines,
        )


def infer_auto_device_map(
    model: torch.nn.Module,
    max_memory: Optional[dict] = None,
    no_split_module_classes=None,
    dtype=None,
    special_dtypes: Optional[dict] = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict:
    """A device map {module name: device} that fits `model` into `max_memory`.

    Devices are filled in order: accelerator ids, then "cpu", then "disk" (unlimited unless
    `max_memory` gives it a size). Budgets may be strings ("10GiB", "500MB") or ints; without
    `max_memory`, what is free on this machine. The first accelerator and the CPU keep room for
    the largest layer left to place. `no_split_module_classes` (class names) are never split across
    devices, tied parameters go together, and `dtype`/`special_dtypes` size the weights as they will
    be loaded. With `clean_result`, children that share a device are merged into their parent.
    With `fallback_allocation`, a device too small for the next module still gets the first
    smaller layer that fits. Warns when the buffers of offloaded modules (which stay on the
    execution device unless `offload_buffers`) fit no accelerator.
    """
    budgets = get_max_memory(max_memory)
    no_split = _as_list(no_split_module_classes)
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    ties = find_tied_parameters(model)
    if not ties and check_tied_parameters_in_config(model):
        logger.warning(
            "The model weights are not tied: call model.tie_weights() before planning its device map."
        )
    planner = _Planner(model, budgets, sizes, ties, no_split, (verbose, offload_buffers, fallback_allocation))
    device_map = planner.run()
    if clean_result:
        device_map = clean_device_map(device_map)
    planner.warn_about_buffers()
    planner.report_short()
    return device_map


def get_balanced_memory(
    model: torch.nn.Module,
    max_memory: Optional[dict] = None,
    no_split_module_classes=None,
    dtype=None,
    special_dtypes: Optional[dict] = None,
    low_zero: bool = False,
) -> dict:
    """A max_memory that spreads `model` evenly over the accelerators instead of filling the first.

    Each accelerator but the last is capped at its share of the model plus a margin (1.25 x the
    larger of the biggest unsplittable block and the mean leaf-module size), so a block that does
    not quite fit does not spill to the CPU. `low_zero` leaves accelerator 0 only what the others
    cannot hold (room for generation outputs). Without accelerators, `max_memory` comes back as is.
    """
    user_set = max_memory is not None
    budgets = get_max_memory(max_memory)
    gpus = sorted(d for d, b in budgets.items() if isinstance(d, int) and b > 0)
    if not gpus:
        return budgets
    if len(gpus) == 1:
        low_zero = False  # nothing to balance against
        if not user_set:
            budgets[gpus[0]] = int(budgets[gpus[0]] * 0.9)  # headroom for activations
        return budgets
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    no_split = set(_as_list(no_split_module_classes))
    block = max(
        (sizes.get(n, 0) for n, m in model.named_modules() if n and type(m).__name__ in no_split), default=0
    )
    leaves = [
        n for n, m in model.named_modules() if n and not any(True for _ in m.children()) and sizes.get(n)
    ]
    mean_leaf = sum(sizes[n] for n in leaves) // max(len(leaves), 1)
    share = sizes.get("", 0) // (len(gpus) - 1 if low_zero else len(gpus))
    share += int(1.25 * max(block, mean_leaf))
    for gpu in gpus[:-1]:
        if not (low_zero and gpu == gpus[0]):
            budgets[gpu] = min(share, budgets[gpu])
    if low_zero:
        rest = sum(budgets[g] for g in gpus[1:])
        budgets[gpus[0]] = min(max(0, sizes.get("", 0) - rest), budgets[gpus[0]])
    return budgets


def calculate_maximum_sizes(model: torch.nn.Module) -> tuple:
    """(the model's size in bytes, (its largest layer's size, that layer's names)): the largest layer
    splits no further than `model._no_split_modules` allows (transformers models set it)."""
    sizes = compute_module_sizes(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    top = (
        list(model.named_parameters(recurse=False))
        + list(model.named_children())
        + list(model.named_buffers(recurse=False))
    )
    return sizes[""], get_max_layer_size(top, sizes, no_split)
