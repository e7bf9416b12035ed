"""What a device family implies for one process: distributed type, collective backend, device.

Pure (no probing): every family can be tested on a machine that has none. `hardware` says which
family is here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .utils import families
from .utils.dataclasses import DistributedType
from .utils.environment import LaunchEnv

# family -> (distributed type when world_size > 1, default collective backend), for the families
# that have a multi-process backend (mps has none).
FAMILIES = {
    f.name: (f.distributed_type, f.backend) for f in families.FAMILIES if f.distributed_type is not None
}


@dataclass(frozen=True)
class Placement:
    distributed_type: DistributedType
    backend: Optional[str]
    device: str  # a torch device string; XLA's is filled in by the XLA runtime


def several_on_cpu(family: Optional[str]) -> bool:
    """Several processes of `family` run on the CPU (MULTI_CPU): no accelerator, or one without a
    multi-process backend (mps)."""
    return family is None or family not in FAMILIES


def resolve_placement(
    env: LaunchEnv,
    family: Optional[str],
    cpu: bool = False,
    device_count: int = 1,
    backend: Optional[str] = None,
) -> Placement:
    """Map (launch env, device family) to what this process should use.

    CPU-only machines with world_size > 1 are MULTI_CPU on gloo, with the ranks the launcher gave:
    the user need not say cpu=True.
    """
    if cpu or family is None or family == "mps":  # mps: one device, no multi-process backend
        if env.distributed:
            return Placement(DistributedType.MULTI_CPU, backend or "gloo", "cpu")
        return Placement(DistributedType.NO, backend, "cpu" if family != "mps" or cpu else "mps")

    if family not in FAMILIES:
        raise ValueError(
            f"Unknown device family {family!r}; expected one of {sorted(FAMILIES)} or None for CPU."
        )
    multi_type, default_backend = FAMILIES[family]
    if family == "xla":
        return Placement(DistributedType.XLA, backend or default_backend, "xla")
    if env.distributed and env.local_rank >= device_count:
        raise ValueError(
            f"LOCAL_RANK={env.local_rank} needs {env.local_rank + 1} {family} devices but {device_count} "
            f"are visible; launch at most {device_count} processes per node, or pass cpu=True."
        )
    if not env.distributed:
        return Placement(DistributedType.NO, backend, f"{family}:0" if family != "neuron" else "xla")
    if family == "neuron":
        return Placement(multi_type, backend or default_backend, "xla")
    return Placement(multi_type, backend or default_backend, f"{family}:{env.local_rank}")
