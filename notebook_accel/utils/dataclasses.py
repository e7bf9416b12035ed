"""Enums and small configuration records shared across the package (accelerate's names)."""

from __future__ import annotations

import contextlib
import copy
import enum
import os
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

from .enums import (  # noqa: F401  (accelerate's names at accelerate's path)
    ComputeEnvironment,
    DDPCommunicationHookType,
    DistributedType,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    ReduceOp,
    RNGType,
)

if TYPE_CHECKING:  # annotations only: this module imports no torch
    import torch


def parse_mixed_precision(value) -> str:
    """'no' | 'fp16' | 'bf16' | 'fp8' (None means 'no'); anything else raises naming the value."""
    if value is None:
        return "no"
    text = str(value.value if isinstance(value, enum.Enum) else value).strip().lower()
    if text in PrecisionType.list():
        return text
    raise ValueError(
        f"Unknown mixed_precision {value!r}: choose one of {PrecisionType.list()} "
        "(for example mixed_precision='bf16')."
    )


# -- configuration records (accelerate's names and defaults) -----------------------------------


@dataclass
class TensorInformation:
    """A tensor's shape and dtype, standing in for it where only its layout travels (debug checks,
    receiving a broadcast)."""

    shape: torch.Size
    dtype: torch.dtype



class KwargsHandler:
    """Base of the kwargs handlers: `to_kwargs()` gives only the fields changed from their defaults."""

    def to_dict(self) -> dict:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict:
        # The defaults as written in the class: a handler that reads ACCELERATE_* variables for its
        # unset fields would otherwise count what the environment set as a default.
        with _without_accelerate_variables():
            default = self.__class__().to_dict()
        return {k: v for k, v in self.to_dict().items() if default.get(k) != v}


@contextlib.contextmanager
def _without_accelerate_variables():
    saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith("ACCELERATE_")]}
    try:
        yield
    finally:
        os.environ.update(saved)


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """How prepare() wraps a model in DistributedDataParallel.

    The first seven fields go to DDP as they are. A communication hook is registered after wrapping,
    in one of two forms:

    - accelerate's: `comm_hook` a `DDPCommunicationHookType` (or its value, "power_sgd"), optionally
      `comm_wrapper` FP16 / BF16 (compresses what the hook sends; ignored when comm_hook is NO) and
      `comm_state_option`, the keywords of torch's `PowerSGDState` for the PowerSGD hooks (its
      process group is the default one).
    - a torch hook function `comm_hook(state, bucket)` with its `comm_state`, handed over as given.

    See model_wrapping.register_comm_hook for what each hook needs to run.
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Any = DDPCommunicationHookType.NO
    comm_wrapper: Any = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)
    comm_state: Any = None

    # Not DDP's keywords: model_wrapping registers the hook from them after wrapping.
    HOOK_FIELDS = ("comm_hook", "comm_wrapper", "comm_state_option", "comm_state")

    def __post_init__(self):
        if not callable(self.comm_hook):
            self.comm_hook = _hook_type("comm_hook", self.comm_hook, DDPCommunicationHookType.list())
        allowed = [DDPCommunicationHookType.NO.value, DDPCommunicationHookType.FP16.value, DDPCommunicationHookType.BF16.value]
        self.comm_wrapper = _hook_type("comm_wrapper", self.comm_wrapper, allowed)
        if not isinstance(self.comm_state_option, dict):
            raise TypeError(
                f"comm_state_option={self.comm_state_option!r}: pass a dict of PowerSGDState keywords, "
                "e.g. {'matrix_approximation_rank': 2}."
            )
        if callable(self.comm_hook) and self.comm_state_option:
            raise ValueError(
                "comm_state_option configures the PowerSGD hooks named by DDPCommunicationHookType; with a hook "
                "function as comm_hook, pass its state as comm_state instead."
            )

    def to_dict(self) -> dict:
        # The hook's state is the user's live object (a call counter, a PowerSGDState): handed on as
        # it is, never a deep copy the user cannot see into (or that holds an uncopyable process group).
        shared = self.HOOK_FIELDS
        rest = copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in shared})
        return {**rest, **{k: self.__dict__[k] for k in shared}}

    def ddp_kwargs(self) -> dict:
        """The keywords for torch's DistributedDataParallel (the changed ones; no hook fields)."""
        return {k: v for k, v in self.to_kwargs().items() if k not in self.HOOK_FIELDS}


def _hook_type(name: str, value, allowed: list) -> DDPCommunicationHookType:
    text = value.value if isinstance(value, enum.Enum) else value
    if value is None:
        text = DDPCommunicationHookType.NO.value
    if isinstance(text, str) and text.lower() in allowed:
        return DDPCommunicationHookType(text.lower())
    raise ValueError(
        f"DistributedDataParallelKwargs({name}={value!r}): choose one of {allowed} "
        f"(DDPCommunicationHookType members){' or pass a torch hook function' if name == 'comm_hook' else ''}."
    )


@dataclass
class GradScalerKwargs(KwargsHandler):
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    backend: Optional[str] = None
    init_method: Optional[str] = None
    timeout: Optional[timedelta] = None


@dataclass
class AutocastKwargs(KwargsHandler):
    enabled: bool = True
    cache_enabled: Optional[bool] = None


_FP8_ENV = "ACCELERATE_FP8_"
_DYNAMO_ENV = "ACCELERATE_DYNAMO_"


def _fp8_choice(record, field_name: str, env: str, choices: tuple, default: str, case=str) -> None:
    """Set `record.<field_name>` to its value (or $ACCELERATE_FP8_<env>, or `default`), case-normalised
    and checked against `choices`."""
    value = getattr(record, field_name)
    chosen = case(value if value is not None else os.environ.get(_FP8_ENV + env, default))
    if chosen not in choices:
        raise ValueError(f"`{field_name}` must be one of {' or '.join(choices)}, got {chosen!r}.")
    setattr(record, field_name, chosen)


@dataclass
class FP8RecipeKwargs(KwargsHandler):
    """Deprecated fp8 recipe of accelerate (its TransformerEngine and MS-AMP fields in one record).
    notebook_accel trains fp8 through torchao and only records these; unset fields come from the
    ACCELERATE_FP8_* variables."""

    opt_level: Optional[str] = None  # MS-AMP: "O1" | "O2"
    use_autocast_during_eval: Optional[bool] = None
    margin: Optional[int] = None
    interval: Optional[int] = None
    fp8_format: Optional[str] = None  # "HYBRID" | "E4M3" | "E5M2"
    amax_history_len: Optional[int] = None
    amax_compute_algo: Optional[str] = None  # "max" | "most_recent"
    override_linear_precision: Optional[tuple] = None  # (fprop, dgrad, wgrad) in higher precision
    use_mxfp8_block_scaling: Optional[bool] = None
    backend: Optional[str] = None  # "MSAMP" | "TE"

    def __post_init__(self) -> None:
        import warnings

        from .env_flags import parse_flag_from_env
        from .imports import is_msamp_available, is_transformer_engine_available

        warnings.warn(
            "FP8RecipeKwargs is deprecated and will be removed in Accelerate v2.0.0. notebook_accel only "
            "records it: mixed_precision='fp8' trains through torchao and needs no recipe.",
            FutureWarning,
            stacklevel=3,
        )
        default = "msamp" if is_msamp_available() else "te"
        _fp8_choice(self, "backend", "BACKEND", ("MSAMP", "TE"), default, str.upper)
        if self.backend == "MSAMP":
            # Only MS-AMP's field applies; the TransformerEngine ones stay unset (accelerate asks for
            # TransformerEngine here too, which an MS-AMP run does not use).
            _fp8_choice(self, "opt_level", "OPT_LEVEL", ("O1", "O2"), "O2")
            return
        if not is_transformer_engine_available():
            raise ImportError(
                "TransformerEngine is not available. Please install it or use a different backend."
            )

        def flag(name: str) -> bool:
            return parse_flag_from_env(_FP8_ENV + name)

        if self.use_autocast_during_eval is None:
            self.use_autocast_during_eval = flag("USE_AUTOCAST_DURING_EVAL")
        if self.margin is None:
            self.margin = int(os.environ.get(_FP8_ENV + "MARGIN", 0))
        if self.interval is None:
            self.interval = int(os.environ.get(_FP8_ENV + "INTERVAL", 1))
        _fp8_choice(self, "fp8_format", "FORMAT", ("HYBRID", "E4M3", "E5M2"), "HYBRID", str.upper)
        algos = ("max", "most_recent")
        _fp8_choice(self, "amax_compute_algo", "AMAX_COMPUTE_ALGO", algos, "most_recent", str.lower)
        if self.amax_history_len is None:
            self.amax_history_len = int(os.environ.get(_FP8_ENV + "AMAX_HISTORY_LEN", 1024))
        if self.override_linear_precision is None:
            self.override_linear_precision = tuple(flag("OVERRIDE_" + g) for g in ("FPROP", "DGRAD", "WGRAD"))
        if self.use_mxfp8_block_scaling is None:
            self.use_mxfp8_block_scaling = flag("USE_MXFP8_BLOCK_SCALING")


# The trace file `Accelerator.profile()` writes per process in ProfileKwargs.output_trace_dir.
PROFILE_PATTERN_NAME = "profile_{suffix}.json"


@dataclass
class ProfileKwargs(KwargsHandler):
    """Settings of `Accelerator.profile()`: torch.profiler's arguments, activities by name
    ("cpu", "cuda", "xpu", "hpu", "mtia"), and a folder for one Chrome trace per process."""

    activities: Optional[list] = None
    schedule_option: Optional[dict] = None
    on_trace_ready: Optional[Callable] = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: Optional[str] = None

    def _activity(self, name):
        import torch.profiler

        kinds = torch.profiler.ProfilerActivity
        known = {n.lower(): getattr(kinds, n) for n in ("CPU", "CUDA", "XPU", "HPU", "MTIA") if hasattr(kinds, n)}
        if not isinstance(name, str) or name.lower() not in known:
            raise ValueError(f"ProfileKwargs.activities: unknown activity {name!r}; use some of {sorted(known)}")
        return known[name.lower()]

    def build(self):
        """A torch.profiler.profile with these settings (not started)."""
        import torch.profiler

        activities = None if self.activities is None else [self._activity(a) for a in self.activities]
        schedule = None
        if self.schedule_option is not None:
            try:
                schedule = torch.profiler.schedule(**self.schedule_option)
            except TypeError as error:
                raise ValueError(
                    f"ProfileKwargs.schedule_option={self.schedule_option!r} is not torch.profiler.schedule's "
                    f"arguments (wait, warmup, active, repeat, skip_first): {error}"
                ) from None
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


@dataclass
class DataLoaderConfiguration:
    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    num_steps: Optional[int] = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self):
        if self.num_steps is not None and (not isinstance(self.num_steps, int) or self.num_steps < 1):
            raise ValueError(
                f"GradientAccumulationPlugin(num_steps={self.num_steps!r}): pass a whole number >= 1."
            )

    def to_kwargs(self) -> dict:
        # GradientState reads every key, so give them all (not only the changed ones).
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class ProjectConfiguration:
    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: Optional[str] = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self):
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and (not isinstance(self.total_limit, int) or self.total_limit < 1):
            raise ValueError(
                f"ProjectConfiguration(total_limit={self.total_limit!r}): pass a whole number >= 1 or None."
            )


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """How `prepare` compiles a model with torch.compile. Fields left as None come from the
    ACCELERATE_DYNAMO_* variables (accelerate launch sets them: BACKEND, MODE, USE_FULLGRAPH,
    USE_DYNAMIC, USE_REGIONAL_COMPILATION), else the defaults: no backend (no compiling), mode
    "default", fullgraph and regional compilation off. `use_regional_compilation` compiles each
    repeated block once (`compile_regions`) instead of the whole model."""

    backend: Optional[str] = None
    mode: Optional[str] = None
    fullgraph: Optional[bool] = None
    dynamic: Optional[bool] = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: Optional[bool] = None

    def __post_init__(self):
        from .env_flags import str_to_bool

        def env(name: str, default=None):
            return os.environ.get(_DYNAMO_ENV + name, default)

        def flag(name: str) -> bool:
            return str_to_bool(env(name, "False"), to_bool=True)

        if self.backend is None:
            self.backend = env("BACKEND", "no")
        # Lower-case, as torch.compile names backends (accelerate's to_dict gives the same).
        backend = self.backend.value if isinstance(self.backend, enum.Enum) else self.backend
        self.backend = str(backend).lower()
        if self.mode is None:
            self.mode = env("MODE", "default")
        if self.fullgraph is None:
            self.fullgraph = flag("USE_FULLGRAPH")
        if self.use_regional_compilation is None:
            self.use_regional_compilation = flag("USE_REGIONAL_COMPILATION")
        if self.dynamic is None and env("USE_DYNAMIC") is not None:  # unset: torch decides
            self.dynamic = flag("USE_DYNAMIC")

    def to_compile_kwargs(self) -> dict:
        out = {"backend": self.backend, "fullgraph": self.fullgraph}
        for name in ("mode", "dynamic", "options"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.disable:
            out["disable"] = True
        return out


# accelerate's path for the FSDP plugin (the class lives in fsdp_plugin.py, which imports nothing of this module).
from .fsdp_plugin import FullyShardedDataParallelPlugin  # noqa: E402,F401
