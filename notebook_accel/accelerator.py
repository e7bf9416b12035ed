"""Accelerator: the facade a training loop talks to. Thin on purpose: the work lives in data_loader.py,
optimizer.py, scheduler.py, precision.py, model_wrapping.py, checkpointing.py and tracking.py; what
prepare produced lives in prepared.py's registry, which checkpointing reads."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Optional, Union

import torch
from torch.utils.hooks import RemovableHandle

from . import checkpointing, fsdp, model_wrapping, precision
from .prepared import Prepared, registry_property
from .state import AcceleratorState, GradientState
from .utils import operations as ops
from .utils.dataclasses import (
    PROFILE_PATTERN_NAME,
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from .utils.imports import is_bitsandbytes_multi_backend_available, is_xpu_available

_UNSET = object()


def _forward(owner: str, name: str, settable: bool = False) -> property:
    """A property that reads (and, if settable, writes) `self.<owner>.<name>`."""

    def get(self):
        return getattr(getattr(self, owner), name)

    def set_(self, value) -> None:
        setattr(getattr(self, owner), name, value)

    return property(get, set_ if settable else None, doc=f"`self.{owner}.{name}`")


class Accelerator:
    """Add `Accelerator()`, `prepare(...)` and `backward(loss)` to an existing loop; the same code
    then runs on 1 or N processes, in fp32, bf16 or fp16."""

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: Any = _UNSET,
        mixed_precision: Optional[str] = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: Optional[DataLoaderConfiguration] = None,
        deepspeed_plugin=None,
        fsdp_plugin=None,
        torch_tp_plugin=None,
        megatron_lm_plugin=None,
        rng_types: Optional[list] = None,
        log_with=None,
        project_dir: Optional[str] = None,
        project_config: Optional[ProjectConfiguration] = None,
        gradient_accumulation_plugin: Optional[GradientAccumulationPlugin] = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Optional[list] = None,
        dynamo_backend=None,
        dynamo_plugin: Optional[TorchDynamoPlugin] = None,
        deepspeed_plugins=None,
        parallelism_config=None,
    ) -> None:
        unsupported = {
            "deepspeed_plugin": deepspeed_plugin,
            "deepspeed_plugins": deepspeed_plugins,
            "megatron_lm_plugin": megatron_lm_plugin,
            "torch_tp_plugin": torch_tp_plugin,
            "parallelism_config": parallelism_config,
        }
        for name, plugin in unsupported.items():
            if plugin is not None:
                raise NotImplementedError(
                    f"{name} is not supported by notebook_accel; for sharded training pass "
                    "fsdp_plugin=FullyShardedDataParallelPlugin() (FSDP2), or remove it to train with DDP."
                )
        fsdp_plugin = fsdp.resolve_plugin(fsdp_plugin)
        self.project_configuration = project_config or ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(project_dir)

        handlers = _sort_handlers(kwargs_handlers or [])
        self.ddp_handler = handlers.get(DistributedDataParallelKwargs)
        self.scaler_handler = handlers.get(GradScalerKwargs)
        self.init_handler = handlers.get(InitProcessGroupKwargs)
        self.autocast_handler = handlers.get(AutocastKwargs)
        self.profile_handler = handlers.get(ProfileKwargs)

        if dynamo_plugin is not None and dynamo_backend is not None:
            raise ValueError("Pass either dynamo_backend or dynamo_plugin, not both.")
        self.dynamo_plugin = dynamo_plugin or TorchDynamoPlugin(backend=dynamo_backend)

        init_kwargs = self.init_handler.to_kwargs() if self.init_handler else {}
        existed = bool(AcceleratorState._shared_state)
        self.state = AcceleratorState(
            mixed_precision=mixed_precision,
            cpu=cpu,
            dynamo_plugin=self.dynamo_plugin,
            _from_accelerator=True,
            **init_kwargs,
        )
        try:
            precision.check_precision_supported(self.state.mixed_precision, self.device)
        except ValueError:
            if not existed:
                # Keep no state with the refused precision: the next Accelerator(...) may ask for another.
                AcceleratorState._reset_state()
            raise
        if fsdp_plugin is not None:
            fsdp.setup(fsdp_plugin, self.state)
        self._fsdp_params: dict = {}  # id(unsharded parameter) -> (weak ref, sharded one)

        if gradient_accumulation_plugin is not None:
            if gradient_accumulation_steps != 1:
                raise ValueError(
                    "Pass gradient_accumulation_steps or gradient_accumulation_plugin, not both "
                    f"(got gradient_accumulation_steps={gradient_accumulation_steps})."
                )
        else:
            steps = int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", gradient_accumulation_steps))
            gradient_accumulation_plugin = GradientAccumulationPlugin(num_steps=steps)
        self.gradient_state = GradientState(gradient_accumulation_plugin=gradient_accumulation_plugin)

        config = dataloader_config or DataLoaderConfiguration()
        if split_batches is not _UNSET:
            config.split_batches = bool(split_batches)
        self.dataloader_config = config
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = list(rng_types) if rng_types is not None else ["generator"]
        self.scaler = precision.make_grad_scaler(self.state.mixed_precision, self.device, self.scaler_handler)
        self.step = 0
        self.flag_tensor = None
        self._prepared = Prepared()
        self._pending_optimizers: list = []  # this prepare call's, not yet prepared: FSDP re-points them as it shards
        self._unscaled: set = set()
        self.log_with = log_with
        self.trackers: list = []
        if log_with is not None:
            from .tracking import filter_trackers

            self.log_with = filter_trackers(log_with, self.logging_dir)

    # -- where we are -----------------------------------------------------------------------
    device = _forward("state", "device")
    distributed_type = _forward("state", "distributed_type")
    num_processes = _forward("state", "num_processes")
    process_index = _forward("state", "process_index")
    local_process_index = _forward("state", "local_process_index")
    is_main_process = _forward("state", "is_main_process")
    is_local_main_process = _forward("state", "is_local_main_process")
    is_last_process = _forward("state", "is_last_process")
    use_distributed = _forward("state", "use_distributed")
    is_fsdp2 = _forward("state", "is_fsdp2")
    mixed_precision = _forward("state", "mixed_precision")
    split_batches = _forward("dataloader_config", "split_batches")
    even_batches = _forward("dataloader_config", "even_batches", settable=True)
    dispatch_batches = _forward("dataloader_config", "dispatch_batches")
    use_seedable_sampler = _forward("dataloader_config", "use_seedable_sampler")
    non_blocking = _forward("dataloader_config", "non_blocking")
    project_dir = _forward("project_configuration", "project_dir")
    logging_dir = _forward("project_configuration", "logging_dir")
    save_iteration = _forward("project_configuration", "iteration")

    # -- what prepare produced (prepared.py); accelerate's attribute names, read by user code and transformers
    _models = registry_property("models")
    _optimizers = registry_property("optimizers")
    _schedulers = registry_property("schedulers")
    _dataloaders = registry_property("dataloaders")
    _custom_objects = registry_property("custom_objects")

    @property
    def _save_model_state_pre_hook(self):
        return self._prepared.pre_hooks["save"]

    @property
    def _load_model_state_pre_hook(self):
        return self._prepared.pre_hooks["load"]

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.plugin_kwargs.update({"num_steps": steps})

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state._set_sync_gradients(value)

    @property
    def multi_device(self) -> bool:
        """Several processes, each on its own accelerator device (not CPU processes, not XLA)."""
        kind = str(self.distributed_type)
        return bool(self.use_distributed) and kind.startswith("MULTI_") and kind != DistributedType.MULTI_CPU

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._prepared.optimizers)

    # -- prepare ----------------------------------------------------------------------------
    def prepare(self, *args, device_placement: Optional[list] = None):
        """Wrap models, optimizers, schedulers and data loaders, in any order; returned in that order."""
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(args)} objects.")
        out = list(args)
        self._pending_optimizers = [obj for obj in args if _kind(obj) == "optimizer"]
        try:
            # Models and loaders first, then optimizers, then schedulers (they point at optimizers).
            for kind in ("first", "optimizer", "scheduler"):
                for i, obj in enumerate(args):
                    if _kind(obj) == kind:
                        out[i] = self._prepare_one(obj, device_placement[i])
        finally:
            self._pending_optimizers = []
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_one(self, obj, placement):
        if isinstance(obj, torch.utils.data.DataLoader):
            return self.prepare_data_loader(obj, device_placement=placement)
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement=placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=placement)
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            return self.prepare_scheduler(obj)
        return obj

    def prepare_model(
        self, model: torch.nn.Module, device_placement: Optional[bool] = None, evaluation_mode=False
    ):
        if _already_prepared(model, self._prepared, "models"):
            return model
        if device_placement is None:
            device_placement = self.device_placement
        plugin = getattr(self.state, "fsdp_plugin", None)
        wrapped = fsdp.check_model(model, plugin) if plugin is not None and not evaluation_mode else None
        # The probes are looked up here, where accelerate's tests patch them (accelerate.accelerator.*).
        model_wrapping.check_quantized_placement(
            model, self.state, bnb_cpu=is_bitsandbytes_multi_backend_available, xpu=is_xpu_available
        )
        self._prepared.models.append(model)
        from_rank0 = wrapped is not None and plugin.cpu_ram_efficient_loading and fsdp.sharding(self.state)
        if device_placement and not getattr(model, "hf_device_map", None) and not from_rank0:
            model = model.to(self.device)
        if self.mixed_precision == "fp8":
            model = precision.prepare_fp8_model(model)
        elif self.mixed_precision != "no":
            precision.patch_forward_for_autocast(
                model, self.mixed_precision, self.device, self.autocast_handler
            )
        if wrapped is not None and fsdp.sharding(self.state):
            optimizers = [*self._prepared.optimizers, *self._pending_optimizers]
            model = fsdp.shard_model(model, plugin, wrapped, self._fsdp_params, optimizers, self.device)
        model = model_wrapping.wrap_model(
            model, self.state, self.ddp_handler, self.dynamo_plugin, evaluation_mode=evaluation_mode
        )
        self._prepared.models[-1] = model
        return _mark_prepared(model)

    def prepare_optimizer(self, optimizer, device_placement: Optional[bool] = None):
        from .optimizer import AcceleratedOptimizer

        if _already_prepared(optimizer, self._prepared, "optimizers") or isinstance(
            optimizer, AcceleratedOptimizer
        ):
            return optimizer
        if device_placement is None:
            device_placement = self.device_placement
        fsdp.repoint_optimizer(optimizer, self._fsdp_params)
        wrapped = AcceleratedOptimizer(optimizer, device_placement=device_placement, scaler=self.scaler)
        self._prepared.optimizers.append(wrapped)
        return _mark_prepared(wrapped)

    def prepare_scheduler(self, scheduler):
        from .scheduler import AcceleratedScheduler

        if _already_prepared(scheduler, self._prepared, "schedulers"):
            return scheduler
        inner = getattr(scheduler, "optimizer", None)
        optimizers = [
            opt for opt in self._prepared.optimizers if opt.optimizer is inner
        ] or self._prepared.optimizers
        wrapped = AcceleratedScheduler(
            scheduler,
            optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        self._prepared.schedulers.append(wrapped)
        return _mark_prepared(wrapped)

    def prepare_data_loader(
        self, data_loader, device_placement: Optional[bool] = None, slice_fn_for_dispatch=None
    ):
        from .data_loader import prepare_data_loader

        if _already_prepared(data_loader, self._prepared, "dataloaders"):
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        config = self.dataloader_config
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.num_processes,
            process_index=self.process_index,
            split_batches=config.split_batches,
            put_on_device=device_placement,
            rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader,
        )
        self._prepared.dataloaders.append(prepared)
        return _mark_prepared(prepared)

    # -- the training step ------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(), divided by the accumulation steps and scaled for fp16."""
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)
        self._unscaled.clear()

    def _do_sync(self) -> None:
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            self.step = 0
            state._set_sync_gradients(True)
        else:
            self.step += 1
            state._set_sync_gradients(self.step % state.num_steps == 0)

    @contextlib.contextmanager
    def accumulate(self, *models):
        """Inside, gradients are reduced only on sync steps (every num_steps-th batch, and always on
        a loader's last batch); elsewhere DDP's no_sync skips the all-reduce."""
        self._do_sync()
        with contextlib.ExitStack() as stack:
            for model in models:
                if not self.sync_gradients and not self.gradient_state.sync_each_batch:
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model):
        if fsdp.is_fsdp_model(model):
            with fsdp.no_sync(model):
                yield
        elif self.use_distributed and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            yield

    def trigger_sync_in_backward(self, model):
        """A context: the next backward inside it reduces gradients, even after forwards under no_sync."""
        if fsdp.is_fsdp_model(model):
            return fsdp.no_sync(model, sync=True)
        return model_wrapping.sync_in_next_backward(model)

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Optional[AutocastKwargs] = None):
        with precision.autocast_context(
            self.mixed_precision, self.device, autocast_handler or self.autocast_handler
        ):
            yield

    def unscale_gradients(self, optimizer=None) -> None:
        """Divide fp16-scaled gradients by the loss scale (once per step), e.g. before clipping."""
        if self.scaler is None:
            return
        optimizers = (
            self._prepared.optimizers
            if optimizer is None
            else list(optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        )
        for opt in optimizers:
            inner = getattr(opt, "optimizer", opt)
            if id(inner) not in self._unscaled:
                self.scaler.unscale_(inner)
                self._unscaled.add(id(inner))

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        self.unscale_gradients()
        return fsdp.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters, clip_value) -> None:
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # -- collectives ------------------------------------------------------------------------
    def gather(self, tensor):
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """Gather across ranks and drop the samples even batching duplicated at the end of the data."""
        try:
            ops.recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        use_gather_object = use_gather_object or not all_tensors
        data = ops.gather_object(input_data) if use_gather_object else self.gather(input_data)
        state = self.gradient_state
        if not (state.end_of_dataloader and state.remainder > 0):
            return data

        def trim(tensor):
            return tensor[: state.remainder]

        return trim(data) if use_gather_object else ops.recursively_apply(trim, data)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        return ops.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def print(self, *args, **kwargs) -> None:
        self.state.print(*args, **kwargs)

    def main_process_first(self):
        return self.state.main_process_first()

    def local_main_process_first(self):
        return self.state.local_main_process_first()

    def split_between_processes(self, inputs, apply_padding: bool = False):
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    def on_main_process(self, function):
        return self.state.on_main_process(function)

    def on_local_main_process(self, function):
        return self.state.on_local_main_process(function)

    def on_last_process(self, function):
        return self.state.on_last_process(function)

    def on_process(self, function=None, process_index=None):
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function=None, local_process_index=None):
        return self.state.on_local_process(function, local_process_index=local_process_index)

    def set_trigger(self) -> None:
        """Raise a flag on this rank; `check_trigger()` on every rank then returns True (e.g. early stop)."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        flag = self.reduce(self.flag_tensor, reduction="sum")
        if flag.item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables, even_batches: Optional[bool] = None):
        """torch's Join over DDP models, for ranks with different numbers of batches; even_batches
        overrides the prepared loaders' setting inside the block (model_wrapping, data_loader)."""
        from .data_loader import override_even_batches

        uneven = not (self.even_batches if even_batches is None else even_batches)
        with override_even_batches(self._prepared.dataloaders if self.use_distributed else [], even_batches):
            with model_wrapping.join_uneven_inputs(joinables, self.state, enable=uneven):
                yield

    # -- models and memory ------------------------------------------------------------------
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The user's module: without DDP (and torch.compile unless keep_torch_compile and it wraps
        the module directly); keep_fp32_wrapper=False also restores the original forward."""
        return model_wrapping.unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model, unwrap: bool = True) -> dict:
        if unwrap:
            # The user's module's keys: a compiled wrapper would prefix them all with "_orig_mod.",
            # and neither the original module nor load_state could load them back.
            model = self.unwrap_model(model, keep_torch_compile=False)
        if fsdp.is_fsdp_model(model):
            return fsdp.full_state_dict(model)  # a collective: every rank calls it, rank 0 gets the tensors
        return model.state_dict()

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        from .data_loader import skip_first_batches

        return skip_first_batches(dataloader, num_batches=num_batches)

    def free_memory(self, *objects):
        """Forget every prepared object (and release `objects`), then empty device caches."""
        self._prepared.forget()
        self._fsdp_params.clear()
        self.step = 0
        from .utils.memory import release_memory

        return release_memory(*objects)

    clear = free_memory

    def verify_device_map(self, model) -> bool:
        """`model` (or a submodule) was dispatched over more than one device by a device map
        (big-model inference); such a model must not be prepared for data-parallel training."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

    # -- checkpoints (checkpointing.py does the work, reading the registry) ----------------------
    def register_for_checkpointing(self, *objects) -> None:
        """Have save_state / load_state also save and restore `objects` (each with state_dict() and
        load_state_dict()), in this order."""
        self._prepared.register_for_checkpointing(*objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Have save_state call `hook(models, weights, output_dir)` on every process before it writes.

        `models` are the prepared models, `weights` their state dicts in a list the hook may edit
        (change a dict; remove one to save that model another way, and remove its model in the
        load pre-hook too). `output_dir` is the folder being written: it becomes the checkpoint's
        folder only once the save completes, so files the hook writes there are saved with it.
        Returns a handle; `handle.remove()` unregisters the hook.
        """
        return self._prepared.add_state_pre_hook("save", hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Have load_state call `hook(models, input_dir)` on every process before it loads anything.

        `models` is a list of the prepared models: remove one to load it yourself, and load_state
        leaves it alone. `input_dir` is the checkpoint's folder. Returns a handle to remove it by.
        """
        return self._prepared.add_state_pre_hook("load", hook)

    def save_state(
        self, output_dir: Optional[str] = None, safe_serialization: bool = True, **save_model_func_kwargs
    ):
        """Save models, optimizers, schedulers, scaler, loaders' positions, registered objects and RNG.

        accelerate hands `save_model_func_kwargs` to DeepSpeed only; here any keyword raises, named."""
        return checkpointing.save_state(
            self, self._prepared, output_dir, safe_serialization, **save_model_func_kwargs
        )

    def load_state(
        self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **load_model_func_kwargs
    ):
        """Restore everything save_state wrote (no input_dir + automatic naming: the latest). Loaders
        resume mid-epoch only with use_stateful_dataloader=True, else replay the epoch (see docs/checkpoints.md).

        `load_model_func_kwargs` takes map_location, strict and trust_pickled_objects; `load_kwargs`
        (accelerate's torch.load keywords) may say map_location, or weights_only=False, which is
        trust_pickled_objects=True. Any other keyword (DeepSpeed's included) raises, named."""
        checkpointing.load_state(self, self._prepared, input_dir, load_kwargs, **load_model_func_kwargs)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: Union[str, os.PathLike],
        max_shard_size: Union[int, str] = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write `model`'s weights (unwrapped) to `save_directory` as checkpointing.save_model does; the
        weights of modules offloaded to the CPU or disk by a device map are read back to save them too."""
        from .big_model.loading import get_state_dict_offloaded_model
        from .utils.other import has_offloaded_params

        if any(has_offloaded_params(m) for m in model.modules()):
            state_dict = get_state_dict_offloaded_model(self.unwrap_model(model))
        elif any(p.device.type == "meta" for p in model.parameters()):
            raise RuntimeError("You can't save the model since some parameters are on the meta device.")
        else:
            state_dict = self.get_state_dict(model)
        checkpointing.save_model(
            state_dict,
            save_directory,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            is_main_process=self.is_main_process,
        )
        self.wait_for_everyone()

    def save(self, obj, f, safe_serialization=False):
        """torch.save (or safetensors for a dict of tensors) on the main process only."""
        if not self.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(obj, f)
        else:
            torch.save(obj, f)

    # -- tracking ---------------------------------------------------------------------------
    def init_trackers(
        self, project_name: str, config: Optional[dict] = None, init_kwargs: Optional[dict] = None
    ):
        from .tracking import make_trackers

        if self.is_main_process:
            self.trackers = make_trackers(
                project_name, self.log_with or [], self.logging_dir, config, init_kwargs
            )

    def get_tracker(self, name: str, unwrap: bool = False):
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(f"No tracker named {name!r}; started: {[t.name for t in self.trackers]}.")

    def log(self, values: dict, step: Optional[int] = None, log_kwargs: Optional[dict] = None) -> None:
        if not self.is_main_process:
            return
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def end_training(self) -> None:
        if self.is_main_process:
            for tracker in self.trackers:
                tracker.finish()
        self.wait_for_everyone()

    @contextlib.contextmanager
    def profile(self, profile_handler: Optional[ProfileKwargs] = None):
        """Run the block under torch.profiler and yield the profiler (`prof.step()`, `prof.key_averages()`).

        Settings come from `profile_handler`, else the Accelerator's ProfileKwargs, else the defaults.
        With `output_trace_dir`, each process writes its Chrome trace there as
        `profile_<process_index>.json` after the block; then the processes wait for each other.
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        if not isinstance(handler, ProfileKwargs):
            raise TypeError(
                f"profile_handler must be a ProfileKwargs, got {type(handler).__name__}: {handler!r}"
            )
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        name = PROFILE_PATTERN_NAME.format(suffix=self.process_index)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, name))
        self.wait_for_everyone()

    def __repr__(self) -> str:
        return f"Accelerator({self.distributed_type}, {self.num_processes} process(es), device={self.device}, mixed_precision={self.mixed_precision})"


def _kind(obj) -> str:
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        return "scheduler"
    return "first"


def _already_prepared(obj, prepared: Prepared, kind: str) -> bool:
    """`obj` came out of a prepare call (it carries accelerate's mark, which transformers reads too):
    it is kept once in the registry's `kind` list and handed back as it is, never wrapped a second time."""
    if not getattr(obj, "_is_accelerate_prepared", False):
        return False
    prepared.keep(obj, kind)
    return True


def _mark_prepared(obj):
    obj._is_accelerate_prepared = True
    return obj


def _sort_handlers(handlers: list) -> dict:
    by_type: dict = {}
    for handler in handlers:
        if not isinstance(handler, KwargsHandler):
            raise TypeError(
                f"kwargs_handlers takes KwargsHandler instances, got {type(handler).__name__}: {handler!r}."
            )
        kind = type(handler)
        if kind in by_type:
            raise ValueError(f"kwargs_handlers has two {kind.__name__} objects; pass one of each kind.")
        by_type[kind] = handler
    return by_type
