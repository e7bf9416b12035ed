"""Wrapping a prepared model for the run (DDP, torch.compile) and unwrapping it back to the user's module.

Accelerator.prepare_model places the model and patches its forward for mixed precision, then hands it
here; Accelerator.unwrap_model and get_state_dict undo the wrappers with `unwrap_model`.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from .utils.dataclasses import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    TorchDynamoPlugin,
)
from .utils.other import compile_regions, extract_model_from_parallel

# The distributed types whose models train under DistributedDataParallel.
DDP_TYPES = (
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_HPU,
)


def uses_ddp(state) -> bool:
    """Whether models of this (Accelerator)State's run are wrapped in DistributedDataParallel."""
    return state.use_distributed and state.distributed_type in DDP_TYPES


def wrap_model(
    model: torch.nn.Module,
    state,
    ddp_handler: DistributedDataParallelKwargs | None = None,
    dynamo_plugin: TorchDynamoPlugin | None = None,
    evaluation_mode: bool = False,
) -> torch.nn.Module:
    """`model` in DistributedDataParallel (when the run is distributed, it trains and has trainable
    parameters), then compiled (when `dynamo_plugin` names a backend)."""
    if not evaluation_mode and uses_ddp(state) and any(p.requires_grad for p in model.parameters()):
        model = _ddp(model, state, ddp_handler)
    if dynamo_plugin is not None and dynamo_plugin.backend not in ("no", None):
        compile_model = compile_regions if dynamo_plugin.use_regional_compilation else torch.compile
        model = compile_model(model, **dynamo_plugin.to_compile_kwargs())
    return model


def _ddp(model, state, ddp_handler):
    kwargs = ddp_handler.ddp_kwargs() if ddp_handler else {}
    # DDP takes device ids only for single-device modules on an accelerator.
    ids = [state.local_process_index] if state.device.type not in ("cpu", "meta") else None
    model = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=ids, output_device=ids[0] if ids else None, **kwargs
    )
    if ddp_handler is not None:
        register_comm_hook(model, ddp_handler, state.backend)
    return model


# Backends whose all-reduce takes bfloat16 (torch's bf16 hooks check for them too).
_BF16_BACKENDS = ("nccl", "xccl")


def register_comm_hook(model, handler: DistributedDataParallelKwargs, backend: str | None) -> None:
    """Register the communication hook `handler` names on the DDP `model` (nothing for NO).

    A hook function is registered with `handler.comm_state` as it is. A DDPCommunicationHookType is
    looked up in torch's ddp_comm_hooks, wrapped by `comm_wrapper` (FP16 / BF16 compression of what
    the hook sends), and the PowerSGD hooks get a PowerSGDState built from `comm_state_option` on
    the default process group (or `comm_state`, when it is one already).

    FP16, POWER_SGD (with or without the FP16 wrapper) are tested on 2 gloo ranks. BF16, as hook or
    wrapper, needs an all-reduce that takes bfloat16 (NCCL on CUDA, XCCL on XPU): elsewhere this
    raises. BATCHED_POWER_SGD is refused where torch's batched hook cannot run: in torch 2.13 it
    hands a 2-D matrix to a helper that asserts 3-D ones, so it fails at its first compressed step
    (start_powerSGD_iter, 1000 by default) on any device. BF16 on NCCL and BATCHED_POWER_SGD with a
    torch that fixes it are still to be checked on a GPU.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hook, wrapper = handler.comm_hook, handler.comm_wrapper
    if callable(hook):
        model.register_comm_hook(handler.comm_state, hook)
        return
    kinds = DDPCommunicationHookType
    if hook == kinds.NO:
        return  # a wrapper compresses a hook's traffic: with no hook there is nothing to wrap (as accelerate)
    for name, value in (("comm_hook", hook), ("comm_wrapper", wrapper)):
        if value == kinds.BF16 and backend not in _BF16_BACKENDS:
            raise ValueError(
                f"DistributedDataParallelKwargs({name}=DDPCommunicationHookType.BF16) needs a process group whose "
                f"all-reduce takes bfloat16 (nccl on CUDA GPUs, xccl on Intel XPUs); this run uses "
                f"backend={backend!r}. Use DDPCommunicationHookType.FP16 here, or train on GPUs for BF16."
            )
    if hook == kinds.BATCHED_POWER_SGD and not _batched_power_sgd_works(powerSGD_hook):
        raise ValueError(
            f"DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BATCHED_POWER_SGD) cannot run with "
            f"torch {torch.__version__}: its batched_powerSGD_hook fails at its first compressed step (a 2-D "
            "matrix reaches a check for 3-D ones in torch's own code). Use DDPCommunicationHookType.POWER_SGD, "
            "which compresses each layer separately, or a torch release that fixes the batched hook."
        )
    function = {
        kinds.FP16: default_hooks.fp16_compress_hook,
        kinds.BF16: default_hooks.bf16_compress_hook,
        kinds.POWER_SGD: powerSGD_hook.powerSGD_hook,
        kinds.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
    }[hook]
    if wrapper == kinds.FP16:
        function = default_hooks.fp16_compress_wrapper(function)
    elif wrapper == kinds.BF16:
        function = default_hooks.bf16_compress_wrapper(function)
    hook_state = handler.comm_state
    if hook in (kinds.POWER_SGD, kinds.BATCHED_POWER_SGD) and hook_state is None:
        try:
            hook_state = powerSGD_hook.PowerSGDState(None, **handler.comm_state_option)
        except TypeError as exc:
            raise ValueError(
                f"DistributedDataParallelKwargs(comm_state_option={handler.comm_state_option!r}) are not keywords of "
                f"torch's PowerSGDState ({exc}); e.g. {{'matrix_approximation_rank': 2, 'start_powerSGD_iter': 10}}."
            ) from exc
    model.register_comm_hook(hook_state, function)


def _batched_power_sgd_works(powerSGD_hook) -> bool:
    """Whether torch's batched PowerSGD hook can orthogonalize the 2-D low-rank matrix it builds."""
    orthogonalize = getattr(powerSGD_hook, "_orthogonalize", None)
    if orthogonalize is None:
        return True  # torch changed its helpers: nothing known against it
    try:
        orthogonalize(torch.ones(4, 1))
    except (AssertionError, IndexError, RuntimeError):
        return False
    return True


@contextlib.contextmanager
def join_uneven_inputs(joinables, state, enable: bool):
    """torch's Join over the DDP models among `joinables` (enable=False: Join is off, as with even
    batches), so a rank that runs out of batches shadows the others' all-reduces instead of hanging.

    A joinable that is not DDP-wrapped (prepared with evaluation_mode=True, without trainable
    parameters, or not prepared) is left out with a UserWarning, and so is the whole block in a
    multi-process run that does not use DDP; one process has nothing to join and stays silent.
    """
    from torch.distributed.algorithms.join import Join, Joinable

    if isinstance(joinables, (torch.nn.Module, Joinable)):
        joinables = [joinables]
    if not uses_ddp(state):
        if state.distributed_type != DistributedType.NO:
            warnings.warn(
                "Joining uneven inputs is only supported for multi-GPU (or multi-CPU, ...) DistributedDataParallel "
                f"training: with distributed_type={state.distributed_type}, join_uneven_inputs has no effect.",
                UserWarning,
                stacklevel=5,
            )
        yield
        return
    usable, skipped = [], []
    for i, obj in enumerate(joinables):
        inner = getattr(obj, "_orig_mod", obj)  # torch.compile over DDP: join the DDP inside
        if isinstance(inner, Joinable):
            usable.append(inner)
        else:
            skipped.append(f"joinables[{i}] ({type(obj).__name__})")
    if skipped:
        warnings.warn(
            f"join_uneven_inputs: {', '.join(skipped)} is not DDP-wrapped (prepared with evaluation_mode=True, "
            "without trainable parameters, or not prepared), so it is not joined; pass the models "
            "accelerator.prepare returned for training.",
            UserWarning,
            stacklevel=5,
        )
    if not (enable and usable):
        yield
        return
    with Join(usable, enable=True, throw_on_early_termination=False):
        yield


def unwrap_model(model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
    """The user's module without DDP / DataParallel; keep_fp32_wrapper=False also restores the
    original forward. With keep_torch_compile, a torch.compile result stays compiled: one compiled
    over DDP gives a compiled wrapper (same settings) around the module inside, and the training
    model is left as it was (accelerate re-points that model's `_orig_mod` instead)."""
    inner = extract_model_from_parallel(model, keep_fp32_wrapper, keep_torch_compile=False)
    compiled = getattr(model, "_orig_mod", None)
    if not keep_torch_compile or not isinstance(compiled, torch.nn.Module):
        return inner
    if compiled is inner:
        return model
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        return OptimizedModule(inner, model.dynamo_ctx)
    return inner


def check_quantized_placement(model, state, bnb_cpu, xpu) -> None:
    """Refuse to prepare an 8-bit / 4-bit (bitsandbytes) model its device map placed where it cannot
    train: over several devices in a distributed run, on a device other than this process's, or
    offloaded to disk, or to the CPU unless bitsandbytes runs there (`bnb_cpu()`, its multi-backend
    build) and the run is not on an Intel XPU (`xpu()`). The probes are passed in by the caller."""
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
    device_map = getattr(model, "hf_device_map", None)
    if not (quantized and device_map):
        return
    devices = set(device_map.values())
    if len(devices) > 1 and state.distributed_type != DistributedType.NO:
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision on multiple devices in any "
            "distributed mode; to use a quantized model spread over several GPUs, run one process (naive "
            "pipeline parallelism) without a distributed setting in your accelerate config."
        )
    # Offloading is checked first: it is the reason a CPU-mapped model cannot train on a GPU either.
    on_cpu = "cpu" in devices
    if "disk" in devices or (on_cpu and (not bnb_cpu() or xpu())):
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk offload. "
            "To train it on the CPU, install bitsandbytes with its multi-backend support "
            "(https://huggingface.co/docs/bitsandbytes/main/en/installation#multi-backend)."
        )
    if len(devices) == 1:
        where = next(iter(devices))
        index = torch.device(where).index if isinstance(where, str) else getattr(where, "index", where)
        device = state.device
        index = None if index is None else int(index)
        elsewhere = torch.device(device.type, index) != device and (device.index is not None or index != 0)
        if elsewhere and not (device.type == "cpu" and bnb_cpu()):
            raise ValueError(
                "You can't train a model that has been loaded in 8-bit or 4-bit precision on a different device "
                f"than the one you're training on ({device}); load it there, e.g. with "
                "`device_map={'': torch.cuda.current_device()}`."
            )


@contextlib.contextmanager
def sync_in_next_backward(model):
    """Make the next backward of a DDP model all-reduce gradients even inside `no_sync`.

    After several forwards under `no_sync`, DDP's reducer expects no reduction; flipping its two sync
    flags and preparing the reducer with no unused outputs makes the coming backward reduce.
    Outside DDP (one process, or a model not wrapped) this does nothing.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        yield
        return
    saved = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = saved
