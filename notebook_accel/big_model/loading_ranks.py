"""Loading a checkpoint across ranks: rank 0 reads it for everyone, and sharded parameters take
their part of it. `loading.load_checkpoint_in_model` uses these for `broadcast_from_rank0` (only
rank 0 has the files: it sends each tensor, in the order every rank loads them) and for DTensor
parameters, as FSDP2 makes them (`full_state_dict`: the checkpoint's tensor is the whole one, or
this rank's shard).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .weights_files import CheckpointReadError, _WeightsFile, checkpoint_files


def process_group_rank() -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "broadcast_from_rank0=True needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group() (or create the Accelerator) first."
        )
    return dist.get_rank()


def is_dtensor(tensor) -> bool:
    import sys

    if "torch.distributed.tensor" not in sys.modules:  # nothing can be a DTensor yet
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def load_shard(owner: torch.nn.Module, local: str, value: torch.Tensor, full: bool) -> None:
    """Put `value` into the DTensor `owner.<local>`: shard it (`full`), or take it as this rank's shard."""
    import inspect

    from torch.distributed.tensor import DTensor, distribute_tensor

    old = getattr(owner, local)
    mesh, placements = old.device_mesh, old.placements
    device = old.to_local().device
    if device.type == "meta":  # sharded on meta (FSDP2 before loading): the mesh's device
        index = torch.cuda.current_device() if mesh.device_type == "cuda" else None
        device = (
            torch.device(mesh.device_type, index) if index is not None else torch.device(mesh.device_type)
        )
    want = tuple(old.shape) if full else tuple(old.to_local().shape)
    if tuple(value.shape) != want:
        raise ValueError(
            f'Trying to set a tensor of shape {value.shape} in "{local}" (which has shape {torch.Size(want)}'
            f"{'' if full else ', its local shard'}), this looks incorrect."
        )
    value = value.to(device)
    if not full:
        new = DTensor.from_local(value, mesh, placements, run_check=False)
    elif "src_data_rank" in inspect.signature(distribute_tensor).parameters:
        new = distribute_tensor(value, mesh, placements, src_data_rank=None)  # every rank has it: no traffic
    else:
        new = distribute_tensor(value, mesh, placements)
    if old.to_local().device.type != "meta":
        with torch.no_grad():
            old.copy_(new)  # in place: FSDP2 keeps its own references to its sharded parameters
    elif local in owner._parameters:
        owner._parameters[local] = torch.nn.Parameter(new, requires_grad=old.requires_grad)
    else:
        owner._buffers[local] = new


def broadcast_files(checkpoint, rank: int) -> list:
    """Rank 0's weights files as every rank reads them: rank 0 opens them and sends their listing."""
    import torch.distributed as dist

    files, box = [], [None]
    if rank == 0:
        try:
            files = [_WeightsFile(path) for path in checkpoint_files(checkpoint)]
            box = [[[(n, f.dtype(n), f.shape(n)) for n in f.names] for f in files]]
        except Exception as exc:  # the others would wait for rank 0 for ever: tell them
            box = [f"{type(exc).__name__}: {exc}"]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise CheckpointReadError(f"Rank 0 could not read the checkpoint {os.fspath(checkpoint)}: {box[0]}")
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    return [_Received(files[i] if files else None, listing, device) for i, listing in enumerate(box[0])]


class _Received:
    """One of rank 0's weights files, read through broadcasts: each `read` is one collective, so
    every rank reads the same names in the same order (same model, same device map)."""

    safetensors = False  # not a file every rank can point at: disk entries are written out

    def __init__(self, source: Optional[_WeightsFile], listing: list, device: torch.device):
        self.source, self.device = source, device
        self.path = source.path if source is not None else "<rank 0's checkpoint>"
        self.names = [name for name, _, _ in listing]
        self._info = {name: (dtype, shape) for name, dtype, shape in listing}

    def dtype(self, name: str):
        return self._info[name][0]

    def shape(self, name: str) -> list:
        return list(self._info[name][1])

    def read(self, name: str) -> torch.Tensor:
        import torch.distributed as dist

        dtype, shape = self._info[name]
        if dtype is None:
            raise CheckpointReadError(
                f"{name!r} in {self.path} has a dtype torch cannot hold: it cannot be sent."
            )
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        tensor = self.source.read(name) if self.source is not None else None
        if nbytes == 0:
            return tensor if tensor is not None else torch.empty(shape, dtype=dtype)
        if tensor is not None:  # as raw bytes: every backend sends uint8, not every dtype
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device)
        else:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dist.broadcast(flat, src=0)
        if tensor is not None:
            return tensor
        return flat.cpu().view(dtype).reshape(shape)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
