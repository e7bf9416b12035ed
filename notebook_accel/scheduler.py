"""AcceleratedScheduler: a learning-rate scheduler that follows the optimizer's real steps."""

from __future__ import annotations

from typing import Any

from .state import GradientState, PartialState

# Earlier versions saved batches counted during accumulation under this key; loading ignores it.
_OLD_PENDING_KEY = "_notebook_accel_pending_batches"


def _metric_driven(scheduler: Any) -> bool:
    # ReduceLROnPlateau counts evaluations (step(metric)), not samples: never repeat or skip it.
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    return isinstance(scheduler, ReduceLROnPlateau)


def _finished(scheduler: Any) -> bool:
    # Schedulers with a fixed length (OneCycleLR) raise when stepped past it.
    total = getattr(scheduler, "total_steps", None)
    return isinstance(total, int) and getattr(scheduler, "last_epoch", -1) >= total


class AcceleratedScheduler:
    """Wraps `scheduler` so that the schedule counts the samples the optimizer really trained on.

    With `step_with_optimizer` (the default), `step()`, as accelerate's does:
    - does nothing to the schedule while gradients are accumulating (not synced this step); with the
      gradient accumulation plugin's `adjust_scheduler` (its default) it only counts the call in
      torch's `_step_count`, so torch does not warn that the scheduler ran before the optimizer;
    - does nothing after an optimizer step skipped for fp16 overflow;
    - otherwise steps once with `split_batches`, or `num_processes` times without it (each process
      saw its own batch), stopping quietly at a fixed-length schedule's end.
    So a schedule is sized in optimizer steps times processes, whatever the accumulation.
    A metric-driven scheduler (ReduceLROnPlateau) steps exactly once per call.
    """

    def __init__(self, scheduler, optimizers, step_with_optimizer: bool = True, split_batches: bool = False):
        self.scheduler = scheduler
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches

    @property
    def gradient_state(self) -> GradientState:
        return GradientState()

    def step(self, *args, **kwargs) -> None:
        if not self.step_with_optimizer or _metric_driven(self.scheduler):
            self.scheduler.step(*args, **kwargs)
            return
        gradient_state = GradientState()
        if not gradient_state.sync_gradients:
            if gradient_state.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
                self.scheduler._step_count += 1
            return
        if any(getattr(opt, "step_was_skipped", False) for opt in self.optimizers):
            return
        for _ in range(1 if self.split_batches else PartialState().num_processes):
            if _finished(self.scheduler):
                break
            self.scheduler.step(*args, **kwargs)

    # -- passthrough ----------------------------------------------------------------------------
    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def get_lr(self):
        return self.scheduler.get_lr()

    def print_lr(self, *args, **kwargs):
        return self.scheduler.print_lr(*args, **kwargs)

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        state.pop(_OLD_PENDING_KEY, None)  # checkpoints of earlier builds: ignored
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str):
        scheduler = self.__dict__.get("scheduler")
        if scheduler is None or name.startswith("__"):
            raise AttributeError(f"'AcceleratedScheduler' object has no attribute {name!r}")
        return getattr(scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
