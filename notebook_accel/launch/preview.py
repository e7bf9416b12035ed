"""What a launch here would use, told to a person: the hardware panel's and the extension's
"a launch here would use" rows, from the plan make_plan would make (launch/plan.py)."""

from __future__ import annotations

from typing import NamedTuple, Optional

from .plan import LaunchPlan, default, make_plan


class Preview(NamedTuple):
    """What a launch here would use, for the hardware panel and the extension's sidebar."""

    rows: list  # (label, value)
    notes: list  # what make_plan would print
    error: Optional[str]  # why a launch would refuse to start


def launch_preview() -> Preview:
    """What `notebook_launcher(fn)` would choose here, or why it would refuse.

    Uses make_plan, which probes without initialising CUDA, and the same placement the ranks
    would resolve.
    """
    from .. import hardware
    from ..placement import resolve_placement
    from ..utils.environment import USE_CPU_ENV, LaunchEnv

    try:
        plan = make_plan(num_processes=None, use_port=default("auto"))  # not chosen: a file's engine: ray applies
        if plan.engine == "ray":
            return _ray_preview(plan)
        cpu = plan.env.get(USE_CPU_ENV) == "1"
        family = None if cpu else hardware.detect_device_family()
        env = LaunchEnv(world_size=plan.world_size, local_world_size=plan.num_processes)
        placement = resolve_placement(env, family, cpu=cpu, device_count=plan.num_processes)
    except Exception as exc:
        return Preview([], [], str(exc) or type(exc).__name__)
    processes = str(plan.num_processes)
    if plan.num_nodes > 1:
        processes += f" per node × {plan.num_nodes} nodes"
    kind = "FSDP" if plan.fsdp and plan.world_size > 1 else str(placement.distributed_type)
    rows = [
        ("Distributed type", kind),
        ("Processes", processes),
        ("Backend", placement.backend or "none: one process, run in this kernel"),
        ("Start method", f"{plan.start_method} ({plan.engine} engine)"),
        ("Mixed precision", plan.mixed_precision),
    ]
    if plan.fsdp:
        rows.append(("FSDP", fsdp_summary(plan)))
    if plan.num_processes == 1 and plan.engine == "local":
        # One process is the default without accelerators; say what asking for more gives.
        many = resolve_placement(LaunchEnv(world_size=2, local_world_size=2), None, cpu=True)
        how = "num_processes=N" if family in (None, "mps") else "num_processes=N, cpu=True"
        kind_many = "FSDP" if plan.fsdp else str(many.distributed_type)
        rows.append((f"With {how}", f"{kind_many} on {many.backend}, N CPU processes"))
    return Preview(rows, list(plan.notes), None)


def _ray_preview(plan: LaunchPlan) -> Preview:
    """The config file's engine: ray: the ranks are placed on the cluster, which is not asked here."""
    gpus = plan.ray.resources.get("GPU")
    kind = "FSDP" if plan.fsdp else ("MULTI_GPU" if gpus else "MULTI_CPU")
    rows = [
        ("Distributed type", kind),
        ("Processes", f"{plan.num_processes} on the Ray cluster ({plan.ray.address or 'RAY_ADDRESS, else auto'})"),
        ("Backend", "nccl" if gpus else "gloo"),
        ("Start method", "ray (ray engine)"),
        ("Mixed precision", plan.mixed_precision),
        ("Each rank", ", ".join(f"{k} {v:g}" for k, v in plan.ray.resources.items()) + f", placed {plan.ray.placement.lower()}"),
    ]
    return Preview(rows, list(plan.notes), None)


def fsdp_summary(plan: LaunchPlan) -> str:
    """FSDP's settings in one line, as the ranks' plugin will read them (its defaults for the rest)."""
    settings = ", ".join(f"{k[len('FSDP_') :].lower()}={v}" for k, v in sorted(plan.fsdp_settings.items()))
    text = (
        f"on ({settings})" if settings else "on (the plugin's defaults: FSDP2, no_wrap, sharded state dict)"
    )
    if plan.world_size == 1:
        text += "; on one process FSDP shards nothing: launch 2 or more to shard"
    return text
