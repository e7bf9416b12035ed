"""`LocalSGD`: each process trains on its own for a few steps, then the processes average their
parameters (fewer all-reduces than DDP's one per backward)."""

from __future__ import annotations

import torch

from .utils.dataclasses import DistributedType


class LocalSGD:
    """Use as `with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:` around the loop,
    calling `local_sgd.step()` after each `optimizer.step()`.

    Inside the block DDP's gradient all-reduce is off (`accelerator.no_sync(model)`): every process
    steps on its own gradients. Every `local_sgd_steps`-th `step()`, and once more when the block
    ends, every parameter is replaced by its mean over the processes. In one process, or with
    `enabled=False`, it does nothing.
    """

    def __init__(self, accelerator, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        kind = accelerator.distributed_type
        if kind != DistributedType.NO and (not str(kind).startswith("MULTI_")):
            raise NotImplementedError(
                f"LocalSGD averages parameters across CPU or GPU processes; distributed_type={kind} is not supported."
            )
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or local_sgd_steps < 1:
            raise ValueError(f"local_sgd_steps={local_sgd_steps!r}: pass a positive integer (steps between averages).")
        self.enabled = bool(enabled) and kind != DistributedType.NO
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync = None

    def __enter__(self) -> "LocalSGD":
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, kind, value, tb):
        if not self.enabled:
            return None
        try:
            if kind is None:  # an error on one rank must not leave the others waiting in a collective
                self._average()
        finally:
            self._no_sync.__exit__(kind, value, tb)
            self._no_sync = None
        return None

    def step(self) -> None:
        """Count one optimizer step; average the parameters when it is a sync step."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    def _average(self) -> None:
        self.accelerator.wait_for_everyone()
        with torch.no_grad():
            for param in self.model.parameters():
                param.copy_(self.accelerator.reduce(param.detach(), reduction="mean"))
