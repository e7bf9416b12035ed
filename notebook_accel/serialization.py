"""Model weights on disk: safetensors (or torch .bin) files, sharded by size with an index json.

Shared tensors (tied weights) are stored once and their aliases recorded, so loading restores the
tie. Used by checkpoints (checkpointing.py) and by save_model.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import uuid

import torch

from .utils import constants
from .utils.checkpoint_files import fsync_dir, fsync_file
from .utils.memory import parse_memory_size

logger = logging.getLogger(__name__)

# The stems of weight files: "model" (safetensors) and "pytorch_model" (torch .bin), accelerate's
# SAFE_MODEL_NAME and MODEL_NAME.
MODEL_NAME = constants.SAFE_MODEL_NAME
WEIGHTS_NAME = constants.MODEL_NAME
_ALIASES_KEY = "notebook_accel.aliases"  # safetensors metadata: {alias: stored name}


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names every problem and the folder."""


TRUST_HINT = (
    "Unpickling them runs whatever code the file names. Only if you trust who wrote this checkpoint, "
    "load it with load_state(..., trust_pickled_objects=True)."
)


def save_plain(obj, path: str) -> None:
    """torch.save(obj, path), warning when the file will need full pickle (and so an opt-in) to load."""
    torch.save(obj, path)
    needed = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    if needed:
        logger.warning(
            "%s holds Python objects that are not plain data (%s); load_state will read it only with "
            "trust_pickled_objects=True. Return tensors, numbers, strings and containers from state_dict() "
            "to avoid that.",
            path,
            ", ".join(needed),
        )


def load_plain(path: str, map_location="cpu", trust_pickled_objects: bool = False):
    """torch.load(path) of plain data (tensors, numbers, strings, containers) with weights_only=True.

    A file that needs other Python objects is refused, naming them, unless the caller trusts the
    checkpoint; a damaged file is reported as corrupt. Both raise CheckpointError naming `path`.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        needed = sorted(set(re.findall(r"GLOBAL ([\w.]+)", str(exc))))
        if trust_pickled_objects:
            try:
                return torch.load(path, map_location=map_location, weights_only=False)
            except Exception as full:
                raise CheckpointError(_corrupt(path, full)) from None
        if needed:
            raise CheckpointError(
                f"{path} holds Python objects that plain-data loading refuses ({', '.join(needed)}). {TRUST_HINT}"
            ) from None
        raise CheckpointError(_corrupt(path, exc)) from None
    except Exception as exc:
        raise CheckpointError(_corrupt(path, exc)) from None


def _corrupt(path: str, exc: BaseException) -> str:
    return f"{path} is corrupt or not a checkpoint file ({type(exc).__name__}: {_reason(exc)})"


def _reason(exc: BaseException) -> str:
    """torch's own cause, without its advice to re-run with weights_only=False (that runs the file)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    kept = []
    for paragraph in re.split(r"\n\s*\n", text):
        sentences = re.split(r"(?<=\.)\s+", " ".join(paragraph.split()))
        kept += [s for s in sentences if s and "weights_only" not in s and "trusted source" not in s]
    return (" ".join(kept[:2]) or type(exc).__name__)[:300]


def _unwrap(model):
    # DDP / DataParallel keep the model in .module, torch.compile in ._orig_mod.
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _state_of(obj) -> dict:
    return _unwrap(obj).state_dict() if isinstance(obj, torch.nn.Module) else obj


# -- weights files: safetensors with aliases for tied tensors -------------------------------------


def _dedupe(state_dict: dict):
    """(tensors to store, aliases): a tensor shared under several names is stored once."""
    unique, aliases, seen = {}, {}, {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor; only tensors are saved."
            )
        if tensor.device.type == "meta":
            raise ValueError(
                f"state_dict[{name!r}] is on the meta device (it has no data). Load or materialise the weights first."
            )
        key = None
        if tensor.numel():
            storage = tensor.untyped_storage()
            key = (
                tensor.device,
                storage.data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
                tensor.dtype,
            )
        if key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensor = tensor.detach().cpu()
        # A view into a bigger (or shared) storage gets its own copy: safetensors refuses shared
        # storage and torch.save would write the whole storage.
        if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.contiguous().clone()
        unique[name] = tensor
    return unique, aliases


def _write_weights(tensors: dict, aliases: dict, path: str, safe: bool) -> None:
    temp = path + ".tmp"
    if safe:
        from safetensors.torch import save_file

        metadata = {"format": "pt"}
        if aliases:
            metadata[_ALIASES_KEY] = json.dumps(aliases)
        save_file(tensors, temp, metadata=metadata)
    else:
        # pickle keeps object identity, so aliases stay tied without metadata.
        torch.save({**tensors, **{a: tensors[s] for a, s in aliases.items()}}, temp)
    fsync_file(temp)  # the data is on disk before any name points at it
    os.replace(temp, path)


def _read_weights(path: str, device="cpu") -> dict:
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        # safetensors takes a device only (torch.load's dict or callable map_location means "cpu" here).
        device = str(device) if isinstance(device, (str, torch.device)) else "cpu"
        try:
            with safe_open(path, framework="pt", device=device) as f:
                state = {name: f.get_tensor(name) for name in f.keys()}
                aliases = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
        except Exception as exc:
            raise CheckpointError(_corrupt(path, exc)) from None
        for alias, stored in aliases.items():
            state[alias] = state[stored]
        return state
    return load_plain(path, map_location=device)


# -- save_model / load_sharded_state_dict ---------------------------------------------------------

_WEIGHT_FILE = re.compile(
    r"^(model|pytorch_model)((-[0-9a-f]{8})?-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?(\.tmp)?$"
)


def save_model(
    state_dict_or_model,
    save_directory: str,
    max_shard_size="10GB",
    safe_serialization: bool = True,
    is_main_process: bool = True,
) -> list:
    """Write a model's weights to `save_directory`, sharded so no file passes `max_shard_size`.

    One file (`model.safetensors`, or `pytorch_model.bin` when not safe) when everything fits;
    otherwise `model-00001-of-0000K.safetensors` ... plus `model.safetensors.index.json`
    ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}). A tensor larger than the limit
    gets a shard of its own. Tied tensors are stored once and re-tied on load. Weight files of an
    earlier save that are not part of this one are removed. Returns the files written (none on a
    process that is not the main one).
    """
    try:
        limit = parse_memory_size(max_shard_size)
    except ValueError as exc:
        raise ValueError(f"save_model(max_shard_size={max_shard_size!r}): {exc}") from None
    if limit <= 0:
        raise ValueError(f"save_model(max_shard_size={max_shard_size!r}): the limit must be above zero.")
    if not is_main_process:
        return []
    if os.path.isfile(save_directory):
        raise NotADirectoryError(f"save_model: {save_directory!r} is a file; pass a folder.")
    state = _state_of(state_dict_or_model)
    tensors, aliases = _dedupe(state)
    shards, sizes = [[]], [0]
    for name, tensor in tensors.items():
        if shards[-1] and sizes[-1] + tensor.nbytes > limit:
            shards.append([])
            sizes.append(0)
        shards[-1].append(name)
        sizes[-1] += tensor.nbytes
    stem, ext = (MODEL_NAME, ".safetensors") if safe_serialization else (WEIGHTS_NAME, ".bin")
    count = len(shards)
    os.makedirs(save_directory, exist_ok=True)
    names = _fresh_shard_names(save_directory, stem, ext, count)
    weight_map = {}
    for file, shard in zip(names, shards):
        members = set(shard)
        shard_aliases = {a: s for a, s in aliases.items() if s in members}
        _write_weights(
            {n: tensors[n] for n in shard},
            shard_aliases,
            os.path.join(save_directory, file),
            safe_serialization,
        )
        weight_map.update({n: file for n in shard}, **{a: file for a in shard_aliases})
    written = list(names)
    if count > 1:
        # Written last: until it is replaced, an older index never points at missing names.
        index_name = f"{stem}{ext}.index.json"
        ordered = {n: weight_map[n] for n in state}  # the model's own order, aliases included
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": ordered}
        temp = os.path.join(save_directory, index_name + ".tmp")
        with open(temp, "w") as f:
            json.dump(index, f, indent=2)
        fsync_file(temp)
        fsync_dir(save_directory)  # every shard's name is durable before the index points at it
        os.replace(temp, os.path.join(save_directory, index_name))
        written.append(index_name)
    for name in os.listdir(save_directory):
        if _WEIGHT_FILE.match(name) and name not in written:
            os.remove(os.path.join(save_directory, name))
    fsync_dir(save_directory)
    return [os.path.join(save_directory, n) for n in written]


def _fresh_shard_names(folder: str, stem: str, ext: str, count: int) -> list:
    """Shard names no file in `folder` has yet, so the previous save's shards stay whole until the
    new index replaces the old one: a crash in between leaves the old index over the old shards.
    The usual names when they are free, else the same with a tag of this save."""
    if count == 1:
        return [f"{stem}{ext}"]  # one file, replaced atomically; an older index still wins until removed
    tag = ""
    while True:
        names = [f"{stem}{tag}-{i + 1:05d}-of-{count:05d}{ext}" for i in range(count)]
        if not any(os.path.exists(os.path.join(folder, n)) for n in names):
            return names
        tag = f"-{uuid.uuid4().hex[:8]}"


def load_sharded_state_dict(folder: str, device="cpu") -> dict:
    """The state dict saved by `save_model` in `folder` (an index and its shards, or one file)."""
    for stem, ext in ((MODEL_NAME, ".safetensors"), (WEIGHTS_NAME, ".bin")):
        index_path = os.path.join(folder, f"{stem}{ext}.index.json")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [n for n in files if not os.path.isfile(os.path.join(folder, n))]
            if missing:
                raise FileNotFoundError(f"{index_path} names shard files that are not in {folder}: {missing}")
            state = {}
            for name in files:
                state.update(_read_weights(os.path.join(folder, name), device))
            absent = [n for n in weight_map if n not in state]
            if absent:
                raise CheckpointError(f"{index_path} lists tensors that no shard holds: {absent[:10]}")
            return {n: state[n] for n in weight_map}
        single = os.path.join(folder, f"{stem}{ext}")
        if os.path.isfile(single):
            return _read_weights(single, device)
    present = sorted(os.listdir(folder))[:20] if os.path.isdir(folder) else "the folder does not exist"
    raise FileNotFoundError(
        f"No model weights in {folder!r}: expected model.safetensors(.index.json) or pytorch_model.bin(.index.json); "
        f"found {present}."
    )
