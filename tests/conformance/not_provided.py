"""accelerate 1.15.0's public names that notebook_accel does not provide, each with the reason.

Names are dotted paths below the package, as `surface.public_names()` gives them. One list, grouped
by reason: tests/test_public_surface.py checks that every name here is accelerate's and is missing
from notebook_accel, and tools/compat_section.py writes docs/compatibility.md's public-surface
section from it.
"""

from __future__ import annotations

# reason key -> (the reason, as docs/compatibility.md shows it; the names)
GROUPS = {
    "deepspeed": (
        "DeepSpeed (ZeRO engines, their config and wrappers): notebook_accel trains with DDP",
        [
            "DeepSpeedPlugin",
            "utils.DeepSpeedPlugin",
            "utils.dataclasses.DeepSpeedPlugin",
            "utils.DeepSpeedSequenceParallelConfig",
            "utils.dataclasses.DeepSpeedSequenceParallelConfig",
            "utils.DeepSpeedEngineWrapper",
            "utils.DeepSpeedOptimizerWrapper",
            "utils.DeepSpeedSchedulerWrapper",
            "utils.DummyOptim",
            "utils.DummyScheduler",
            "utils.HfDeepSpeedConfig",
            "utils.deepspeed_required",
            "utils.get_active_deepspeed_plugin",
            "utils.map_pytorch_optim_to_deepspeed",
            "utils.compile_regions_deepspeed",
            "utils.prepare_deepspeed_cmd_env",
            "utils.operations.GatheredParameters",
            "utils.GatheredParameters",
            "accelerator.Accelerator.deepspeed_plugin",
            "accelerator.Accelerator.deepspeed_ulysses_dl_adapter",
            "state.AcceleratorState.deepspeed_plugin",
            "state.AcceleratorState.get_deepspeed_plugin",
            "state.AcceleratorState.select_deepspeed_plugin",
        ],
    ),
    "megatron": (
        "Megatron-LM (its engine, train steps and model-config parsers)",
        [
            "utils.MegatronLMPlugin",
            "utils.dataclasses.MegatronLMPlugin",
            "utils.dataclasses.MODEL_CONFIGS_TO_MEGATRON_PARSERS",
            "utils.add_model_config_to_megatron_parser",
            "utils.dataclasses.add_model_config_to_megatron_parser",
            "utils.dataclasses.parse_bert_config",
            "utils.dataclasses.parse_glm4_moe_config",
            "utils.dataclasses.parse_gpt2_config",
            "utils.dataclasses.parse_llama_config",
            "utils.dataclasses.parse_t5_config",
            "utils.AbstractTrainStep",
            "utils.BertTrainStep",
            "utils.GPTTrainStep",
            "utils.T5TrainStep",
            "utils.MegatronEngine",
            "utils.MegatronLMDummyDataLoader",
            "utils.MegatronLMDummyScheduler",
            "utils.MegatronLMOptimizerWrapper",
            "utils.MegatronLMSchedulerWrapper",
            "utils.avg_losses_across_data_parallel_group",
            "utils.gather_across_data_parallel_groups",
            "utils.megatron_lm_initialize",
            "utils.megatron_lm_prepare_data_loader",
            "utils.megatron_lm_prepare_model_optimizer_scheduler",
            "utils.megatron_lm_prepare_optimizer",
            "utils.megatron_lm_prepare_scheduler",
        ],
    ),
    "fsdp": (
        "FSDP2 helpers beyond prepare and save_state / load_state (accelerate's internal FSDP2 steps, tied-weight and compile helpers, N-D meshes): later slices of issue #17",
        [
            "utils.dataclasses.get_module_class_from_name",
            "utils.ensure_weights_retied",
            "utils.fsdp2_apply_ac",
            "utils.fsdp2_canonicalize_names",
            "utils.fsdp2_load_full_state_dict",
            "utils.fsdp2_prepare_model",
            "utils.fsdp2_switch_optimizer_parameters",
            "utils.get_fsdp2_grad_scaler",
            "utils.compile_regions_fsdp2",
            "accelerator.Accelerator.is_composable_parallelism_enabled",
        ],
    ),
    "nd_parallel": (
        "N-D parallelism (ParallelismConfig: tensor, context and pipeline parallel device meshes)",
        [
            "ParallelismConfig",
            "utils.ParallelismConfig",
            "utils.TorchContextParallelConfig",
            "utils.dataclasses.TorchContextParallelConfig",
            "utils.TorchTensorParallelConfig",
            "utils.dataclasses.TorchTensorParallelConfig",
            "utils.TorchTensorParallelPlugin",
            "utils.dataclasses.TorchTensorParallelPlugin",
            "accelerator.Accelerator.parallelism_config",
            "accelerator.Accelerator.torch_device_mesh",
            "accelerator.Accelerator.should_save_model",
            "accelerator.Accelerator.data_parallel_rank",
            "accelerator.Accelerator.data_parallel_shard_rank",
            "accelerator.Accelerator.context_parallel_rank",
            "accelerator.Accelerator.tensor_parallel_rank",
            "accelerator.Accelerator.pipeline_parallel_rank",
            "accelerator.Accelerator.maybe_context_parallel",
        ],
    ),
    "pippy": (
        "Pipeline-parallel inference (PiPPy / torch.distributed.pipelining)",
        [
            "prepare_pippy",
            "inference.prepare_pippy",
            "inference.build_pipeline",
            "inference.find_pippy_batch_size",
            "inference.generate_device_map",
            "inference.pippy_forward",
        ],
    ),
    "fp8": (
        "FP8 training backends (TransformerEngine, MS-AMP, torchao)",
        [
            "utils.TERecipeKwargs",
            "utils.dataclasses.TERecipeKwargs",
            "utils.MSAMPRecipeKwargs",
            "utils.dataclasses.MSAMPRecipeKwargs",
            "utils.AORecipeKwargs",
            "utils.dataclasses.AORecipeKwargs",
            "utils.dataclasses.FP8BackendType",
            "utils.apply_fp8_autowrap",
            "utils.contextual_fp8_autocast",
            "utils.convert_model",
            "utils.has_transformer_engine_layers",
            "utils.convert_model_to_fp8_ao",
            "utils.filter_first_and_last_linear_layers",
            "utils.has_ao_layers",
            "utils.torchao_required",
            "accelerator.Accelerator.fp8_backend",
        ],
    ),
    "bnb": (
        "bitsandbytes quantization (load_and_quantize_model and its config)",
        [
            "utils.BnbQuantizationConfig",
            "utils.dataclasses.BnbQuantizationConfig",
            "utils.CustomDtype",
            "utils.dataclasses.CustomDtype",
            "utils.has_4bit_bnb_layers",
            "utils.load_and_quantize_model",
        ],
    ),
    "xla": (
        "TPU / XLA-only internals (notebook_accel launches TPU hosts through xmp.spawn)",
        [
            "data_loader.MpDeviceLoaderWrapper",
            "state.GradientState.is_xla_gradients_synced",
            "utils.install_xla",
            "utils.prepare_tpu",
        ],
    ),
    "launch_cli": (
        "internals of accelerate's command-line launcher and its config (notebook_accel has its own launch path)",
        [
            "utils.PrepareForLaunch",
            "utils.prepare_multi_gpu_env",
            "utils.prepare_simple_launcher_cmd_env",
            "utils.prepare_sagemager_args_inputs",
            "utils.set_numa_affinity",
            "utils.check_cuda_p2p_ib_support",
            "utils.write_basic_config",
            "utils.SageMakerDistributedType",
            "utils.dataclasses.SageMakerDistributedType",
        ],
    ),
    "trackers": (
        "experiment trackers not built in (subclass tracking.GeneralTracker around them; jsonl and tensorboard are built in)",
        [
            "tracking.AimTracker",
            "tracking.ClearMLTracker",
            "tracking.CometMLTracker",
            "tracking.DVCLiveTracker",
            "tracking.MLflowTracker",
            "tracking.SwanLabTracker",
            "tracking.TrackioTracker",
            "tracking.WandBTracker",
            "tracking.LOGGER_TYPE_TO_CLASS",
        ],
    ),
    "stateful_loader": (
        "torchdata's StatefulDataLoader (notebook_accel's loaders resume exactly through their own state_dict)",
        [
            "data_loader.DataLoaderAdapter",
            "accelerator.Accelerator.use_stateful_dataloader",
        ],
    ),
    "internal": (
        "accelerate's own internals (version gates, enum bases, thread-local storage, import checks)",
        [
            "utils.dataclasses.BaseEnum",
            "utils.dataclasses.EnumWithContains",
            "state.ThreadLocalSharedDict",
            "utils.are_libraries_initialized",
            "utils.operations.is_torch_xpu_tensor",
        ],
    ),
    "device_map_internals": (
        "steps inside accelerate's device-map planner and offload reader (notebook_accel's planner, big_model/planner.py, is its own)",
        [
            "utils.modeling.fallback_allocate",
            "utils.modeling.get_module_leaves",
        ],
    ),
    "integrations": (
        "other integrations: LOMO optimizers (lomo_optim), rich tracebacks installed on import",
        [
            "accelerator.Accelerator.lomo_backward",
            "rich",
        ],
    ),
}

NOT_PROVIDED = {name: key for key, (_, names) in GROUPS.items() for name in names}
REASONS = {key: reason for key, (reason, _) in GROUPS.items()}
