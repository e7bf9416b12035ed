"""The offload store: the disk offload folder, and a lazy weights map over memory, that store and safetensors files.

Folder format: one raw file per tensor, `{folder}/{name}.dat` (the tensor's bytes in C order, read
back through a memory map), plus `{folder}/index.json`: `{name: {"dtype": "float16", "shape": [..]}}`.
dtypes numpy lacks (bfloat16, float8 ...) are stored as integers of the same width, so their bits
survive exactly. An index entry may instead point at a safetensors file,
`{"safetensors_file": path, "weight_name": key, "dtype": ...}`: the tensor is then read from there,
lazily, and never copied into the folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Optional

import numpy as np
import torch

from .pages import _PAGE, advise_huge, drop_later

INDEX_NAME = "index.json"

# torch dtype -> numpy dtype of the same bytes; anything missing here is stored as raw integer bits.
_NUMPY = {
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}
_BITS = {
    1: (torch.uint8, np.uint8),
    2: (torch.int16, np.int16),
    4: (torch.int32, np.int32),
    8: (torch.int64, np.int64),
}


def dtype_name(dtype: torch.dtype) -> str:
    """ "float16" for torch.float16: the spelling used in index files."""
    return str(dtype).replace("torch.", "")


def dtype_from_name(name) -> torch.dtype:
    """torch.float16 from "float16", "torch.float16" or torch.float16 itself."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"Unknown dtype {name!r}: expected a torch dtype name such as 'float16' or 'bfloat16'."
        )
    return dtype


def _storage_dtypes(dtype: torch.dtype):
    """(torch dtype, numpy dtype) whose bytes the file holds for a tensor of `dtype`."""
    if dtype in _NUMPY:
        return dtype, _NUMPY[dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if itemsize not in _BITS:
        raise TypeError(
            f"Cannot offload tensors of dtype {dtype}: no integer type of {itemsize} bytes holds its bits."
        )
    return _BITS[itemsize]


def _weight_file(folder: str, weight_name: str) -> str:
    return os.path.join(folder, f"{weight_name}.dat")


def offload_weight(weight, weight_name: str, offload_folder: str, index: Optional[dict] = None) -> dict:
    """Write `weight` to `{offload_folder}/{weight_name}.dat` and record its dtype and shape in `index`."""
    if index is None:
        index = {}
    if not isinstance(weight, torch.Tensor):
        weight = torch.as_tensor(weight)
    if weight.device.type == "meta":
        raise ValueError(f"Cannot offload {weight_name!r}: it is on the meta device and has no data.")
    os.makedirs(offload_folder, exist_ok=True)
    dtype = weight.dtype
    torch_store, numpy_store = _storage_dtypes(dtype)
    flat = weight.detach().to("cpu").contiguous().reshape(-1)
    if torch_store != dtype:
        flat = flat.view(torch_store)
    path = _weight_file(offload_folder, weight_name)
    if flat.numel() == 0:
        open(path, "wb").close()  # numpy cannot map an empty file; the index alone describes it
    else:
        # One write of the whole tensor: the page cache then holds it in large folios, which a map
        # made with MADV_HUGEPAGE (load_offloaded_weight) maps 2 MB at a time. Written through a
        # map, it was held in 4 KB pages, and each forward paid a fault per 64 KB and a costly unmap.
        # A new file put in place, not the old one rewritten: a model still mapping the old one
        # keeps its weights (a map of a file cut short faults with SIGBUS).
        part = f"{path}.{os.getpid()}.part"
        try:
            with open(part, "wb") as f:
                f.write(memoryview(flat.numpy()).cast("B"))
            os.replace(part, path)
        except BaseException:
            if os.path.exists(part):
                os.remove(part)
            raise
    index[weight_name] = {"dtype": dtype_name(dtype), "shape": list(weight.shape)}
    return index


def load_offloaded_weight(weight_file: str, weight_info: dict) -> torch.Tensor:
    """The tensor stored at `weight_file`, described by its index entry (dtype, shape).

    The result is backed by a copy-on-write map of the file: pages are read when touched and stay
    page cache (not process memory) unless written to.
    """
    dtype = dtype_from_name(weight_info["dtype"])
    shape = tuple(weight_info["shape"])
    numel = int(np.prod(shape)) if shape else 1
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    torch_store, numpy_store = _storage_dtypes(dtype)
    expected = numel * np.dtype(numpy_store).itemsize
    size = os.path.getsize(weight_file) if os.path.exists(weight_file) else None
    if size != expected:
        found = "it is missing" if size is None else f"it has {size}"
        raise ValueError(
            f"Offloaded weight file {weight_file} should hold {expected} bytes for shape {list(shape)} {dtype} but "
            f"{found}. The offload folder is incomplete or from another model; offload the weights again."
        )
    # A private (copy-on-write) map that keeps no file descriptor open: a loader keeps one map per
    # file, and a model of thousands of tensors would otherwise run out of descriptors.
    tensor = torch.from_file(weight_file, shared=False, size=numel, dtype=torch_store)
    advise_huge(tensor.data_ptr(), expected)  # read from disk, it comes in 2 MB folios mapped whole
    if torch_store != dtype:
        tensor = tensor.view(dtype)
    return tensor.reshape(shape)


def load_offload_index(offload_folder: str) -> dict:
    """The index.json of an offload folder ({} when there is none)."""
    path = os.path.join(offload_folder, INDEX_NAME)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def save_offload_index(index: dict, offload_folder: str) -> None:
    """Merge `index` into `{offload_folder}/index.json` (entries for the same names are replaced)."""
    if not index:
        return
    os.makedirs(offload_folder, exist_ok=True)
    current = load_offload_index(offload_folder)
    current.update(index)
    path = os.path.join(offload_folder, INDEX_NAME)
    with open(path + ".tmp", "w") as f:
        json.dump(current, f, indent=2)
    os.replace(path + ".tmp", path)


def offload_state_dict(save_dir: str, state_dict: dict) -> dict:
    """Offload every tensor of `state_dict` into `save_dir`; returns the index (also saved)."""
    os.makedirs(save_dir, exist_ok=True)
    index = {}
    for name, tensor in state_dict.items():
        index = offload_weight(tensor, name, save_dir, index=index)
    save_offload_index(index, save_dir)
    return index


def safetensors_reference(path: str, weight_name: str, dtype=None, shape=None) -> dict:
    """An index entry that reads `weight_name` from the safetensors file at `path` when needed."""
    entry = {"safetensors_file": os.path.abspath(path), "weight_name": weight_name}
    if dtype is not None:
        entry["dtype"] = dtype_name(dtype_from_name(dtype))
    if shape is not None:
        entry["shape"] = list(shape)
    return entry


class PrefixedDataset(Mapping):
    """The entries of `dataset` whose keys start with `prefix`, addressed without the prefix."""

    def __init__(self, dataset: Mapping, prefix: str):
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key):
        return self.dataset[f"{self.prefix}{key}"]

    def mapped(self, key):
        return lookup(self.dataset, f"{self.prefix}{key}")

    def __contains__(self, key) -> bool:
        return f"{self.prefix}{key}" in self.dataset

    def __iter__(self):
        n = len(self.prefix)
        return iter([key[n:] for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        return sum(1 for key in self.dataset if key.startswith(self.prefix))

    def __repr__(self) -> str:
        return f"PrefixedDataset(prefix={self.prefix!r}, {len(self)} entries)"


class OffloadedWeightsLoader(Mapping):
    """A read-only name -> tensor mapping over `state_dict` (in memory) and an offload folder.

    Nothing is read up front: disk entries are memory-mapped and safetensors entries read at the
    moment a key is looked up. `index` defaults to `save_folder`'s index.json. `device` is where
    looked-up tensors are put (None: left on the CPU).
    """

    def __init__(
        self,
        state_dict: Optional[dict] = None,
        save_folder: Optional[str] = None,
        index: Optional[dict] = None,
        device=None,
    ):
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("OffloadedWeightsLoader needs a state_dict, a save_folder or an index.")
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = save_folder
        if index is None and save_folder is not None:
            index = load_offload_index(save_folder)
        self.index = {} if index is None else index
        self.all_keys = list(self.state_dict)
        self.all_keys.extend(key for key in self.index if key not in self.state_dict)
        self.device = device
        self._handles = {}  # safetensors file -> open handle; opening parses the header each time
        self._maps: dict = {}  # key -> the tensor mapping its offload folder file
        self._map_ends: dict = {}  # start -> end of each of those maps
        self._mapped: list = []  # (start, end) of the safetensors files those handles map
        self._views: dict = {}  # key -> its tensor in one of those maps (the hooks' lookups)

    def __getitem__(self, key: str) -> torch.Tensor:
        """The tensor of `key`; one of the offload folder is a fresh map of its file, so what a
        caller writes to it is seen by nobody else."""
        return self._lookup(key, shared=False)

    def mapped(self, key: str) -> torch.Tensor:
        """As `loader[key]`, but an offload folder's file is mapped once and the map kept (the
        hooks' path): mapping and unmapping each file at every forward cost more than the forward's
        reads (issue #19). `release_pages` gives its pages back between uses."""
        return self._lookup(key, shared=True)

    def _lookup(self, key: str, shared: bool) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index.get(key)
        if info is None:
            raise KeyError(key)
        if "safetensors_file" in info:
            tensor = self._views.get(key) if shared else None
            if tensor is not None:
                return tensor.view(tensor.shape)
            tensor = self._from_safetensors(info, key)
            if shared and self.device is None and self._in_shard_map(tensor):
                self._views[key] = tensor  # a view of the shard's one mapping: kept, as folder maps are
        else:
            if self.save_folder is None:
                raise ValueError(
                    f"{key!r} is an offloaded weight but the loader was given no save_folder to read it from."
                )
            if shared:
                tensor = self._from_folder(info, key)
            else:
                tensor = load_offloaded_weight(_weight_file(self.save_folder, key), info)
        if self.device is not None:
            tensor = tensor.to(self.device)
        return tensor

    def maps_in_place(self) -> bool:
        """Whether `mapped()` only maps (no read, no copy): no device to copy to, and no
        safetensors entry converted to another dtype so far. The read-ahead looks such entries up
        on the forward's thread, and the others on its own."""
        return self.device is None and not self.__dict__.get("_converts", False)

    def _from_folder(self, info: dict, key: str) -> torch.Tensor:
        mapped = self._maps.get(key)
        if mapped is None:
            mapped = load_offloaded_weight(_weight_file(self.save_folder, key), info)
            if mapped.numel():
                self._map_ends[mapped.data_ptr()] = mapped.data_ptr() + mapped.numel() * mapped.element_size()
            self._maps[key] = mapped
        return mapped.view(mapped.shape)

    def _from_safetensors(self, info: dict, key: str) -> torch.Tensor:
        path = info["safetensors_file"]
        handle = self._handles.get(path)
        if handle is None:
            from safetensors import safe_open

            handle = self._handles[path] = safe_open(path, framework="pt", device="cpu")
            tensor = handle.get_tensor(info.get("weight_name", key))
            found = _mappings_of(path, tensor.data_ptr())
            for low, high in found:
                advise_huge(low, high - low)
            self._mapped += found
        else:
            tensor = handle.get_tensor(info.get("weight_name", key))
        if "dtype" in info:
            converted = tensor.to(dtype_from_name(info["dtype"]))
            if converted is not tensor:  # a copy: the shard's pages it was read from go back now
                self._converts = True
                self.release_pages([tensor])
                tensor = converted
        return tensor

    def _in_shard_map(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s bytes lie in a safetensors file this loader maps (never anonymous memory)."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return tensor.device.type == "cpu" and any(low <= start and end <= high for low, high in self._mapped)

    def release_pages(self, tensors) -> None:
        """Let the kernel take back the pages of `tensors` that are views of a file this loader
        keeps mapped (a hook is done with them): the next use maps them again from the page cache,
        and what was written to their whole pages in place is forgotten, as if the file were mapped
        afresh (a safetensors tensor's partial first and last pages are never dropped: they keep it).
        Without this, every disk block a forward used stayed in the process's RSS. Inside a hooked
        forward they go in rounds (`pages.drop_later`), all by the end of it, and before a hook
        of the same forward takes them again (`pages.taking`)."""
        for tensor in tensors:
            if tensor.device.type != "cpu" or tensor.numel() == 0:
                continue
            start = tensor.data_ptr()
            end = start + tensor.numel() * tensor.element_size()
            if self._map_ends.get(start) == end:  # a file's own map: its last, partial page too
                drop_later(start, end + (-end) % _PAGE, tensor)
            elif self._in_shard_map(tensor):
                drop_later(start, end, tensor)

    def __iter__(self):
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)

    def __contains__(self, key) -> bool:
        return key in self.state_dict or key in self.index

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = {}  # open files do not pickle; they are reopened on demand
        state["_mapped"] = []
        state["_maps"] = {}
        state["_map_ends"] = {}
        state["_views"] = {}  # views of this process's shard maps: pickled, they would be copies
        state.pop("_converts", None)
        state.pop("_notebook_accel_prefetcher", None)  # a thread: read_ahead.py makes a new one
        return state


def _mappings_of(path: str, address: int) -> list:
    """The (start, end) of this process's mappings of `path` that hold `address` (Linux's
    /proc/self/maps; [] elsewhere)."""
    real = os.path.realpath(path)
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip() == real:
                    low, high = (int(x, 16) for x in fields[0].split("-"))
                    if low <= address < high:
                        found.append((low, high))
    except OSError:
        pass
    return found


def root_loader(weights_map) -> Optional["OffloadedWeightsLoader"]:
    """The OffloadedWeightsLoader under `weights_map` (through PrefixedDataset views and maps that
    wrap another as `base`, such as dispatch.py's tied-weights map), or None."""
    while True:
        if isinstance(weights_map, PrefixedDataset):
            weights_map = weights_map.dataset
        elif isinstance(getattr(weights_map, "base", None), Mapping):
            weights_map = weights_map.base
        else:
            break
    return weights_map if isinstance(weights_map, OffloadedWeightsLoader) else None


def lookup(weights_map, key: str) -> torch.Tensor:
    """`weights_map[key]`, through the loader's kept maps where the map offers them (`mapped`)."""
    mapped = getattr(weights_map, "mapped", None)
    return mapped(key) if mapped is not None else weights_map[key]


def extract_submodules_state_dict(state_dict: dict, submodule_names) -> dict:
    """The entries of `state_dict` that belong to one of `submodule_names` (or are one of them)."""
    names = list(submodule_names)
    if "" in names:
        return dict(state_dict)
    return {
        key: value
        for key, value in state_dict.items()
        if any(key == name or key.startswith(name + ".") for name in names)
    }
