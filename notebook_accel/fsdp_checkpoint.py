"""The FSDP branch of save_state / load_state (FSDP2, `fully_shard`): checkpointing.py, where every
save and load enters, calls `save_pieces` / `load_pieces` when the run has an FSDP plugin.

SHARDED_STATE_DICT: each model and optimizer is one `torch.distributed.checkpoint` folder
(`pytorch_model_fsdp_{i}`, `optimizer_{i}`, accelerate's names) that every rank writes its own shards
into and reads its own shards from, resharding when the number of ranks changed; no rank holds the
whole model. FULL_STATE_DICT: the model and optimizer are gathered to rank 0 (on CPU) and written as
`model.safetensors` and `optimizer.bin` (the optimizer keyed by parameter name); a load sets every
rank's shards from the full dicts. Everything else (schedulers, scaler, loaders, RNG states,
registered objects) is written by `checkpointing.py` as in any run, inside the same atomic save:
this module returns the arguments of its save / load that an FSDP run changes, and never imports it.

A sharded checkpoint needs one folder that every rank sees: a rank that cannot see what rank 0
wrote gets a clear error on every rank, before anything is written. `torch.distributed.checkpoint`
reads its `.metadata` with pickle; here it is read through an unpickler that only builds torch's
checkpoint metadata classes, and the non-tensor items with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import logging
import os
import uuid

import torch

from .serialization import MODEL_NAME, WEIGHTS_NAME, CheckpointError
from .utils.checkpoint_files import find_checkpoint
from .utils.constants import OPTIMIZER_NAME, RNG_STATE_NAME
from .utils.dcp_plain import PlainLoadPlanner, PlainReader, one_process_quietly

logger = logging.getLogger(__name__)

MODEL_FOLDER = "pytorch_model_fsdp"
OPTIMIZER_FOLDER = "optimizer"


def applies(state) -> bool:
    """Whether this run's checkpoints go through here: an FSDP plugin (one process or more)."""
    return getattr(state, "fsdp_plugin", None) is not None


def _sharded(state) -> bool:
    return state.fsdp_plugin.state_dict_type.name == "SHARDED_STATE_DICT"


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _all_gather(value) -> list:
    if not _distributed():
        return [value]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def _together(what: str, function) -> None:
    """Run `function` on this rank; if it failed on any rank, raise the same error on every rank, so
    no rank goes on into a collective that the failed one never joins."""
    error = None
    try:
        function()
    except Exception as exc:  # noqa: BLE001 (reported to every rank, then raised)
        error = exc
    failures = [
        (r, m)
        for r, m in enumerate(_all_gather(None if error is None else f"{type(error).__name__}: {error}"))
        if m
    ]
    if failures:
        lines = "\n".join(f"  rank {r}: {m}" for r, m in failures)
        raise CheckpointError(f"{what} failed:\n{lines}") from error


def _model_of(optimizer, models: list):
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [m for m in models if params & {id(p) for p in m.parameters()}]
    if len(owners) != 1:
        raise CheckpointError(
            f"An optimizer's parameters belong to {len(owners)} prepared models; an FSDP checkpoint saves each "
            "optimizer with the one model it steps."
        )
    return owners[0]


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


# -- saving ------------------------------------------------------------------------------------------


def save_pieces(accelerator, prepared, output_dir: str) -> dict:
    """Check that every rank saves into one shared `output_dir`, take the models' and optimizers' states
    (`prepared`: the Accelerator's registry), and return the keyword arguments of
    `checkpointing.save_accelerator_state` that an FSDP run sets (rank 0 writes the shared files)."""
    acc = accelerator
    if acc.project_configuration.save_on_each_node and acc.num_processes > 1:
        raise ValueError(
            "save_on_each_node=True cannot hold an FSDP checkpoint: each rank writes only its own shards, so every "
            "rank must write into one folder that all of them see. Use a shared filesystem."
        )
    _check_shared_folder(output_dir)
    models, optimizers = list(prepared.models), list(prepared.optimizers)
    owners = [_model_of(_inner(o), models) for o in optimizers]
    sharded = _sharded(acc.state)
    if sharded:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        weights = [get_model_state_dict(m) for m in models]  # this rank's shards (DTensors)
        optims = [get_optimizer_state_dict(m, _inner(o)) for m, o in zip(owners, optimizers)]
        shared_weights, shared_optims = [], []
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = [acc.get_state_dict(m) for m in models]  # full on rank 0, {} elsewhere
        optims = [get_optimizer_state_dict(m, _inner(o), options=full) for m, o in zip(owners, optimizers)]
        shared_weights, shared_optims = weights, [_Fixed(s) for s in optims]

    def before_writing(folder: str) -> None:
        _together(
            "save_state's pre-hooks", lambda: prepared.run_state_pre_hooks("save", models, weights, folder)
        )
        if sharded:
            _write_sharded(folder, weights, optims)

    return dict(
        model_states=shared_weights,
        optimizers=shared_optims,
        is_main_process=acc.process_index == 0,
        before_writing=before_writing,
    )


class _Fixed:
    """A state dict already taken, as an object checkpointing.py can write."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def _write_sharded(folder: str, weights: list, optims: list) -> None:
    import torch.distributed.checkpoint as dcp

    # Under "model" / "optimizer", as accelerate writes them (its merge_fsdp_weights reads these folders).
    for i, state in enumerate(weights):
        with one_process_quietly():
            dcp.save({"model": state}, checkpoint_id=os.path.join(folder, f"{MODEL_FOLDER}_{i}"))
    for i, state in enumerate(optims):
        with one_process_quietly():
            dcp.save({"optimizer": state}, checkpoint_id=os.path.join(folder, f"{OPTIMIZER_FOLDER}_{i}"))


def _check_shared_folder(output_dir: str) -> None:
    """Every rank names the same folder, and sees a file rank 0 writes next to it."""
    paths = _all_gather(output_dir)
    if len(set(paths)) > 1:
        raise ValueError(
            "An FSDP checkpoint is one folder that every rank writes its shards into; the ranks named different "
            f"folders: {', '.join(f'rank {r}: {p}' for r, p in enumerate(paths))}."
        )
    if not _distributed():
        return
    parent = os.path.dirname(output_dir)
    probe = os.path.join(parent, f".{os.path.basename(output_dir)}.probe-{uuid.uuid4().hex[:8]}")
    probe = _all_gather(probe)[0]
    rank = torch.distributed.get_rank()
    if rank == 0:
        _together("preparing the checkpoint folder", lambda: _write_probe(parent, probe))
    else:
        _together("preparing the checkpoint folder", lambda: None)
    seen = _all_gather(os.path.isfile(probe))
    torch.distributed.barrier()
    if rank == 0:
        os.remove(probe)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise CheckpointError(
            f"An FSDP checkpoint needs a folder every rank sees, and rank(s) {blind} cannot see {parent} as rank 0 "
            "wrote it (no shared filesystem?). Save to a folder on a filesystem shared by every machine."
        )


def _write_probe(parent: str, probe: str) -> None:
    os.makedirs(parent, exist_ok=True)
    with open(probe, "w") as f:
        f.write("probe\n")


# -- loading -----------------------------------------------------------------------------------------


def load_pieces(accelerator, prepared, input_dir: str, strict: bool) -> dict:
    """Check that every rank sees the checkpoint, run the load pre-hooks, load the sharded models and
    optimizers (a SHARDED_STATE_DICT checkpoint), and return the keyword arguments of
    `checkpointing.load_accelerator_state` that load the rest: the full models and optimizers of a
    FULL_STATE_DICT checkpoint, and every other piece, with a read check every rank passes or fails together."""
    acc = accelerator
    folder = find_checkpoint(input_dir)
    seen = _all_gather(folder)
    if any(f is None for f in seen):
        blind = [r for r, f in enumerate(seen) if f is None]
        raise CheckpointError(
            f"No checkpoint folder at {os.path.abspath(input_dir)!r} on rank(s) {blind}: an FSDP checkpoint is "
            "one folder every rank must see (a shared filesystem)."
        )
    models, optimizers = list(prepared.models), list(prepared.optimizers)
    owners = [_model_of(_inner(o), models) for o in optimizers]
    _together("load_state's pre-hooks", lambda: prepared.run_state_pre_hooks("load", models, folder))
    sharded = os.path.isdir(os.path.join(folder, f"{MODEL_FOLDER}_0")) or not models
    if sharded:
        _together("checking the sharded checkpoint", lambda: _check_sharded(folder, len(models), len(owners)))
        _load_sharded(folder, models, owners, optimizers, strict)
        models_for_files, optims_for_files, load_model = [], [], None
    else:
        _together("checking the checkpoint", lambda: _check_full(folder, len(models), len(owners)))
        models_for_files = models
        optims_for_files = [_FullOptimizer(m, _inner(o)) for m, o in zip(owners, optimizers)]
        load_model = _set_full_model
    # A rank the saving run did not have (more ranks now: the shards were resharded) has no RNG
    # states or loader positions of its own: it loads the shared pieces and keeps its RNG.
    new_rank = not os.path.isfile(os.path.join(folder, f"{RNG_STATE_NAME}_{acc.process_index}.pkl"))
    if new_rank:
        logger.warning(
            "Rank %d is not in the checkpoint %s (saved on fewer ranks): its model and optimizer shards are "
            "resharded from the saved ones; its RNG states and data loader positions are not restored.",
            acc.process_index,
            folder,
        )
    return dict(
        input_dir=folder,
        models=models_for_files,
        optimizers=optims_for_files,
        dataloaders=[] if new_rank else prepared.dataloaders,
        process_index=0 if new_rank else acc.process_index,
        strict=strict and not new_rank,  # the ranks that were saved check the same files strictly
        load_model_func=load_model,
        restore_rng=not new_rank,
        # A rank's own files (RNG states, loader positions) can be unreadable on it alone.
        agree=lambda check: _together("reading the checkpoint", check),
    )


def _check_sharded(folder: str, n_models: int, n_optimizers: int) -> None:
    missing = [
        name
        for name in [f"{MODEL_FOLDER}_{i}" for i in range(n_models)]
        + [f"{OPTIMIZER_FOLDER}_{i}" for i in range(n_optimizers)]
        if not os.path.isfile(os.path.join(folder, name, ".metadata"))
    ]
    if missing:
        raise CheckpointError(
            f"The checkpoint {folder!r} has no sharded {', '.join(missing)} (its .metadata)."
        )


def _check_full(folder: str, n_models: int, n_optimizers: int) -> None:
    """The files every rank reads before the collectives that set the shards (so none waits in one)."""
    names = [_indexed(OPTIMIZER_NAME, i, ".bin") for i in range(n_optimizers)]
    for i in range(n_models):
        names.append(
            next((n for n in _model_files(i) if os.path.isfile(os.path.join(folder, n))), _model_files(i)[0])
        )
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise CheckpointError(
            f"The checkpoint {folder!r} has no {', '.join(missing)} (FULL_STATE_DICT save)."
        )


def _indexed(stem: str, i: int, ext: str) -> str:
    return f"{stem}{'' if i == 0 else f'_{i}'}{ext}"  # accelerate's numbering, as checkpointing.py writes it


def _model_files(i: int) -> list:
    return [_indexed(MODEL_NAME, i, ".safetensors"), _indexed(WEIGHTS_NAME, i, ".bin")]


def _load_sharded(folder: str, models: list, owners: list, optimizers: list, strict: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for i, model in enumerate(models):
        state = {"model": get_model_state_dict(model)}  # this rank's shards, filled in place
        path = os.path.join(folder, f"{MODEL_FOLDER}_{i}")
        with one_process_quietly():
            dcp.load(state, storage_reader=PlainReader(path), planner=PlainLoadPlanner())
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
    for i, (model, optimizer) in enumerate(zip(owners, optimizers)):
        state = {"optimizer": get_optimizer_state_dict(model, _inner(optimizer))}
        path = os.path.join(folder, f"{OPTIMIZER_FOLDER}_{i}")
        with one_process_quietly():
            dcp.load(state, storage_reader=PlainReader(path), planner=PlainLoadPlanner())
        set_optimizer_state_dict(model, _inner(optimizer), state["optimizer"])


def _set_full_model(model, state: dict, strict: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))


class _FullOptimizer:
    """An optimizer whose load_state_dict takes the full, name-keyed dict a FULL_STATE_DICT save wrote."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            self.model, self.optimizer, self._by_name(state), options=StateDictOptions(full_state_dict=True)
        )

    def _by_name(self, state: dict) -> dict:
        """A plain optimizer.state_dict() (a DDP or one-process run's checkpoint: parameters numbered in
        param_groups order) keyed by parameter name, as a FULL_STATE_DICT save writes it."""
        groups = state.get("param_groups", [])
        numbered = [p for g in groups for p in g.get("params", [])]
        if not numbered or not all(isinstance(p, int) for p in numbered):
            return state
        names = {id(p): n for n, p in self.model.named_parameters()}
        ours = [names.get(id(p)) for g in self.optimizer.param_groups for p in g["params"]]
        if len(ours) != len(numbered) or None in ours:
            raise CheckpointError(
                f"The checkpoint's optimizer state has {len(numbered)} parameters in {len(groups)} group(s), and "
                f"this run's {type(self.optimizer).__name__} has {len(ours)} (of its model's: "
                f"{len([n for n in ours if n])}); build the optimizer as the saving run did."
            )
        name_of = dict(zip(numbered, ours))
        return {
            "state": {name_of[i]: value for i, value in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in groups],
        }
