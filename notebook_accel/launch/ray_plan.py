"""A launch whose ranks are Ray actors on a cluster (engine="ray"): the plan's part. Every bad
argument fails here, before Ray is touched; starters/ray_engine.py runs the plan.

Ray places the ranks, so what places them on a machine (nodes, ports, rendezvous, start method,
device ids) is refused rather than silently ignored."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import RAY_PLACEMENTS
from .errors import LaunchConfigError

ENGINES = (None, "ray")
# Our names (as Ray Train's docs write them) -> Ray's placement strategies.
PLACEMENTS = {name: name.upper() for name in RAY_PLACEMENTS}
# Arguments that place ranks on machines: Ray does that, so passing one with engine="ray" is an error.
PLACED_BY_RAY = (
    "num_nodes",
    "node_rank",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_conf",
    "master_addr",
    "use_port",
    "start_method",
    "gpu_ids",
    "max_restarts",
    "pdb",
)
INSTALL = "pip install 'notebook_accel[ray]'"


@dataclass(frozen=True)
class RaySettings:
    address: Optional[str] = None  # None: the connected cluster, else $RAY_ADDRESS, else "auto"
    resources: dict = field(default_factory=lambda: {"CPU": 1})  # one bundle per rank, Ray's names
    placement: str = "PACK"  # Ray's strategy
    runtime_env: Optional[dict] = None  # passed to every rank's actor as it is


def check_engine(engine) -> Optional[str]:
    if engine not in ENGINES:
        raise LaunchConfigError(
            f"engine={engine!r} is not a launch engine: use None (this machine, or torch elastic across "
            "nodes, as the arguments say) or 'ray' (the ranks as actors on a Ray cluster)."
        )
    return engine


def refuse_placing(given: dict) -> None:
    """`given`: {argument: True when the caller passed it}."""
    passed = [name for name in PLACED_BY_RAY if given.get(name)]
    if passed:
        raise LaunchConfigError(
            f"engine='ray' places the ranks itself, so {', '.join(passed)} cannot be given with it; "
            "use num_processes (the world size over the cluster), resources_per_rank and placement."
        )


def refuse_without_ray(ray_address, resources_per_rank, placement, runtime_env) -> None:
    """Ray's arguments without engine="ray" would be ignored: say so instead."""
    given = {"ray_address": ray_address, "resources_per_rank": resources_per_rank, "runtime_env": runtime_env}
    passed = [f"{name}={value!r}" for name, value in given.items() if value is not None]
    if placement != "pack":
        passed.append(f"placement={placement!r}")
    if passed:
        raise LaunchConfigError(
            f"{', '.join(passed)} only apply with engine='ray': add it, or leave them out."
        )


def settings(ray_address, resources_per_rank, placement, runtime_env, cpu: bool) -> RaySettings:
    if ray_address is not None and (not isinstance(ray_address, str) or not ray_address):
        raise LaunchConfigError(
            f"ray_address={ray_address!r} must be a Ray address ('auto', 'host:6379', 'ray://host:10001') or None."
        )
    if placement not in PLACEMENTS:
        raise LaunchConfigError(f"placement={placement!r} is not one of {tuple(PLACEMENTS)}.")
    if runtime_env is not None and not isinstance(runtime_env, dict):
        raise LaunchConfigError(f"runtime_env={runtime_env!r} must be a dict (Ray's runtime_env) or None.")
    resources = _resources(resources_per_rank)
    if cpu and resources.get("GPU"):
        raise LaunchConfigError(
            f"resources_per_rank={resources_per_rank!r} asks for GPUs but cpu=True: drop one of them."
        )
    return RaySettings(ray_address, resources, PLACEMENTS[placement], runtime_env)


def _resources(value) -> dict:
    if value is None:
        return {"CPU": 1}
    if not isinstance(value, dict) or not value:
        raise LaunchConfigError(
            f"resources_per_rank={value!r} must be a dict of Ray resources for one rank, such as "
            "{'CPU': 1} or {'CPU': 1, 'GPU': 1}."
        )
    for name, amount in value.items():
        if not isinstance(name, str) or isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise LaunchConfigError(f"resources_per_rank={value!r}: each entry is a name and a number.")
        if amount < 0:
            raise LaunchConfigError(f"resources_per_rank={value!r}: {name} must be 0 or more, not {amount}.")
        if name == "GPU" and amount != int(amount):
            raise LaunchConfigError(
                f"resources_per_rank={value!r}: GPU must be a whole number (each rank uses cuda:LOCAL_RANK, its "
                "own GPU); ranks sharing a GPU are not supported."
            )
        if round(amount, 4) != amount:
            raise LaunchConfigError(f"resources_per_rank={value!r}: Ray counts {name} in steps of 0.0001.")
    if not any(value.values()):
        raise LaunchConfigError(
            f"resources_per_rank={value!r} asks for nothing: a rank needs at least one CPU."
        )
    return dict(value)


def threads(resources: dict) -> int:
    """OMP threads of a rank: the CPUs its bundle holds, at least one."""
    return max(1, int(resources.get("CPU", 1)))
