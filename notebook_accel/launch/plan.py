"""Arguments + config + hardware -> a frozen LaunchPlan. Every bad input fails here, before any
process starts (see shared/DESIGN.md, "The launch path as data")."""

from __future__ import annotations

import operator
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Optional

from ..utils import families
from . import limits, pdb_relay, ports, ray_plan, stall_settings
from .errors import LaunchConfigError
from .limits import MANY_PROCESSES_ENV, PROCESSES_PER_CORE  # noqa: F401  (their old home)
from .plan_config import CONFIGURABLE, default, engine_from_config, is_default, passed, with_config  # noqa: F401  (default, is_default: their old home)
from .ports import free_port  # noqa: F401  (its old home: tests, tools and benchmarks import it here)

START_METHODS = ("fork", "spawn", "forkserver")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")


# One machine, no agent: what a debug launch and an interactive session pass to make_plan, so a
# config file written for real runs cannot turn them into multi-node or elastic ones.
ONE_MACHINE = {
    "use_port": "auto",
    "master_addr": "127.0.0.1",
    "node_rank": 0,
    "num_nodes": 1,
    "rdzv_backend": "static",
    "max_restarts": 0,
}


@dataclass(frozen=True)
class LaunchPlan:
    num_processes: int  # on this node
    start_method: str
    engine: str  # "local" (our process manager), "elastic" (torch elastic agent), "xla" (xmp.spawn), "ray"
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    mixed_precision: str = "no"
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_conf: dict = field(default_factory=dict)
    rdzv_id: str = "none"
    max_restarts: int = 0
    stall_after: float = stall_settings.DEFAULT_STALL_AFTER  # seconds without progress; 0: off
    monitor_interval: float = 0.1
    log_line_prefix_template: Optional[str] = None
    threads_per_process: int = 1
    fsdp: bool = False  # the ranks build an FSDP plugin from FSDP_* (ACCELERATE_USE_FSDP is true)
    pdb: bool = False  # the first rank to fail stays in pdb, debugged from the launching thread
    port_held: bool = False  # master_port was picked here and is held until the launch ends (ports.py)
    ray: Optional[ray_plan.RaySettings] = None  # engine "ray": where and how Ray places the ranks
    notes: tuple = ()  # one-line messages the user should see (why a default was changed); the
    # launcher sends them to the sinks as LaunchNotice events (launcher.send_notes)
    env: dict = field(default_factory=dict)  # set in every child

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_nodes

    @property
    def chooses_devices(self) -> bool:
        """gpu_ids chose the devices: the ranks get a visible-devices variable (so none runs here)."""
        return any(name in self.env for name in _VISIBLE_ENV.values())

    @property
    def fsdp_settings(self) -> dict:
        """The FSDP_* variables this plan sets for its ranks (the plugin's settings), by variable."""
        return {k: v for k, v in self.env.items() if k.startswith("FSDP_")} if self.fsdp else {}

    def rank_env(self, local_rank: int) -> dict:
        rank = self.node_rank * self.num_processes + local_rank
        return {
            **self.env,
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.num_processes),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def make_plan(
    num_processes=None,
    mixed_precision=default("no"),
    use_port=default("29500"),
    master_addr=default("127.0.0.1"),
    node_rank=default(0),
    num_nodes=default(1),
    rdzv_backend=default("static"),
    rdzv_endpoint="",
    rdzv_conf=None,
    rdzv_id="none",
    max_restarts=default(0),
    monitor_interval=0.1,
    log_line_prefix_template=None,
    start_method=default("fork"),
    cpu: Optional[bool] = None,
    *,
    debug: Optional[bool] = None,
    gpu_ids: Optional[str] = None,
    config_file: Optional[str] = None,
    fsdp=None,
    stall_after=None,
    pdb=False,
    engine=None,
    ray_address=None,
    resources_per_rank=None,
    placement=default("pack"),
    runtime_env=None,
) -> LaunchPlan:
    from .. import hardware
    from ..placement import several_on_cpu
    from ..utils import imports
    from ..utils.dataclasses import parse_mixed_precision
    from ..utils.environment import DEBUG_ENV, LAUNCHER_ENV, MIXED_PRECISION_ENV, USE_CPU_ENV

    notes = []
    arguments = locals()
    ray_plan.check_engine(engine)
    # The config file fills in what the caller left out.
    chosen, config_env, config = with_config(config_file, notes, {n: arguments[n] for n in CONFIGURABLE})
    engine, ray_address, resources_per_rank, placement = engine_from_config(arguments, config, notes)
    if engine == "ray":
        ray_plan.refuse_placing({name: passed(arguments[name]) for name in ray_plan.PLACED_BY_RAY})
    else:
        ray_plan.refuse_without_ray(ray_address, resources_per_rank, placement, runtime_env)
    stall_after = stall_settings.resolve_stall_after(stall_after, config)  # env beats the config
    num_processes, mixed_precision, use_port, master_addr, node_rank, num_nodes, cpu = (
        chosen[name] for name in CONFIGURABLE[:7]
    )
    rdzv_backend, max_restarts, debug, gpu_ids = (chosen[name] for name in CONFIGURABLE[7:])
    cpu = bool(cpu)
    if cpu and arguments["gpu_ids"] is None:
        gpu_ids = None  # the config's device choice does not apply to a launch on the CPU
    master_addr = None if master_addr is None else str(master_addr)
    rdzv_backend = str(rdzv_backend)
    if start_method not in START_METHODS:
        raise LaunchConfigError(f"start_method={start_method!r} is not one of {START_METHODS}.")
    try:
        mixed_precision = parse_mixed_precision(mixed_precision)
    except ValueError as exc:
        raise LaunchConfigError(str(exc)) from None
    if engine == "ray":
        ray = ray_plan.settings(ray_address, resources_per_rank, placement, runtime_env, cpu)
        return _ray_plan(num_processes, mixed_precision, ray, config_env, fsdp, stall_after, debug, notes)
    num_nodes = _positive_int("num_nodes", num_nodes)
    node_rank = _int("node_rank", node_rank)
    if not 0 <= node_rank < num_nodes:
        raise LaunchConfigError(
            f"node_rank={node_rank} must be in 0..{num_nodes - 1} for num_nodes={num_nodes}."
        )
    max_restarts = _int("max_restarts", max_restarts)
    if max_restarts < 0:
        raise LaunchConfigError(f"max_restarts={max_restarts} must be 0 or more.")
    if rdzv_backend not in RDZV_BACKENDS:
        raise LaunchConfigError(f"rdzv_backend={rdzv_backend!r} is not one of {RDZV_BACKENDS}.")

    family = None if cpu else hardware.detect_device_family()
    engine = choose_engine(family, num_nodes, max_restarts, rdzv_backend)
    pdb_relay.check(pdb, engine)

    devices = hardware.device_count(family) if family and families.family(family).rank_per_device else 0
    visible = _visible_devices(family, gpu_ids, devices, cpu)
    if visible:
        devices = len(visible[1].split(","))
    if num_processes is None:
        num_processes = _default_num_processes(devices, engine, notes)
    num_processes = _positive_int("num_processes", num_processes)
    if engine != "xla":
        limits.check_process_count(num_processes, hardware.physical_cores())
    if devices and num_processes > devices:
        raise LaunchConfigError(
            f"num_processes={num_processes} but only {devices} {family} device(s) are visible: use at most "
            f"{devices}, or pass cpu=True to run {num_processes} CPU processes."
        )

    # A local launch of one rank runs here (as in accelerate), so a single-GPU notebook that already
    # used CUDA can still run notebook_launcher(fn); every other fork launch forks this process (the
    # elastic engine forks its agent process from here, and the agent forks the ranks), except an
    # elastic one after CUDA was used here, whose ranks then come from a fresh forkserver.
    if start_method == "fork" and engine == "elastic" and _cuda_initialised():
        start_method = "forkserver"
        notes.append(
            "CUDA is already initialised in this process, so the elastic launch starts its "
            "ranks from a fresh forkserver (start_method='forkserver'): the function and its arguments travel "
            "pickled, not inherited."
        )
    # With gpu_ids, even one rank runs in a child: the variable must be set before its runtime starts;
    # with pdb too, so that a failing rank is debugged the one way.
    runs_here = engine == "local" and num_processes == 1 and not visible and not pdb
    if start_method == "fork" and not runs_here:
        _check_fork_is_safe()
        limits.check_no_group_to_fork()  # a rank launching again: its ranks would inherit its group
    if engine == "elastic" and rdzv_backend == "static" and num_nodes > 1 and not master_addr:
        raise LaunchConfigError(
            "num_nodes > 1 with rdzv_backend='static' needs master_addr (the node-0 address)."
        )

    if rdzv_endpoint:
        _check_endpoint(rdzv_endpoint)
    # One machine needs no agreed port: without an explicit one, a free one is picked and held
    # (ports.py), so two notebooks on one machine never meet on 29500. Nodes keep the one they agree on.
    one_machine = num_nodes == 1
    port, port_held = ports.resolve(
        use_port,
        master_addr,
        pick=is_default(use_port) and one_machine,
        check_free=(engine == "local" and one_machine),
    )
    threads = _threads_per_process(num_processes, "here" if runs_here else start_method, notes)

    env = {
        **_fsdp_env(config_env, fsdp),
        LAUNCHER_ENV: "1",
        limits.OUTER_LAUNCHES_ENV: limits.for_ranks(num_processes),  # a launch inside a rank counts these
        MIXED_PRECISION_ENV: mixed_precision,
        "OMP_NUM_THREADS": str(threads),
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        stall_settings.STALL_AFTER_ENV: f"{stall_after:g}",  # 0: the ranks serve nothing to a watch
    }
    if cpu:
        env[USE_CPU_ENV] = "1"
    elif num_processes * num_nodes > 1 and several_on_cpu(family) and USE_CPU_ENV not in os.environ:
        env[USE_CPU_ENV] = "1"  # so accelerate itself (transformers' Trainer) sees one job, as our state does
        if imports.hf_accelerate_installed():
            notes.append(_USE_CPU_NOTE.format(n=num_processes * num_nodes))
    if debug is not None:
        env[DEBUG_ENV] = "1" if debug else "0"
    if visible:
        env[visible[0]] = visible[1]
    if start_method == "fork":
        env["FORK_LAUNCHED"] = "1"
    if pdb:
        env[pdb_relay.PDB_ENV] = "1"
    plan = LaunchPlan(
        num_processes=num_processes,
        start_method=start_method,
        engine=engine,
        num_nodes=num_nodes,
        node_rank=node_rank,
        master_addr=master_addr or "127.0.0.1",
        master_port=port,
        mixed_precision=mixed_precision,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint or "",
        rdzv_conf=dict(rdzv_conf or {}),
        rdzv_id=str(rdzv_id),
        max_restarts=max_restarts,
        stall_after=stall_after,
        monitor_interval=float(monitor_interval),
        log_line_prefix_template=log_line_prefix_template,
        threads_per_process=threads,
        fsdp=_fsdp_on(env),
        pdb=pdb,
        notes=tuple(notes),
        env=env,
        port_held=port_held,
    )
    if port_held:
        weakref.finalize(plan, ports.release, port)  # a plan dropped unlaunched lets go of its port
    return plan


def _ray_plan(num_processes, mixed_precision, ray, config_env, fsdp, stall_after, debug, notes) -> LaunchPlan:
    """engine="ray": `num_processes` ranks over the cluster, placed by Ray (starters/ray_engine.py)."""
    from ..utils.environment import DEBUG_ENV, LAUNCHER_ENV, MIXED_PRECISION_ENV, USE_CPU_ENV

    if num_processes is None:
        raise LaunchConfigError("engine='ray' needs num_processes: the number of ranks over the cluster.")
    num_processes = _positive_int("num_processes", num_processes)
    threads = ray_plan.threads(ray.resources)
    env = {
        **_fsdp_env(config_env, fsdp),
        LAUNCHER_ENV: "1",
        limits.OUTER_LAUNCHES_ENV: limits.for_ranks(num_processes),
        MIXED_PRECISION_ENV: mixed_precision,
        "OMP_NUM_THREADS": str(threads),
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        stall_settings.STALL_AFTER_ENV: f"{stall_after:g}",  # 0: the ranks serve nothing to a watch
    }
    if not ray.resources.get("GPU"):
        env[USE_CPU_ENV] = "1"  # ranks without a GPU form one MULTI_CPU job, accelerate's own included
    if debug is not None:
        env[DEBUG_ENV] = "1" if debug else "0"
    return LaunchPlan(
        num_processes=num_processes,
        start_method="ray",
        engine="ray",
        mixed_precision=mixed_precision,
        stall_after=stall_after,
        threads_per_process=threads,
        fsdp=_fsdp_on(env),
        notes=tuple(notes),
        env=env,
        ray=ray,
    )


# accelerate 1.15 without an accelerator is one process per rank (DistributedType.NO) unless told
# cpu: AcceleratorState and transformers' TrainingArguments read ACCELERATE_USE_CPU, PartialState does not.
_USE_CPU_NOTE = (
    "ACCELERATE_USE_CPU=1 for the ranks (no accelerator here), so Hugging Face accelerate's "
    "Accelerator() and transformers' Trainer in them form one {n}-process job; set ACCELERATE_USE_CPU to choose."
)
# Notes a process needs to read once, not at every launch (by the start of their text).
ONCE_PER_PROCESS = (_USE_CPU_NOTE.split("{", 1)[0],)


def choose_engine(family: Optional[str], num_nodes: int, max_restarts: int, rdzv_backend: str) -> str:
    """ "xla" on a TPU host (xmp.spawn, one process per core), "elastic" for what needs an agent
    (several nodes, restarts, a dynamic rendezvous), else "local" (our own process manager)."""
    if family == "xla":
        return "xla"
    if num_nodes > 1 or max_restarts > 0 or rdzv_backend != "static":
        return "elastic"
    return "local"


def _int(name: str, value) -> int:
    """An int (numpy's and torch's integer scalars too); "2", 2.0 and True are refused alike."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise LaunchConfigError(
            f"{name}={value!r} must be an integer, not {type(value).__name__}; pass {name}=N."
        ) from None


def _positive_int(name: str, value) -> int:
    number = _int(name, value)
    if number < 1:
        raise LaunchConfigError(f"{name}={number} must be 1 or more.")
    return number


def _default_num_processes(devices: int, engine: str, notes: list) -> int:
    if devices:
        return devices
    if engine == "xla":
        return 1
    notes.append(
        "no accelerator and no num_processes (argument or config), so num_processes=1; pass "
        "num_processes=N to run N CPU ranks."
    )
    return 1


def _fsdp_env(config_env: dict, fsdp) -> dict:
    """The config's variables with FSDP as `fsdp` says: None keeps the config's choice, True turns it
    on, False off (the config's settings dropped), a dict of fsdp_* settings on with those settings."""
    from ..utils.fsdp_plugin import USE_FSDP_ENV, launch_variables

    if fsdp is None:
        return config_env
    if fsdp is True:
        return {**config_env, USE_FSDP_ENV: "true"}
    if fsdp is False:
        kept = {k: v for k, v in config_env.items() if not k.startswith("FSDP_")}
        return {
            **kept,
            USE_FSDP_ENV: "false",
        }  # "false", not absent: this process's own variable is inherited
    if isinstance(fsdp, dict):
        try:
            return {**config_env, USE_FSDP_ENV: "true", **launch_variables(fsdp)}
        except ValueError as exc:
            raise LaunchConfigError(f"fsdp={fsdp!r}: {exc}.") from None
    raise LaunchConfigError(
        f"fsdp={fsdp!r} must be None (as the config says), True, False, or a dict of accelerate's fsdp_* "
        "settings such as {'fsdp_auto_wrap_policy': 'size_based_wrap', 'fsdp_min_num_params': 1000}."
    )


def _fsdp_on(env: dict) -> bool:
    from ..utils.env_flags import str_to_bool
    from ..utils.fsdp_plugin import USE_FSDP_ENV

    value = env.get(USE_FSDP_ENV, os.environ.get(USE_FSDP_ENV, "false"))  # ranks inherit this process's
    try:
        return bool(str_to_bool(value))
    except ValueError:
        return False


# The variable that restricts each family to the chosen device indices (gpu_ids).
_VISIBLE_ENV = {f.name: f.visible_env for f in families.FAMILIES if f.visible_env}


def _visible_devices(family, gpu_ids, devices: int, cpu: bool):
    """(variable, "0,2") for gpu_ids naming devices, or None for all of them. Indices count the
    devices this process sees: where the variable is set here already, they pick from its list."""
    if gpu_ids is None or (isinstance(gpu_ids, str) and gpu_ids.strip().lower() == "all"):
        return None
    ids = _device_ids(gpu_ids)
    if cpu:
        raise LaunchConfigError(
            f"gpu_ids={gpu_ids!r} chooses accelerator devices, but cpu=True runs every rank on the CPU: "
            "leave gpu_ids out (or 'all'), or drop cpu=True."
        )
    if family is None:
        raise LaunchConfigError(
            f"gpu_ids={gpu_ids!r} but no accelerator is detected here (CPU only): leave gpu_ids out to run "
            "on the CPU, or run where the devices are."
        )
    if family not in _VISIBLE_ENV:
        raise LaunchConfigError(f"gpu_ids={gpu_ids!r} cannot select {family} devices; leave it at 'all'.")
    bad = [i for i in ids if not 0 <= i < devices]
    if bad:
        seen = f"devices here are 0..{devices - 1}" if devices else "no device is visible here"
        raise LaunchConfigError(f"gpu_ids={gpu_ids!r}: {family} {seen}; pass indices among them.")
    variable = _VISIBLE_ENV[family]
    inherited = [e.strip() for e in os.environ.get(variable, "").split(",") if e.strip()]
    chosen = [inherited[i] if len(inherited) == devices else str(i) for i in ids]
    return variable, ",".join(chosen)


def _device_ids(gpu_ids) -> list:
    """"0,2", 1 or [0, 2] -> [0, 2]; anything else is refused naming the value."""
    try:
        if isinstance(gpu_ids, bool):
            raise ValueError
        if isinstance(gpu_ids, (list, tuple)):
            ids = [operator.index(i) for i in gpu_ids if not isinstance(i, bool)]
            if len(ids) != len(gpu_ids):
                raise ValueError
        elif isinstance(gpu_ids, int):
            ids = [gpu_ids]
        else:
            ids = [int(p) for p in str(gpu_ids).split(",") if p.strip()]
    except (ValueError, TypeError):
        raise LaunchConfigError(
            f"gpu_ids={gpu_ids!r} must be 'all' or device indices like '0,1' (or [0, 1])."
        ) from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise LaunchConfigError(f"gpu_ids={gpu_ids!r} must name distinct device indices >= 0, like '0,1'.")
    return ids


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")  # not imported: nothing can have initialised CUDA
    return torch is not None and torch.cuda.is_initialized()


def _check_fork_is_safe() -> None:
    if sys.platform == "win32":
        raise LaunchConfigError("start_method='fork' is not available on Windows; use start_method='spawn'.")
    if _cuda_initialised():
        from ..utils import cuda_init
        from .frontend import label_traceback

        where = cuda_init.describe()  # the cell or module line that did it, where it was recorded
        raise LaunchConfigError(
            "CUDA is already initialised in this process, and forked children cannot use it (CUDA is not "
            "fork-safe). "
            + (
                f"{label_traceback(where)}, or pass start_method='spawn' (or 'forkserver')."
                if where
                else "Use start_method='spawn' (or 'forkserver'), or restart the kernel and keep CUDA "
                "calls inside the launched function."
            )
        )


def _check_endpoint(endpoint) -> None:
    """'host:port' (or 'host', torch then uses its default port); every node must pass the same."""
    text = str(endpoint).strip()
    host, colon, port = text.rpartition(":") if ":" in text else (text, "", "")
    good_port = (not colon and not port) or (port.isdigit() and 1 <= int(port) <= 65535)
    if not host or not good_port or " " in text:
        raise LaunchConfigError(
            f"rdzv_endpoint={endpoint!r} is not 'host:port' (for example '10.0.0.1:29400'): pass node 0's "
            "address and a port every node can reach."
        )


def _threads_per_process(num_processes: int, start_method: str, notes: list) -> int:
    explicit = os.environ.get("OMP_NUM_THREADS")
    if explicit and explicit.isdigit() and int(explicit) > 0:
        wanted = int(explicit)
    else:
        wanted = max(1, _physical_cores() // num_processes)
    if start_method == "fork" and wanted > 1 and _parent_may_have_omp_pool():
        notes.append(
            f"forked ranks use 1 intra-op thread each, not {wanted}: GNU OpenMP hangs in "
            "children forked after this process ran a parallel torch op. start_method='forkserver' starts "
            f"about as fast and gives each rank {wanted} threads."
        )
        return 1
    return wanted


def _physical_cores() -> int:
    from .. import hardware

    return hardware.physical_cores()


def _parent_may_have_omp_pool() -> bool:
    # There is no API to ask whether the pool exists; any torch with >1 intra-op thread may have one.
    torch = sys.modules.get("torch")
    return torch is not None and torch.get_num_threads() > 1
