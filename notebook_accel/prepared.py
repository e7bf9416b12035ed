"""What `Accelerator.prepare` produced, in one place: the prepared models, optimizers, schedulers and
data loaders, the objects registered for checkpointing, and the save / load state pre-hooks.

The Accelerator fills it; checkpointing.py and fsdp_checkpoint.py read it through these names, never
through the Accelerator's private attributes. Order matters: a checkpoint's files are numbered by it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from torch.utils.hooks import RemovableHandle

from .utils.other import get_pretty_name

HOOK_KINDS = ("save", "load")


class Prepared:
    """The registry of one Accelerator (accelerate's `_models`, `_optimizers`, ... read through to it)."""

    def __init__(self) -> None:
        self.models: list = []
        self.optimizers: list = []
        self.schedulers: list = []
        self.dataloaders: list = []
        self.custom_objects: list = []
        self.pre_hooks = {kind: OrderedDict() for kind in HOOK_KINDS}  # id -> hook, in registration order

    def keep(self, obj, kind: str) -> None:
        """Add `obj` to the list of `kind` ("models", "optimizers", ...) unless it is there already."""
        items = getattr(self, kind)
        if not any(item is obj for item in items):
            items.append(obj)

    def register_for_checkpointing(self, *objects) -> None:
        """Save and restore `objects` (each with state_dict() and load_state_dict()) with the rest, in order."""
        bad = [
            f"\n\t- Item at index {i}, `{get_pretty_name(obj)}`"
            for i, obj in enumerate(objects)
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))
        ]
        if bad:
            raise ValueError(
                "All `objects` must include a `state_dict` and `load_state_dict` function to be stored. "
                "The following inputs are invalid:" + "".join(bad)
            )
        self.custom_objects.extend(objects)

    def add_state_pre_hook(self, kind: str, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook` before every save_state (kind "save") or load_state ("load"); remove it by the handle."""
        if not callable(hook):
            raise TypeError(f"register_{kind}_state_pre_hook takes a function, got {hook!r}.")
        hooks = self.pre_hooks[kind]
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def run_state_pre_hooks(self, kind: str, *args) -> None:
        for hook in list(self.pre_hooks[kind].values()):
            hook(*args)

    def forget(self) -> None:
        """Drop the prepared objects (free_memory); registered objects and hooks stay, as in accelerate."""
        for items in (self.models, self.optimizers, self.schedulers, self.dataloaders):
            items.clear()


def registry_property(name: str) -> property:
    """accelerate's `Accelerator._<name>` as a view of `self._prepared.<name>` (user code and transformers read them)."""

    def get(self):
        return getattr(self._prepared, name)

    def set_(self, value) -> None:
        setattr(self._prepared, name, value)

    return property(get, set_, doc=f"`self._prepared.{name}`")
