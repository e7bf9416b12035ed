"""Accelerator methods that ask about the run rather than drive it: `profile()`, `multi_device`,
`verify_device_map()`, the save / load state pre-hooks' registry, and the checkpoint methods
(`save_state`, `load_state`, `save_model`, `save`, `register_for_checkpointing`), which hand the
work to checkpointing.py / fsdp_checkpoint.py. A mixin of `Accelerator`, kept apart so the facade
stays thin."""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from typing import Callable, Optional, Union

import torch
from torch.utils.hooks import RemovableHandle

from .utils.dataclasses import PROFILE_PATTERN_NAME, DistributedType, ProfileKwargs
from .utils.other import get_pretty_name


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

    # -- checkpoints -----------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects):
        """Have save_state / load_state also save and restore `objects` (each with state_dict() and
        load_state_dict()), in this order."""
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
        self._custom_objects.extend(objects)

    def save_state(
        self, output_dir: Optional[str] = None, safe_serialization: bool = True, **save_model_func_kwargs
    ):
        """Save models, optimizers, schedulers, scaler, loaders' positions, registered objects and RNG."""
        from .fsdp_checkpoint import save_state  # checkpointing.save_state unless the run uses FSDP

        return save_state(self, output_dir, safe_serialization=safe_serialization)

    def load_state(
        self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **load_model_func_kwargs
    ):
        """Restore everything save_state wrote (no input_dir + automatic naming: the latest). Loaders
        resume mid-epoch only with use_stateful_dataloader=True, else replay the epoch (see docs/checkpoints.md).

        `load_model_func_kwargs` takes map_location, strict and trust_pickled_objects; `load_kwargs`
        (accelerate's torch.load keywords) may say map_location, or weights_only=False, which is
        trust_pickled_objects=True."""
        from .fsdp_checkpoint import load_state  # checkpointing.load_state unless the run uses FSDP

        load_state(self, input_dir, **_merge_load_kwargs(load_kwargs, load_model_func_kwargs))

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: Union[str, os.PathLike],
        max_shard_size: Union[int, str] = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write `model`'s weights (unwrapped) to `save_directory` as checkpointing.save_model does; the
        weights of modules offloaded to the CPU or disk by a device map are read back to save them too."""
        from .checkpointing import save_model
        from .utils.loading import get_state_dict_offloaded_model
        from .utils.other import has_offloaded_params

        if any(has_offloaded_params(m) for m in model.modules()):
            state_dict = get_state_dict_offloaded_model(self.unwrap_model(model))
        elif any(p.device.type == "meta" for p in model.parameters()):
            raise RuntimeError("You can't save the model since some parameters are on the meta device.")
        else:
            state_dict = self.get_state_dict(model)
        save_model(
            state_dict,
            save_directory,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            is_main_process=self.is_main_process,
        )
        self.wait_for_everyone()

    def save(self, obj, f, safe_serialization=False):
        """torch.save (or safetensors for a dict of tensors) on the main process only."""
        if not self.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(obj, f)
        else:
            torch.save(obj, f)


def _merge_load_kwargs(load_kwargs: Optional[dict], model_kwargs: dict) -> dict:
    """load_state's keywords as checkpointing.load_state takes them (see Accelerator.load_state)."""
    merged = dict(model_kwargs)
    extra = dict(load_kwargs or {})
    if "map_location" in extra:
        merged.setdefault("map_location", extra.pop("map_location"))
    if extra.pop("weights_only", True) is False:
        merged["trust_pickled_objects"] = True
    unknown = sorted(set(extra) | (set(merged) - {"map_location", "strict", "trust_pickled_objects"}))
    if unknown:
        raise TypeError(
            f"load_state() does not take {unknown}: it reads map_location, strict and trust_pickled_objects, "
            "and load_kwargs={'map_location': ..., 'weights_only': False}."
        )
    return merged
