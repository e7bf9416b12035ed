"""Seeding and keeping random number generators in step across processes (accelerate's names).

Seeding per rank and synchronising ask the process's PartialState, so this sits above state.py;
accelerate's path (`notebook_accel.utils.random`) re-exports it."""

from __future__ import annotations

import os
import random
import re
import sys
from typing import Iterable, Optional, Union

import torch

from .state import PartialState
from .utils import families
from .utils.dataclasses import DistributedType, RNGType
from .utils.imports import is_cuda_available, is_torch_xla_available

# Device families whose torch module keeps its own RNG states (manual_seed_all, get/set_rng_state).
_DEVICE_RNG_FAMILIES = tuple(f.name for f in families.FAMILIES if f.own_rng)


def _family_module(name: str, for_seeding: bool = False):
    """torch.<name> when that family is usable here; None otherwise (never initialises a device)."""
    module = getattr(torch, name, None)
    if module is None:
        return None
    if name == "cuda":
        # Seeding is lazy (queued until CUDA is first used); reading a state needs a device.
        return module if for_seeding or is_cuda_available() else None
    try:
        return module if module.is_available() else None
    except Exception:
        return None


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's `random`, numpy, torch and every accelerator family present.

    device_specific adds the process index, so ranks draw different streams; deterministic turns on
    `torch.use_deterministic_algorithms(True)`.
    """
    if device_specific:
        seed += PartialState().process_index
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is a dependency, but a broken install should not stop seeding
        np = None
    if np is not None:
        np.random.seed(seed % 2**32)  # numpy only takes 32-bit seeds
    torch.manual_seed(seed)
    for name in _DEVICE_RNG_FAMILIES:
        module = _family_module(name, for_seeding=True)
        if module is not None and hasattr(module, "manual_seed_all"):
            module.manual_seed_all(seed)
    # Importing torch_xla is costly and can claim a TPU: only seed it where XLA is in use.
    if "torch_xla" in sys.modules or (is_torch_xla_available() and os.environ.get("PJRT_DEVICE")):
        _xla_set_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace for deterministic matmuls; harmless elsewhere.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def _parse_rng_type(rng_type) -> RNGType:
    try:
        return RNGType(rng_type.value if isinstance(rng_type, RNGType) else str(rng_type).lower())
    except ValueError:
        raise ValueError(f"Unknown rng type {rng_type!r}: choose from {RNGType.list()}.") from None


def _get_state(rng_type: RNGType, generator: Optional[torch.Generator]) -> torch.Tensor:
    if rng_type == RNGType.TORCH:
        return torch.get_rng_state()
    if rng_type == RNGType.GENERATOR:
        if generator is None:
            raise ValueError('synchronize_rng_state("generator") needs the generator: pass generator=...')
        return generator.get_state()
    module = getattr(torch, rng_type.value, None)
    if module is None or not hasattr(module, "get_rng_state") or not _family_module(rng_type.value):
        raise RuntimeError(
            f'Cannot synchronize the "{rng_type.value}" RNG: no {rng_type.value} device is usable in this process. '
            'Drop it from rng_types (e.g. rng_types=["generator"]).'
        )
    return module.get_rng_state()


def _set_state(rng_type: RNGType, generator: Optional[torch.Generator], state: torch.Tensor) -> None:
    if rng_type == RNGType.TORCH:
        torch.set_rng_state(state)
    elif rng_type == RNGType.GENERATOR:
        generator.set_state(state)
    else:
        getattr(torch, rng_type.value).set_rng_state(state)


def synchronize_rng_state(
    rng_type: Union[str, RNGType, None] = None, generator: Optional[torch.Generator] = None
):
    """Give every process the RNG state of rank 0 for one kind of generator."""
    if rng_type is None:
        return
    rng_type = _parse_rng_type(rng_type)
    state = PartialState()
    distributed = state.use_distributed
    xla = state.distributed_type == DistributedType.XLA
    if rng_type == RNGType.XLA:
        if xla and distributed:
            _xla_sync_seed()
        return
    rng_state = _get_state(rng_type, generator)
    if not distributed:
        return
    if xla:  # XLA processes share no torch.distributed group
        _set_state(rng_type, generator, _xla_value_of_rank0(rng_state))
        return
    # RNG states are CPU byte tensors; backends like nccl only move device tensors.
    on_device = state.device.type not in ("cpu", "xla") and state.backend != "gloo"
    payload = rng_state.to(state.device) if on_device else rng_state.clone()
    torch.distributed.broadcast(payload, src=0)
    _set_state(rng_type, generator, payload.cpu())


def synchronize_rng_states(
    rng_types: Iterable[Union[str, RNGType]], generator: Optional[torch.Generator] = None
):
    """synchronize_rng_state for each type in `rng_types` ("torch", "cuda", "xla", "generator", ...)."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)


# -- every generator at once, for checkpoints ----------------------------------------------------


def capture_rng_states() -> dict:
    """Python's, numpy's, torch's and each used device family's RNG states (and XLA's seed).

    Plain tuples and tensors only, so the file a checkpoint writes loads with
    torch.load(weights_only=True). A device family nobody used here is left out: reading it would
    initialise it, and its RNG is still the seeded one.
    """
    import numpy as np

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "random_state": random.getstate(),
        "numpy_random_seed": (
            name,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(gauss),
        ),
        "torch_manual_seed": torch.get_rng_state(),
    }
    for name in _DEVICE_RNG_FAMILIES:
        module = families.family(name).used_module()
        if module is None or not hasattr(module, "get_rng_state"):
            continue
        every = getattr(module, "get_rng_state_all", None)
        states[f"torch_{name}_manual_seed"] = list(every()) if every else [module.get_rng_state()]
    if "torch_xla" in sys.modules:
        try:
            import torch_xla.core.xla_model as xm

            states["xm_seed"] = int(xm.get_rng_state())
        except Exception:  # installed but unusable: nothing to save
            pass
    return states


def restore_rng_states(states: dict) -> None:
    """Put back what capture_rng_states returned (devices this process lacks are skipped)."""
    import numpy as np

    random.setstate(states["random_state"])
    name, keys, pos, has_gauss, gauss = states["numpy_random_seed"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch_manual_seed"])
    for key, per_device in states.items():
        match = re.fullmatch(r"torch_(\w+)_manual_seed", key)
        if not match or match.group(1) not in _DEVICE_RNG_FAMILIES:
            continue
        module = getattr(torch, match.group(1), None)
        if module is None or not hasattr(module, "set_rng_state"):
            continue
        try:
            count = module.device_count() if hasattr(module, "device_count") else 1
        except Exception:
            count = 0
        for device, state in enumerate(per_device[:count]):
            if hasattr(module, "get_rng_state_all"):
                module.set_rng_state(state, device)
            else:
                module.set_rng_state(state)
    if "xm_seed" in states and "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(states["xm_seed"])


# -- the XLA boundary: the only calls into torch_xla ----------------------------------------------


def _xla_set_seed(seed: int) -> None:
    try:
        import torch_xla.core.xla_model as xm
    except Exception:  # installed but unusable (a mismatched torch): nothing to seed
        return
    xm.set_rng_state(seed)


def _xla_value_of_rank0(value):
    import torch_xla.core.xla_model as xm

    return xm.mesh_reduce("notebook_accel.rng_state", value, lambda per_rank: per_rank[0])


def _xla_sync_seed() -> None:
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(_xla_value_of_rank0(xm.get_rng_state()))
