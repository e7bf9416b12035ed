"""What runs inside each rank process: take over fds 1 and 2, leave the kernel (when forked from
one), run the function, report back.

A rank receives three connected sockets: `out` and `err` become fds 1 and 2 (so C-level output
is caught too), `ctrl` carries the frames of channel.py: ("started", pid), ("calling",) once the
function is loaded and about to run, ("group", "joining" or "joined") around joining the process group, ("result", body, sizes) followed by the result's
out-of-band buffers, or ("error", dict). In a `pdb=True` launch an error is followed by pdb on its
traceback: ("pdb", output, prompt) for each prompt, answered by ("pdb_line", line or None), and
("pdb", output, None) when pdb ends; then the rank exits.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
import traceback

from . import pdb_relay
from .channel import recv_frame, send_frame, send_result
from .leave_kernel import leave_the_kernel


def _die_with_parent() -> None:
    # Linux: if the launching process dies (kernel killed, OOM), take this rank down too.
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _take_over_stdio(out_fd: int, err_fd: int) -> None:
    sys.stdout.flush() if sys.stdout else None
    sys.stderr.flush() if sys.stderr else None
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # A forked kernel's sys.stdout would talk to the kernel's sockets: write to the fds instead.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))


def _prepare_process(env: dict, threads: int, inherited_group: bool = False) -> None:
    if inherited_group:
        # make_plan refuses such a fork; this is a plan made before the group existed.
        from .errors import LaunchConfigError

        raise LaunchConfigError(
            "this rank was forked from a process in a torch.distributed process group (created after the "
            "launch was planned), which it can neither use nor close; launch with start_method='forkserver' "
            "or 'spawn', or before the group exists."
        )
    os.environ.update(env)
    import torch

    torch.set_num_threads(threads)
    from . import watch_rank

    watch_rank.start()  # the launcher's watch reads this rank's stacks and collectives through it
    from .. import state

    # A forked child inherits the parent's resolved state; this process is a different rank.
    state.PartialState._reset_state()
    state.AcceleratorState._reset_state()
    state.GradientState._reset_state()


def _user_traceback(exc: BaseException):
    tb = exc.__traceback__
    # Drop our frames (this module's, and those marked __tracebackhide__): the user's code starts below.
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__ or "__tracebackhide__" in tb.tb_frame.f_locals
    ):
        tb = tb.tb_next
    return tb


def _error_report(exc: BaseException) -> dict:
    text = "".join(traceback.format_exception(type(exc), exc, _user_traceback(exc)))
    kind = type(exc)
    name = (
        kind.__name__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__name__}"
    )
    return {"exc_type": name, "message": str(exc), "traceback": text}


def run(rank: int, fds: tuple, env: dict, threads: int, load) -> int:
    """Run one rank; `load()` returns (function, args). Returns the process exit code."""
    out_fd, err_fd, ctrl_fd = fds
    # Read, and gone from the environment: a launch inside this rank is not one of ours to debug.
    debug = "1" in (env.pop(pdb_relay.PDB_ENV, ""), os.environ.pop(pdb_relay.PDB_ENV, ""))
    inherited = _group_exists()  # forked from a process in a group: its group, never ours to close
    _die_with_parent()
    kernel_streams = (sys.stdout, sys.stderr)
    _take_over_stdio(out_fd, err_fd)
    leave_the_kernel(kernel_streams)  # display(), widgets, input(): this process's, not the kernel's
    os.close(out_fd)
    os.close(err_fd)
    ctrl = socket.socket(fileno=ctrl_fd)
    try:
        return run_function(rank, ctrl, lambda: _prepare_process(env, threads, inherited), load, debug)
    finally:
        flush_output()
        if not inherited:
            _destroy_group()
        from . import watch_rank

        watch_rank.stop()
        ctrl.close()


def run_function(rank: int, ctrl: socket.socket, prepare, load, debug: bool = False) -> int:
    """Say started, run `prepare()` then the loaded function, and report its result or error on
    `ctrl`; with `debug`, an error is then debugged from the launcher (`_post_mortem`). Returns the
    exit code. (A TPU rank runs this inside xmp.spawn's process: xla.py.)"""
    send_frame(ctrl, ("started", os.getpid()))
    from ..utils import peers

    peers.listen(lambda word: send_frame(ctrl, ("group", word)))  # see monitor.py, _check_group
    called = False
    try:
        prepare()
        function, args = load()
        send_frame(ctrl, ("calling",))  # the watch tells a rank still starting from one that stalled
        called = True
        result = function(*args)
    except BaseException as exc:  # report everything, KeyboardInterrupt and SystemExit too
        flush_output()
        send_frame(ctrl, ("error", _error_report(exc)))
        if debug and called:  # not before: those frames are the launch's own, not the user's
            _post_mortem(ctrl, exc)
        return 1
    flush_output()
    from .payload import dumps_result

    try:
        body, buffers = dumps_result(result)
    except Exception as exc:
        msg = f"the return value of rank {rank} ({type(result).__name__}) cannot be pickled: {exc}"
        send_frame(ctrl, ("error", {"exc_type": "PicklingError", "message": msg, "traceback": ""}))
        return 1
    send_result(ctrl, body, buffers)
    return 0


def _post_mortem(ctrl: socket.socket, exc: BaseException) -> None:
    """pdb on `exc`'s frames, its prompts answered by the launcher, which asks its user (monitor.py).
    A launcher that goes away (EOF) or answers anything but a line ends pdb."""

    def ask(text: str) -> str:
        try:
            send_frame(ctrl, ("pdb", *pdb_relay.split_prompt(text)))
            message = recv_frame(ctrl)
        except (OSError, EOFError):
            return ""
        return pdb_relay.as_pdb_line(message[1]) if message[0] == "pdb_line" else ""

    rest = pdb_relay.debug(_user_traceback(exc), ask)
    flush_output()
    try:
        send_frame(ctrl, ("pdb", rest, None))
    except OSError:
        pass


def flush_output() -> None:
    """Python's buffered output, then libc's (C extensions write through it, and it buffers when
    fd 1 is not a terminal). Session workers call this after each cell too."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    global _libc
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL(None)
        _libc.fflush(None)
    except Exception:
        pass


_libc = None


def _group_exists() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def _destroy_group() -> None:
    """Close the group this rank created. Never call it in a rank that inherited one: the group's
    threads stayed in the parent, so tearing it down here hangs (and would close the parent's links)."""
    try:
        if _group_exists():
            sys.modules["torch.distributed"].destroy_process_group()
    except Exception:
        pass


def spawn_main() -> None:
    """Entry of a spawned child: out/err are fds 1 and 2 already; the spec comes on the ctrl socket."""
    ctrl_fd = int(os.environ.pop("NOTEBOOK_ACCEL_CTRL_FD"))
    with socket.socket(fileno=os.dup(ctrl_fd)) as ctrl:
        rank, env, threads, payload = recv_frame(ctrl)

    def load():
        from .payload import loads

        return loads(payload)

    os._exit(run(rank, (os.dup(1), os.dup(2), ctrl_fd), env, threads, load))
