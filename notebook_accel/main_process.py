"""Work done once, on the main process, while the others skip or wait: `save`, `tqdm`,
`merge_fsdp_weights`, and `clean_state_dict_for_safetensors` (safetensors refuses tensors that share
memory). Which process is the main one is the PartialState's to say, so this sits above state.py;
`notebook_accel.utils` exports these names, as accelerate's does."""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict

import torch

from .state import PartialState
from .utils.dcp_plain import merge_folder
from .utils.imports import is_tqdm_available
from .utils.other import id_tensor_storage


def _ranks() -> tuple:
    """(is main process, is local main process); both True in a lone process."""
    state = PartialState()
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


def merge_fsdp_weights(
    checkpoint_dir: str,
    output_path: str,
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> str:
    """The full weights of a sharded checkpoint folder (`.../pytorch_model_fsdp_0`, as save_state writes
    with SHARDED_STATE_DICT) in one file: `{output_path}/model.safetensors` (`pytorch_model.bin` without
    safe_serialization). Runs in one process, on CPU, reading the folder as plain data; in a run of
    several processes the main process merges and the others wait. Returns the file written."""
    state = PartialState()
    path = merge_folder(
        checkpoint_dir, output_path, safe_serialization, remove_checkpoint_dir, write=state.is_main_process
    )
    state.wait_for_everyone()
    return path
