"""The elastic agent in a process of its own, forked from the launching process, for fork launches.

The agent process runs torch elastic's agent on its main thread and forks every attempt's ranks from
there, so each attempt inherits the function and its arguments as they are in memory (a fork-context
multiprocessing.Queue, an open file). It is single-threaded when it forks (apart from torch's C++
store threads), so no lock another Python thread held is copied into a rank. It tells this process
how the agent ended through a pipe: nothing on success, else the error's type, text and failed ranks.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import threading

from .. import procs
from ..child import _die_with_parent
from ..leave_kernel import leave_the_kernel

_TEXT_LIMIT = 16 << 10


class AgentError(RuntimeError):
    """How the agent process's elastic launch failed, rebuilt here from what it reported."""

    def __init__(self, type_name: str, text: str, failures: list):
        super().__init__(f"{type_name}: {text}" if text else type_name)
        self.type_name, self.text, self.failures = type_name, text, failures


def agent_failures(error: BaseException, child_failed_type) -> list:
    """[(rank, pid, exitcode)] of the ranks the agent saw fail, from either kind of error."""
    if isinstance(error, AgentError):
        return list(error.failures)
    if isinstance(error, child_failed_type):
        return [(rank, f.pid, f.exitcode) for rank, f in sorted(error.failures.items())]
    return []


class AgentProcess:
    """Forks the agent process; `thread` waits for it and ends when it has exited and been reaped."""

    def __init__(self, config, entry, args):
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            # From the process's lasting thread: the agent's PR_SET_PDEATHSIG follows that thread.
            self.pid = procs._LastingThread.call(_fork_agent, config, entry, args, read_fd, write_fd)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.error = None
        self.thread = threading.Thread(
            target=self._wait, args=(read_fd,), name="notebook_accel-elastic-agent", daemon=True
        )
        self.thread.start()

    def _wait(self, read_fd: int) -> None:
        # The agent's exit, not the pipe's end, says it is done: its ranks (and whatever they start)
        # inherit the write end, so the pipe may stay open after the agent is gone. The report is
        # small (_describe caps it), so the agent never blocks writing it before it exits.
        try:
            _, status = os.waitpid(self.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped by someone else
            code = None
        os.set_blocking(read_fd, False)
        data = b""
        try:
            while chunk := os.read(read_fd, 1 << 16):
                data += chunk
        except BlockingIOError:
            pass
        finally:
            os.close(read_fd)
        if data:
            report = pickle.loads(data)
            self.error = AgentError(report["type"], report["text"], report["failures"])
        elif code != 0:
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            self.error = AgentError("AgentProcessDied", f"the elastic agent process ended ({how})", [])

    def stop(self) -> None:
        """Kill the agent: its ranks die with it (PR_SET_PDEATHSIG), the hub kills their groups."""
        if not self.thread.is_alive():
            return  # exited and reaped: its pid may be another process's by now
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fork_agent(config, entry, args, read_fd: int, write_fd: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        os.close(read_fd)
        _die_with_parent()
        procs._after_fork_like_multiprocessing()
        # A kernel's sys.stdout talks to its sockets: this process writes to the plain fds instead.
        kernel_streams = (sys.stdout, sys.stderr)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        leave_the_kernel(kernel_streams)  # every attempt's ranks are forked from here
        report = b""
        try:
            from torch.distributed.launcher.api import elastic_launch

            elastic_launch(config, entry)(*args)
        except BaseException as exc:
            report = pickle.dumps(_describe(exc))
        _write_all(write_fd, report)
    finally:
        os._exit(0)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _describe(error: BaseException) -> dict:
    failures = getattr(error, "failures", None)
    listed = []
    if isinstance(failures, dict):
        listed = [(r, getattr(f, "pid", None), getattr(f, "exitcode", None)) for r, f in sorted(failures.items())]
    text = str(error)
    if len(text) > _TEXT_LIMIT:  # the pipe holds 64 KiB: a longer report would block the agent's exit
        text = text[: _TEXT_LIMIT // 2] + "\n...\n" + text[-_TEXT_LIMIT // 2 :]
    return {"type": type(error).__name__, "text": text, "failures": listed[:256]}
