"""`notebook-accel`: config, launch, env, test and merge-weights, for the terminal."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import config_cmd, env_cmd, launch_cmd, merge_cmd, selfcheck

# name -> (module with add_arguments(parser) and run(args), one-line help, description)
COMMANDS = {
    "config": (
        config_cmd,
        "answer a few questions and save them as the launch config",
        (
            "Ask about machines, devices, processes and precision, then write the launch config "
            "(accelerate's YAML keys) that notebook_launcher and `notebook-accel launch` use by default."
        ),
    ),
    "launch": (
        launch_cmd,
        "run a script (or -m module) on N processes",
        (
            "Run a script on N processes (and M machines). Options left out come from the config file "
            "(see `notebook-accel config`), else from this machine's hardware."
        ),
    ),
    "env": (
        env_cmd,
        "show versions, hardware and the config in use",
        "Print versions, hardware and the launch config in use, for bug reports.",
    ),
    "test": (
        selfcheck,
        "run a short distributed self-check on this machine",
        (
            "Start CPU ranks (gloo) and check the process group, all_reduce, gather and broadcast; "
            "prints 'success' or what failed."
        ),
    ),
    "merge-weights": (
        merge_cmd,
        "merge a sharded FSDP checkpoint into one safetensors file",
        (
            "Read the sharded model folder that save_state wrote with SHARDED_STATE_DICT "
            "(a torch.distributed.checkpoint folder, e.g. pytorch_model_fsdp_0) and write the full weights "
            "as OUTPUT_PATH/model.safetensors, in this process, on the CPU."
        ),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="notebook-accel", description="Run PyTorch on N processes from a notebook."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help, description) in COMMANDS.items():
        p = sub.add_parser(name, help=help, description=description)
        p.set_defaults(run=module.run)
        module.add_arguments(p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
