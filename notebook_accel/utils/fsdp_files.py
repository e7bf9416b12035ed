"""accelerate's FSDP checkpoint helpers (`save_fsdp_model`, `load_fsdp_model`, `save_fsdp_optimizer`,
`load_fsdp_optimizer`) for FSDP2 models, with accelerate's file and folder names.

SHARDED_STATE_DICT: a `torch.distributed.checkpoint` folder (`pytorch_model_fsdp_{i}`, `optimizer_{i}`)
with the entries under "model" / "optimizer", read back as plain data (`dcp_plain.py`).
FULL_STATE_DICT: the full dict gathered to rank 0 on CPU, written there (`pytorch_model_fsdp.bin`,
`optimizer.bin`), read back with `weights_only=True` on every rank. Every rank must call each helper.
Unlike `save_state`, these write straight into `output_dir` (no atomic swap), as accelerate's do.
"""

from __future__ import annotations

import os

import torch

from .constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
from .dcp_plain import PlainLoadPlanner, PlainReader, one_process_quietly


def _full(plugin) -> bool:
    name = getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type))
    if name not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        raise ValueError(
            f"state_dict_type={name}: FSDP2 checkpoints are FULL_STATE_DICT or SHARDED_STATE_DICT."
        )
    return name == "FULL_STATE_DICT"


def _refuse(adapter_only: bool, use_dcp: bool) -> None:
    if adapter_only:
        raise NotImplementedError("adapter_only=True (PEFT adapters) is not implemented by notebook_accel.")
    if not use_dcp:
        raise NotImplementedError(
            "use_dcp=False (per-rank torch.save of DTensor shards) is not implemented by notebook_accel: those files "
            "cannot be read as plain data. Use use_dcp=True (torch.distributed.checkpoint)."
        )


def _options(full: bool, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full, strict=strict)


def _indexed(stem: str, i: int, ext: str = "") -> str:
    return f"{stem}{ext}" if i == 0 else f"{stem}_{i}{ext}"


def _barrier(accelerator) -> None:
    accelerator.wait_for_everyone()


def save_fsdp_model(
    fsdp_plugin, accelerator, model, output_dir, model_index=0, adapter_only=False, use_dcp=True
):
    """Save an FSDP2 model into `output_dir` (see the module's docstring for the layout)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    _refuse(adapter_only, use_dcp)
    full = _full(fsdp_plugin)
    os.makedirs(output_dir, exist_ok=True)
    state = get_model_state_dict(model, options=_options(full))
    if full:
        if accelerator.process_index == 0:
            torch.save(state, os.path.join(output_dir, _indexed(FSDP_MODEL_NAME, model_index, ".bin")))
    else:
        with one_process_quietly():
            dcp.save({"model": state}, checkpoint_id=os.path.join(output_dir, f"{FSDP_MODEL_NAME}_{model_index}"))
    _barrier(accelerator)


def load_fsdp_model(
    fsdp_plugin, accelerator, model, input_dir, model_index=0, adapter_only=False, use_dcp=True
):
    """Load what save_fsdp_model wrote into an FSDP2 model (resharded when the ranks changed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    _refuse(adapter_only, use_dcp)
    full = _full(fsdp_plugin)
    _barrier(accelerator)
    if full:
        state = torch.load(
            os.path.join(input_dir, _indexed(FSDP_MODEL_NAME, model_index, ".bin")),
            map_location="cpu",
            weights_only=True,
        )
    else:
        folder = os.path.join(input_dir, f"{FSDP_MODEL_NAME}_{model_index}")
        if os.path.basename(os.path.normpath(input_dir)) == f"{FSDP_MODEL_NAME}_{model_index}":
            folder = input_dir  # accelerate takes the folder itself too
        wrapped = {"model": get_model_state_dict(model)}
        with one_process_quietly():
            dcp.load(wrapped, storage_reader=PlainReader(folder), planner=PlainLoadPlanner())
        state = wrapped["model"]
    result = set_model_state_dict(model, state, options=_options(full))
    _barrier(accelerator)
    return result


def save_fsdp_optimizer(
    fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index=0, use_dcp=True
):
    """Save the optimizer of an FSDP2 model into `output_dir`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    _refuse(False, use_dcp)
    full = _full(fsdp_plugin)
    os.makedirs(output_dir, exist_ok=True)
    optimizer = getattr(optimizer, "optimizer", optimizer)
    state = get_optimizer_state_dict(model, optimizer, options=_options(full))
    if full:
        if accelerator.process_index == 0:
            torch.save(state, os.path.join(output_dir, _indexed(OPTIMIZER_NAME, optimizer_index, ".bin")))
    else:
        with one_process_quietly():
            dcp.save(
                {"optimizer": state},
                checkpoint_id=os.path.join(output_dir, f"{OPTIMIZER_NAME}_{optimizer_index}"),
            )
    _barrier(accelerator)


def load_fsdp_optimizer(
    fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=0, adapter_only=False, use_dcp=True
):
    """Load what save_fsdp_optimizer wrote into the optimizer of an FSDP2 model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    _refuse(adapter_only, use_dcp)
    full = _full(fsdp_plugin)
    _barrier(accelerator)
    optimizer = getattr(optimizer, "optimizer", optimizer)
    if full:
        path = os.path.join(input_dir, _indexed(OPTIMIZER_NAME, optimizer_index, ".bin"))
        state = torch.load(path, map_location="cpu", weights_only=True)
    else:
        folder = os.path.join(input_dir, f"{OPTIMIZER_NAME}_{optimizer_index}")
        if os.path.basename(os.path.normpath(input_dir)) == f"{OPTIMIZER_NAME}_{optimizer_index}":
            folder = input_dir
        wrapped = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        with one_process_quietly():
            dcp.load(wrapped, storage_reader=PlainReader(folder), planner=PlainLoadPlanner())
        state = wrapped["optimizer"]
    set_optimizer_state_dict(model, optimizer, state, options=_options(full))
    _barrier(accelerator)
