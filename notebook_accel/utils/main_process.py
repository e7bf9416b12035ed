"""Saving and progress bars done once, on the main process: `save`, `tqdm`, and
`clean_state_dict_for_safetensors` (safetensors refuses tensors that share memory)."""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict

import torch

from .current import current_state
from .imports import is_tqdm_available
from .other import id_tensor_storage


def _ranks() -> tuple:
    """(is main process, is local main process); both True in a lone process."""
    state = current_state()
    if state is None:
        return True, True
    return state.is_main_process, state.is_local_main_process


def clean_state_dict_for_safetensors(state_dict: dict) -> dict:
    """Keep the first name of each group of tensors that share memory (tied weights), drop the rest
    with a warning naming them, and make every tensor contiguous. Changes and returns `state_dict`."""
    groups = defaultdict(list)
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor):
            groups[id_tensor_storage(tensor)].append(name)
    dropped = [name for names in groups.values() for name in names[1:]]
    for name in dropped:
        del state_dict[name]
    if dropped:
        # Logged, as accelerate does ("Removed shared tensor", its words, which code may look for).
        logging.getLogger(__name__).warning(
            f"Removed shared tensor {sorted(dropped)} while saving: they share memory with another entry "
            "(tied weights); re-tie them after loading."
        )
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor):
            state_dict[name] = tensor.contiguous()
    return state_dict


def save(obj, f, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """torch.save (or safetensors' save_file with `safe_serialization`) on the main process only, or
    on each node's main process with `save_on_each_node`; the other processes do nothing."""
    main, local_main = _ranks()
    if not (local_main if save_on_each_node else main):
        return
    if not safe_serialization:
        torch.save(obj, f)
        return
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise TypeError("save(..., safe_serialization=True) takes a dict of tensors (a state_dict)")
    from safetensors.torch import save_file

    tensors = OrderedDict((k, v.detach().cpu()) for k, v in obj.items())
    save_file(clean_state_dict_for_safetensors(tensors), f, metadata={"format": "pt"})


def tqdm(*args, main_process_only: bool = True, **kwargs):
    """tqdm.auto.tqdm, shown on each node's main process only (unless `main_process_only=False`)."""
    if not is_tqdm_available():
        raise ImportError("notebook_accel.utils.tqdm needs the tqdm package: pip install tqdm")
    if args and isinstance(args[0], bool):
        raise ValueError(
            f"tqdm({args[0]!r}, ...): pass main_process_only= by keyword; the first argument is the iterable"
        )
    from tqdm.auto import tqdm as _tqdm

    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = not _ranks()[1]
    return _tqdm(*args, disable=disable, **kwargs)
