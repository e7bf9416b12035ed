"""Accelerator methods that ask about the run rather than drive it: `profile()`, `multi_device`,
`verify_device_map()`. A mixin of `Accelerator`, kept apart so the facade stays thin."""

from __future__ import annotations

import contextlib
import os
from typing import Optional

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
