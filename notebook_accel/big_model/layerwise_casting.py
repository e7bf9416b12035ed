"""Weights stored in a low precision, computed in a high one (accelerate's layerwise casting).

`attach_layerwise_casting_hooks` keeps the weights of every linear and convolution layer in a small
dtype (float8, float16) and gives each layer a `LayerwiseCastingHook` that casts them up for its
forward only: memory of the storage dtype, arithmetic of the compute dtype, at the cost of the
rounding of the storage dtype. `hooks.LayerwiseCastingHook` and
`big_modeling.attach_layerwise_casting_hooks` are these (accelerate's paths).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Optional, Union

import torch
import torch.nn as nn

from ..utils.constants import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
from .hooks import ModelHook, add_hook_to_module

logger = logging.getLogger(__name__)

__all__ = ["LayerwiseCastingHook", "attach_layerwise_casting_hooks"]


def _eager(method):
    """Run `method` outside torch.compile: casting a module's weights in place inside a compiled
    graph would break it (or recompile it) at every call. Disabled on first use, because
    `torch.compiler.disable` imports torch._dynamo (seconds)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if "eager" not in wrapper.__dict__:
            wrapper.eager = torch.compiler.disable(method)
        return wrapper.eager(*args, **kwargs)

    return wrapper


class LayerwiseCastingHook(ModelHook):
    """Keep a layer's weights in `storage_dtype` and cast them to `compute_dtype` for its forward."""

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module):
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    @_eager
    def pre_forward(self, module: nn.Module, *args, **kwargs):
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    @_eager
    def post_forward(self, module: nn.Module, output):
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output

    def __repr__(self) -> str:
        return f"LayerwiseCastingHook(storage_dtype={self.storage_dtype}, compute_dtype={self.compute_dtype})"


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: Optional[Union[str, tuple]] = None,
    skip_modules_classes: Optional[tuple] = None,
    non_blocking: bool = False,
) -> None:
    """Store the weights of every linear and convolution layer of `module` in `storage_dtype`
    (e.g. `torch.float8_e4m3fn`) and cast them to `compute_dtype` only for that layer's forward.

    Other layers (norms, embeddings) keep their dtype. A submodule whose dotted name matches one of
    the regular expressions `skip_modules_pattern` (`re.search`), or whose class is one of
    `skip_modules_classes`, is left as it is, with everything below it.
    """
    if isinstance(skip_modules_pattern, str):
        skip_modules_pattern = (skip_modules_pattern,)  # one pattern, not one per character
    hook = functools.partial(LayerwiseCastingHook, storage_dtype, compute_dtype, non_blocking)
    _cast_layerwise(module, "", hook, tuple(skip_modules_pattern or ()), skip_modules_classes)


def _cast_layerwise(module: nn.Module, name: str, hook, patterns: tuple, classes) -> None:
    if (classes is not None and isinstance(module, classes)) or any(re.search(p, name) for p in patterns):
        logger.debug("Layerwise casting leaves %r as it is", name)
        return
    if isinstance(module, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
        add_hook_to_module(module, hook(), append=True)
        return
    for child_name, child in module.named_children():
        _cast_layerwise(child, f"{name}.{child_name}" if name else child_name, hook, patterns, classes)
