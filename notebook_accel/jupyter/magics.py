"""%%accelerate (run a cell on N processes) and %accelerate hardware|env|config."""

from __future__ import annotations

import argparse
import functools
import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from ..commands.args import json_object
from ..commands.args import positive as _positive
from ..commands.args import positive_seconds as _seconds
from ..commands.args import stall_seconds as _stall
from ..commands.args import whole as _int
from ..launch.errors import LaunchConfigError
from ..launch.plan_config import on_ray
from ..session.errors import SessionError
from . import cell_jobs

START_METHODS = ("fork", "spawn", "forkserver")
PRECISIONS = ("no", "fp16", "bf16", "fp8")
LINE_COMMANDS = (
    "hardware",
    "env",
    "config",
    "start",
    "stop",
    "restart",
    "status",
    "push",
    "pull",
    "auto",
    "debug",
)
# Options that shape a fresh launch; a running session already has its workers.
LAUNCH_ONLY = (
    "num_processes",
    "mixed_precision",
    "cpu",
    "fsdp",
    "num_nodes",
    "node_rank",
    "rdzv_endpoint",
    "max_restarts",
    "port",
    "gpu_ids",
    "engine",
    "ray_address",
    "placement",
    "resources_per_rank",
)


_STALL_HELP = "say so when no rank made progress for S seconds (0: off; default: $NOTEBOOK_ACCEL_STALL_AFTER, the config's, else 60)"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would exit the kernel's process
        raise UsageError(f"%%accelerate: {message}\n{self.format_usage()}")


def _names(text: str) -> tuple:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if not n.isidentifier()]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"must be comma-separated variable names, got {text!r}")
    return names


@functools.lru_cache(maxsize=1)  # built once: a session cell's whole round trip is a few ms
def cell_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%%accelerate", add_help=False, description="Run this cell on N processes.")
    p.add_argument(
        "-n",
        "--num-processes",
        type=_positive,
        default=None,
        help="processes on this machine (default: as notebook_launcher decides)",
    )
    p.add_argument(
        "--start-method", choices=START_METHODS, default=None, help="how ranks start (default fork)"
    )
    p.add_argument("--mixed-precision", choices=PRECISIONS, default=None)
    p.add_argument("--cpu", action="store_true", help="run on CPU even where accelerators exist")
    p.add_argument("--fsdp", action="store_true", help="FSDP on for this launch (settings from the config)")
    p.add_argument(
        "--engine", choices=("ray",), default=None, help="ray: the ranks as actors on a Ray cluster"
    )
    p.add_argument(
        "--ray-address", default=None, help="with --engine ray: the cluster (default: $RAY_ADDRESS, auto)"
    )
    p.add_argument("--placement", choices=("pack", "spread", "strict_pack", "strict_spread"), default=None)
    p.add_argument(
        "--resources-per-rank",
        type=json_object,
        default=None,
        metavar="JSON",
        help='with --engine ray: one rank\'s Ray resources, like \'{"CPU": 1, "GPU": 1}\'',
    )
    p.add_argument("--num-nodes", type=_positive, default=None)
    p.add_argument("--node-rank", type=_int, default=None)
    p.add_argument("--rdzv-endpoint", default="", help="host:port where the nodes meet")
    p.add_argument("--max-restarts", type=_int, default=None)
    p.add_argument("--port", default=None, help="the rendezvous port (default: a free one)")
    p.add_argument("--gpu-ids", default=None, help='the devices the ranks see, like "0,2" (default: all)')
    p.add_argument("--timeout", type=_seconds, default=None, help="stop every rank and fail after this long")
    p.add_argument("--stall-after", type=_stall, default=None, metavar="S", help=_STALL_HELP)
    p.add_argument("--out", type=_names, default=(), help="names to copy from rank 0 into the notebook")
    p.add_argument(
        "--pdb", action="store_true", help="keep the first failing rank in pdb, its commands read here"
    )
    p.add_argument("--ranks", default=None, help='with a session: the ranks to run on ("0,2", "1:", "all")')
    return p


def start_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%accelerate start", add_help=False, description="Start workers that live across cells.")
    p.add_argument("-n", "--num-processes", type=_positive, default=None)
    p.add_argument("--start-method", choices=START_METHODS, default="fork")
    p.add_argument("--mixed-precision", choices=PRECISIONS, default=None)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="FSDP on in the workers (settings from the config)")
    p.add_argument("--gpu-ids", default=None, help='the devices the workers see, like "0,2" (default: all)')
    p.add_argument(
        "--stall-after", type=_stall, default=None, metavar="S", help="for every cell: " + _STALL_HELP
    )
    return p


def launch_kwargs(args: argparse.Namespace) -> dict:
    """Only what the cell set: everything else keeps notebook_launcher's defaults and config."""
    kwargs = {"num_processes": args.num_processes, "timeout": args.timeout}
    optional = {
        "start_method": args.start_method,
        "engine": args.engine,
        "ray_address": args.ray_address,
        "placement": args.placement,
        "resources_per_rank": args.resources_per_rank,
        "mixed_precision": args.mixed_precision,
        "num_nodes": args.num_nodes,
        "node_rank": args.node_rank,
        "max_restarts": args.max_restarts,
        "use_port": args.port,
        "gpu_ids": args.gpu_ids,
        "stall_after": args.stall_after,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if args.rdzv_endpoint:
        kwargs["rdzv_endpoint"] = args.rdzv_endpoint
    if args.cpu:
        kwargs["cpu"] = True
    if args.fsdp:
        kwargs["fsdp"] = True
    if args.pdb:
        kwargs["pdb"] = True
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
        from . import kernel_session as session

        running = session.current()
        if running is not None and args.pdb:
            raise UsageError(
                "%%accelerate: --pdb is for a one-off launch; a session's workers keep a failed cell's frames "
                "already: after the cell fails, %accelerate debug RANK opens pdb on them."
            )
        if running is not None:
            given = [
                f"--{name.replace('_', '-')}"
                for name in LAUNCH_ONLY
                if getattr(args, name) not in (None, False, "")
            ]
            if given or args.start_method is not None:
                raise UsageError(
                    f"%%accelerate: {', '.join(given or ['--start-method'])} set(s) up a fresh launch, but a session "
                    f"with {running.world} workers is running: %accelerate stop first, or leave them out."
                )
            try:
                return running.run_cell(
                    cell, ranks=args.ranks, timeout=args.timeout, out=args.out, stall_after=args.stall_after
                )
            except ValueError as exc:  # a bad --ranks
                raise UsageError(f"%%accelerate: {exc}") from None
        if args.ranks is not None:
            raise UsageError("%%accelerate: --ranks needs a running session (%accelerate start -n N)")
        shell = self.shell
        number = cell_jobs.cell_number(shell)
        filename = shell.compile.cache(cell, number)  # IPython's own name for this cell's code
        label = f"Cell In[{number}]"
        kwargs = launch_kwargs(args)
        travels = (
            (args.start_method or "fork") != "fork"
            or (args.max_restarts or 0) > 0
            or (args.num_nodes or 1) > 1
            or on_ray(kwargs)  # --engine ray, or the config file's engine: ray
        )
        if travels:  # the cell and the names it reads are pickled; fail here, naming the culprit
            namespace = cell_jobs.travelling_namespace(cell, filename, shell.user_ns)
            job = cell_jobs.CellJob(cell, filename, args.out, namespace)
            function, fargs = job, ()
        else:  # a forked rank runs the cell in its copy of the notebook's namespace
            job = cell_jobs.CellJob(cell, filename, args.out)
            function, fargs = job, (shell.user_ns,)
        try:
            results = notebook_launcher(function, fargs, **kwargs)
        except LaunchConfigError as exc:
            raise UsageError(f"%%accelerate: {exc}") from None
        except Exception as exc:
            shown = cell_jobs.shorten(exc, filename, label)
            if shown is exc:
                raise
            raise shown from None
        if args.out and results and results[0]:
            shell.user_ns.update(results[0])

    @line_magic("accelerate")
    def accelerate_line(self, line: str):
        """%accelerate hardware | env | config | start [-n N ...] | stop | restart | status |
        push NAME... [--ranks R] | pull NAME [--rank R] | auto on|off | debug [RANK]"""
        words = shlex.split(line)
        if not words or words[0] not in LINE_COMMANDS:
            raise UsageError(
                f"%accelerate: expected one of {', '.join(LINE_COMMANDS)}, got {line.strip()!r}. "
                "To run a cell on N processes, start it with %%accelerate -n N."
            )
        return getattr(self, f"_cmd_{words[0]}")(words[1:])

    def _cmd_hardware(self, rest: list):
        from .kernel_env import widgets_enabled

        if widgets_enabled():
            from IPython.display import display

            from .hardware_panel import hardware_widget

            display(hardware_widget())
        else:
            from ..hardware import report

            print(report(refresh=True))

    def _cmd_env(self, rest: list):
        from ..commands.env_cmd import run

        run(argparse.Namespace(config_file=None, json=False))

    def _cmd_config(self, rest: list):
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

    # -- interactive sessions ------------------------------------------------------------------
    def _cmd_start(self, rest: list):
        from . import kernel_session as session

        args = start_parser().parse_args(rest)
        try:
            ks = session.start(
                self.shell,
                args.num_processes,
                args.start_method,
                args.mixed_precision,
                True if args.cpu else None,
                True if args.fsdp else None,
                args.gpu_ids,
                stall_after=args.stall_after,
            )
        except (RuntimeError, LaunchConfigError) as exc:
            raise UsageError(f"%accelerate start: {exc}") from None
        how = f"{args.start_method}, FSDP on" if args.fsdp else args.start_method
        print(f"session started: {ks.world} workers ({how}); %%accelerate cells now run on them")

    def _cmd_stop(self, rest: list):
        from . import kernel_session as session

        print("session stopped" if session.stop() else "no session is running")

    def _cmd_restart(self, rest: list):
        ks = self._session("restart")
        ks.session.restart()
        print(f"session restarted: {ks.world} workers, fresh namespaces")

    def _cmd_status(self, rest: list):
        from . import kernel_session as session

        ks = session.current()
        if ks is None:
            print("no session is running (%accelerate start -n N starts one)")
            return
        rows = ks.session.status()
        print(f"{'rank':>4}  {'pid':>7}  {'state':<24}  {'device':<8}  {'memory':>10}")
        for row in rows:
            state = row["state"]
            if state == "dead":
                state += f" ({row['signal'] or 'exit code ' + str(row['exitcode'])})"
            memory = f"{row['rss'] / 2**20:.0f} MiB" if row["rss"] else "-"
            print(f"{row['rank']:>4}  {row['pid']:>7}  {state:<24}  {row['device'] or '-':<8}  {memory:>10}")
        if session.auto():
            print("auto mode: every cell runs on the workers (%accelerate auto off)")

    def _cmd_push(self, rest: list):
        names, ranks = _names_and_option(rest, "--ranks")
        if not names:
            raise UsageError("%accelerate push: name the variables to send, e.g. %accelerate push model data")
        missing = [n for n in names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"%accelerate push: {', '.join(map(repr, missing))} not defined in the notebook")
        ks = self._session("push")
        try:
            ks.session.push({n: self.shell.user_ns[n] for n in names}, ranks=ranks)
        except (ValueError, SessionError) as exc:
            raise UsageError(f"%accelerate push: {exc}") from None

    def _cmd_pull(self, rest: list):
        names, rank = _names_and_option(rest, "--rank")
        if len(names) != 1:
            raise UsageError("%accelerate pull: one name, e.g. %accelerate pull losses --rank 1")
        ks = self._session("pull")
        try:
            value = ks.session.pull(names[0], int(rank) if rank is not None else 0)
        except (ValueError, SessionError) as exc:
            raise UsageError(f"%accelerate pull: {exc}") from None
        self.shell.user_ns[names[0]] = value

    def _cmd_auto(self, rest: list):
        from . import kernel_session as session

        if rest not in (["on"], ["off"]):
            raise UsageError("%accelerate auto: on or off")
        if rest == ["on"]:
            self._session("auto on")
        session.set_auto(self.shell, rest == ["on"])
        print("auto mode on: every cell runs on the workers" if rest == ["on"] else "auto mode off")

    def _cmd_debug(self, rest: list):
        from IPython.core.error import StdinNotImplementedError

        ks = self._session("debug")
        if len(rest) > 1 or (rest and not rest[0].lstrip("-").isdigit()):
            raise UsageError(
                f"%accelerate debug: one rank number, e.g. %accelerate debug 1; got {' '.join(rest)!r}"
            )
        if not rest and not ks.last_failed:
            raise UsageError(
                "%accelerate debug: the last session cell failed on no rank; name one: %accelerate debug RANK"
            )
        rank = int(rest[0]) if rest else ks.last_failed[0]
        if not 0 <= rank < ks.world:
            raise UsageError(
                f"%accelerate debug: rank {rank} does not exist; the session's ranks are 0..{ks.world - 1}"
            )
        if not rest:
            print(f"rank {rank}, the first rank the last session cell failed on:")
        try:
            ks.debug(rank)
        except StdinNotImplementedError:
            raise UsageError(
                "%accelerate debug: this front end does not answer input(), which the debugger reads commands with"
            ) from None
        except (ValueError, SessionError) as exc:
            raise UsageError(f"%accelerate debug: {exc}") from None
        except KeyboardInterrupt:
            raise DebuggerInterrupted(
                f"the debugger on rank {rank} ended; the worker keeps its state"
            ) from None

    def _session(self, what: str):
        from . import kernel_session as session

        ks = session.current()
        if ks is None:
            raise UsageError(f"%accelerate {what}: no session is running (%accelerate start -n N starts one)")
        return ks


class DebuggerInterrupted(cell_jobs._ShownShort, KeyboardInterrupt):
    """The kernel was interrupted during `%accelerate debug`: the worker's pdb has ended."""


def _names_and_option(words: list, option: str) -> tuple:
    """(names, value of `option` or None) from e.g. ['a', 'b', '--ranks', '0,2']."""
    names, value = [], None
    it = iter(words)
    for word in it:
        if word == option:
            value = next(it, None)
            if value is None:
                raise UsageError(f"{option} needs a value")
        elif word.startswith("-"):
            raise UsageError(f"unknown option {word!r} (expected {option})")
        elif not word.isidentifier():
            raise UsageError(f"{word!r} is not a variable name")
        else:
            names.append(word)
    return names, value
