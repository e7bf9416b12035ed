"""One rank of a Ray launch, inside its actor on a node (starters/ray_engine.py drives it).

Everything travels over Ray's own actor calls, never a socket back to the driver, so a driver the
nodes cannot reach (Ray Client, a laptop) works. The actor serves three calls at once: `run` (the
function), `take` (the output since the last call) and `probe` (the stall watch's questions, which
the actor asks its own process's worker server: watch_rank.py): its fds 1 and 2 are pipes while
`run` runs, so what the rank prints, C extensions included, reaches the driver's events and not Ray's
log files (which Ray would print on the driver a second time)."""

from __future__ import annotations

import os
import threading
import time


def versions() -> dict:
    import torch

    from ..utils.version import __version__

    return {"notebook_accel": __version__, "torch": torch.__version__.split("+")[0]}


class RankActor:
    """Created by the driver with `ray.remote(max_concurrency=CALLS)`, one per rank and bundle."""

    CALLS = 3  # run, take and probe at once

    def __init__(self):
        self._calling = False  # the function has begun (it was loaded: imports, unpickling)
        self._lock = threading.Lock()
        self._chunks: list = []  # (stream, bytes) read since the last `take`
        self._readers: list = []
        self._sampler = None  # this process's resources, while `run` runs (launch/resources.py)

    def where(self) -> dict:
        """Where this rank runs: its node, address, GPUs, pid and versions."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
            "versions": versions(),
        }

    def free_port(self) -> int:
        from .ports import free_port

        return free_port()

    def take(self) -> tuple:
        """(the output since the last call as (stream, bytes) pieces, a RankResources or None,
        whether the function has begun): the resources are sampled here, on the rank's node, at most
        once a second, as the launcher samples a local rank's."""
        with self._lock:
            chunks, self._chunks = self._chunks, []
            sampler = self._sampler
        usage = None
        if sampler is not None and sampler.due(time.monotonic()):
            usage = next(iter(sampler.sample(time.monotonic(), list(sampler.ranks))), None)
        return chunks, usage, self._calling

    def probe(self, stacks: bool) -> tuple:
        """(the rank's collectives, its threads' stacks as text when `stacks`), each None where its
        worker server did not answer: what watch_probe reads of a local rank by its pid."""
        from . import watch_probe

        pid = os.getpid()
        return watch_probe.collectives(pid), (watch_probe.stacks(pid) if stacks else None)

    def run(self, env: dict, threads: int, payload: bytes) -> tuple:
        """("result", body, buffers) or ("error", report): as a forked rank reports on its socket."""
        from .resources import ResourceSampler

        with self._lock:
            self._sampler = ResourceSampler({int(env["RANK"]): os.getpid()})
        saved = self._capture()
        self._calling = False
        try:
            return _run(env, threads, payload, lambda: setattr(self, "_calling", True))
        finally:
            self._release(saved)
            with self._lock:
                self._sampler = None
            from . import watch_rank

            watch_rank.stop()  # an actor runs one rank, then the driver kills it: no socket left behind

    def _capture(self) -> tuple:
        from .child import flush_output

        flush_output()
        saved = (os.dup(1), os.dup(2))
        self._stop = os.pipe()  # written once the function is over: the readers take what is left
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            read, write = os.pipe()
            os.dup2(write, fd)
            os.close(write)
            reader = threading.Thread(target=self._read, args=(read, stream), daemon=True)
            reader.start()
            self._readers.append(reader)
        return saved

    def _release(self, saved: tuple) -> None:
        from .child import flush_output

        flush_output()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        # Not the pipes' end: a process the rank started (a DataLoader worker server, a compile pool)
        # may hold them open past the function. What was written by now is read, then they close.
        os.write(self._stop[1], b"x")
        for reader in self._readers:
            reader.join(timeout=10)
        self._readers = []
        for fd in self._stop:
            os.close(fd)

    def _read(self, fd: int, stream: str) -> None:
        import select

        try:
            while True:
                readable, _, _ = select.select([fd, self._stop[0]], [], [])
                if self._stop[0] in readable:  # the function is over: what the pipe holds now, then done
                    os.set_blocking(fd, False)
                    for _ in range(64):  # a process still writing there does not hold us
                        data = _read_some(fd)
                        if not data:
                            break
                        self._keep(stream, data)
                    return
                data = _read_some(fd)
                if not data:  # every writer is gone
                    return
                self._keep(stream, data)
        finally:
            os.close(fd)

    def _keep(self, stream: str, data: bytes) -> None:
        with self._lock:
            self._chunks.append((stream, data))


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return b""


def _run(env: dict, threads: int, payload: bytes, calling) -> tuple:
    from .child import _destroy_group, _error_report, flush_output
    from .payload import dumps_result, loads

    __tracebackhide__ = True  # noqa: F841  (child._user_traceback starts the rank's traceback below this)
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(threads)
        from .. import state
        from . import watch_rank

        watch_rank.start()  # off where the plan turned the watch off (its env); one per process

        for kind in (state.PartialState, state.AcceleratorState, state.GradientState):
            kind._reset_state()  # a reused actor process: the last launch's state is not this one's
        function, args = loads(payload)
        calling()
        result = function(*args)
    except BaseException as exc:  # everything, SystemExit and KeyboardInterrupt too
        flush_output()
        return ("error", _error_report(exc))
    finally:
        _destroy_group()
    try:
        body, buffers = dumps_result(result)
    except Exception as exc:
        rank = env.get("RANK", "?")
        message = f"the return value of rank {rank} ({type(result).__name__}) cannot be pickled: {exc}"
        return ("error", {"exc_type": "PicklingError", "message": message, "traceback": ""})
    return ("result", body, [bytes(b) for b in buffers])  # Ray pickles bytes, not memoryviews
