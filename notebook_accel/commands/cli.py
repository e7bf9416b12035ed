"""`notebook-accel`: subcommands for the terminal. `env` prints what this machine has."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _env(args: argparse.Namespace) -> int:
    from .. import hardware

    report = hardware.report()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="notebook-accel", description="Run PyTorch on N processes from a notebook.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    env = sub.add_parser("env", help="show the hardware, environment and versions found here")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(run=_env)
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
