"""Read the variables a launcher sets (torchrun / elastic, MPI, ours) into one record."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

# Our launcher sets the torchrun names too; these extra ones carry what torchrun has no name for.
MIXED_PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"
DEBUG_ENV = "ACCELERATE_DEBUG_MODE"
USE_CPU_ENV = "ACCELERATE_USE_CPU"
LAUNCHER_ENV = "NOTEBOOK_ACCEL_LAUNCHER"

_MPI_SCHEMES = (
    # (rank, size, local rank, local size) variable names, by MPI implementation.
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    source: str = "single"  # "single" | "torchrun" | "mpi" | "notebook_accel"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; unset it or give a whole number.") from None


def parse_bool(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on", "y")


def read_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Build a LaunchEnv from `env` (default: os.environ); inconsistent variables raise."""
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT")

    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None or world is not None:
        if world is None:
            raise ValueError(
                f"RANK={rank} is set but WORLD_SIZE is not; set both (as torchrun does) or neither."
            )
        if rank is None:
            raise ValueError(
                f"WORLD_SIZE={world} is set but RANK is not; set RANK for each process (torchrun does), "
                "or unset WORLD_SIZE for a single process."
            )
        local_rank = _int(env, "LOCAL_RANK")
        local_world = _int(env, "LOCAL_WORLD_SIZE")
        source = "notebook_accel" if env.get(LAUNCHER_ENV) else "torchrun"
        return _checked(rank, world, local_rank, local_world, addr, port, source)

    for r_name, s_name, lr_name, ls_name in _MPI_SCHEMES:
        rank, world = _int(env, r_name), _int(env, s_name)
        if rank is None or world is None:
            continue
        return _checked(rank, world, _int(env, lr_name), _int(env, ls_name), addr, port, "mpi")

    return LaunchEnv(master_addr=addr, master_port=port)


def _checked(rank, world, local_rank, local_world, addr, port, source) -> LaunchEnv:
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world} must be at least 1.")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside 0..{world - 1} for WORLD_SIZE={world}.")
    if local_world is None:
        # Without a local size we can only assume one node.
        local_world = world
    if local_rank is None:
        local_rank = rank % local_world
    if not 0 <= local_rank < local_world:
        raise ValueError(
            f"LOCAL_RANK={local_rank} is outside 0..{local_world - 1} for LOCAL_WORLD_SIZE={local_world}."
        )
    return LaunchEnv(rank, world, local_rank, local_world, addr, port, source)
