"""%%accelerate (run a cell on N processes) and %accelerate hardware|env|config."""

from __future__ import annotations

import argparse
import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from ..launch.errors import LaunchConfigError
from . import cells

START_METHODS = ("fork", "spawn", "forkserver")
PRECISIONS = ("no", "fp16", "bf16", "fp8")
LINE_COMMANDS = ("hardware", "env", "config")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would exit the kernel's process
        raise UsageError(f"%%accelerate: {message}\n{self.format_usage()}")


def _positive(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _names(text: str) -> tuple:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if not n.isidentifier()]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"must be comma-separated variable names, got {text!r}")
    return names


def cell_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%%accelerate", add_help=False, description="Run this cell on N processes.")
    p.add_argument(
        "-n",
        "--num-processes",
        type=_positive,
        default=None,
        help="processes on this machine (default: as notebook_launcher decides)",
    )
    p.add_argument("--start-method", choices=START_METHODS, default="fork")
    p.add_argument("--mixed-precision", choices=PRECISIONS, default=None)
    p.add_argument("--cpu", action="store_true", help="run on CPU even where accelerators exist")
    p.add_argument("--num-nodes", type=_positive, default=None)
    p.add_argument("--node-rank", type=_int, default=None)
    p.add_argument("--rdzv-endpoint", default="", help="host:port where the nodes meet")
    p.add_argument("--max-restarts", type=_int, default=None)
    p.add_argument("--port", default=None, help='the rendezvous port, or "auto"')
    p.add_argument("--timeout", type=_seconds, default=None, help="stop every rank and fail after this long")
    p.add_argument("--out", type=_names, default=(), help="names to copy from rank 0 into the notebook")
    return p  # fmt: skip


def launch_kwargs(args: argparse.Namespace) -> dict:
    """Only what the cell set: everything else keeps notebook_launcher's defaults and config."""
    kwargs = {"num_processes": args.num_processes, "start_method": args.start_method, "timeout": args.timeout}
    optional = {
        "mixed_precision": args.mixed_precision, "num_nodes": args.num_nodes, "node_rank": args.node_rank,
        "max_restarts": args.max_restarts, "use_port": args.port,
    }  # fmt: skip
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if args.rdzv_endpoint:
        kwargs["rdzv_endpoint"] = args.rdzv_endpoint
    if args.cpu:
        kwargs["cpu"] = True
    return kwargs


@magics_class
class AccelerateMagics(Magics):
    @cell_magic
    def accelerate(self, line: str, cell: str):
        """%%accelerate [-n N] [--start-method M] [--timeout S] [--out a,b] ...: run the cell on N processes."""
        from ..launch import notebook_launcher

        try:
            args = cell_parser().parse_args(shlex.split(line))
        except ValueError as exc:  # shlex: an unclosed quote
            raise UsageError(f"%%accelerate: {exc}") from None
        shell = self.shell
        number = shell.execution_count
        filename = shell.compile.cache(cell, number)  # IPython's own name for this cell's code
        label = f"Cell In[{number}]"
        kwargs = launch_kwargs(args)
        travels = args.start_method != "fork" or (args.max_restarts or 0) > 0 or (args.num_nodes or 1) > 1
        if travels:  # the cell and the names it reads are pickled; fail here, naming the culprit
            namespace = cells.travelling_namespace(cell, filename, shell.user_ns)
            job = cells.CellJob(cell, filename, args.out, namespace)
            function, fargs = job, ()
        else:  # a forked rank runs the cell in its copy of the notebook's namespace
            job = cells.CellJob(cell, filename, args.out)
            function, fargs = job, (shell.user_ns,)
        try:
            results = notebook_launcher(function, fargs, **kwargs)
        except LaunchConfigError as exc:
            raise UsageError(f"%%accelerate: {exc}") from None
        except Exception as exc:
            shown = cells.shorten(exc, filename, label)
            if shown is exc:
                raise
            raise shown from None
        if args.out and results and results[0]:
            shell.user_ns.update(results[0])

    @line_magic("accelerate")
    def accelerate_line(self, line: str):
        """%accelerate hardware | env | config"""
        words = shlex.split(line)
        if not words or words[0] not in LINE_COMMANDS:
            raise UsageError(
                f"%accelerate: expected one of {', '.join(LINE_COMMANDS)}, got {line.strip()!r}. "
                "To run a cell on N processes, start it with %%accelerate -n N."
            )
        return getattr(self, f"_show_{words[0]}")(words[1:])

    def _show_hardware(self, rest: list):
        from . import widgets_enabled

        if widgets_enabled():
            from IPython.display import display

            from .hardware_panel import hardware_widget

            display(hardware_widget())
        else:
            from ..hardware import report

            print(report(refresh=True))

    def _show_env(self, rest: list):
        from ..commands.env_cmd import run

        run(argparse.Namespace(config_file=None, json=False))

    def _show_config(self, rest: list):
        from ..commands.env_cmd import config_section

        section = config_section()
        if not section["exists"]:
            print(f"No config file at {section['path']}: launches use notebook_launcher's defaults.")
            print("Write one with `notebook-accel config` (or `notebook-accel config --default`).")
        elif "error" in section:
            raise UsageError(f"%accelerate config: {section['path']} is invalid: {section['error']}")
        else:
            print(f"Config in use: {section['path']}")
            for key, value in section["config"].items():
                print(f"  {key}: {value}")
