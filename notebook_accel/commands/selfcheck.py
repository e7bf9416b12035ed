"""`notebook-accel test`: a short distributed self-check on CPU ranks, "success" or what failed."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p) -> None:
    p.add_argument(
        "--num_processes",
        type=int,
        default=2,
        choices=range(2, 9),
        metavar="N",
        help="CPU ranks to start (2..8, default 2)",
    )


def check_rank() -> str:
    """Runs on every rank; raises AssertionError saying what differs from the expected value."""
    import torch

    from ..state import PartialState
    from ..utils import broadcast, gather, gather_object

    state = PartialState()
    rank, world = state.process_index, state.num_processes
    _expect("distributed type", str(state.distributed_type), "MULTI_CPU")
    _expect("process group", torch.distributed.is_initialized(), True)
    _expect("world size", torch.distributed.get_world_size(), world)
    total = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(total)
    _expect("all_reduce sum", total.item(), world * (world + 1) / 2)
    _expect("gather", gather(torch.tensor([rank])).tolist(), list(range(world)))
    _expect("gather_object", gather_object([f"rank{rank}"]), [f"rank{r}" for r in range(world)])
    _expect("broadcast from rank 0", broadcast(torch.tensor([float(rank) + 7.0])).item(), 7.0)
    state.wait_for_everyone()
    return f"rank {rank} of {world}: ok"


def _expect(what: str, got, wanted) -> None:
    if got != wanted:
        raise AssertionError(f"{what}: expected {wanted!r}, got {got!r}")


def run(args: argparse.Namespace) -> int:
    from ..launch import LaunchConfigError, LaunchFailedError, ListSink, notebook_launcher

    n = args.num_processes
    print(f"Running the self-check on {n} CPU processes (gloo)...")
    try:
        # Every setting explicit, so a config file for real runs does not change the check.
        results = notebook_launcher(
            check_rank,
            num_processes=n,
            mixed_precision="no",
            use_port="auto",
            master_addr="127.0.0.1",
            node_rank=0,
            num_nodes=1,
            rdzv_backend="static",
            max_restarts=0,
            cpu=True,
            sinks=[ListSink()],
        )
    except (LaunchFailedError, LaunchConfigError) as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    for line in results:
        print(f"  {line}")
    print("success")
    return 0
