"""Module-level functions the launcher tests run on ranks.

They live in a module of their own so that spawn and forkserver children import them by reference
(cheap: only the standard library at the top) instead of importing a test module.
"""

from __future__ import annotations

import os
import sys
import time


def rank_of_this_process() -> int:
    return int(os.environ["RANK"])


def rank_info(tag=None, rank0_delay: float = 0.0) -> dict:
    """What a rank sees: state, process group, environment. Rank 0 may finish last on purpose."""
    import torch
    import torch.distributed as dist

    from notebook_accel.state import AcceleratorState

    state = AcceleratorState()
    total = torch.tensor([float(state.process_index)])
    dist.all_reduce(total)
    if state.process_index == 0 and rank0_delay:
        time.sleep(rank0_delay)
    return {
        "pid": os.getpid(),
        "rank": state.process_index,
        "local_rank": state.local_process_index,
        "world": state.num_processes,
        "local_world": state.num_local_processes,
        "type": state.distributed_type,
        "mixed_precision": state.mixed_precision,
        "rank_sum": total.item(),
        "env_rank": int(os.environ["RANK"]),
        "env_local_rank": int(os.environ["LOCAL_RANK"]),
        "master_port": int(os.environ["MASTER_PORT"]),
        "threads": torch.get_num_threads(),
        "tag": tag,
    }


def raise_on_rank(fail_rank: int, marker_path: str, sleep_s: float = 20.0) -> str:
    """`fail_rank` raises at once; every other rank sleeps, then leaves a file behind."""
    rank = rank_of_this_process()
    if rank == fail_rank:
        raise ValueError(f"boom on rank {rank}")
    time.sleep(sleep_s)
    with open(f"{marker_path}.{rank}", "w") as f:
        f.write("ran to completion")
    return "finished"


def raise_after_group_is_up(fail_rank: int) -> str:
    """All ranks join the process group; `fail_rank` raises while the others wait in a barrier."""
    import torch.distributed as dist

    from notebook_accel.state import PartialState

    PartialState()
    if rank_of_this_process() == fail_rank:
        raise RuntimeError("root cause on this rank")
    dist.barrier()
    return "unreachable"


def kill_self_on_rank(fail_rank: int, marker_path: str) -> str:
    import signal

    rank = rank_of_this_process()
    if rank == fail_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(20)
    with open(f"{marker_path}.{rank}", "w") as f:
        f.write("ran to completion")
    return "finished"


def segfault_on_rank(fail_rank: int, marker_path: str) -> str:
    import ctypes
    import faulthandler

    rank = rank_of_this_process()
    if rank == fail_rank:
        faulthandler.disable()  # pytest's handler would dump this rank's stack to the terminal
        ctypes.string_at(0)
    time.sleep(20)
    with open(f"{marker_path}.{rank}", "w") as f:
        f.write("ran to completion")
    return "finished"


def sleep_then_touch(marker_path: str, sleep_s: float = 20.0) -> str:
    time.sleep(sleep_s)
    with open(f"{marker_path}.{rank_of_this_process()}", "w") as f:
        f.write("ran to completion")
    return "finished"


def write_every_way() -> int:
    """Output through Python, raw file descriptors and C stdio, on both streams."""
    import ctypes

    rank = rank_of_this_process()
    print(f"print from rank {rank}")
    os.write(1, f"fd1 from rank {rank}\n".encode())
    os.write(2, f"fd2 from rank {rank}\n".encode())
    print(f"stderr print from rank {rank}", file=sys.stderr)
    libc = ctypes.CDLL(None)
    libc.puts(f"from C on rank {rank}".encode())
    libc.fflush(None)
    os.write(1, f"unterminated from rank {rank}".encode())
    return rank


def many_lines(count: int) -> int:
    rank = rank_of_this_process()
    for i in range(count):
        print(f"{rank} {i}")
    return count


def big_stderr(megabytes: int) -> str:
    line = "e" * 1023 + "\n"
    for _ in range(megabytes):
        sys.stderr.write(line * 1024)
    sys.stderr.flush()
    return "done"


def parallel_math() -> tuple:
    """A matmul and a large reduction: the first multi-threaded ops of a rank."""
    import torch

    product = torch.ones(256, 256) @ torch.ones(256, 256)
    total = torch.ones(1_000_000).sum()
    return float(product[0, 0]), float(total), torch.get_num_threads()


def put_in_queue(queue, items: int, size: int) -> int:
    rank = rank_of_this_process()
    for i in range(items):
        queue.put((rank, i, "q" * size))
    return rank


def progress_bar(steps: int) -> int:
    """Redraw one line with '\\r' as tqdm does off a terminal, then end it with a newline."""
    for i in range(steps + 1):
        sys.stderr.write(f"\rstep: {100 * i // steps:3d}%| {i}/{steps}")
        sys.stderr.flush()
    sys.stderr.write("\n")
    print("after the bar")
    return steps


def sleep_and_return(seconds: float) -> int:
    time.sleep(seconds)
    return int(os.environ["RANK"])


def start_a_sleeper(marker_path: str) -> int:
    """Starts a grandchild that would outlive the rank, writes its pid to a file, and returns."""
    import subprocess

    sleeper = subprocess.Popen(["sleep", "300"])
    with open(f"{marker_path}.{os.environ['RANK']}", "w") as f:
        f.write(str(sleeper.pid))
    return sleeper.pid


def tensors_to_return(megabytes: int) -> dict:
    """A large tensor, views sharing its storage, a Parameter, a transposed matrix, an empty one."""
    import numpy as np
    import torch

    rank = int(os.environ["RANK"])
    big = torch.full((megabytes << 18,), float(rank))
    matrix = torch.arange(12.0).reshape(3, 4)
    return {
        "big": big,
        "head": big[:5],
        "param": torch.nn.Parameter(torch.ones(3, 4, dtype=torch.bfloat16)),
        "matrix": matrix,
        "transposed": matrix.t(),
        "empty": torch.empty(0, 3),
        "array": np.arange(10),
        "text": "x",
    }


def xla_rank(tag: str) -> tuple:
    """A TPU rank (tests/xla_standin): says its ordinal and returns it with its pid."""
    import torch_xla.runtime as xr

    # One write per line: ranks that are threads of one process share its stdout (TPU v2/v3), and
    # print() writes the text and its newline apart.
    sys.stdout.write(f"ordinal {xr.global_ordinal()} {tag}\n")
    sys.stderr.write(f"to stderr {xr.global_ordinal()}\n")
    return xr.global_ordinal(), os.getpid()


def xla_fail_on(failing: int, marker: str) -> None:
    """Ordinal `failing` raises; the others would sleep, then leave a marker file, unless stopped."""
    import torch_xla.runtime as xr

    if xr.global_ordinal() == failing:
        raise ValueError(f"ordinal {failing} gives up")
    time.sleep(20.0)
    with open(f"{marker}.{xr.global_ordinal()}", "w"):
        pass


def _wait_for(path: str, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def hold_memory(megabytes: int, go_path: str) -> bool:
    """Touches `megabytes` of fresh memory and holds it until `go_path` exists (the test saw it
    sampled) or a minute passed; returns whether it was told to go."""
    block = bytearray(megabytes << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    told = _wait_for(f"{go_path}.{os.environ['RANK']}")
    return told and len(block) > 0


def outgrow_cgroup(cgroup_dir: str, go_path: str) -> None:
    """Rank 1 moves itself into `cgroup_dir`, waits for `go_path` (the launcher has seen it there),
    then allocates 8 MiB at a time until the kernel kills it; the other ranks wait to be stopped."""
    if os.environ["RANK"] != "1":
        time.sleep(120)
        return
    with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    if not _wait_for(go_path):
        raise TimeoutError("the launcher never reported this rank in its cgroup")
    blocks = []
    while True:
        block = bytearray(8 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        blocks.append(block)
        time.sleep(0.01)


def where_this_rank_runs(name: str) -> dict:
    """What a rank sees of its launcher: its parent, priority, one variable, sys.path and folder."""
    return {
        "ppid": os.getppid(),
        "priority": os.getpriority(os.PRIO_PROCESS, 0),
        "variable": os.environ.get(name),
        "path": list(sys.path),
        "cwd": os.getcwd(),
    }


def servers_a_rank_starts() -> list:
    """A rank importing notebook_accel and asking for an early forkserver: what processes it starts."""
    import psutil

    import notebook_accel  # noqa: F401
    from notebook_accel.jupyter import prewarm as in_a_kernel
    from notebook_accel.launch import prewarm

    in_a_kernel()
    prewarm.start()
    return [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]


def join_unless_rank(skip: int) -> int:
    """Every rank but `skip` creates the state (joins the group); `skip` returns at once."""
    rank = int(os.environ["RANK"])
    if rank != skip:
        from notebook_accel import PartialState

        PartialState()
    return rank


def process_name() -> dict:
    """This rank's pid, parent and name (what `ps` shows)."""
    with open("/proc/self/comm") as f:
        return {"pid": os.getpid(), "ppid": os.getppid(), "name": f.read().strip()}


def join_with_rank0_late(delay: float) -> dict:
    """Rank 0 begins joining the group `delay` s after the others; what each rank's wait for rank 0's
    store (utils/peers.wait_for_listener) returned, and when, against when rank 0 began joining."""
    from notebook_accel.state import PartialState
    from notebook_accel.utils import peers

    seen = {}
    probe = peers.wait_for_listener

    def watched(*args, **kwargs):
        seen["listening"] = probe(*args, **kwargs)
        seen["at"] = time.time()
        return seen["listening"]

    peers.wait_for_listener = watched
    if os.environ["RANK"] == "0":
        time.sleep(delay)
    seen["began"] = time.time()
    PartialState()
    return seen
