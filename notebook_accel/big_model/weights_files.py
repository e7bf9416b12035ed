"""A checkpoint's files and the tensors in them, read lazily (headers first, tensors mapped).

A checkpoint is one `.safetensors` / `.bin` / `.pt` file, an index json naming shards, or a folder
holding either. `loading.py` streams them into a model; `loading_ranks.py` reads them on rank 0.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

_WEIGHT_EXTENSIONS = (".safetensors", ".bin", ".pt", ".pth")
_ALIASES_KEY = "notebook_accel.aliases"  # written by serialization.save_model for tied tensors
# safetensors dtype codes -> torch dtypes (the codes torch can hold)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
    "U16": getattr(torch, "uint16", None),
    "U32": getattr(torch, "uint32", None),
    "U64": getattr(torch, "uint64", None),
}


class CheckpointReadError(ValueError):
    """A checkpoint file could not be read (missing, truncated, corrupt or not a state dict)."""


# -- finding and opening the files ---------------------------------------------------------------


def _files_from_index(index_path: str) -> list:
    try:
        with open(index_path) as f:
            index = json.load(f)
        # transformers' {"metadata": ..., "weight_map": {name: file}}, or the bare {name: file}.
        weight_map = index["weight_map"] if "weight_map" in index else index
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("its values are not all file names")
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointReadError(
            f"Cannot read the checkpoint index {index_path}: {exc}. Expected json {{'weight_map': {{name: file}}}} "
            f"or {{name: file}}."
        ) from None
    folder = os.path.dirname(os.path.abspath(index_path))
    files = [os.path.join(folder, name) for name in dict.fromkeys(weight_map.values())]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(
            f"The checkpoint index {index_path} names shard files that do not exist: {missing}"
        )
    return files


def checkpoint_files(checkpoint) -> list:
    """The weight files of `checkpoint` (a weights file, an index json, or a folder holding either)."""
    path = os.fspath(checkpoint)
    if os.path.isfile(path):
        if path.endswith(".json"):
            return _files_from_index(path)
        if path.endswith(_WEIGHT_EXTENSIONS):
            return [path]
        raise CheckpointReadError(
            f"{path} is not a checkpoint: expected {', '.join(_WEIGHT_EXTENSIONS)} or an .index.json."
        )
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Checkpoint {path!r} does not exist.")
    names = sorted(os.listdir(path))
    indexes = [n for n in names if n.endswith(".index.json")]
    if len(indexes) > 1:
        # Both formats saved side by side: the safetensors one holds the same weights, read faster.
        indexes = [n for n in indexes if n.endswith(".safetensors.index.json")] or indexes
    if len(indexes) == 1:
        return _files_from_index(os.path.join(path, indexes[0]))
    if indexes:
        raise CheckpointReadError(f"{path} holds several checkpoint indexes {indexes}; pass the one to load.")
    weights = [n for n in names if n.endswith(_WEIGHT_EXTENSIONS)]
    if len(weights) > 1:
        weights = [n for n in weights if n.endswith(".safetensors")] or weights
    if len(weights) == 1:
        return [os.path.join(path, weights[0])]
    found = (
        f"several weight files {weights} but no index json"
        if weights
        else f"no weight files (found {names[:20]})"
    )
    raise CheckpointReadError(f"{path} is not a checkpoint folder: it has {found}.")


class _WeightsFile:
    """The tensors of one weights file, read one at a time: names, dtypes, and a reader per name."""

    def __init__(self, path: str):
        self.path = path
        self.safetensors = path.endswith(".safetensors")
        try:
            if self.safetensors:
                from safetensors import safe_open

                self._handle = safe_open(path, framework="pt", device="cpu")
                self.names = list(self._handle.keys())
                aliases = json.loads((self._handle.metadata() or {}).get(_ALIASES_KEY, "{}"))
                self.stored = {n: n for n in self.names}
                self.stored.update({a: s for a, s in aliases.items() if s in self.stored})
                self.names += [a for a in aliases if a in self.stored and a not in self.names]
            else:
                try:
                    # mmap: tensors stay in the page cache until used, instead of all read at once.
                    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                except RuntimeError as exc:
                    if "mmap" not in str(exc):
                        raise
                    state = torch.load(path, map_location="cpu", weights_only=True)  # legacy format: no mmap
                if not isinstance(state, dict) or not all(
                    isinstance(v, torch.Tensor) for v in state.values()
                ):
                    raise CheckpointReadError(
                        f"{path} does not hold a state dict (a dict of tensor names to tensors)."
                    )
                self._state = state
                self.names = list(state)
        except CheckpointReadError:
            raise
        except Exception as exc:
            raise CheckpointReadError(
                f"Cannot read checkpoint file {path}: {exc}. The file is truncated or corrupt; save or download it again."
            ) from None

    def dtype(self, name: str) -> Optional[torch.dtype]:
        if not self.safetensors:
            return self._state[name].dtype
        return _SAFETENSORS_DTYPES.get(self._handle.get_slice(self.stored[name]).get_dtype())

    def shape(self, name: str) -> list:
        if not self.safetensors:
            return list(self._state[name].shape)
        return list(self._handle.get_slice(self.stored[name]).get_shape())

    def read(self, name: str) -> torch.Tensor:
        if not self.safetensors:
            return self._state[name]
        try:
            return self._handle.get_tensor(self.stored[name])
        except Exception as exc:
            raise CheckpointReadError(
                f"Cannot read {name!r} from checkpoint file {self.path}: {exc}"
            ) from None

    def close(self) -> None:
        self._handle = self._state = None
