"""What the layers above tell the floor: the process's state and this machine's accelerators.

utils/ sits below state.py and hardware.py and may not import them, yet collectives need the
current PartialState and device-map planning needs the machine. Those modules register a
provider here when they are imported; the floor asks through `current_state()` and
`accelerators()` / `ram_available()`.
"""

from __future__ import annotations

from typing import Callable, Optional

_state_provider: Optional[Callable] = None
_accelerator_state_provider: Optional[Callable] = None
_machine_provider: Optional[object] = None


def register_state_provider(provider: Callable) -> None:
    """`provider()` returns the process's PartialState, creating it on first use (state.py)."""
    global _state_provider
    _state_provider = provider


def register_accelerator_state_provider(provider: Callable) -> None:
    """`provider()` returns the process's AcceleratorState, creating it on first use (the package root)."""
    global _accelerator_state_provider
    _accelerator_state_provider = provider


def register_machine_provider(machine) -> None:
    """`machine` answers accelerators() and ram_available() (the hardware module itself), or is a
    function that returns it (the package root lends one that imports hardware on first use)."""
    global _machine_provider
    _machine_provider = machine


def current_state():
    """The process's PartialState, or None for a lone process that never made one.

    Without a provider, notebook_accel.state was never imported, so no state exists: a process
    that is alone (no launcher variables, no process group) needs none, and one in a multi-process
    job must make one first, since which device and backend to use is decided there.
    """
    if _state_provider is not None:
        return _state_provider()
    from .environment import read_launch_env

    if not read_launch_env().distributed and not _process_group_exists():
        return None
    raise RuntimeError(
        "This process is part of a multi-process job but has no PartialState yet: create "
        "PartialState() or Accelerator() before calling a collective."
    )


def current_accelerator_state():
    """The process's AcceleratorState (its mixed precision on top of the PartialState), created from
    the environment on first use, as accelerate's `AcceleratorState()` is."""
    if _accelerator_state_provider is None:
        raise RuntimeError("No AcceleratorState is lent to utils/: import notebook_accel, whose root lends it.")
    return _accelerator_state_provider()


def _process_group_exists() -> bool:
    import sys

    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _machine():
    if _machine_provider is None:
        raise RuntimeError(
            "The machine's devices are not known yet: `import notebook_accel.hardware` (any Accelerator, "
            "PartialState or notebook_launcher does) before asking for them."
        )
    return _machine_provider() if callable(_machine_provider) else _machine_provider


def accelerators() -> list:
    """Every accelerator device this process can use (hardware.accelerators())."""
    return _machine().accelerators()


def ram_available() -> int:
    """Bytes of RAM available now (hardware.ram_available())."""
    return _machine().ram_available()
