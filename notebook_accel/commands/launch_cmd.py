"""`notebook-accel launch script.py [args]` (or `-m module`): the script on every rank, on our launcher.

Each rank runs the script as `python script.py args` would (`__name__ == "__main__"`, `sys.argv`),
so output comes back as `[rank N] line` and a failing rank is reported with its traceback, as
notebook_launcher does. Several machines or restarts go through torch elastic; `--engine ray` runs
the ranks on a Ray cluster (the script's text travels with the launch).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
import traceback

from .. import config as cfg
from .args import json_object, non_negative, port, positive, positive_seconds, stall_seconds


def add_arguments(p) -> None:
    p.set_defaults(parser=p)  # run() reports bad values through it
    p.add_argument(
        "--config_file", default=None, help="config to read (default: the one `notebook-accel config` wrote)"
    )
    p.add_argument(
        "--num_processes",
        type=positive,
        default=None,
        help="processes on all machines together (as accelerate counts them)",
    )
    p.add_argument("--num_machines", type=positive, default=None, help="number of machines taking part")
    p.add_argument(
        "--machine_rank", type=non_negative, default=None, help="rank of this machine (0 is the main one)"
    )
    p.add_argument("--main_process_ip", default=None, help="address of the machine with rank 0")
    p.add_argument("--main_process_port", type=port, default=None, help="port on the main machine, or 'auto'")
    p.add_argument("--rdzv_backend", choices=cfg.RDZV_BACKENDS, default=None, help="how the machines meet")
    p.add_argument(
        "--mixed_precision", choices=cfg.MIXED_PRECISIONS, default=None, help="mixed precision mode"
    )
    p.add_argument(
        "--cpu", action="store_true", default=None, help="run on CPU processes even if accelerators exist"
    )
    p.add_argument(
        "--gpu_ids", "--gpu-ids", dest="gpu_ids", default=None, help="devices to use, like 0,1 (default: all)"
    )
    p.add_argument(
        "--debug", action="store_true", default=None, help="check collectives for mismatched shapes"
    )
    p.add_argument(
        "--max_restarts", type=non_negative, default=None, help="restart the group this often on failure"
    )
    p.add_argument(
        "--stall_after",
        "--stall-after",
        dest="stall_after",
        type=stall_seconds,
        default=None,
        metavar="S",
        help="say so when no rank has made progress for S seconds (default: the config's, else 60; 0: off)",
    )
    p.add_argument(
        "--monitor_interval", type=positive_seconds, default=0.1, help="seconds between health checks"
    )
    p.add_argument(
        "--start_method",
        choices=("fork", "spawn", "forkserver"),
        default=None,
        help="how ranks start (default fork: this process has computed nothing)",
    )
    _add_ray_arguments(p)
    _add_fsdp_arguments(p)
    p.add_argument(
        "-m", "--module", action="store_true", help="treat the script as a module name, as `python -m`"
    )
    p.add_argument("training_script", help="the script to run (or the module, with -m)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


# accelerate launch's FSDP flags that notebook_accel's plugin reads (FSDP2 only); each is an fsdp_config key.
_FSDP_FLAGS = (
    (
        "fsdp_version",
        {"choices": ("2",), "help": "FSDP version: 2 (torch's fully_shard) is the one implemented"},
    ),
    ("fsdp_reshard_after_forward", {"help": "true: free gathered parameters after forward (FULL_SHARD)"}),
    ("fsdp_auto_wrap_policy", {"help": "transformer_based_wrap, size_based_wrap or no_wrap"}),
    (
        "fsdp_transformer_layer_cls_to_wrap",
        {"help": "class names that get their own shard, like Block,Attention"},
    ),
    ("fsdp_min_num_params", {"help": "with size_based_wrap: parameters a submodule needs for its own shard"}),
    ("fsdp_state_dict_type", {"help": "SHARDED_STATE_DICT or FULL_STATE_DICT, for save_state"}),
    ("fsdp_activation_checkpointing", {"help": "true: recompute activations of wrapped blocks in backward"}),
    (
        "fsdp_cpu_ram_efficient_loading",
        {"help": "true: load the weights on one process (not implemented yet)"},
    ),
    ("fsdp_offload_params", {"help": "true: keep sharded parameters in host memory (needs an accelerator)"}),
)


def _add_ray_arguments(p) -> None:
    group = p.add_argument_group("Ray (engine ray: the ranks as actors on a Ray cluster; see docs/ray.md)")
    group.add_argument("--engine", choices=("ray",), default=None, help="ray: run the ranks on a Ray cluster")
    group.add_argument(
        "--ray_address",
        "--ray-address",
        dest="ray_address",
        default=None,
        help="the cluster (default: $RAY_ADDRESS, else 'auto')",
    )
    group.add_argument(
        "--resources_per_rank",
        type=json_object,
        default=None,
        metavar="JSON",
        help='Ray resources of one rank, like \'{"CPU": 1, "GPU": 1}\' (default {"CPU": 1})',
    )
    group.add_argument(
        "--placement",
        choices=("pack", "spread", "strict_pack", "strict_spread"),
        default=None,
        help="how Ray places the ranks (default pack)",
    )
    group.add_argument(
        "--runtime_env",
        type=json_object,
        default=None,
        metavar="JSON",
        help='Ray\'s runtime_env for the ranks, like \'{"working_dir": "."}\'',
    )


def _ray_kwargs(args: argparse.Namespace) -> dict:
    """make_plan's Ray arguments, and the placing flags as given (make_plan refuses them with Ray)."""
    out = {
        "engine": "ray",
        "ray_address": args.ray_address,
        "resources_per_rank": args.resources_per_rank,
        "runtime_env": args.runtime_env,
    }
    if args.placement is not None:
        out["placement"] = args.placement
    out.update(_placing_kwargs(args))
    if args.start_method is not None:
        out["start_method"] = args.start_method
    if args.num_processes is not None:
        out["num_processes"] = args.num_processes  # over the cluster: Ray places them
    return {**out, **_rank_kwargs(args)}


def _placing_kwargs(args: argparse.Namespace) -> dict:
    """The flags that place ranks on machines, where given (Ray refuses them: it places the ranks)."""
    given = {
        "num_nodes": args.num_machines,
        "node_rank": args.machine_rank,
        "master_addr": args.main_process_ip,
        "use_port": args.main_process_port,
        "rdzv_backend": args.rdzv_backend,
        "gpu_ids": args.gpu_ids,
        "max_restarts": args.max_restarts,
    }
    return {k: v for k, v in given.items() if v is not None}


def _rank_kwargs(args: argparse.Namespace) -> dict:
    """What every engine's ranks take from the command line, where given: CPU, precision, debug,
    the stall watch, FSDP."""
    given = {
        "cpu": args.cpu,
        "mixed_precision": args.mixed_precision,
        "debug": args.debug,
        "stall_after": args.stall_after,
        "fsdp": _fsdp_setting(args),
    }
    return {k: v for k, v in given.items() if v is not None}


def _add_fsdp_arguments(p) -> None:
    group = p.add_argument_group("FSDP (sharded data parallel; the config's fsdp_config otherwise)")
    group.add_argument(
        "--use_fsdp", action="store_true", default=None, help="turn FSDP on in every rank (FSDP2)"
    )
    for name, options in _FSDP_FLAGS:
        group.add_argument(f"--{name}", default=None, metavar="VALUE", **options)


def _fsdp_setting(args: argparse.Namespace):
    """make_plan's fsdp: None (as the config says), or the flags given as fsdp_* settings.

    A --fsdp_* flag turns FSDP on, as it says what FSDP should do; its settings override the config's."""
    settings = {name: getattr(args, name) for name, _ in _FSDP_FLAGS if getattr(args, name) is not None}
    if settings:
        return settings
    return True if args.use_fsdp else None


def run_script(target: str, argv: list, as_module: bool) -> int:
    """Runs in each rank: the script as its own __main__. SystemExit(0 or None) is success."""
    if as_module:
        sys.argv = [target, *argv]  # run_module replaces argv[0] with the module's file
        sys.path.insert(0, os.getcwd())  # as `python -m` does
    else:
        sys.argv = [target, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    return 0


def run_source(target: str, source: str, argv: list) -> int:
    """run_script for a rank on another machine (engine ray): the script's text travels with the
    launch, so the node needs no copy of it; it runs as `python script.py` would."""
    import linecache
    import types

    sys.argv = [target, *argv]
    folder = os.path.dirname(os.path.abspath(target))
    if os.path.isdir(folder):
        sys.path.insert(0, folder)  # as `python script.py` does, where the folder is there too
    linecache.cache[target] = (len(source), None, source.splitlines(True), target)  # for tracebacks
    main = types.ModuleType("__main__")
    main.__file__ = target
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(source, target, "exec"), main.__dict__)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved
    return 0


def _launch_kwargs(args: argparse.Namespace, config) -> dict:
    """make_plan's arguments for what was given on the command line; the rest come from the config."""
    out = {}
    if args.num_processes is not None:
        machines = args.num_machines or (config.num_machines if config else 1)
        if args.num_processes % machines:
            raise ValueError(
                f"--num_processes {args.num_processes} cannot be split evenly over {machines} "
                "machines (it counts the processes on all machines together)"
            )
        out["num_processes"] = args.num_processes // machines
    out.update(_placing_kwargs(args))
    out.update(_rank_kwargs(args))
    machines = args.num_machines or (config.num_machines if config else 1)
    if "use_port" not in out and machines == 1 and (config is None or config.main_process_port is None):
        out["use_port"] = "auto"  # one machine needs no agreed port; a fixed one may be busy
    return out


def run(args: argparse.Namespace) -> int:
    from ..launch import ConsoleSink, LaunchConfigError, LaunchFailedError, make_plan
    from ..launch.launcher import run_plan, send_notes
    from ..launch.sinks import Fanout

    parser = args.parser
    target = args.training_script
    if args.module:
        sys.path.insert(0, os.getcwd())  # where `python -m` looks first
        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            found = None
        if found is None:
            parser.error(f"no module named {target!r} (from {os.getcwd()})")
    elif not os.path.isfile(target):
        parser.error(f"script {target!r} not found")
    ray_flags = {
        "--ray_address": args.ray_address,
        "--resources_per_rank": args.resources_per_rank,
        "--placement": args.placement,
        "--runtime_env": args.runtime_env,
    }
    given = [flag for flag, value in ray_flags.items() if value is not None]
    try:
        config = cfg.load_config(args.config_file) if args.config_file else cfg.load_default()
        placing = _placing_kwargs(args) or args.start_method is not None
        if config is not None and config.engine == "ray" and args.engine is None and not placing:
            # The file's engine (its Ray keys fill in what the flags leave out: make_plan). Flags that
            # place the ranks keep the launch here, as notebook_launcher's arguments do.
            args.engine = "ray"
        if given and args.engine != "ray":
            parser.error(f"{', '.join(given)} only apply with --engine ray: add it, or leave them out")
        kwargs = _ray_kwargs(args) if args.engine == "ray" else _launch_kwargs(args, config)
    except cfg.ConfigError as exc:
        print(f"notebook-accel launch: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        parser.error(str(exc))
    import torch

    # This process only starts ranks and never computes, so forking is safe with any thread count;
    # one thread here tells the plan so (it cannot know otherwise) and ranks get cores // N threads.
    torch.set_num_threads(1)
    try:
        if args.engine != "ray" and args.start_method is not None:
            kwargs["start_method"] = args.start_method
        plan = make_plan(
            monitor_interval=args.monitor_interval,
            rdzv_id="notebook-accel-launch",
            config_file=args.config_file,
            **kwargs,
        )
    except LaunchConfigError as exc:
        parser.error(str(exc))
    # A terminal or a pipe takes long lines whole (a rank printing JSON); only a notebook cell cuts them.
    sink = Fanout([ConsoleSink(max_line=None)])
    send_notes(plan, sink)
    try:
        if plan.engine == "ray" and not args.module:
            with open(target, encoding="utf-8") as f:
                run_plan(plan, run_source, (target, f.read(), list(args.training_script_args)), sink)
        else:
            run_plan(plan, run_script, (target, list(args.training_script_args), args.module), sink)
    except LaunchFailedError as exc:
        print(f"notebook-accel launch: {target} failed\n{exc}", file=sys.stderr)
        return 1
    except SystemExit as exc:  # one process runs here, in this process, and its script may exit
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # sys.exit("message") prints it, as Python does
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except KeyboardInterrupt:
        print("notebook-accel launch: interrupted; every rank was stopped.", file=sys.stderr)
        return 130
    except Exception:  # one process: the script's own exception, as `python script.py` shows it
        traceback.print_exc()
        return 1
    finally:
        sink.close()
    return 0
