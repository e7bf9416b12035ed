"""notebook_launcher and debug_launcher: accelerate's signatures, plus start_method and results."""

from __future__ import annotations

from typing import Optional

from . import events as ev
from . import frontend, starters
from .control import LaunchControl
from .errors import LaunchFailedError
from .payload import Payload
from .plan import ONCE_PER_PROCESS, ONE_MACHINE, LaunchPlan, default, make_plan
from .sinks import Fanout

_noted: set = set()  # the once-per-process notes (plan.ONCE_PER_PROCESS) this process has sent


def notebook_launcher(
    function,
    args=(),
    num_processes: Optional[int] = None,
    mixed_precision: str = default("no"),
    use_port: str = default("29500"),
    master_addr: str = default("127.0.0.1"),
    node_rank: int = default(0),
    num_nodes: int = default(1),
    rdzv_backend: str = default("static"),
    rdzv_endpoint: str = "",
    rdzv_conf: Optional[dict] = None,
    rdzv_id: str = "none",
    max_restarts: int = default(0),
    monitor_interval: float = 0.1,
    log_line_prefix_template: Optional[str] = None,
    start_method: str = default("fork"),
    *,
    cpu: Optional[bool] = None,
    sinks=None,
    timeout: Optional[float] = None,
    fsdp=None,
    gpu_ids=None,
    stall_after: Optional[float] = None,
    pdb: bool = False,
    engine: Optional[str] = None,
    ray_address: Optional[str] = None,
    resources_per_rank: Optional[dict] = None,
    placement: str = default("pack"),
    runtime_env: Optional[dict] = None,
) -> list:
    """Run `function(*args)` on `num_processes` processes; return each local rank's return value.

    A rank that raises makes this raise `LaunchFailedError` (a torch `ChildFailedError`) with that
    rank's traceback; the other ranks are stopped. `timeout` (seconds) stops every rank and raises
    `LaunchTimeoutError` when the run takes longer. `sinks` replace the default sink: the live panel
    in a notebook kernel with widgets, else rank-prefixed text on the console (see frontend.py).
    Arguments left out come from the config file (`notebook-accel config`) when there is one, else
    take the defaults shown; `cpu=None` means the config's `use_cpu`, else False. `fsdp=True` turns
    FSDP on in every rank (`Accelerator()` then shards with the plugin's FSDP_* settings), False turns
    it off whatever the config says, and a dict of accelerate's fsdp_config keys (`fsdp_auto_wrap_policy`,
    `fsdp_min_num_params`, ...) turns it on with those settings; None does as the config says.
    `gpu_ids` ("0,2" or [0, 2]) chooses the devices the ranks see (CUDA_VISIBLE_DEVICES, or the
    family's variable), checked against the devices here; None means the config's, else all. Without
    `use_port`, a launch on one machine picks a free port (two notebooks never meet on 29500).
    Several ranks on the CPU (no accelerator, or `cpu=True`) get ACCELERATE_USE_CPU=1 unless it is set
    here already, so Hugging Face's own accelerate in them (transformers' Trainer, `Accelerator()`)
    forms one MULTI_CPU job too; its bare `PartialState()` reads only its `cpu` argument.
    `stall_after` (seconds, 0 off) is how long no rank may make progress before you are told; None
    means $NOTEBOOK_ACCEL_STALL_AFTER, else the config's `stall_after`, else 60.
    `pdb=True` keeps the first rank that raises alive in pdb on its traceback, the others stopped,
    and asks you for pdb's commands here with input() (in a notebook, the front end's input box)
    until pdb ends (q, c); then the rank exits and `LaunchFailedError` is raised as usual. The
    timeout stops counting once that rank is in pdb. Where no command can be read (a front end that
    does not answer input, a script whose stdin is not a terminal), the rank ends and the error says so.
    `engine="ray"` runs the ranks as Ray actors on the cluster this process is connected to, else
    the one at `ray_address` ($RAY_ADDRESS, else "auto"): `num_processes` ranks over the cluster, one
    placement-group bundle of `resources_per_rank` ({"CPU": 1} by default) each, placed as `placement`
    says ("pack", "spread", "strict_pack", "strict_spread"); `runtime_env` goes to every rank's actor.
    Results come back in global rank order. Ray places the ranks, so the node, port, rendezvous,
    start-method and device arguments are refused with it. See docs/ray.md.
    """
    if not callable(function):
        raise TypeError(
            f"notebook_launcher needs a function to run, got {type(function).__name__}: {function!r}"
        )
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of arguments, got {type(args).__name__}; write args=(value,).")
    plan = make_plan(
        num_processes=num_processes,
        mixed_precision=mixed_precision,
        use_port=use_port,
        master_addr=master_addr,
        node_rank=node_rank,
        num_nodes=num_nodes,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template,
        start_method=start_method,
        cpu=cpu,
        fsdp=fsdp,
        gpu_ids=gpu_ids,
        stall_after=stall_after,
        pdb=pdb,
        engine=engine,
        ray_address=ray_address,
        resources_per_rank=resources_per_rank,
        placement=placement,
        runtime_env=runtime_env,
    )
    control = LaunchControl(timeout)
    sink = Fanout(sinks if sinks is not None else frontend.default_sinks())
    try:
        sink.attach(control)
        send_notes(plan, sink)
        return run_plan(plan, function, tuple(args), sink, control)
    except LaunchFailedError as exc:
        exc.args = (frontend.label_traceback(exc.args[0]),)  # in a notebook: Cell In[N], as IPython says
        raise
    finally:
        sink.close()
        control.close()


def debug_launcher(function, args=(), num_processes: int = 2) -> list:
    """Run on `num_processes` CPU processes with gloo (MULTI_CPU, distinct ranks), for debugging."""
    return notebook_launcher(
        function, args, num_processes=num_processes, mixed_precision="no", cpu=True, **ONE_MACHINE
    )


def send_notes(plan: LaunchPlan, sink) -> None:
    """The plan's notes to `sink` as LaunchNotice events (the console sink prints them, the panel
    shows them); a note a process needs once (plan.ONCE_PER_PROCESS) only the first time."""
    for note in plan.notes:
        once = next((start for start in ONCE_PER_PROCESS if note.startswith(start)), None)
        if once is not None:
            if once in _noted:
                continue
            _noted.add(once)
        sink.handle(ev.LaunchNotice(note))


def run_plan(plan: LaunchPlan, function, args: tuple, sink, control: Optional[LaunchControl] = None) -> list:
    """Run `function(*args)` as `plan` says, reporting to `sink`; one result per local rank."""
    return starters.run(plan, Payload(function, args), sink, control or LaunchControl())
