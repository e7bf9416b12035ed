"""`FullyShardedDataParallelPlugin`: the FSDP2 settings a user sets, checked and normalised here.

Fields left as None are read from the variables accelerate's launcher writes (`FSDP_*`). Only
FSDP2 (`torch.distributed.fsdp.fully_shard`) is implemented; `fsdp.py` applies the plugin to a model.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from .env_flags import parse_flag_from_env as _env_flag
from .env_flags import str_to_bool

WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16", "fp32": "float32", "no": None}
# FSDP1 settings that have no meaning for fully_shard: accepted (a config written for accelerate
# loads), warned about when set.
_FSDP1_ONLY = (
    "backward_prefetch",
    "use_orig_params",
    "sync_module_states",
    "forward_prefetch",
    "limit_all_gathers",
    "param_init_fn",
    "state_dict_config",
    "optim_state_dict_config",
)


USE_FSDP_ENV = "ACCELERATE_USE_FSDP"
# accelerate's fsdp_config keys (and `accelerate launch --fsdp_*` flags) -> the variable the plugin reads.
LAUNCH_VARIABLES = {
    "fsdp_version": "FSDP_VERSION",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_min_num_params": "FSDP_MIN_NUM_PARAMS",
    "fsdp_state_dict_type": "FSDP_STATE_DICT_TYPE",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "fsdp_cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_ignored_modules": "FSDP_IGNORED_MODULES",
}
_FLAG_KEYS = (
    "fsdp_activation_checkpointing",
    "fsdp_cpu_ram_efficient_loading",
    "fsdp_offload_params",
)


def launch_variables(settings: dict, strict: bool = True) -> dict:
    """The FSDP_* variables for accelerate's fsdp_config keys; ValueError names a bad key or value.

    strict=False is for a config file accelerate wrote: its other fsdp_* keys (FSDP1 settings among
    them) pass as FSDP_<NAME>, unchecked, as accelerate's launcher passes them."""
    if not isinstance(settings, dict):
        raise ValueError(f"must be a dict of accelerate's fsdp_* settings, not {type(settings).__name__}")
    known = sorted(LAUNCH_VARIABLES)
    bad = sorted(str(k) for k in settings if not str(k).startswith("fsdp_") or (strict and k not in LAUNCH_VARIABLES))
    if bad:
        raise ValueError(f"unknown key(s) {bad}; the keys are accelerate's fsdp_config names: {', '.join(known)}")
    env = {}
    for key, value in settings.items():
        if value is None:  # YAML's null: not set, so the plugin's default holds
            continue
        name = LAUNCH_VARIABLES.get(key) or "FSDP_" + key[len("fsdp_") :].upper()
        if key in LAUNCH_VARIABLES:
            value = _checked(key, value)
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        env[name] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def _checked(key: str, value):
    """One launch setting, checked as the plugin would check it in every rank, but before any starts."""

    def fail(wanted: str):
        raise ValueError(f"{key}={value!r}: {wanted}")

    text = str(value).strip()
    if key == "fsdp_version":
        if text != "2":
            fail("notebook_accel implements FSDP2 only; use 2")
    elif key == "fsdp_reshard_after_forward":
        if isinstance(value, bool) or text.upper() in ("FULL_SHARD", "SHARD_GRAD_OP"):
            return value
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            fail("use true or false (FULL_SHARD or SHARD_GRAD_OP also work)")
    elif key == "fsdp_auto_wrap_policy":
        if text.lower() not in WRAP_POLICIES:
            fail(f"use one of {', '.join(WRAP_POLICIES)}")
        return text.lower()
    elif key == "fsdp_min_num_params":
        if isinstance(value, bool) or not text.isdigit():
            fail("use a whole number of parameters, 0 or more")
    elif key == "fsdp_state_dict_type":
        if text.upper() not in STATE_DICT_TYPES:
            fail(f"use {' or '.join(STATE_DICT_TYPES)}")
        return text.upper()
    elif key in _FLAG_KEYS:
        if not isinstance(value, bool) and text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            fail("use true or false")
    elif key == "fsdp_transformer_layer_cls_to_wrap":
        names = value if isinstance(value, (list, tuple)) else [n for n in text.split(",") if n.strip()]
        if not all(isinstance(n, str) and n.strip().isidentifier() for n in names):
            fail("use class names, as a list or comma-separated (e.g. 'Block,Attention')")
        return [n.strip() for n in names]  # none: the model's _no_split_modules
    return value


@dataclass
class FullyShardedDataParallelPlugin:
    """FSDP2 through `Accelerator(fsdp_plugin=...)`: which submodules get their own `fully_shard`
    (`auto_wrap_policy`), resharding, mixed precision, activation checkpointing, ignored modules."""

    fsdp_version: Optional[int] = None
    sharding_strategy: Any = None
    reshard_after_forward: Optional[Union[bool, str]] = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Optional[Union[Callable, str]] = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: Any = None
    use_orig_params: Any = None
    param_init_fn: Any = None
    sync_module_states: Any = None
    forward_prefetch: Any = None
    activation_checkpointing: Optional[bool] = None
    activation_checkpointing_offload: Optional[bool] = None
    cpu_ram_efficient_loading: Optional[bool] = None
    transformer_cls_names_to_wrap: Optional[list] = None
    min_num_params: Optional[int] = None

    def __post_init__(self) -> None:
        env = os.environ
        if self.fsdp_version is None:
            self.fsdp_version = env.get("FSDP_VERSION", "2")
        try:
            self.fsdp_version = int(self.fsdp_version)
        except (TypeError, ValueError):
            raise ValueError(f"fsdp_version={self.fsdp_version!r}: set fsdp_version=2 (FSDP2).") from None
        if self.fsdp_version != 2:
            raise ValueError(
                f"fsdp_version={self.fsdp_version}: notebook_accel implements FSDP2 only (torch's fully_shard); "
                "set fsdp_version=2 (or FSDP_VERSION=2 / fsdp_version: 2 in the config). FSDP1 is not provided."
            )
        self._resolve_resharding()
        for name in _FSDP1_ONLY:
            if getattr(self, name) not in (None, False):
                warnings.warn(
                    f"FullyShardedDataParallelPlugin({name}=...) is an FSDP1 setting; with FSDP2 it has no effect.",
                    UserWarning,
                    stacklevel=3,
                )
        self._resolve_wrap_policy()
        if self.cpu_offload is None:
            self.cpu_offload = _env_flag("FSDP_OFFLOAD_PARAMS")
        if self.state_dict_type is None:
            self.state_dict_type = env.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
        self.set_state_dict_type()
        if self.activation_checkpointing is None:
            self.activation_checkpointing = _env_flag("FSDP_ACTIVATION_CHECKPOINTING")
        if self.activation_checkpointing_offload is None:
            self.activation_checkpointing_offload = _env_flag("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD")
        if self.activation_checkpointing_offload:
            raise NotImplementedError(
                "activation_checkpointing_offload=True is not implemented by notebook_accel yet; "
                "use activation_checkpointing=True without offload."
            )
        if self.cpu_ram_efficient_loading is None:
            self.cpu_ram_efficient_loading = _env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING")
        self.cpu_ram_efficient_loading = bool(self.cpu_ram_efficient_loading)
        if self.cpu_ram_efficient_loading:
            # transformers' from_pretrained reads this to build the model on meta on ranks other than 0.
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"
        if self.ignored_modules is None:
            self.ignored_modules = env.get("FSDP_IGNORED_MODULES") or None
        if self.mixed_precision_policy is not None:
            self.mixed_precision_policy = _policy(self.mixed_precision_policy)

    def _resolve_resharding(self) -> None:
        if self.reshard_after_forward is None and self.sharding_strategy is None:
            if "FSDP_RESHARD_AFTER_FORWARD" not in os.environ:
                self.sharding_strategy = os.environ.get("FSDP_SHARDING_STRATEGY")  # an FSDP1 config's spelling
        if self.reshard_after_forward is None and self.sharding_strategy is not None:
            name = str(getattr(self.sharding_strategy, "name", self.sharding_strategy)).upper()
            mapping = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False}
            if name not in mapping:
                raise ValueError(
                    f"sharding_strategy={self.sharding_strategy!r} has no FSDP2 equivalent here; use "
                    "reshard_after_forward=True (FULL_SHARD) or False (SHARD_GRAD_OP)."
                )
            self.reshard_after_forward = mapping[name]
        if self.reshard_after_forward is None:
            self.reshard_after_forward = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true")
        value = self.reshard_after_forward
        if isinstance(value, str):
            named = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}.get(value.upper())
            value = named if named is not None else str_to_bool(value.lower())
        if not isinstance(value, (bool, int)) or value not in (True, False):
            raise ValueError(f"reshard_after_forward={self.reshard_after_forward!r}: FSDP2 takes True or False.")
        self.reshard_after_forward = bool(value)

    def _resolve_wrap_policy(self) -> None:
        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = os.environ.get("FSDP_AUTO_WRAP_POLICY", "no_wrap")
        if isinstance(self.auto_wrap_policy, str):
            policy = self.auto_wrap_policy.lower()
            if policy not in WRAP_POLICIES:
                raise ValueError(
                    f"auto_wrap_policy={self.auto_wrap_policy!r} is not one of {', '.join(WRAP_POLICIES)} "
                    "(or pass a callable that takes a module and says whether it gets its own fully_shard)."
                )
            self.auto_wrap_policy = policy
        elif not callable(self.auto_wrap_policy):
            raise TypeError(f"auto_wrap_policy must be a string or a callable, got {self.auto_wrap_policy!r}.")
        if self.transformer_cls_names_to_wrap is None:
            self.transformer_cls_names_to_wrap = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or None
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [
                n.strip() for n in self.transformer_cls_names_to_wrap.split(",") if n.strip()
            ]
        if self.min_num_params is None:
            self.min_num_params = int(os.environ.get("FSDP_MIN_NUM_PARAMS", "0"))
        if self.min_num_params < 0:
            raise ValueError(f"min_num_params={self.min_num_params} must be 0 or more.")

    def set_state_dict_type(self, state_dict_type=None) -> None:
        """Store which state dict checkpoints will use (FULL_STATE_DICT or SHARDED_STATE_DICT)."""
        from torch.distributed.fsdp import StateDictType

        if state_dict_type is not None:
            self.state_dict_type = state_dict_type
        value = self.state_dict_type
        if isinstance(value, str):
            key = value.upper()
            if key.isdigit():
                value = StateDictType(int(key))
            elif key in StateDictType.__members__:
                value = StateDictType[key]
        if not isinstance(value, StateDictType) or value.name not in STATE_DICT_TYPES:
            raise ValueError(
                f"state_dict_type={self.state_dict_type!r}: FSDP2 takes {' or '.join(STATE_DICT_TYPES)}."
            )
        self.state_dict_type = value

    def set_mixed_precision(self, mixed_precision, buffer_autocast: bool = False, override: bool = False) -> None:
        """Set the policy from a precision name ("bf16", "fp16", ...) unless one is set (override=True: always)."""
        if override or self.mixed_precision_policy is None:
            dtype = _dtype(mixed_precision)
            if dtype is None:
                self.mixed_precision_policy = None
                return
            from torch.distributed.fsdp import MixedPrecisionPolicy

            self.mixed_precision_policy = MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype
            )


def _dtype(value):
    import torch

    if isinstance(value, torch.dtype) or value is None:
        return value
    if isinstance(value, str):
        key = value.lower()
        if key in _DTYPES:
            return None if _DTYPES[key] is None else getattr(torch, _DTYPES[key])
        if isinstance(getattr(torch, key, None), torch.dtype):
            return getattr(torch, key)
    raise ValueError(f"{value!r} is not a precision: use one of {', '.join(_DTYPES)} or a torch.dtype.")


def _policy(value):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, dict):
        allowed = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(
                f"mixed_precision_policy has keys {unknown} that FSDP2's MixedPrecisionPolicy does not take; "
                f"use {', '.join(allowed)}."
            )
        return MixedPrecisionPolicy(**{k: v if k == "cast_forward_inputs" else _dtype(v) for k, v in value.items()})
    dtype = _dtype(value)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)


def enable_fsdp_ram_efficient_loading() -> None:
    """Ask transformers' from_pretrained to build the model on meta on ranks other than 0 (as
    `cpu_ram_efficient_loading=True` does); prepare then fills their shards from rank 0."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"


def disable_fsdp_ram_efficient_loading() -> None:
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"


def model_has_dtensor(model) -> bool:
    """Whether any parameter of `model` is a DTensor (the model was sharded by fully_shard)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
