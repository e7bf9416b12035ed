"""`notebook-accel`: config, launch, env and test, for the terminal."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import config_cmd, env_cmd, launch_cmd, selfcheck


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="notebook-accel", description="Run PyTorch on N processes from a notebook."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (config_cmd, launch_cmd, env_cmd, selfcheck):
        module.add_parser(sub)
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
