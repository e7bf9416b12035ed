"""Small general helpers with accelerate's names: a barrier, module and tensor queries, dict and name
utilities, a port probe."""

from __future__ import annotations

import functools
import socket
import types
from typing import Optional

import torch

from ..autocast import get_grad_scaler, get_mixed_precision_context_manager  # noqa: F401
from ..collectives import wait_for_everyone  # noqa: F401
from ..hardware import get_gpu_info  # noqa: F401
from . import families
from .imports import is_peft_available


def is_port_in_use(port: Optional[int] = None) -> bool:
    """Something listens on localhost:`port` (29500, torch's default rendezvous port, when None)."""
    port = 29500 if port is None else port
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port={port!r}: pass a TCP port number between 1 and 65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        return probe.connect_ex(("localhost", port)) == 0


def get_pretty_name(obj) -> str:
    """The qualified name of a function or class, or of an object's class."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = type(obj)
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or str(obj)


def merge_dicts(source: dict, destination: dict) -> dict:
    """Merge `source` into `destination` in place, nested dicts key by key; returns `destination`."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def recursive_getattr(obj, attr: str):
    """getattr along a dotted path: recursive_getattr(model, "encoder.layer.0")."""
    return functools.reduce(getattr, attr.split("."), obj)


def convert_bytes(size) -> str:
    """A byte count in the largest unit under 1024 of it, e.g. "1.5 GB"."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def is_compiled_module(module) -> bool:
    """`module` is what torch.compile returned for a module."""
    dynamo = getattr(torch, "_dynamo", None)
    return dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule)


def get_module_children_bottom_up(model: torch.nn.Module, return_fqns: bool = False) -> list:
    """Every module of `model`, children before their parents, `model` last; with `return_fqns`,
    (dotted name, module) pairs ("" for `model`)."""
    ordered = []
    stack = [("", model)]
    while stack:
        name, module = stack.pop()
        ordered.append((name, module))
        for child_name, child in module.named_children():
            stack.append((f"{name}.{child_name}" if name else child_name, child))
    ordered.reverse()
    return ordered if return_fqns else [module for _, module in ordered]


def id_tensor_storage(tensor: torch.Tensor) -> tuple:
    """(device, storage start, storage end): equal for tensors that share memory."""
    storage = tensor.untyped_storage()
    start = storage.data_ptr()  # 0 for every meta tensor: they are all one (empty) storage
    return tensor.device, start, start + storage.nbytes()


def is_peft_model(model) -> bool:
    """`model` (under any DDP or torch.compile wrapper) is a peft PeftModel."""
    if not is_peft_available():
        return False
    from peft import PeftModel

    inner = getattr(model, "_orig_mod", model)
    while isinstance(inner, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        inner = inner.module
    return isinstance(inner, PeftModel)


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Some submodule of `module` (or `module` itself, when it has children) is a torch.compile result."""
    if not module._modules:
        return False
    return any(is_compiled_module(m) for m in module.modules())


def has_offloaded_params(module: torch.nn.Module) -> bool:
    """`module` carries an offloading hook (its weights live elsewhere between forwards), alone or
    among a SequentialHook's hooks."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    return any(getattr(h, "offload", False) is True for h in hooks)


def get_model_tp_size(model: torch.nn.Module) -> Optional[int]:
    """The tensor-parallel degree a transformers model was sharded with, or None when it was not.
    transformers < 5 sets `model.tp_size`; transformers 5 leaves that as None and keeps the degree in
    `model.config.distributed_config` (a dict once the config went through JSON)."""
    if getattr(model, "tp_size", None) is not None:
        return model.tp_size
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(config, dict):
        return config.get("tp_size")
    return getattr(config, "tp_size", None)


def check_os_kernel() -> None:
    """Log a warning on Linux older than 5.5, where distributed processes can hang (accelerate's
    check, through `logging` as accelerate's is)."""
    import logging
    import platform
    import re

    info = platform.uname()
    if info.system != "Linux":
        return
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release)
    if found and tuple(int(p) for p in found.groups()) < (5, 5, 0):
        # Formatted here: handlers and tests that read record.msg see the versions.
        logging.getLogger(__name__).warning(
            f"Linux kernel {found.group(0)} is older than the recommended minimum 5.5.0; multi-process "
            "runs can hang on it. Upgrade the kernel if you see processes stall."
        )


def check_device_same(first_device, second_device) -> bool:
    """The two devices are the same device, a bare accelerator type meaning its index 0 ("cuda" is "cuda:0")."""
    first, second = torch.device(first_device), torch.device(second_device)
    if first.type != second.type:
        return False
    if first.type == "cpu":
        return True
    return (first.index or 0) == (second.index or 0)


def check_tied_parameters_in_config(model: torch.nn.Module) -> bool:
    """A transformers model whose config (or modules) asks for tied weights: tied word embeddings with an
    output embedding, tied encoder and decoder, or a module with `_tie_weights`. False for other models."""
    if "PreTrainedModel" not in [c.__name__ for c in type(model).__mro__]:
        return False
    config = getattr(model, "config", None)
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    word_embeddings = bool(
        text_config is not None
        and getattr(text_config, "tie_word_embeddings", False)
        and model.get_output_embeddings() is not None
    )
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False) and getattr(config, "tie_encoder_decoder", False))
    return word_embeddings or encoder_decoder or any(hasattr(m, "_tie_weights") for m in model.modules())


def get_current_device_type() -> tuple:
    """(device type, distributed type) of the first accelerator family present, found without
    initialising a device; ("cpu", "MULTI_CPU") on a machine with none (accelerate says "cuda" there)."""
    for family in families.FAMILIES:
        if family.distributed_type is None or family.name == "xla":
            continue
        try:
            present = family.is_available()
        except Exception:
            present = False
        if present:
            return family.name, str(family.distributed_type)
    return "cpu", "MULTI_CPU"


_PARALLEL_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


def restore_original_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Undo a mixed-precision patch of `model.forward`: an instance forward wrapping (`__wrapped__`)
    the original, which the patch kept at `model._original_forward` (accelerate's marker). The
    class's own forward comes back by removing the patch, any other original is put back as it was."""
    patched = model.__dict__.get("forward")
    if patched is None or "_original_forward" not in model.__dict__ or not hasattr(patched, "__wrapped__"):
        return model
    original = patched.__wrapped__
    del model.__dict__["forward"], model.__dict__["_original_forward"]
    own = getattr(type(model).forward, "__func__", type(model).forward)
    if not (isinstance(original, types.MethodType) and original.__self__ is model and original.__func__ is own):
        model.forward = original
    return model


def _unwrap_children(module: torch.nn.Module) -> None:
    for name, child in list(module.named_children()):
        while isinstance(child, _PARALLEL_WRAPPERS):
            child = child.module
        setattr(module, name, child)
        _unwrap_children(child)


def extract_model_from_parallel(
    model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
):
    """The user's module inside DistributedDataParallel / DataParallel (and torch.compile).

    A torch.compile result is kept (`keep_torch_compile`): as it is when it wraps the user's module
    directly, as a new compiled wrapper around the module inside when it was compiled over DDP /
    DataParallel (the one given is left unchanged). `keep_fp32_wrapper=False` also restores the forward
    mixed precision patched. `recursive=True` also replaces every DDP / DataParallel among the
    submodules by the module inside it (changing the model in place).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"extract_model_from_parallel takes a torch.nn.Module, got {type(model).__name__}: {model!r}")
    compiled = getattr(model, "_orig_mod", None)
    inner = compiled if isinstance(compiled, torch.nn.Module) else model
    while isinstance(inner, _PARALLEL_WRAPPERS):
        inner = inner.module
    if recursive:
        _unwrap_children(inner)
    if not keep_fp32_wrapper:
        restore_original_forward(inner)
    if keep_torch_compile and isinstance(compiled, torch.nn.Module):
        if inner is compiled:
            return model
        return _compiled_around(model, inner)
    return inner


def _compiled_around(compiled, inner: torch.nn.Module) -> torch.nn.Module:
    """`inner` compiled as `compiled` (a torch.compile result over DDP) is: a new wrapper with the
    same settings, so the training model keeps its own (accelerate re-points its `_orig_mod`)."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(compiled, OptimizedModule):
        return OptimizedModule(inner, compiled.dynamo_ctx)
    return inner


def _is_repeated_blocks(module: torch.nn.Module) -> bool:
    return (
        isinstance(module, torch.nn.ModuleList) and len(module) > 0 and all(type(m) is type(module[0]) for m in module)
    )


def _compile_regions(module: torch.nn.Module, compile_kwargs: dict) -> torch.nn.Module:
    if _is_repeated_blocks(module):
        return torch.nn.ModuleList(torch.compile(block, **compile_kwargs) for block in module)
    if not any(_is_repeated_blocks(m) for m in module.modules()):
        return torch.compile(module, **compile_kwargs)
    import copy

    twin = copy.copy(module)  # same parameters and attributes; its own table of children
    for name, value in list(twin.__dict__.items()):  # methods bound to the original follow the twin
        if isinstance(value, types.MethodType) and value.__self__ is module:
            twin.__dict__[name] = types.MethodType(value.__func__, twin)
    twin._modules = {}
    for name, child in module.named_children():
        twin.add_module(name, _compile_regions(child, compile_kwargs))
    return twin


def compile_regions(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """Regional compilation: each block of a ModuleList of same-class blocks is compiled on its own
    (one compilation, reused from the cache for the others), and the rest of the model around them;
    a model without such blocks is compiled whole. Returns a new module sharing `module`'s parameters
    (`._orig_mod` is `module`); `module` itself is left as it was."""
    compiled = _compile_regions(module, compile_kwargs)
    compiled.__dict__.setdefault("_orig_mod", module)
    return compiled


def _numpy_globals() -> list:
    """What numpy arrays and RNG states need to unpickle: allowed by `load` with weights_only."""
    import codecs

    import numpy as np

    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25: one class per dtype
    if dtypes is not None:
        allowed += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    return allowed


def load(f, map_location=None, **kwargs):
    """torch.load of plain data: weights_only=True unless asked otherwise, with numpy arrays and RNG
    states allowed; a file holding other Python objects is refused (pickle.UnpicklingError naming them)."""
    kwargs.setdefault("weights_only", True)
    if not kwargs["weights_only"]:
        return torch.load(f, map_location=map_location, **kwargs)
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(f, map_location=map_location, **kwargs)
