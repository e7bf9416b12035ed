"""`notebook-accel config`: ask a few questions once, save the answers as the launch config.

Every answer is checked as it is typed; a bad one is asked again with the reason. `--default`
writes a config for this machine's hardware without asking.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import socket
import sys

from .. import config as cfg
from ..utils import families
from ..utils.fsdp_plugin import STATE_DICT_TYPES, WRAP_POLICIES

_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*$")


def add_arguments(p) -> None:
    p.add_argument(
        "--config_file",
        default=None,
        help=f"where to write (default: ${cfg.CONFIG_ENV}, else ~/.cache/notebook_accel/default_config.yaml)",
    )
    p.add_argument("--default", action="store_true", help="write a config for this machine without asking")


class Aborted(Exception):
    pass


def ask(prompt: str, parse, default=None):
    """Ask until `parse(text)` accepts; it raises ValueError with the reason to show otherwise."""
    shown = f"{prompt} [{default}]: " if default is not None else f"{prompt}: "
    while True:
        try:
            text = input(shown).strip()
        except EOFError:
            raise Aborted("input ended before the questions were answered") from None
        if not text:
            if default is None:
                print("  An answer is needed.")
                continue
            text = str(default)
        try:
            return parse(text)
        except ValueError as exc:
            print(f"  Invalid answer {text!r}: {exc}. Try again.")


def whole(low: int, high=None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("enter a whole number") from None
        if value < low or (high is not None and value > high):
            raise ValueError(
                f"enter a number from {low} to {high}" if high is not None else f"enter {low} or more"
            )
        return value

    return parse


def choice(options):
    def parse(text: str) -> str:
        for option in options:
            if text.lower() == option.lower():
                return option
        raise ValueError(f"choose one of {', '.join(options)}")

    return parse


def yes_no(text: str) -> bool:
    if text.lower() in ("y", "yes", "true", "1"):
        return True
    if text.lower() in ("n", "no", "false", "0"):
        return False
    raise ValueError("answer yes or no")


def address(text: str) -> str:
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    if not _HOSTNAME.match(text):
        raise ValueError("enter an IP address (like 10.0.0.4) or a host name")
    return text


def device_list(count: int):
    def parse(text: str) -> str:
        if text.lower() == "all":
            return "all"
        try:
            ids = [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError("enter 'all' or device numbers separated by commas, like 0,1") from None
        bad = [i for i in ids if not 0 <= i < count]
        if bad:
            raise ValueError(f"device {bad[0]} does not exist; this machine has devices 0..{count - 1}")
        if len(set(ids)) != len(ids):
            raise ValueError("a device is listed twice")
        return ",".join(map(str, ids))

    return parse


def precision(report, cpu: bool):
    """Reject a precision the chosen devices cannot run, naming the device."""

    def parse(text: str) -> str:
        value = choice(cfg.MIXED_PRECISIONS)(text)
        if value != "no" and not cpu:
            for device in report.accelerators:
                if not getattr(device, f"supports_{value}", True):
                    raise ValueError(
                        f"{value} is not supported by {device.kind}:{device.index} ({device.name})"
                    )
        if cpu and value == "fp8":
            raise ValueError("fp8 needs an accelerator that supports it; on CPU choose no, bf16 or fp16")
        return value

    return parse


def questionnaire(report) -> cfg.ClusterConfig:
    """The questions, in order; returns a validated config."""
    family = report.device_family
    devices = len(report.accelerators)
    print("Answer each question, or press Enter to take the value in brackets.")
    ask(
        "Compute environment (LOCAL_MACHINE is the only one supported)",
        choice(["LOCAL_MACHINE"]),
        "LOCAL_MACHINE",
    )
    machines = ask("How many machines will take part in the launch", whole(1), 1)
    rank, ip, port, rdzv = 0, None, None, "static"
    if machines > 1:
        rank = ask(
            f"What is the rank of this machine (0 to {machines - 1}; 0 is the main machine)",
            whole(0, machines - 1),
            0,
        )
        ip = ask(
            "IP address or host name of the main machine (rank 0)",
            address,
            _own_address() if rank == 0 else None,
        )
        port = ask("Port on the main machine for the processes to meet", whole(1, 65535), 29500)
        rdzv = ask(
            f"Rendezvous backend ({', '.join(cfg.RDZV_BACKENDS)})", choice(cfg.RDZV_BACKENDS), "static"
        )
    if devices:
        cpu = ask(f"Run on CPU only, ignoring the {devices} {family} device(s) (yes/no)", yes_no, "no")
    else:
        print("No accelerator found here: the processes will run on the CPU.")
        cpu = True
    gpu_ids = None
    if not cpu and family is not None and families.family(family).visible_env:  # devices can be chosen
        gpu_ids = ask(
            f"Which {family} devices should be used (comma-separated, or all)", device_list(devices), "all"
        )
    usable = devices if gpu_ids in (None, "all") else len(gpu_ids.split(","))
    if cpu:
        per_machine = ask("How many processes on each machine", whole(1), 1)
    else:
        per_machine = ask(
            f"How many processes on each machine (one per device, at most {usable})", whole(1, usable), usable
        )
    mixed = ask(f"Mixed precision ({', '.join(cfg.MIXED_PRECISIONS)})", precision(report, cpu), "no")
    debug = ask(
        "Check collectives across ranks for mismatched shapes (debug mode; slower) (yes/no)", yes_no, "no"
    )
    total = per_machine * machines
    kind = "MULTI_CPU" if cpu else cfg.FAMILY_TYPES.get(family, "MULTI_GPU")
    if total == 1 and kind != "XLA":
        kind = "NO"
    extra = {}
    if total > 1 and kind != "XLA":  # one process has nothing to shard; XLA has its own sharding
        if ask("Use FSDP (fully sharded data parallel) (yes/no)", yes_no, "no"):
            kind, extra = "FSDP", {"fsdp_config": fsdp_questions()}
    config = cfg.ClusterConfig(
        distributed_type=kind,
        mixed_precision=mixed,
        use_cpu=cpu,
        debug=debug,
        num_processes=total,
        num_machines=machines,
        machine_rank=rank,
        gpu_ids=gpu_ids,
        main_process_ip=ip,
        main_process_port=port,
        rdzv_backend=rdzv,
        extra=extra,
    )
    config.validate()
    return config


def class_names(text: str) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a class name; enter names like BertLayer,GPT2Block")
    return names


def fsdp_questions() -> dict:
    """The FSDP settings, as accelerate's fsdp_config keys (its spellings, so accelerate reads the file too)."""
    print("FSDP version: 2 (torch's fully_shard, the one notebook_accel implements).")
    out = {"fsdp_version": 2}
    policies = [p.upper() for p in WRAP_POLICIES]
    policy = ask(
        f"Which submodules get their own shard: auto wrap policy ({', '.join(policies)})",
        choice(policies),
        "TRANSFORMER_BASED_WRAP",
    )
    out["fsdp_auto_wrap_policy"] = policy
    if policy == "TRANSFORMER_BASED_WRAP":
        names = ask(
            "Transformer layer class names to wrap, comma-separated (none: the model's _no_split_modules)",
            lambda text: [] if text.lower() == "none" else class_names(text),
            "none",
        )
        if names:
            out["fsdp_transformer_layer_cls_to_wrap"] = ",".join(names)
    elif policy == "SIZE_BASED_WRAP":
        out["fsdp_min_num_params"] = ask(
            "Parameters a submodule needs for its own shard", whole(0), 100_000_000
        )
    out["fsdp_reshard_after_forward"] = ask(
        "Free gathered parameters after forward (less memory, one more all-gather in backward) (yes/no)",
        yes_no,
        "yes",
    )
    out["fsdp_state_dict_type"] = ask(
        f"How save_state writes the model ({', '.join(STATE_DICT_TYPES)})",
        choice(STATE_DICT_TYPES),
        "SHARDED_STATE_DICT",
    )
    out["fsdp_activation_checkpointing"] = ask(
        "Activation checkpointing: recompute wrapped blocks' activations in backward (yes/no)", yes_no, "no"
    )
    out["fsdp_cpu_ram_efficient_loading"] = ask(
        "Build the real weights on rank 0 only (the others on meta) and send each rank its shard (yes/no)",
        yes_no,
        "no",
    )
    # Not asked: offload needs an accelerator; written so accelerate reads the same choice.
    out["fsdp_offload_params"] = False
    return out


def _own_address():
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def default_config(report) -> cfg.ClusterConfig:
    """This machine's config: every device when there are accelerators, else one CPU process."""
    devices = len(report.accelerators)
    if report.device_family is None or report.device_family == "mps" or not devices:
        # One CPU process: N CPU ranks only split the same cores, so N is a choice, not a default.
        return cfg.ClusterConfig(distributed_type="NO", use_cpu=True, num_processes=1)
    kind = cfg.FAMILY_TYPES.get(report.device_family, "MULTI_GPU")
    if devices == 1 and kind != "XLA":
        kind = "NO"
    return cfg.ClusterConfig(distributed_type=kind, num_processes=devices, gpu_ids="all")


def run(args: argparse.Namespace) -> int:
    from .. import hardware

    path = args.config_file or cfg.default_config_file()
    report = hardware.report()
    if args.default:
        config = default_config(report)
    else:
        try:
            config = questionnaire(report)
        except Aborted as exc:
            print(f"\nnotebook-accel config: {exc}; nothing was written.", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nnotebook-accel config: interrupted; nothing was written.", file=sys.stderr)
            return 130
    try:
        written = config.save(path)
    except (OSError, cfg.ConfigError) as exc:
        print(f"notebook-accel config: cannot write {path}: {exc}", file=sys.stderr)
        return 1
    print(f"Config saved to {written}")
    return 0
