"""AcceleratedOptimizer: an optimizer that steps only when gradients are synced, and knows when
an fp16 step was skipped."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .state import GradientState, PartialState
from .utils.dataclasses import DistributedType


def _move_state_to_param_devices(optimizer: torch.optim.Optimizer) -> None:
    """Put each parameter's optimizer state on that parameter's device (state built or loaded elsewhere).

    Per parameter rather than to one accelerator device, so params that live on different devices
    (offloaded, sharded by hand) keep their state beside them. A non-capturable, non-fused "step"
    counter stays where it is: torch keeps it on the CPU on purpose.
    """
    for group in optimizer.param_groups:
        device_step = group.get("capturable", False) or group.get("fused", False)
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if not isinstance(value, torch.Tensor) or value.device == param.device:
                    continue
                if key == "step" and not device_step:
                    continue
                state[key] = value.to(param.device)


def _found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> Optional[bool]:
    """Whether the scaler's last step of `optimizer` found inf/nan gradients (None: cannot tell).

    Read before `update()`, which clears it. Watching whether `optimizer.step` gets called is not
    enough: a fused optimizer (`_step_supports_amp_scaling`) is called even on an overflow and
    skips inside its kernel.
    """
    per_optimizer = getattr(scaler, "_per_optimizer_states", None)
    if per_optimizer is None or id(optimizer) not in per_optimizer:
        return None
    found = per_optimizer[id(optimizer)].get("found_inf_per_device")
    if not found:
        return None
    return any(bool(v.item()) for v in found.values())


def _xla_reduce_gradients(optimizer: torch.optim.Optimizer, world_size: int) -> None:
    # XLA has no DDP here: average the gradients across replicas before stepping.
    import torch_xla.core.xla_model as xm

    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / world_size)


def _wrapped_attribute(name: str) -> property:
    """The wrapped optimizer's attribute `name`, read and written through (schedulers assign them)."""
    return property(
        lambda self: getattr(self.optimizer, name),
        lambda self, value: setattr(self.optimizer, name, value),
    )


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer`: step / zero_grad act only on gradient-sync steps; fp16 goes through `scaler`.

    Still an `torch.optim.Optimizer` (isinstance holds), so LR schedulers and user code accept it;
    anything not defined here is read from the wrapped optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device_placement: bool = True, scaler=None) -> None:
        # No super().__init__(): the wrapped optimizer owns param_groups, state and hooks.
        self.optimizer = optimizer
        self.scaler = scaler
        self.device_placement = device_placement
        # accelerate's name for the flag: code written for accelerate (its tests too) sets it directly.
        self._is_overflow = False
        if device_placement:
            # The model may have moved after this optimizer built (or loaded) its state.
            _move_state_to_param_devices(optimizer)

    def __getattr__(self, name: str):
        # Only reached for names not found normally; guard against recursion while unpickling.
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None or name.startswith("__"):
            raise AttributeError(f"'AcceleratedOptimizer' object has no attribute {name!r}")
        return getattr(optimizer, name)

    # -- the wrapped optimizer's surface ------------------------------------------------------
    @property
    def gradient_state(self) -> GradientState:
        # Looked up each time, not stored: a pickled copy must keep sharing the process's state.
        return GradientState()

    param_groups = _wrapped_attribute("param_groups")
    state = _wrapped_attribute("state")
    defaults = _wrapped_attribute("defaults")

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        # torch already casts each state tensor to its param's device and dtype; an optimizer that
        # overrides load_state_dict may not, hence the pass after it.
        self.optimizer.load_state_dict(state_dict)
        if self.device_placement:
            _move_state_to_param_devices(self.optimizer)

    def train(self) -> None:
        """Switch a schedule-free style optimizer to training mode (no-op for others)."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    # -- stepping -----------------------------------------------------------------------------
    @property
    def step_was_skipped(self) -> bool:
        """True when the last step was skipped because the fp16 gradients overflowed (inf/nan)."""
        return self._is_overflow

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        if not self.gradient_state.sync_gradients:
            return  # accumulating: the gradients are still needed
        if set_to_none is None:
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None):
        gradient_state = self.gradient_state
        if not gradient_state.sync_gradients:
            return None
        state = PartialState()
        if state.distributed_type == DistributedType.XLA and state.num_processes > 1:
            if not gradient_state._is_xla_gradients_synced:
                _xla_reduce_gradients(self.optimizer, state.num_processes)
            gradient_state._is_xla_gradients_synced = False
        if self.scaler is None:
            self._is_overflow = False
            return self.optimizer.step() if closure is None else self.optimizer.step(closure)
        # The base class's get_scale: a SharedGradScaler's own would apply an update still due from
        # another optimizer's step on this backward, before this optimizer unscales.
        scale_before = torch.amp.GradScaler.get_scale(self.scaler)
        # GradScaler rejects a closure while enabled; pass one only when given, so its error shows.
        result = (
            self.scaler.step(self.optimizer) if closure is None else self.scaler.step(self.optimizer, closure)
        )
        skipped = _found_inf(self.scaler, self.optimizer)
        defer = getattr(self.scaler, "defer_update", None)
        if skipped is not None and defer is not None:
            defer()  # updated once before the next scale(), after every optimizer of this backward
        else:
            self.scaler.update()
            if skipped is None:
                # Fallback where the scaler keeps no per-optimizer record: an overflow lowers the scale.
                skipped = self.scaler.get_scale() < scale_before
        self._is_overflow = bool(skipped)
        return result

    # -- pickling -----------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        # An LR scheduler built on this wrapper patched `step` with a weakref closure: drop it.
        state.pop("step", None)
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        if "_step_was_skipped" in state:  # pickled by an earlier build, under our old name
            state["_is_overflow"] = state.pop("_step_was_skipped")
        self.__dict__.update(state)
