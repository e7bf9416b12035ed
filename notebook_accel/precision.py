"""Mixed precision: the one place that knows about autocast, gradient scalers and fp8.

bf16 and fp16 run the model's forward under `torch.autocast` and hand fp32 outputs back, so a loss
computed outside the model is fp32; fp16 adds a `torch.amp.GradScaler`; fp8 converts the model's
linear layers with torchao. A precision the hardware cannot do is an error, never a silent fp32 run.
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from typing import Any, Optional, Union

import torch

from .utils.dataclasses import AutocastKwargs, GradScalerKwargs, parse_mixed_precision
from .utils.operations import convert_to_fp32
from .utils.other import restore_original_forward

DeviceLike = Union[torch.device, str]

_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Compute capabilities (major, minor) below which a CUDA device has no native support.
_CUDA_BF16_MIN = (8, 0)  # Ampere
_CUDA_FP8_MIN = (8, 9)  # Ada / Hopper


def _device_type(device: DeviceLike) -> str:
    return torch.device(device).type


def _kwargs(handler) -> dict:
    if handler is None:
        return {}
    return dict(handler) if isinstance(handler, dict) else handler.to_kwargs()


# -- can this hardware do it ----------------------------------------------------------------------


def precision_problem(
    mixed_precision: str,
    device_type: str,
    capability: Optional[tuple] = None,
    torchao_installed: bool = False,
    autocast_supported: bool = True,
    bf16_supported: bool = True,
) -> Optional[str]:
    """Why `mixed_precision` cannot run on a `device_type` device with these facts, or None if it can.

    Pure: the caller gathers the facts (CUDA compute capability, whether torchao is installed,
    whether torch's autocast takes the dtype there, whether the device runs bf16).
    """
    mp = parse_mixed_precision(mixed_precision)
    if mp == "no":
        return None
    cap = None if capability is None else (int(capability[0]), int(capability[1]))
    where = f"this {device_type} device" + (f" (compute capability {cap[0]}.{cap[1]})" if cap else "")
    if mp == "fp8":
        if device_type != "cuda":
            return (
                f"mixed_precision='fp8' needs an NVIDIA GPU with compute capability >= 8.9 (Ada, Hopper), "
                f"not {where}. Use mixed_precision='bf16' instead."
            )
        if cap is None or cap < _CUDA_FP8_MIN:
            return (
                f"mixed_precision='fp8' needs compute capability >= 8.9 (Ada, Hopper); {where} has none "
                "that notebook_accel can confirm. Use mixed_precision='bf16' (>= 8.0) or 'fp16'."
            )
        if not torchao_installed:
            return (
                f"mixed_precision='fp8' on {where} trains through torchao, which is not installed: "
                "run `pip install torchao`, or use mixed_precision='bf16'."
            )
        return None
    if device_type == "cuda":
        if mp == "bf16" and cap is not None and cap < _CUDA_BF16_MIN:
            return (
                f"mixed_precision='bf16' needs compute capability >= 8.0 (Ampere or newer); {where} would "
                "only emulate it. Use mixed_precision='fp16' on this GPU."
            )
        return None
    if device_type == "xla" and mp == "fp16":
        return "mixed_precision='fp16' is not supported on TPU (xla); TPUs train in bf16: use mixed_precision='bf16'."
    if mp == "bf16" and not bf16_supported:
        return f"mixed_precision='bf16' is not supported on {where} (MPS needs macOS 14+); use mixed_precision='fp16'."
    if not autocast_supported:
        return (
            f"torch {torch.__version__} has no {mp} autocast on {where}; upgrade torch, or use "
            "mixed_precision='no'."
        )
    return None


def _autocast_takes(device_type: str, dtype: torch.dtype) -> bool:
    # torch.autocast turns itself off with only a warning for an unsupported dtype: detect that.
    try:
        if not torch.amp.is_autocast_available(device_type):
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast(device_type=device_type, dtype=dtype):
                return (
                    torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == dtype
                )
    except (RuntimeError, AssertionError, ValueError):
        return False


def _cuda_capability(device: torch.device) -> Optional[tuple]:
    from . import hardware

    index = device.index if device.index is not None else 0
    for d in hardware.accelerators():  # NVML: no CUDA initialisation
        if d.kind == "cuda" and d.index == index and d.compute_capability:
            return tuple(d.compute_capability)
    try:
        return tuple(torch.cuda.get_device_capability(device))
    except Exception:  # no driver or ROCm without the call: unknown
        return None


def _facts(mixed_precision: str, device: torch.device) -> dict:
    from .utils.imports import is_torchao_available

    facts = {"torchao_installed": is_torchao_available()}
    if device.type == "cuda":
        facts["capability"] = _cuda_capability(device)
    elif mixed_precision in _AUTOCAST_DTYPES:
        facts["autocast_supported"] = _autocast_takes(device.type, _AUTOCAST_DTYPES[mixed_precision])
        if device.type == "mps" and mixed_precision == "bf16":
            from . import hardware

            facts["bf16_supported"] = all(d.supports_bf16 for d in hardware.accelerators() if d.kind == "mps")
    return facts


def check_precision_supported(mixed_precision: str, device: DeviceLike) -> None:
    """Raise ValueError naming the precision, the device and what to do when `device` cannot run it."""
    mp = parse_mixed_precision(mixed_precision)
    if mp == "no":
        return
    device = torch.device(device)
    problem = precision_problem(mp, device.type, **_facts(mp, device))
    if problem is not None:
        raise ValueError(problem)


# -- autocast -------------------------------------------------------------------------------------


def autocast_context(
    mixed_precision: str, device: DeviceLike, autocast_kwargs: Optional[AutocastKwargs] = None
):
    """A context manager running its block in `mixed_precision` on `device`'s type.

    "no" and "fp8" give a null context: fp8's converted linear layers do their own casting.
    """
    mp = parse_mixed_precision(mixed_precision)
    if mp not in _AUTOCAST_DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(
        device_type=_device_type(device), dtype=_AUTOCAST_DTYPES[mp], **_kwargs(autocast_kwargs)
    )


class AutocastForward:
    """A module's forward run under autocast, with fp32 outputs.

    Holds the original forward's function and module rather than a closure, so a patched model
    still deep-copies (an EMA copy calls its own weights) and pickles.
    """

    def __init__(self, module: torch.nn.Module, original, device_type: str, dtype: torch.dtype, kwargs: dict):
        bound = isinstance(original, types.MethodType) and original.__self__ is module
        self.module = module
        self.function = original.__func__ if bound else original
        self.bound = bound
        self.device_type = device_type
        self.dtype = dtype
        self.kwargs = kwargs
        self._describe()

    def _describe(self) -> None:
        functools.update_wrapper(self, self.function, updated=())
        # What inspect.signature and accelerate-style unwrapping follow: the original as it was called.
        self.__wrapped__ = self.original

    @property
    def original(self):
        return types.MethodType(self.function, self.module) if self.bound else self.function

    def __call__(self, *args, **kwargs):
        with torch.autocast(device_type=self.device_type, dtype=self.dtype, **self.kwargs):
            out = (
                self.function(self.module, *args, **kwargs) if self.bound else self.function(*args, **kwargs)
            )
        return convert_to_fp32(out)

    def __getstate__(self):
        keep = ("module", "function", "bound", "device_type", "dtype", "kwargs")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._describe()


def patch_forward_for_autocast(
    model: torch.nn.Module,
    mixed_precision: str,
    device: DeviceLike,
    autocast_kwargs: Optional[AutocastKwargs] = None,
) -> torch.nn.Module:
    """Make `model.forward` run under autocast and return fp32; `restore_forward` undoes it.

    The original stays at `model._original_forward` (accelerate's name). "no" and "fp8" leave the
    model as it is. Patching twice replaces the first patch.
    """
    mp = parse_mixed_precision(mixed_precision)
    if mp not in _AUTOCAST_DTYPES:
        return model
    restore_forward(model)
    original = model.forward
    model._original_forward = original
    model.forward = AutocastForward(
        model, original, _device_type(device), _AUTOCAST_DTYPES[mp], _kwargs(autocast_kwargs)
    )
    return model


def restore_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Give `model` back the forward it had before `patch_forward_for_autocast` (no-op if unpatched)."""
    patched = model.__dict__.get("forward")
    if isinstance(patched, AutocastForward):
        model.__dict__.setdefault("_original_forward", patched.original)
        restore_original_forward(model)
    return model


# -- gradient scaling -----------------------------------------------------------------------------


class SharedGradScaler(torch.amp.GradScaler):
    """A GradScaler that several prepared optimizers can step after one scaled backward.

    accelerate updates the scale after each optimizer's step. When two optimizers share one
    backward, an overflow in the first halves the scale before the second unscales, so the second
    steps with doubled gradients. Here a step only marks the update as due (`defer_update`); it runs
    once, before the next `scale()`, or when the scale is read, saved or loaded.
    """

    _update_due = False

    def defer_update(self) -> None:
        self._update_due = True

    def _settle(self) -> None:
        if self._update_due:
            self.update()

    def update(self, new_scale=None) -> None:
        self._update_due = False
        super().update(new_scale)

    def scale(self, outputs):
        self._settle()
        return super().scale(outputs)

    def get_scale(self) -> float:
        self._settle()
        return super().get_scale()

    def state_dict(self) -> dict:
        self._settle()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._settle()  # also clears the stepped optimizers' records, which would refuse the next step
        super().load_state_dict(state_dict)


def make_grad_scaler(
    mixed_precision: str, device: DeviceLike, kwargs: Optional[GradScalerKwargs] = None
) -> Optional[torch.amp.GradScaler]:
    """A GradScaler (SharedGradScaler) for fp16 on `device`'s type; None for every other precision."""
    if parse_mixed_precision(mixed_precision) != "fp16":
        return None
    return SharedGradScaler(_device_type(device), **_kwargs(kwargs))


# -- fp8 ------------------------------------------------------------------------------------------


def _fp8_convertible(module: torch.nn.Module, name: str) -> bool:
    # torchao's float8 matmuls need both dimensions divisible by 16.
    return (
        isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
    )


def prepare_fp8_model(model: torch.nn.Module, device: Optional[DeviceLike] = None, config: Any = None):
    """Convert `model`'s linear layers to torchao float8 training layers (in place; returned).

    Raises ValueError when the device or the installed packages cannot do fp8.
    """
    if device is None:
        params = list(model.parameters())
        device = params[0].device if params else torch.device("cpu")
    check_precision_supported("fp8", device)
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model, config=config, module_filter_fn=_fp8_convertible)
