"""Training checkpoints (save_state / load_state), checkpoint rotation, and sharded model files.

A checkpoint folder uses accelerate's file names (model.safetensors, optimizer.bin, scheduler.bin,
scaler.pt, custom_checkpoint_0.pkl, dl_state_dict.bin, random_states_0.pkl, ...), so people find
pieces where they expect them. Saving is atomic: everything is written to a hidden sibling folder,
fsynced, and swapped in with renames, so a crash or power loss at any moment leaves the previous
checkpoint loadable (at the hidden `.NAME.old` if it came between the renames: `find_checkpoint`).
Every file is loaded as plain data (torch.load(weights_only=True)); registered objects that need
full pickle load only with `trust_pickled_objects=True`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any, Callable, Optional

import torch

from . import fsdp_checkpoint
from .checkpoint_names import checkpoint_number, list_checkpoints, next_checkpoint_dir, rotate_checkpoints
from .serialization import (  # noqa: F401  (save_model and friends are part of this module's surface)
    MODEL_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    _dedupe,
    _read_weights,
    _state_of,
    _unwrap,
    _write_weights,
    load_plain,
    load_sharded_state_dict,
    save_model,
    save_plain,
)
from .utils.checkpoint_files import find_checkpoint, fsync_dir, fsync_file, fsync_tree, sibling
from .utils.constants import OPTIMIZER_NAME, RNG_STATE_NAME, SCALER_NAME, SCHEDULER_NAME
from .utils.random import capture_rng_states, restore_rng_states

logger = logging.getLogger(__name__)

SAMPLER_NAME = "dl_state_dict"  # the loaders' state (accelerate's utils.constants.SAMPLER_NAME is a sampler's)
CUSTOM_NAME = "custom_checkpoint"


# -- small file helpers ---------------------------------------------------------------------------


def _indexed(stem: str, i: int, ext: str) -> str:
    return f"{stem}{'' if i == 0 else f'_{i}'}{ext}"


def _loader_file(i: int, rank: int) -> str:
    # Rank 0 keeps accelerate's name; other ranks' loaders may stand elsewhere, so they get their own.
    return (
        _indexed(SAMPLER_NAME, i, ".bin") if rank == 0 else f"{_indexed(SAMPLER_NAME, i, '')}_rank{rank}.bin"
    )


def _indexed_files(folder: str, pattern: str) -> list:
    """(i, name) of the files in `folder` matching pattern (group 1 empty for i == 0), by i."""
    found = []
    for name in os.listdir(folder):
        match = re.fullmatch(pattern, name)
        if match:
            found.append((int(match.group(1) or 0), name))
    return sorted(found)


# -- saving ---------------------------------------------------------------------------------------


def _default_is_writer(process_index: int, save_on_each_node: bool) -> bool:
    if not save_on_each_node:
        return process_index == 0
    from .state import PartialState

    if PartialState._shared_state:  # a resolved state knows the local rank
        return PartialState().is_local_main_process
    return int(os.environ.get("LOCAL_RANK", process_index)) == 0


def folder_writer(
    output_dir: str, process_index: int, num_processes: int, save_on_each_node: bool = False
) -> bool:
    """Whether this rank writes the shared pieces (models, optimizers, ...) into `output_dir`.

    Ranks that name the same folder share one writer: rank 0 (each node's local main process with
    save_on_each_node), else the lowest rank among them. So a rank that passes a folder of its own
    (a local disk on a cluster without a shared filesystem) writes a complete checkpoint there, and
    load_state on that rank reads it back. Call on every rank: the folders are compared across them.
    """
    mine = (os.path.abspath(output_dir), _default_is_writer(process_index, save_on_each_node))
    everyone = [mine]
    if num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
        process_index = torch.distributed.get_rank()
    same = [rank for rank, (path, _) in enumerate(everyone) if path == mine[0]]
    if len(everyone) == 1 or any(everyone[rank][1] for rank in same):
        return mine[1]
    return process_index == same[0]


class _Agreement:
    """Barriers that also tell every rank whether any rank failed, so none waits forever."""

    def __init__(self, num_processes: int, wait_for_everyone: Optional[Callable[[], None]]):
        self.num_processes = num_processes
        self.wait = wait_for_everyone
        if self.wait is None and num_processes > 1:
            from .state import PartialState

            self.wait = PartialState().wait_for_everyone

    def __call__(self, error: Optional[BaseException], process_index: int) -> list:
        """[(rank, message)] for every rank that failed this phase."""
        mine = None if error is None else f"{type(error).__name__}: {error}"
        if self.num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            per_rank = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(per_rank, mine)
            return [(r, m) for r, m in enumerate(per_rank) if m is not None]
        if self.wait is not None:
            self.wait()
        return [] if mine is None else [(process_index, mine)]


def _raise_if_failed(failures: list, error, what: str, output_dir: str) -> None:
    if not failures:
        return
    lines = "\n".join(f"  rank {r}: {m}" for r, m in failures)
    raise CheckpointError(
        f"Saving the checkpoint {output_dir!r} failed while {what}; any previous checkpoint there is untouched.\n{lines}"
    ) from error


def _recover(output_dir: str, staging: str, old: str) -> None:
    """Undo what a crashed save left behind; the last complete checkpoint stays at output_dir."""
    if os.path.isdir(old):
        if os.path.isdir(output_dir):
            shutil.rmtree(old)  # the crash came after the new folder was in place
        else:
            logger.warning(
                "An earlier save to %s was interrupted; moving its previous checkpoint back.", output_dir
            )
            os.rename(old, output_dir)  # the crash came between the two renames
            fsync_dir(os.path.dirname(output_dir))
    if os.path.exists(staging):
        shutil.rmtree(staging)


def save_accelerator_state(
    output_dir: str,
    model_states: list,
    optimizers: list,
    schedulers: list,
    dataloaders: list,
    process_index: int,
    num_processes: int,
    scaler=None,
    custom_objects: list = (),
    safe_serialization: bool = True,
    save_on_each_node: bool = False,
    is_main_process: Optional[bool] = None,
    wait_for_everyone: Optional[Callable[[], None]] = None,
    before_writing: Optional[Callable[[str], None]] = None,
) -> str:
    """Save a training run's state to `output_dir` atomically; returns its absolute path.

    Call on every process. Each folder's writer (see `folder_writer`: the main process, each node's
    with save_on_each_node, and every rank that names a folder of its own) writes the shared pieces
    and swaps the folder in; every process writes its RNG states and its loaders' positions.
    `model_states` holds state dicts (or models). Loaders without `state_dict` are skipped.
    `before_writing(folder)` runs on every process once the new folder exists, before it is written.
    """
    output_dir = os.path.abspath(output_dir)
    writer = (
        folder_writer(output_dir, process_index, num_processes, save_on_each_node)
        if is_main_process is None
        else bool(is_main_process)
    )
    agree = _Agreement(num_processes, wait_for_everyone)
    staging, old = sibling(output_dir, "saving"), sibling(output_dir, "old")

    error = None
    if writer:
        try:
            os.makedirs(os.path.dirname(output_dir), exist_ok=True)
            _recover(output_dir, staging, old)
            os.makedirs(staging)
        except Exception as exc:
            error = exc
    _raise_if_failed(agree(error, process_index), error, "preparing the folder", output_dir)

    try:
        if not os.path.isdir(staging):
            raise FileNotFoundError(
                f"{staging} is not visible from rank {process_index}: without a shared filesystem across nodes, "
                "pass save_on_each_node=True, or give each rank a folder of its own."
            )
        if before_writing is not None:
            before_writing(staging)
        if writer:
            _write_shared(
                staging, model_states, optimizers, schedulers, scaler, custom_objects, safe_serialization
            )
        for path in _write_own(staging, dataloaders, process_index):
            fsync_file(path)  # from the rank that wrote it: another node's writer cannot
        if writer:
            fsync_tree(staging)  # contents and names on disk before a rename can point at them
        error = None
    except Exception as exc:
        error = exc
    failures = agree(error, process_index)
    if failures and writer:
        shutil.rmtree(staging, ignore_errors=True)
    _raise_if_failed(failures, error, "writing", output_dir)

    error = None
    if writer:
        try:
            # Old aside, new in, old deleted: at every instant one complete checkpoint exists.
            if os.path.exists(output_dir):
                os.rename(output_dir, old)
            os.rename(staging, output_dir)
            fsync_dir(os.path.dirname(output_dir))  # the renames survive a power loss
            shutil.rmtree(old, ignore_errors=True)
        except Exception as exc:
            error = exc
    _raise_if_failed(agree(error, process_index), error, "moving the new folder into place", output_dir)
    return output_dir


def _write_shared(folder, model_states, optimizers, schedulers, scaler, custom_objects, safe) -> None:
    for i, state in enumerate(model_states):
        name = _indexed(MODEL_NAME, i, ".safetensors") if safe else _indexed(WEIGHTS_NAME, i, ".bin")
        _write_weights(*_dedupe(_state_of(state)), os.path.join(folder, name), safe)
    for stem, objects in ((OPTIMIZER_NAME, optimizers), (SCHEDULER_NAME, schedulers)):
        for i, obj in enumerate(objects):
            save_plain(obj.state_dict(), os.path.join(folder, _indexed(stem, i, ".bin")))
    if scaler is not None:
        save_plain(scaler.state_dict(), os.path.join(folder, SCALER_NAME))
    for i, obj in enumerate(custom_objects):
        save_plain(obj.state_dict(), os.path.join(folder, f"{CUSTOM_NAME}_{i}.pkl"))


def _write_own(folder: str, dataloaders: list, rank: int) -> list:
    """Write this rank's loader positions and RNG states; returns the paths written."""
    written = []
    for i, loader in enumerate(dataloaders):
        if callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        ):
            written.append(os.path.join(folder, _loader_file(i, rank)))
            save_plain(loader.state_dict(), written[-1])
    written.append(os.path.join(folder, f"{RNG_STATE_NAME}_{rank}.pkl"))
    save_plain(capture_rng_states(), written[-1])
    return written


# -- loading --------------------------------------------------------------------------------------


def load_accelerator_state(
    input_dir: str,
    models: list,
    optimizers: list,
    schedulers: list,
    dataloaders: list,
    process_index: int,
    scaler=None,
    custom_objects: list = (),
    map_location="cpu",
    strict: bool = True,
    load_model_func: Optional[Callable[[Any, dict, bool], Any]] = None,
    trust_pickled_objects: bool = False,
    agree: Optional[Callable[[Callable[[], None]], None]] = None,
    restore_rng: bool = True,
) -> dict:
    """Restore what `save_accelerator_state` wrote, RNG states included; returns a summary.

    Every file is read and checked before anything is changed. Missing pieces, and with strict also
    extra pieces and model key mismatches, raise one CheckpointError naming each problem and the
    folder. `load_model_func(model, state_dict, strict)` replaces `model.load_state_dict` when given.
    Every file is read as plain data; one that needs full pickle (a registered object's own classes,
    say) is refused unless `trust_pickled_objects`, since unpickling runs the code a file names.
    `agree(check)` runs the check that raises on problems; an FSDP run passes one that raises on
    every rank when any rank found a problem, so none goes on into collectives alone.
    `restore_rng=False` reads the RNG states but keeps this process's (a rank the saving run lacked).
    """
    folder = find_checkpoint(input_dir)
    if folder is None:
        raise CheckpointError(f"No checkpoint folder at {os.path.abspath(input_dir)!r}.")
    problems, plan = [], []

    def read(name: str, what: str):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{what}: {name} is missing")
            return None
        try:
            return load_plain(path, map_location, trust_pickled_objects)
        except CheckpointError as exc:
            problems.append(f"{what}: {exc}")
            return None

    def check_count(pattern: str, given: int, what: str) -> None:
        extra = [name for i, name in _indexed_files(folder, pattern) if i >= given]
        if extra and strict:
            problems.append(f"{what}: {given} given, but the checkpoint also has {', '.join(extra)}")

    # Models.
    check_count(r"(?:model|pytorch_model)(?:_(\d+))?\.(?:safetensors|bin)", len(models), "models")
    for i, model in enumerate(models):
        names = [_indexed(MODEL_NAME, i, ".safetensors"), _indexed(WEIGHTS_NAME, i, ".bin")]
        path = next((os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))), None)
        if path is None:
            problems.append(f"model {i}: neither {names[0]} nor {names[1]} is there")
            continue
        try:
            state = _read_weights(path, map_location)
        except CheckpointError as exc:
            problems.append(f"model {i}: {exc}")
            continue
        if load_model_func is None:
            _check_model_keys(_unwrap(model), state, i, strict, problems)
        plan.append(("model", model, state))

    # Optimizers, schedulers, scaler, custom objects.
    for stem, objects in ((OPTIMIZER_NAME, optimizers), (SCHEDULER_NAME, schedulers)):
        check_count(rf"{stem}(?:_(\d+))?\.bin", len(objects), f"{stem}s")
        for i, obj in enumerate(objects):
            plan.append((f"{stem} {i}", obj, read(_indexed(stem, i, ".bin"), f"{stem} {i}")))
    if scaler is not None:
        plan.append(("scaler", scaler, read(SCALER_NAME, "GradScaler")))
    elif strict and os.path.isfile(os.path.join(folder, SCALER_NAME)):
        problems.append(
            f"the checkpoint has {SCALER_NAME} but no GradScaler was given (mixed_precision='fp16' when saved?)"
        )
    check_count(rf"{CUSTOM_NAME}_(\d+)\.pkl", len(custom_objects), "custom objects")
    for i, obj in enumerate(custom_objects):
        plan.append((f"custom object {i}", obj, read(f"{CUSTOM_NAME}_{i}.pkl", f"custom object {i}")))

    # Loaders and RNG states of this rank.
    stateful = [i for i, dl in enumerate(dataloaders) if callable(getattr(dl, "load_state_dict", None))]
    suffix = "" if process_index == 0 else rf"_rank{process_index}"
    extra = [
        n for i, n in _indexed_files(folder, rf"{SAMPLER_NAME}(?:_(\d+))?{suffix}\.bin") if i not in stateful
    ]
    if extra and strict:
        problems.append(
            f"data loaders: no loader with load_state_dict was given at the position of {', '.join(extra)}"
        )
    for i in stateful:
        what = f"data loader {i} (rank {process_index})"
        plan.append((what, dataloaders[i], read(_loader_file(i, process_index), what)))
    rng = read(f"{RNG_STATE_NAME}_{process_index}.pkl", f"random states of rank {process_index}")

    def check() -> None:
        if problems:
            raise CheckpointError(_report(folder, "cannot be loaded", problems))

    (agree or (lambda run: run()))(check)
    failures = []
    for what, obj, state in plan:
        try:
            if what == "model":
                if load_model_func is not None:
                    load_model_func(obj, state, strict)
                else:
                    _unwrap(obj).load_state_dict(state, strict=strict)
            else:
                obj.load_state_dict(state)
        except Exception as exc:
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
    if failures:
        raise CheckpointError(_report(folder, "was only partly loaded", failures))
    for i in stateful:
        _rewind_unless_stateful(dataloaders[i], i)
    if restore_rng:
        restore_rng_states(rng)
    counts = (
        len(models),
        len(optimizers),
        len(schedulers),
        scaler is not None,
        len(custom_objects),
        len(stateful),
    )
    return dict(
        zip(("models", "optimizers", "schedulers", "scaler", "custom_objects", "dataloaders"), counts),
        input_dir=folder,
    )


def _rewind_unless_stateful(loader, i: int) -> None:
    """accelerate restores a loader's position only with use_stateful_dataloader=True; without it,
    resume code skips the done batches itself (skip_first_batches, or counting), so restoring here
    too would skip them twice. The epoch, its order and the RNG states are still restored."""
    if getattr(loader, "use_stateful_dataloader", True) or not hasattr(loader, "_restart_epoch"):
        return
    dropped = loader._restart_epoch()
    if dropped:
        logger.info(
            "data loader %d restarts epoch %d at its first batch, in the saved order; the checkpoint was taken after "
            "batch %d. Skip them with accelerator.skip_first_batches(loader, %d), or prepare with "
            "DataLoaderConfiguration(use_stateful_dataloader=True) to resume there.",
            i,
            loader.iteration,
            dropped,
            dropped,
        )


def _check_model_keys(model, state: dict, i: int, strict: bool, problems: list) -> None:
    own = model.state_dict()
    if strict:
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if missing:
            problems.append(f"model {i}: missing keys {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            problems.append(
                f"model {i}: unexpected keys {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
            )
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    if shapes:
        problems.append(f"model {i}: shape mismatch (checkpoint vs model) {shapes[:10]}")


def _report(folder: str, verb: str, problems: list) -> str:
    return f"The checkpoint {folder!r} {verb}:\n" + "\n".join(f"  - {p}" for p in problems)


# -- the Accelerator's save_state / load_state: where every save and load enters -------------------

# accelerate hands these on to DeepSpeed's save_checkpoint / load_checkpoint; notebook_accel runs no DeepSpeed.
DEEPSPEED_SAVE_KEYWORDS = ("tag", "client_state", "save_latest", "exclude_frozen_parameters")
DEEPSPEED_LOAD_KEYWORDS = (
    "tag",
    "load_module_strict",
    "load_optimizer_states",
    "load_lr_scheduler_states",
    "load_module_only",
    "custom_load_fn",
)
LOAD_KEYWORDS = ("map_location", "strict", "trust_pickled_objects")


def _refuse(call: str, names, deepspeed: tuple, takes: str) -> None:
    """Raise a TypeError naming every keyword in `names`: a typo must not pass as a quiet no-op."""
    names = sorted(names)
    if not names:
        return
    ours = [n for n in names if n in deepspeed]
    why = f" ({', '.join(ours)}: DeepSpeed's, and notebook_accel does not run DeepSpeed)" if ours else ""
    raise TypeError(f"{call} does not take {names}{why}; it takes {takes}.")


def load_options(load_kwargs: Optional[dict], load_model_func_kwargs: dict) -> dict:
    """Accelerator.load_state's keywords as load_state takes them: map_location, strict and
    trust_pickled_objects directly; in `load_kwargs` (accelerate's torch.load keywords) map_location,
    and weights_only, where False means trust_pickled_objects=True. Any other name raises, named."""
    options = dict(load_model_func_kwargs)
    extra = dict(load_kwargs or {})
    if "map_location" in extra:
        options.setdefault("map_location", extra.pop("map_location"))
    if extra.pop("weights_only", True) is False:
        options["trust_pickled_objects"] = True
    _refuse(
        "load_state()", set(options) - set(LOAD_KEYWORDS), DEEPSPEED_LOAD_KEYWORDS, ", ".join(LOAD_KEYWORDS)
    )
    _refuse(
        "load_state(load_kwargs=...)",
        extra,
        (),
        "{'map_location': ..., 'weights_only': False} (or leave it out)",
    )
    return options


def save_state(
    accelerator, prepared, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs
) -> str:
    """Accelerator.save_state: pick the folder (automatic naming or output_dir), save, rotate.

    `prepared` is the Accelerator's registry (prepared.py); an FSDP run's models and optimizers are
    taken and written by fsdp_checkpoint.py, inside the same atomic save.
    """
    _refuse("save_state()", kwargs, DEEPSPEED_SAVE_KEYWORDS, "output_dir and safe_serialization")
    acc, config = accelerator, accelerator.project_configuration
    if config.automatic_checkpoint_naming:
        if output_dir is not None:
            raise ValueError("With automatic_checkpoint_naming, save_state() takes no output_dir.")
        output_dir = next_checkpoint_dir(config)
    elif output_dir is None:
        raise ValueError(
            "save_state() needs an output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)."
        )
    output_dir = os.path.abspath(output_dir)
    if fsdp_checkpoint.applies(acc.state):
        pieces = fsdp_checkpoint.save_pieces(acc, prepared, output_dir)
    else:
        writer = folder_writer(output_dir, acc.process_index, acc.num_processes, config.save_on_each_node)
        models = list(prepared.models)
        weights = [acc.get_state_dict(m) for m in models]
        pieces = dict(
            model_states=weights,
            optimizers=prepared.optimizers,
            is_main_process=writer,
            before_writing=lambda folder: prepared.run_state_pre_hooks("save", models, weights, folder),
        )
    path = save_accelerator_state(
        output_dir,
        schedulers=prepared.schedulers,
        dataloaders=prepared.dataloaders,
        process_index=acc.process_index,
        num_processes=acc.num_processes,
        scaler=acc.scaler,
        custom_objects=prepared.custom_objects,
        safe_serialization=safe_serialization,
        save_on_each_node=config.save_on_each_node,
        wait_for_everyone=acc.wait_for_everyone,
        **pieces,
    )
    if config.automatic_checkpoint_naming:
        config.iteration += 1
        if pieces[
            "is_main_process"
        ]:  # each folder's writer rotates it (several when ranks keep their own folders)
            rotate_checkpoints(config)
        acc.wait_for_everyone()
    return path


def load_state(
    accelerator, prepared, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **kwargs
) -> None:
    """Accelerator.load_state: the given folder, or the latest automatic checkpoint.

    Keywords as `load_options` reads them. trust_pickled_objects=True lets files that need full pickle
    (registered objects of your own classes) load that way; unpickling runs code, so pass it only for
    checkpoints you trust.
    """
    options = load_options(load_kwargs, kwargs)
    strict = options.get("strict", True)
    acc, config = accelerator, accelerator.project_configuration
    if input_dir is None:
        if not config.automatic_checkpoint_naming:
            raise ValueError(
                "load_state() needs an input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)."
            )
        saved = list_checkpoints(config)
        if not saved:
            raise FileNotFoundError(f"No checkpoint to load under {config.project_dir}/checkpoints.")
        input_dir = saved[-1]
    if fsdp_checkpoint.applies(acc.state):
        pieces = fsdp_checkpoint.load_pieces(acc, prepared, input_dir, strict)
    else:
        models = list(prepared.models)
        prepared.run_state_pre_hooks("load", models, find_checkpoint(input_dir) or input_dir)
        pieces = dict(
            input_dir=input_dir,
            models=[acc.unwrap_model(m) for m in models],  # after the hooks, which may take some out
            optimizers=prepared.optimizers,
            dataloaders=prepared.dataloaders,
            process_index=acc.process_index,
            strict=strict,
        )
    load_accelerator_state(
        schedulers=prepared.schedulers,
        scaler=acc.scaler,
        custom_objects=prepared.custom_objects,
        map_location=options.get("map_location", "cpu"),
        trust_pickled_objects=options.get("trust_pickled_objects", False),
        **pieces,
    )
    number = checkpoint_number(input_dir)
    if config.automatic_checkpoint_naming and number is not None:
        config.iteration = number + 1  # the next save must not overwrite this one
