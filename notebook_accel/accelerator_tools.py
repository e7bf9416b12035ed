"""Accelerator methods that ask about the run rather than drive it: `profile()`, `multi_device`,
`verify_device_map()`, and the save / load state pre-hooks' registry. A mixin of `Accelerator`,
kept apart so the facade stays thin."""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from typing import Callable, Optional

from torch.utils.hooks import RemovableHandle

from .utils.dataclasses import PROFILE_PATTERN_NAME, DistributedType, ProfileKwargs


class AcceleratorTools:
    """Mixed into `Accelerator`; uses its `state`, `process_index` and `wait_for_everyone()`."""

    profile_handler: Optional[ProfileKwargs] = None

    def _set_profile_handler(self, handlers: dict) -> None:
        """Keep the ProfileKwargs among the sorted kwargs_handlers, if any."""
        self.profile_handler = handlers.get(ProfileKwargs)

    @contextlib.contextmanager
    def profile(self, profile_handler: Optional[ProfileKwargs] = None):
        """Run the block under torch.profiler and yield the profiler (`prof.step()`, `prof.key_averages()`).

        Settings come from `profile_handler`, else the Accelerator's ProfileKwargs, else the defaults.
        With `output_trace_dir`, each process writes its Chrome trace there as
        `profile_<process_index>.json` after the block; then the processes wait for each other.
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        if not isinstance(handler, ProfileKwargs):
            raise TypeError(f"profile_handler must be a ProfileKwargs, got {type(handler).__name__}: {handler!r}")
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        name = PROFILE_PATTERN_NAME.format(suffix=self.process_index)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, name))
        self.wait_for_everyone()

    @property
    def multi_device(self) -> bool:
        """Several processes, each on its own accelerator device (not CPU processes, not XLA)."""
        kind = str(self.distributed_type)
        return bool(self.use_distributed) and kind.startswith("MULTI_") and kind != DistributedType.MULTI_CPU

    def verify_device_map(self, model) -> bool:
        """`model` (or a submodule) was dispatched over more than one device by a device map
        (big-model inference); such a model must not be prepared for data-parallel training."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

    # -- save_state / load_state pre-hooks (checkpointing.py calls them) ----------------------------
    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Have save_state call `hook(models, weights, output_dir)` on every process before it writes.

        `models` are the prepared models, `weights` their state dicts in a list the hook may edit
        (change a dict; remove one to save that model another way, and remove its model in the
        load pre-hook too). `output_dir` is the folder being written: it becomes the checkpoint's
        folder only once the save completes, so files the hook writes there are saved with it.
        Returns a handle; `handle.remove()` unregisters the hook.
        """
        return self._add_state_pre_hook("save", hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Have load_state call `hook(models, input_dir)` on every process before it loads anything.

        `models` is a list of the prepared models: remove one to load it yourself, and load_state
        leaves it alone. `input_dir` is the checkpoint's folder. Returns a handle to remove it by.
        """
        return self._add_state_pre_hook("load", hook)

    def _state_pre_hooks(self, kind: str) -> OrderedDict:
        # accelerate's attribute names; made on first use, so Accelerator.__init__ need not know.
        return self.__dict__.setdefault(f"_{kind}_model_state_pre_hook", OrderedDict())

    def _add_state_pre_hook(self, kind: str, hook) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"register_{kind}_state_pre_hook takes a function, got {hook!r}.")
        hooks = self._state_pre_hooks(kind)
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def _run_state_pre_hooks(self, kind: str, *args) -> None:
        for hook in list(self._state_pre_hooks(kind).values()):
            hook(*args)
