"""Copying weights read ahead to the device that will use them, off the forward's path.

On a CUDA execution device, `CudaStager` copies each CPU tensor into pinned memory (a plain
memcpy, on the read-ahead thread) and from there to the device with `non_blocking=True` on a
stream of its own, so the copy overlaps the forward of the hook before; the forward that needs
the weights makes its stream wait for that copy, nothing more. `PlainStager` does the same with a
plain copy and no stream: it is what the tests run on the CPU, where there is no pinned memory or
stream to overlap with. Other devices are not staged (the hook copies when it runs, as before).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class Staged:
    """Tensors already on their way to the device; `ready()` returns them usable on the current
    stream."""

    def __init__(self, tensors: dict, event=None, device=None):
        self.tensors = tensors
        self.event = event
        self.device = device

    def ready(self) -> dict:
        if self.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.event)
            for tensor in self.tensors.values():
                # Allocated on the side stream, used and freed on this one: the allocator must
                # not hand the memory back to the side stream while this one still reads it.
                tensor.record_stream(stream)
        return self.tensors


class PlainStager:
    def __init__(self, device):
        self.device = torch.device(device)

    def stage(self, tensors: dict, release: Optional[Callable] = None) -> Staged:
        staged = {name: _copy(tensor, self.device) for name, tensor in tensors.items()}
        if release is not None:
            release(list(tensors.values()))  # the copies hold the data now
        return Staged(staged)


def _copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor.clone()
    return tensor.to(device)


class CudaStager:
    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    def stage(self, tensors: dict, release: Optional[Callable] = None) -> Staged:
        staged = {}
        with torch.cuda.stream(self.stream):
            for name, tensor in tensors.items():
                if tensor.device.type != "cpu":
                    staged[name] = tensor.to(self.device, non_blocking=True)
                    continue
                host = tensor
                if not tensor.is_pinned():
                    # Freed at the end of this call: the caching host allocator does not reuse
                    # pinned memory before the copy that reads it has finished.
                    host = torch.empty_like(tensor, pin_memory=True).copy_(tensor)
                staged[name] = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        if release is not None:
            release(list(tensors.values()))  # the pinned copies hold the data now
        return Staged(staged, event, self.device)


def _device(device) -> Optional[torch.device]:
    if device is None:
        return None
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def stages(device) -> bool:
    """Whether weights for `device` are staged (a CUDA device; checked without initialising CUDA
    for any other)."""
    device = _device(device)
    return device is not None and device.type == "cuda" and torch.cuda.is_available()


def stager_for(device) -> Optional[object]:
    """The stager for an execution device: CudaStager for a CUDA device, None for the others."""
    return CudaStager(_device(device)) if stages(device) else None
