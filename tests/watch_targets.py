"""Functions the stall-watch tests launch (importable by spawn and forkserver ranks)."""

from __future__ import annotations

import time


def mismatch(odd_one: int = 0):
    """Rank `odd_one` waits in all_reduce, the others in barrier: a stall that never ends."""
    import torch
    import torch.distributed as dist

    from notebook_accel import PartialState

    state = PartialState()
    print("ready", flush=True)
    t = torch.ones(4)
    if state.process_index == odd_one:
        dist.all_reduce(t)
    else:
        dist.barrier()


def ddp_mismatch():
    """Rank 0's backward makes DDP all-reduce its gradient bucket from C++; rank 1 waits in barrier."""
    import torch
    import torch.distributed as dist

    from notebook_accel import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    loss = model(torch.randn(4, 8)).sum()
    print("ready", flush=True)
    if accelerator.process_index == 0:
        accelerator.backward(loss)
    else:
        dist.barrier()


def one_more_all_reduce():
    """Rank 0 runs one more all_reduce than rank 1, which returns normally."""
    import torch
    import torch.distributed as dist

    from notebook_accel import PartialState

    state = PartialState()
    t = torch.ones(4)
    dist.all_reduce(t)
    if state.process_index == 0:
        dist.all_reduce(t)
    return state.process_index


def quiet_then_talk(seconds: float):
    """Silent, in no collective, for `seconds`; then each rank prints and returns."""
    import os

    time.sleep(seconds)
    print("moving again", flush=True)
    return int(os.environ["RANK"])


def serves_the_watch() -> bool:
    """Whether this rank serves its stacks and collectives to the launcher's watch."""
    import os

    from notebook_accel.launch import watch_rank

    return watch_rank._server is not None and os.path.exists(watch_rank.socket_path(os.getpid()))


def _slept(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


class SlowToLoad:
    """An argument that takes `seconds` to unpickle in a rank, where it becomes the number."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __reduce__(self):
        return (_slept, (self.seconds,))


def identity(value):
    return value
