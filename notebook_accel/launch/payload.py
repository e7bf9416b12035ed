"""What a launch runs (`Payload`), and its bytes for children that do not share the parent's memory.

cloudpickle sends notebook-defined functions and classes by value. Cells' source lines travel too
(they live only in the parent's linecache), so a child's traceback shows the user's code.
"""

from __future__ import annotations

import inspect
import io
import linecache
import os
import pickle
import sys
import types

import cloudpickle

from .errors import UnpicklableError

_DYNAMIC = "<dynamic-code>"


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, keeping each code object's file name: cloudpickle 3.1 renames every by-value
    code object to "<dynamic-code>", and a child's traceback could no longer find the cell's lines."""

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType) and obj.co_filename != _DYNAMIC:
            return _with_filename, (obj.replace(co_filename=_DYNAMIC), obj.co_filename)
        return super().reducer_override(obj)


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    return code.replace(co_filename=filename)


class Payload:
    """What a launch runs: `function(*args)`. Forked ranks take it from memory; the others get
    `pickled()`, made once, before any rank starts, so an unpicklable object is named first."""

    def __init__(self, function, args: tuple = ()):
        self.function = function
        self.args = tuple(args)
        self._data = None

    def pickled(self) -> bytes:
        if self._data is None:
            self._data = dumps(self.function, self.args)
        return self._data


def dumps(function, args: tuple) -> bytes:
    try:
        buffer = io.BytesIO()
        _Pickler(buffer).dump((function, tuple(args), _interactive_sources()))
        return buffer.getvalue()
    except Exception as exc:
        raise UnpicklableError(_explain(function, args, exc)) from exc


class _ResultPickler(_Pickler):
    """A rank's return value with its tensors' and arrays' bytes out of band (pickle protocol 5):
    the rank sends them straight from the tensors' memory and the parent rebuilds the tensors on
    the buffers it received them into, so a 1 GB result is not copied three times on each side.
    As torch's own pickling does, a storage travels whole and once: tensors that shared one (tied
    weights, views) share it again in the parent. Tensors arrive on the CPU (a CUDA tensor
    unpickled in the parent would initialise CUDA there)."""

    def __init__(self, file, buffers: list):
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._storages: dict = {}  # (address, size) -> _StorageBytes, so each storage goes once
        self._copies: dict = {}  # (device, address, size) -> the CPU copy of a device storage

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter):
            reduced = self._tensor(torch, obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)

    def _tensor(self, torch, tensor):
        if tensor.device.type == "meta":
            return None
        t = self._on_cpu(torch, tensor.detach()).resolve_conj().resolve_neg()
        if t.layout != torch.strided or t.is_quantized:
            return t.__reduce_ex__(self.proto)  # torch's own way, but of the CPU copy
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self._storages:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            self._storages[key] = _StorageBytes(whole.numpy() if storage.nbytes() else b"")
        shape, stride, parameter = tuple(t.shape), tuple(t.stride()), isinstance(tensor, torch.nn.Parameter)
        args = (
            self._storages[key],
            t.dtype,
            t.storage_offset(),
            shape,
            stride,
            tensor.requires_grad,
            parameter,
        )
        return (_tensor_from, args)

    def _on_cpu(self, torch, t):
        """`t` on the CPU; tensors that shared a device storage share one CPU copy of it."""
        if t.device.type == "cpu" or t.layout != torch.strided or t.is_quantized:
            return t.cpu()
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr(), storage.nbytes())
        if key not in self._copies:
            self._copies[key] = storage.cpu()
        return torch.empty(0, dtype=t.dtype).set_(self._copies[key], t.storage_offset(), t.shape, t.stride())


class _StorageBytes:
    """A storage's bytes; pickled out of band, unpickled as the buffer they were received into."""

    def __init__(self, data):
        self.data = data

    def __reduce_ex__(self, protocol):
        return (_received, (pickle.PickleBuffer(self.data),))


def _received(buffer):
    return buffer


def _tensor_from(
    buffer, dtype, offset: int, shape: tuple, stride: tuple, requires_grad: bool, parameter: bool
):
    """Rebuild a tensor on the memory its storage was received into (no copy)."""
    import torch

    if len(buffer):
        storage = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype)
    else:
        storage = torch.empty(0, dtype=dtype)
    tensor = storage.as_strided(shape, stride, offset)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def dumps_result(value) -> tuple:
    """(pickle body, out-of-band buffers) of a rank's return value; see _ResultPickler."""
    buffers: list = []
    file = io.BytesIO()
    _ResultPickler(file, buffers).dump(value)
    return file.getvalue(), [b.raw() for b in buffers]


def loads_result(body: bytes, buffers: list):
    return pickle.loads(body, buffers=buffers)


def loads(data: bytes):
    function, args, sources = cloudpickle.loads(data)
    for filename, entry in sources.items():
        linecache.cache.setdefault(filename, entry)
    return function, args


def _interactive_sources() -> dict:
    # Cells compile to files that do not exist on disk (ipykernel temp names, <ipython-input-...>).
    return {
        name: entry
        for name, entry in list(linecache.cache.items())
        if len(entry) == 4 and entry[3] == name and not os.path.exists(name)
    }


def _fails(obj) -> bool:
    try:
        cloudpickle.dumps(obj)
        return False
    except Exception:
        return True


def _explain(function, args, exc: Exception) -> str:
    """Name the first object that cannot be pickled and where it was found."""
    hint = (
        "Ranks started by spawn or forkserver, by torch elastic or on a Ray cluster receive the function "
        "and its arguments by pickling. Create that object inside the function, or, on this machine, use "
        "start_method='fork'."
    )
    for i, arg in enumerate(args):
        if _fails(arg):
            return f"argument {i} ({type(arg).__name__}: {_short(arg)}) cannot be pickled: {exc}. {hint}"
    name = getattr(function, "__qualname__", repr(function))
    try:
        closure = inspect.getclosurevars(function)
    except TypeError:
        closure = None
    if closure is not None:
        for kind, names in (("closure variable", closure.nonlocals), ("global", closure.globals)):
            for var, value in names.items():
                if _fails(value):
                    return (
                        f"{kind} {var!r} ({type(value).__name__}: {_short(value)}) used by {name}() "
                        f"cannot be pickled: {exc}. {hint}"
                    )
    return f"function {name} cannot be pickled: {exc}. {hint}"


def _short(obj) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."
