"""PartialState, AcceleratorState, GradientState: the environment, resolved once per process.

Every instance of a state class shares one dict (the Borg pattern), so `PartialState()` anywhere in
a process returns the same view. `use_thread_local_state(True)` gives each thread its own dict,
for tests that need isolation; `_reset_state()` clears it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import threading
from typing import Any, Callable, Optional

import torch

from . import hardware
from .placement import resolve_placement
from .utils import families, peers
from .utils.dataclasses import DistributedType, parse_mixed_precision
from .utils.environment import DEBUG_ENV, MIXED_PRECISION_ENV, USE_CPU_ENV, parse_bool, read_launch_env

_thread_local_mode = parse_bool(os.environ.get("NOTEBOOK_ACCEL_THREAD_LOCAL_STATE", "0"))


def use_thread_local_state(enabled: bool = True) -> None:
    """Give each thread its own state from now on (tests); False shares one per process again."""
    global _thread_local_mode
    _thread_local_mode = bool(enabled)


class SharedDict:
    """Class-level descriptor: the one dict every instance uses as its __dict__."""

    def __init__(self) -> None:
        self._process: dict = {}
        self._threads = threading.local()

    def __get__(self, obj, owner=None) -> dict:
        if not _thread_local_mode:
            return self._process
        if not hasattr(self._threads, "d"):
            self._threads.d = {}
        return self._threads.d

    def clear(self) -> None:
        self.__get__(None).clear()


def _init_process_group(
    backend: str, env, timeout: Optional[datetime.timedelta], init_method: Optional[str] = None
) -> None:
    import torch.distributed as dist

    if env.master_addr is None or env.master_port is None:
        if env.local_world_size != env.world_size:
            raise RuntimeError(
                f"MASTER_ADDR/MASTER_PORT are not set for a {env.world_size}-process job across nodes; "
                "set both to the address and port of the rank-0 machine."
            )
        # One node: a local default is the only sensible answer.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    else:
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
    kwargs = {"backend": backend, "rank": env.rank, "world_size": env.world_size}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if init_method is not None:  # InitProcessGroupKwargs(init_method=...): the user's rendezvous
        kwargs["init_method"] = init_method
    peers.joined = True
    store = peers.attempt_store(env.world_size, timeout) if init_method is None else None
    if store is not None:  # under torch elastic: see utils/peers.py
        peers.wait_for_peers(store, env.rank, env.world_size, timeout)
        kwargs["store"] = store
    peers.tell("joining")
    if store is None and init_method is None and env.rank != 0 and env.local_world_size == env.world_size:
        # One machine: connect once rank 0's store listens, not into torch's back-off (peers.py).
        most = timeout.total_seconds() if timeout is not None else 60.0
        peers.wait_for_listener(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), min(60.0, most))
    # torch.distributed.nn's functions take `group=group.WORLD` as a default, read at import: DDP
    # imports it, and imported after the group exists it holds the group for good, so the group's
    # threads outlive the interpreter and a late one aborts the exit (see peers.keep).
    import torch.distributed.nn  # noqa: F401

    dist.init_process_group(**kwargs)
    peers.keep(dist.group.WORLD)  # see there: a torch deadlock
    peers.tell("joined")
    if backend == "gloo" and env.world_size > 1:
        # gloo's init can return on one rank while a peer is still connecting to it; a rank that then
        # finishes and tears its group down fails that peer ("connectFullMesh ... closed by peer").
        # Seen with a cell that runs no collective. One barrier: everyone is connected before anyone goes.
        dist.barrier()


class _Borg:
    """A state class: every instance shares the class's one dict (see SharedDict)."""

    _shared_state: SharedDict

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}

    def __reduce__(self):
        # Unpickled where this process has its state, a state is that shared one (not a private copy
        # that later changes miss); see _unpickle_state.
        return (_unpickle_state, (type(self), dict(self.__dict__)))


def _unpickle_state(cls, saved: dict):
    """A `cls` instance viewing this process's shared dict, as `cls()` would, when the process has
    resolved its state; else one holding the pickled values on its own (accelerate's behaviour), so
    a process that has not resolved its state yet still resolves its own on the next `cls()`."""
    obj = cls.__new__(cls)
    shared = cls._shared_state
    obj.__dict__ = shared if shared else saved
    return obj


class PartialState(_Borg):
    """Where this process sits in the job and which device it drives; no training settings."""

    _shared_state = SharedDict()

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if self.initialized:
            return
        try:
            self._resolve(cpu, kwargs)
        except BaseException:
            # A half-resolved state would pass `initialized` and mislead every later instance.
            self.__dict__.clear()
            raise

    def _resolve(self, cpu: bool, kwargs: dict) -> None:
        env = read_launch_env()
        cpu = bool(cpu) or parse_bool(os.environ.get(USE_CPU_ENV, "0"))
        family = None if cpu else hardware.detect_device_family()
        placement = resolve_placement(
            env,
            family,
            cpu=cpu,
            device_count=hardware.device_count(family),
            backend=kwargs.pop("backend", None),
        )
        self._cpu = cpu
        self._launch_env = env
        self.debug = parse_bool(os.environ.get(DEBUG_ENV, "0"))
        self.distributed_type = placement.distributed_type
        self.backend = placement.backend
        self.num_processes = env.world_size
        self.process_index = env.rank
        self.local_process_index = env.local_rank
        self.num_local_processes = env.local_world_size
        self.fork_launched = parse_bool(os.environ.get("FORK_LAUNCHED", "0"))
        if placement.distributed_type == DistributedType.XLA:
            # xmp.spawn sets no RANK/WORLD_SIZE: the XLA runtime knows the topology.
            self.device, topology = _xla_device_and_topology()
            (self.process_index, self.num_processes, self.local_process_index, self.num_local_processes) = (
                topology
            )
        else:  # ACCELERATE_TORCH_DEVICE (e.g. "cuda:1") overrides the placement's choice, as in accelerate
            self.device = torch.device(os.environ.get("ACCELERATE_TORCH_DEVICE") or placement.device)
        if env.distributed and placement.distributed_type != DistributedType.XLA:
            import torch.distributed as dist

            if not dist.is_initialized():
                _init_process_group(
                    placement.backend, env, kwargs.pop("timeout", None), kwargs.pop("init_method", None)
                )
        self.set_device()

    # -- identity -------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type}{'  Backend: ' + self.backend if self.backend else ''}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )

    @staticmethod
    def _reset_state() -> None:
        """Forget the resolved environment (the process group, if any, is left as it is)."""
        PartialState._shared_state.clear()

    def __getattr__(self, name: str):
        # Only reached for names not set on the shared dict nor defined on the class.
        if not self.__dict__ and not name.startswith("__"):
            raise AttributeError(
                f"`PartialState` object has no attribute `{name}` yet. This happens if `PartialState._reset_state()` "
                "was called after it was created: create a new PartialState() or Accelerator() and use that."
            )
        raise AttributeError(f"'PartialState' object has no attribute {name!r}")

    @property
    def use_distributed(self) -> bool:
        return self.distributed_type != DistributedType.NO and self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def default_device(self) -> torch.device:
        return self.device

    # -- synchronisation ------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """Barrier across all processes; a no-op in a single process."""
        if not self.use_distributed:
            return
        if self.distributed_type == DistributedType.XLA:
            import torch_xla.core.xla_model as xm

            xm.rendezvous("notebook_accel.wait_for_everyone")
            return
        torch.distributed.barrier()

    def _goes_first(self, is_first: bool):
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def main_process_first(self):
        """The main process runs the block first, then the others (download once, then read)."""
        yield from self._goes_first(self.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self):
        yield from self._goes_first(self.is_local_main_process)

    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        """Yield this process's contiguous share of `inputs` (list, tuple, dict of those, tensor).

        17 items over 4 processes give 5, 4, 4, 4; with apply_padding every share has 5, the short
        ones repeating their own last item, so every rank runs the same number of steps and
        collectives line up. Padded results sit at the end of each rank's share: drop them per rank
        (or use gather_for_metrics) before using gathered values.
        """
        yield _split(inputs, self.num_processes, self.process_index, apply_padding)

    # -- decorators -----------------------------------------------------------------------
    def on_main_process(self, function: Callable) -> Callable:
        return self._only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable) -> Callable:
        return self._only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        return self._only_if(function, lambda: self.is_last_process)

    def on_process(self, function: Optional[Callable] = None, process_index: Optional[int] = None):
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        _check_index("process_index", process_index)
        return self._only_if(function, lambda: self.process_index == process_index)

    def on_local_process(
        self, function: Optional[Callable] = None, local_process_index: Optional[int] = None
    ):
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        _check_index("local_process_index", local_process_index)
        return self._only_if(function, lambda: self.local_process_index == local_process_index)

    @staticmethod
    def _only_if(function: Callable, condition: Callable[[], bool]) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if condition():
                return function(*args, **kwargs)
            return None

        return wrapper

    def print(self, *args, **kwargs) -> None:
        """print(), once per node."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # -- teardown and devices -------------------------------------------------------------
    def destroy_process_group(self, group=None) -> None:
        import torch.distributed as dist

        # A forked rank's default group is the launcher's to close (accelerate's rule too).
        if (self.fork_launched and group is None) or not (dist.is_available() and dist.is_initialized()):
            return
        if self.use_distributed:
            dist.destroy_process_group(group)

    def set_device(self) -> None:
        """Make this process's device the current one for its family (no-op on CPU)."""
        kind = self.device.type
        if kind not in families.names():  # cpu, meta
            return
        module = families.family(kind).module()  # None for xla and neuron; mps has no set_device
        if module is not None and hasattr(module, "set_device"):
            module.set_device(self.device)


def _xla_device_and_topology():
    # The one call into torch_xla for placement; it cannot run on machines without it.
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    topology = (xr.global_ordinal(), xr.world_size(), xr.local_ordinal(), xr.local_process_count())
    return xm.xla_device(), topology


def _check_index(name: str, value) -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r}: pass a non-negative integer, e.g. @state.on_process({name}=1).")


def _split(inputs, num: int, index: int, apply_padding: bool):
    if num == 1:
        return inputs
    if isinstance(inputs, dict):
        lengths = {k: len(v) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"split_between_processes needs dict values of equal length; got lengths {lengths}."
            )
        return {k: _split(v, num, index, apply_padding) for k, v in inputs.items()}
    if not hasattr(inputs, "__len__") or not hasattr(inputs, "__getitem__"):
        raise TypeError(
            f"split_between_processes takes a list, tuple, dict or tensor, not {type(inputs).__name__}."
        )
    length = len(inputs)
    per, extra = divmod(length, num)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    share = inputs[start:end]
    if not apply_padding or length == 0:
        return share
    target = per + (1 if extra else 0)
    missing = target - (end - start)
    if missing <= 0:
        return share
    # Repeat this share's own last item (accelerate does the same); an empty share repeats the input's.
    last = share[-1:] if end > start else inputs[-1:]
    if isinstance(share, torch.Tensor):
        return torch.cat([share] + [last] * missing)
    if isinstance(share, tuple):
        return share + tuple(last) * missing
    return list(share) + list(last) * missing


class AcceleratorState(_Borg):
    """PartialState plus training settings (mixed precision, plugins); one per process."""

    _shared_state = SharedDict()
    _partial_attrs = (
        "device",
        "backend",
        "distributed_type",
        "num_processes",
        "process_index",
        "local_process_index",
        "num_local_processes",
        "fork_launched",
        "use_distributed",
        "is_main_process",
        "is_local_main_process",
        "is_last_process",
        "default_device",
        "wait_for_everyone",
        "main_process_first",
        "local_main_process_first",
        "split_between_processes",
        "on_main_process",
        "on_local_main_process",
        "on_last_process",
        "on_process",
        "on_local_process",
        "print",
        "destroy_process_group",
        "set_device",
    )

    def __init__(
        self,
        mixed_precision: Optional[str] = None,
        cpu: bool = False,
        dynamo_plugin=None,
        deepspeed_plugin=None,
        fsdp_plugin=None,
        torch_tp_plugin=None,
        megatron_lm_plugin=None,
        _from_accelerator: bool = False,
        **kwargs: Any,
    ) -> None:
        self.__dict__ = self._shared_state
        requested = None if mixed_precision is None else parse_mixed_precision(mixed_precision)
        if self.initialized:
            if requested is not None and requested != self._mixed_precision:
                raise ValueError(
                    f"AcceleratorState already exists with mixed_precision={self._mixed_precision!r}; "
                    f"it cannot be re-created with mixed_precision={requested!r} in the same process. "
                    "Call AcceleratorState._reset_state(reset_partial_state=True) first, or restart the kernel "
                    "(in a notebook, create the Accelerator inside the launched function)."
                )
            return
        # Parse the environment's choice before anything is stored, so a bad value leaves no half state.
        mixed_precision = requested or parse_mixed_precision(os.environ.get(MIXED_PRECISION_ENV, "no"))
        partial = PartialState(cpu, **kwargs)
        self._partial = partial
        self._mixed_precision = mixed_precision
        self.dynamo_plugin = dynamo_plugin
        self.deepspeed_plugin = deepspeed_plugin
        self.fsdp_plugin = fsdp_plugin
        self.torch_tp_plugin = torch_tp_plugin
        self.megatron_lm_plugin = megatron_lm_plugin
        self.use_ipex = False

    def __getattr__(self, name: str):
        # Only reached for names not set on the shared dict nor defined on the class.
        if not self.__dict__ and not name.startswith("__"):
            raise AttributeError(_not_created(name))
        raise AttributeError(f"'AcceleratorState' object has no attribute {name!r}")

    def destroy_process_group(self, group=None) -> None:
        # Works after _reset_state too (scripts end with it): the process group is PartialState's.
        PartialState().destroy_process_group(group)

    def __repr__(self) -> str:
        return repr(self._partial) + f"Mixed precision type: {self._mixed_precision}\n"

    @property
    def mixed_precision(self) -> str:
        return self._mixed_precision

    @property
    def debug(self) -> bool:
        return self._partial.debug

    @property
    def is_fsdp2(self) -> bool:
        return str(self.distributed_type) == "FSDP" and getattr(self.fsdp_plugin, "fsdp_version", None) == 2

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        AcceleratorState._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


def _from_partial(name: str) -> property:
    """An AcceleratorState attribute that is its PartialState's (one object answers for both)."""

    def get(self):
        if not self.__dict__:
            raise AttributeError(_not_created(name))
        if name in self.__dict__:  # set on this state (e.g. distributed_type for FSDP): it shadows
            return self.__dict__[name]
        return getattr(self._partial, name)

    def set_(self, value) -> None:
        self.__dict__[name] = value

    def delete(self) -> None:  # back to the PartialState's value
        self.__dict__.pop(name, None)

    return property(get, set_, delete, doc=f"PartialState().{name}")


def _not_created(name: str) -> str:
    # Never created, or cleared under an existing Accelerator (which then must not go on).
    return (
        f"`AcceleratorState` object has no attribute `{name}` yet. This happens if "
        "`AcceleratorState._reset_state()` was called after it was created, or before any "
        "AcceleratorState() or Accelerator() was: create a new Accelerator() and use that."
    )


for _name in AcceleratorState._partial_attrs:
    if _name not in AcceleratorState.__dict__:  # destroy_process_group is its own method
        setattr(AcceleratorState, _name, _from_partial(_name))


def _shared(name: str) -> property:
    """A GradientState attribute kept in the shared dict under its own name (a property, so the
    class lists it as accelerate's does)."""

    def get(self):
        return self.__dict__[name]

    def set_(self, value) -> None:
        self.__dict__[name] = value

    return property(get, set_)


class GradientState(_Borg):
    """Whether gradients sync on this step, and which dataloader is running (for accumulation)."""

    _shared_state = SharedDict()

    def __init__(self, gradient_accumulation_plugin=None) -> None:
        self.__dict__ = self._shared_state
        if not self.initialized:
            self.sync_gradients = True
            self.active_dataloader = None
            self.dataloader_references = [None]
            self.plugin_kwargs = {}
            self._is_xla_gradients_synced = False
        if gradient_accumulation_plugin is not None:
            self.plugin_kwargs = gradient_accumulation_plugin.to_kwargs()

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\nGradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    active_dataloader = _shared("active_dataloader")
    dataloader_references = _shared("dataloader_references")

    @property
    def num_steps(self) -> int:
        return self.plugin_kwargs.get("num_steps", 1)

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin_kwargs.get("adjust_scheduler", False)

    @property
    def sync_with_dataloader(self) -> bool:
        return self.plugin_kwargs.get("sync_with_dataloader", True)

    @property
    def sync_each_batch(self) -> bool:
        return self.plugin_kwargs.get("sync_each_batch", False)

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self.in_dataloader and getattr(self.active_dataloader, "end_of_dataloader", False))

    @property
    def remainder(self) -> int:
        return getattr(self.active_dataloader, "remainder", -1) if self.in_dataloader else -1

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader) -> None:
        self.active_dataloader = dataloader
        self.dataloader_references.append(dataloader)

    def _remove_dataloader(self, dataloader) -> None:
        self.dataloader_references.remove(dataloader)
        self.active_dataloader = self.dataloader_references[-1]

    @staticmethod
    def _reset_state() -> None:
        GradientState._shared_state.clear()


def is_initialized() -> bool:
    """An AcceleratorState exists in this process (an Accelerator was created)."""
    return bool(AcceleratorState._shared_state)


def do_nothing(*args, **kwargs) -> None:
    """Takes anything, does nothing: the stand-in for a decorated function on the other processes."""
    return None

