"""Reading `torch.distributed.checkpoint` folders as plain data, and merging one into a weights file.

torch writes a checkpoint's `.metadata` with pickle and reads it with plain pickle, and loads its
non-tensor items with `torch.load(weights_only=False)`: either runs code a tampered file names.
`PlainReader` reads `.metadata` through an unpickler that builds only torch's checkpoint records;
`PlainLoadPlanner` loads the non-tensor items with `weights_only=True` (tensors torch already loads so).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings

import torch


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what torch writes into a checkpoint's .metadata: its metadata records, torch.Size,
    dtypes and memory formats, and plain containers."""

    def find_class(self, module: str, name: str):
        allowed = (
            _checkpoint_record(module, name)
            or (
                module == "torch"
                and (
                    name == "Size"
                    or isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))
                )
            )
            or (module == "torch.serialization" and name == "_get_layout")  # a layout by name (torch.strided)
            or (
                module == "pathlib"
                and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
            )
            or (module == "collections" and name == "OrderedDict")
            or (module == "builtins" and name in ("set", "frozenset", "slice", "tuple", "list", "dict"))
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"The checkpoint's .metadata names {module}.{name}, which a torch.distributed.checkpoint metadata "
                "file does not hold; it was not loaded (unpickling it would run code the file names)."
            )
        return super().find_class(module, name)


def _checkpoint_record(module: str, name: str) -> bool:
    """A dataclass or enum that torch.distributed.checkpoint defines (its metadata records)."""
    import dataclasses
    import enum
    import sys

    if not module.startswith("torch.distributed.checkpoint.") or "." in name or module not in sys.modules:
        return False
    found = getattr(sys.modules[module], name, None)
    return (
        isinstance(found, type)
        and found.__module__ == module
        and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
    )


def _plain_reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class PlainReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return PlainReader


def _plain_planner_class():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class PlainLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)  # torch's own planner allows any pickle here
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return PlainLoadPlanner


def PlainReader(path: str):  # noqa: N802 (a class, built on first use so importing this module imports no dcp)
    return _plain_reader_class()(path)


def PlainLoadPlanner():  # noqa: N802
    """torch's default load planner, reading non-tensor items with weights_only=True."""
    return _plain_planner_class()()


@contextlib.contextmanager
def one_process_quietly():
    """torch.distributed.checkpoint warns that it assumes one process when no process group exists;
    in a run of one process (or a merge) that is what we mean, so the warning only confuses."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def merge_folder(
    checkpoint_dir: str,
    output_path: str,
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
    write: bool = True,
) -> str:
    """The body of `merge_fsdp_weights` (main_process.py), for one process: check that `checkpoint_dir`
    is a torch.distributed.checkpoint folder, and with `write` merge its weights into one file in
    `output_path` (removing the folder with `remove_checkpoint_dir`). Returns the file's path."""
    import shutil

    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        inside = [
            n
            for n in ("pytorch_model_fsdp_0", "optimizer_0")
            if os.path.isdir(os.path.join(checkpoint_dir, n))
        ]
        hint = (
            f"; it holds {', '.join(inside)}: pass {os.path.join(checkpoint_dir, inside[0])}"
            if inside
            else ""
        )
        raise ValueError(
            f"{checkpoint_dir} is not a torch.distributed.checkpoint folder (no .metadata){hint}."
        )
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    path = os.path.join(output_path, name)
    if write:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        reader = PlainReader(checkpoint_dir)
        entries = reader.read_metadata().state_dict_metadata.items()
        merged = {
            k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in entries
            if isinstance(m, TensorStorageMetadata)
        }
        with one_process_quietly():
            dcp.load(merged, storage_reader=reader, planner=PlainLoadPlanner(), no_dist=True)
        # A folder save_state (or accelerate) wrote holds one top-level entry, "model": unwrap it.
        tops = {k.split(".", 1)[0] for k in merged}
        if len(tops) == 1 and all("." in k for k in merged):
            merged = {k.split(".", 1)[1]: v for k, v in merged.items()}
        tensors = {k: v.contiguous() for k, v in merged.items() if isinstance(v, torch.Tensor)}
        os.makedirs(output_path, exist_ok=True)
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(tensors, path, metadata={"format": "pt"})
        else:
            torch.save(tensors, path)
        if remove_checkpoint_dir:
            shutil.rmtree(checkpoint_dir)
    return path
