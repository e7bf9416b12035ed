"""Planning where each module of a model lives: `infer_auto_device_map` and `get_balanced_memory`.

The plan fills devices in order (accelerator ids, then "cpu", then "disk"), walking the model's
modules in definition order. A module that does not fit is split into its children unless it is a
leaf or of a class in `no_split_module_classes`; one that cannot be split moves to the next
device. Tied parameters go to the device of their first holder, together with their other holders.

A main device (the first accelerator, and the CPU) keeps room for the largest layer only when some
layers are offloaded below it: offloaded layers are brought there to run. accelerate always
reserves it, which leaves memory unused whenever the whole model fits.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .modeling import (
    _layers,
    clean_device_map,
    compute_module_sizes,
    find_tied_parameters,
    get_max_layer_size,
    get_max_memory,
)

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


def _splittable(obj, no_split: set) -> bool:
    return (
        isinstance(obj, torch.nn.Module)
        and type(obj).__name__ not in no_split
        and any(True for _ in obj.children())
    )


def _tie_group(queue: list, ties: list) -> list:
    """Indices of the queue entries that must share a device with queue[0] (queue[0] included)."""
    group, pending = [0], [0]
    while pending:
        entry = queue[pending.pop()][0]
        for tie in ties:
            if not any(_inside(entry, n) for n in tie):
                continue
            for name in tie:
                if _inside(entry, name):
                    continue
                for i, (other, _) in enumerate(queue):
                    if i not in group and _inside(other, name):
                        group.append(i)
                        pending.append(i)
    return group


class _Planner:
    def __init__(self, model, devices, capacity, sizes, ties, no_split, fallback, verbose):
        self.model, self.devices, self.capacity = model, devices, capacity
        self.sizes, self.ties, self.no_split = sizes, ties, no_split
        self.fallback, self.verbose = fallback, verbose

    def _say(self, text: str) -> None:
        if self.verbose:
            print(text)

    def plan(self, reserve: dict) -> list:
        """[(name, module or tensor, device)] in placement order."""
        if type(self.model).__name__ in self.no_split:
            queue = [("", self.model)]
        else:
            queue = _children("", self.model)
        placed, index, used, here = [], 0, 0, 0
        while queue:
            device = self.devices[index]
            limit = self.capacity[device]
            if limit is not None:
                limit -= reserve.get(device, 0)
            group = _tie_group(queue, self.ties)
            size = sum(self.sizes.get(queue[i][0], 0) for i in group)
            if limit is None or used + size <= limit:
                for i in sorted(group, reverse=True):
                    name, obj = queue.pop(i)
                    placed.append((name, obj, device))
                    self._say(f"{name or '<model>'} ({self.sizes.get(name, 0)} bytes) -> {device!r}")
                used += size
                here += len(group)
                continue
            split = next((i for i in group if _splittable(queue[i][1], self.no_split)), None)
            if split is not None:
                name, obj = queue[split]
                self._say(
                    f"{name or '<model>'} ({size} bytes with its ties) does not fit in {device!r}: splitting it"
                )
                queue[split : split + 1] = _children(name, obj)
                continue
            if self.fallback and here == 0 and limit is not None and self._fill(queue, device, limit, placed):
                here, used = 1, self.sizes.get(placed[-1][0], 0)
                continue
            self._say(f"{queue[0][0] or '<model>'} ({size} bytes) does not fit in {device!r}: next device")
            index += 1
            used = here = 0
            if index == len(self.devices):
                left = [name or "<model>" for name, _ in queue]
                raise ValueError(
                    f"The model does not fit in max_memory: nothing is left for {left}. Raise a budget, or leave "
                    f"'disk' out of max_memory so the rest is offloaded to disk without a limit."
                )
        return placed

    def _fill(self, queue: list, device, limit: int, placed: list) -> bool:
        """Put the first layer that fits (breadth-first, no ties outside it) on an otherwise empty device."""
        pending = [(name, obj, [name]) for name, obj in queue]
        while pending:
            name, obj, path = pending.pop(0)
            size = self.sizes.get(name, 0)
            tied_out = any(
                any(_inside(name, n) for n in tie) and not all(_inside(name, n) for n in tie)
                for tie in self.ties
            )
            if size <= limit and not tied_out:
                # Open up the entries above the chosen one so the rest of it stays in the queue.
                for step in path[:-1]:
                    i = next(k for k, (n, _) in enumerate(queue) if n == step)
                    queue[i : i + 1] = _children(step, queue[i][1])
                i = next(k for k, (n, _) in enumerate(queue) if n == name)
                queue.pop(i)
                placed.append((name, obj, device))
                self._say(f"fallback: {name} ({size} bytes) -> {device!r}")
                return True
            if _splittable(obj, self.no_split):
                pending.extend((n, o, path + [n]) for n, o in _children(name, obj))
        return False


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
    `max_memory`, what is free on this machine. `no_split_module_classes` (class names) are never
    split across devices, tied parameters are kept on one device, and `dtype`/`special_dtypes`
    size the weights as they will be loaded. With `clean_result`, children that share a device
    are merged into their parent. With `fallback_allocation`, a device too small for the next
    module still gets the first smaller layer that fits, rather than nothing.
    """
    budgets = get_max_memory(max_memory)
    capacity = {d: b for d, b in budgets.items() if d != "disk" and b > 0}
    capacity["disk"] = budgets.get("disk")  # None: no limit
    devices = list(capacity)
    accelerators = [d for d in devices if d not in ("cpu", "disk")]
    main = accelerators[:1] + (["cpu"] if "cpu" in devices else [])
    no_split = set(_as_list(no_split_module_classes))
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    ties = find_tied_parameters(model)
    planner = _Planner(model, devices, capacity, sizes, ties, no_split, fallback_allocation, verbose)

    # Reserve room on a main device for the largest layer run from below it, only when there is
    # one; a bigger reserve only pushes more below, so this settles in a few rounds.
    reserve = {}
    for _ in range(6):
        placed = planner.plan(reserve)
        need = dict(reserve)
        for device in main:
            runs_from = ("disk",) if device == "cpu" else ("cpu", "disk")
            below = [(n, o) for n, o, d in placed if d in runs_from]
            if below:
                layer = max((sizes.get(n, 0) for n, _ in _layers(below, no_split)), default=0)
                need[device] = max(need.get(device, 0), layer)
        if need == reserve:
            break
        reserve = need
        planner._say(f"reserving room for the largest offloaded layer: {reserve}")
    else:
        placed = planner.plan(reserve)

    device_map = {name: device for name, _, device in placed}
    if not offload_buffers and main:
        runner = main[0]
        runs_from = ("disk",) if runner == "cpu" else ("cpu", "disk")
        offloaded = [o for _, o, d in placed if d in runs_from]
        buffer_bytes = sum(
            b.numel() * b.element_size()
            for o in offloaded
            for b in (o.buffers() if isinstance(o, torch.nn.Module) else [])
        )
        used = sum(sizes.get(n, 0) for n, _, d in placed if d == runner)
        if buffer_bytes and capacity.get(runner) is not None and used + buffer_bytes > capacity[runner]:
            logger.warning(
                "The offloaded modules' buffers (%d bytes) stay on %r and may not fit in its budget; pass "
                "offload_buffers=True to offload them too.",
                buffer_bytes,
                runner,
            )
    if clean_result:
        device_map = clean_device_map(device_map)
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
