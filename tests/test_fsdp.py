"""FSDP2 through Accelerator.prepare (issue #17, first slice): a small MLP trained with FSDP on 2 real
gloo ranks (notebook_launcher) against DDP on the same seed and data, and the inputs FSDP refuses."""

import os

import pytest
import torch
from fsdp_targets import bad_inputs, is_block, mixed_precision_step, rank0_on_meta, train

from notebook_accel import Accelerator, AcceleratorState, notebook_launcher
from notebook_accel.launch.sinks import ListSink
from notebook_accel.utils import FullyShardedDataParallelPlugin

TIMEOUT = 120
# fp32, same arithmetic; only the order of a reduction may differ between reduce-scatter and all-reduce.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def on_ranks(function, *args, world=2):
    return notebook_launcher(
        function, args, num_processes=world, use_port="auto", cpu=True, sinks=[ListSink()], timeout=TIMEOUT
    )


_DDP_CACHE: dict = {}


def ddp_run(accumulation, clip, world=2):
    key = (accumulation, clip, world)
    if key not in _DDP_CACHE:
        _DDP_CACHE[key] = on_ranks(train, False, "before", accumulation, clip, world=world)
    return _DDP_CACHE[key]


def assert_matches_ddp(fsdp, ddp):
    assert fsdp[0]["distributed_type"] == "FSDP" and ddp[0]["distributed_type"] == "MULTI_CPU"
    assert not ddp[0]["is_fsdp2"]
    for rank in fsdp:
        assert rank["param_types"] == ["DTensor"]  # the parameters really are shards
        assert rank["optimizer_has_model_params"]  # the optimizer steps the sharded parameters
        assert rank["unwrapped_is_model"] and rank["is_fsdp2"] and rank["has_dtensor"]
    assert not any(rank["has_dtensor"] for rank in ddp)
    # Each rank holds a shard of the parameters: DDP holds all 193 on each.
    assert [r["local_numel"] for r in ddp] == [193] * len(ddp)
    assert sum(r["local_numel"] for r in fsdp) == 193 and max(r["local_numel"] for r in fsdp) < 193
    assert fsdp[0]["syncs"] == ddp[0]["syncs"]
    torch.testing.assert_close(fsdp[0]["losses"], ddp[0]["losses"], **TOLERANCE)
    torch.testing.assert_close(fsdp[0]["norms"], ddp[0]["norms"], **TOLERANCE)
    # get_state_dict: full tensors on rank 0 (nothing elsewhere), equal to the DDP model's.
    assert all(r["state"] == {} for r in fsdp[1:])
    assert list(fsdp[0]["state"]) == list(ddp[0]["state"])
    for name, tensor in fsdp[0]["state"].items():
        assert type(tensor) is torch.Tensor and tensor.shape == ddp[0]["state"][name].shape
    torch.testing.assert_close(fsdp[0]["state"], ddp[0]["state"], **TOLERANCE)


@pytest.mark.timeout(2 * TIMEOUT + 30)
@pytest.mark.parametrize("optimizer", ["before", "separately", "after"])
def test_fsdp_training_matches_ddp(optimizer):
    """The optimizer built on the unsharded model (prepared with it, or in an earlier prepare call)
    is re-pointed at the shards; one built on the prepared model holds them already."""
    fsdp = on_ranks(train, True, optimizer, 1, None)
    ddp = ddp_run(1, None)
    assert_matches_ddp(fsdp, ddp)
    assert fsdp[0]["syncs"] == [True] * 16 and fsdp[0]["reduces"] == [True] * 16
    assert fsdp[0]["sharded"] == ["", "blocks.0", "blocks.1"]


@pytest.mark.timeout(2 * TIMEOUT + 30)
@pytest.mark.parametrize(
    "overrides, sharded",
    [
        ({"auto_wrap_policy": "size_based_wrap", "min_num_params": 50}, ["", "blocks.0.linear", "blocks.1.linear"]),
        ({"auto_wrap_policy": "no_wrap"}, [""]),
        ({"auto_wrap_policy": is_block}, ["", "blocks.0", "blocks.1"]),
        ({"activation_checkpointing": True}, ["", "blocks.0", "blocks.1"]),
        ({"ignored_modules": "out", "reshard_after_forward": False}, ["", "blocks.0", "blocks.1"]),
    ],
    ids=["size-based", "no-wrap", "callable", "activation-checkpointing", "ignored-modules"],
)
def test_plugin_settings_shard_what_they_say_and_train_like_ddp(overrides, sharded):
    fsdp = on_ranks(train, True, "before", 1, None, 2, overrides)
    assert fsdp[0]["sharded"] == sharded
    assert fsdp[0]["checkpointed"] == (["blocks.0", "blocks.1"] if "activation_checkpointing" in overrides else [])
    ddp = ddp_run(1, None)
    if "ignored_modules" in overrides:
        # `out` stays a plain replicated parameter on every rank; FSDP does not reduce its gradients.
        assert fsdp[0]["param_types"] == ["DTensor", "Parameter"]
        assert [r["local_numel"] for r in fsdp] == [101, 101]  # all 9 of out's on each, half the other 184
        return
    assert_matches_ddp(fsdp, ddp)


@pytest.mark.timeout(2 * TIMEOUT + 30)
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_gradient_accumulation_and_clipping_match_ddp(world):
    fsdp = on_ranks(train, True, "before", 2, 1.0, world=world)
    ddp = ddp_run(2, 1.0, world=world)
    steps = 2 * 64 // (4 * world)  # 2 epochs of 64 samples, batch 4 per rank
    assert fsdp[0]["syncs"] == [False, True] * (steps // 2)
    for run in (fsdp, ddp):  # no_sync really kept the other batches' gradients local
        assert all(r["reduces"] == [False, True] * (steps // 2) for r in run)
    norms = fsdp[0]["norms"]
    assert len(norms) == steps // 2 and all(n > 1.0 for n in norms)  # clipping did clip
    assert all(r["norms"] == norms for r in fsdp)  # every rank sees the same global norm
    assert_matches_ddp(fsdp, ddp)


@pytest.mark.timeout(TIMEOUT + 30)
def test_fsdp_refuses_models_it_cannot_shard_with_their_reason():
    messages = on_ranks(bad_inputs)[0]
    assert messages["distributed_type"] == "FSDP"
    assert "device map" in messages["device_map"] and "'out': 'disk'" in messages["device_map"]
    assert "offload / dispatch hooks" in messages["offload_hooks"] and "remove_hook_from_module" in messages["offload_hooks"]
    missing = messages["missing_class"]
    assert "['Block']" in missing and "Sequential, Linear, ReLU" in missing
    assert "DistributedDataParallel" in messages["ddp"] and "model.module" in messages["ddp"]


@pytest.mark.timeout(TIMEOUT + 30)
def test_mixed_precision_maps_to_fsdp_policy():
    for result in on_ranks(mixed_precision_step):
        assert result == {"param_dtype": "torch.bfloat16", "out_dtype": "torch.bfloat16", "grad_dtypes": ["torch.float32"]}


# -- the plugin, in this process ---------------------------------------------------------------------


def test_plugin_fields_and_defaults():
    from torch.distributed.fsdp import MixedPrecisionPolicy, StateDictType

    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=10, reshard_after_forward="false",
        state_dict_type="full_state_dict", mixed_precision_policy={"param_dtype": "bf16", "reduce_dtype": "fp32"},
    )  # fmt: skip
    assert plugin.fsdp_version == 2 and plugin.auto_wrap_policy == "size_based_wrap"
    assert plugin.reshard_after_forward is False
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT
    assert plugin.mixed_precision_policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    default = FullyShardedDataParallelPlugin()
    assert default.auto_wrap_policy == "no_wrap" and default.reshard_after_forward is True
    assert default.state_dict_type == StateDictType.SHARDED_STATE_DICT and default.cpu_offload is False


def test_plugin_reads_accelerates_variables(monkeypatch):
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Block,Other")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.auto_wrap_policy == "transformer_based_wrap"
    assert plugin.transformer_cls_names_to_wrap == ["Block", "Other"]
    assert plugin.reshard_after_forward is False and plugin.activation_checkpointing is True
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"


def test_an_fsdp1_configs_sharding_strategy_variable_maps_to_resharding(monkeypatch):
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP")  # accelerate's fsdp_sharding_strategy
    assert FullyShardedDataParallelPlugin().reshard_after_forward is False
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "true")  # the FSDP2 variable wins
    assert FullyShardedDataParallelPlugin().reshard_after_forward is True
    monkeypatch.delenv("FSDP_RESHARD_AFTER_FORWARD")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "NO_SHARD")
    with pytest.raises(ValueError, match=r"sharding_strategy='NO_SHARD' has no FSDP2 equivalent"):
        FullyShardedDataParallelPlugin()


def test_accelerate_names_are_the_same_class():
    import notebook_accel
    from notebook_accel.utils import dataclasses

    assert notebook_accel.FullyShardedDataParallelPlugin is FullyShardedDataParallelPlugin
    assert dataclasses.FullyShardedDataParallelPlugin is FullyShardedDataParallelPlugin


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"fsdp_version": 1}, ValueError, r"fsdp_version=1.*set fsdp_version=2"),
        ({"auto_wrap_policy": "layer_wrap"}, ValueError, r"'layer_wrap' is not one of transformer_based_wrap"),
        ({"reshard_after_forward": 3}, ValueError, r"reshard_after_forward=3"),
        ({"state_dict_type": "LOCAL_STATE_DICT"}, ValueError, r"FULL_STATE_DICT or SHARDED_STATE_DICT"),
        ({"mixed_precision_policy": {"buffer_dtype": "bf16"}}, ValueError, r"\['buffer_dtype'\]"),
    ],
)
def test_plugin_bad_values_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        FullyShardedDataParallelPlugin(**kwargs)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the refusal is for CPU-only machines")
def test_cpu_offload_on_a_cpu_only_machine_is_refused():
    with pytest.raises(ValueError, match=r"cpu_offload=True.*no accelerator.*cpu_offload=False"):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(cpu_offload=True))
    assert not AcceleratorState._shared_state  # refused before any state was made


def test_deepspeed_and_megatron_point_at_fsdp():
    for name in ("deepspeed_plugin", "megatron_lm_plugin"):
        with pytest.raises(NotImplementedError, match=rf"{name} is not supported.*fsdp_plugin=FullyShardedDataParallelPlugin"):
            Accelerator(**{name: object()})


def test_fsdp_plugin_must_be_the_plugin():
    with pytest.raises(TypeError, match=r"FullyShardedDataParallelPlugin, got dict"):
        Accelerator(fsdp_plugin={"fsdp_version": 2})


def test_one_process_notes_it_shards_nothing_and_trains(capsys, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # the launcher's switch, no plugin passed
    accelerator = Accelerator()
    assert "FSDP on one process shards nothing" in capsys.readouterr().out
    assert isinstance(accelerator.state.fsdp_plugin, FullyShardedDataParallelPlugin)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    assert isinstance(model, torch.nn.Linear)  # unsharded, no DDP either
    before = model.weight.detach().clone()
    accelerator.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    assert not torch.equal(before, model.weight)
    # The model checks still run on one process.
    with pytest.raises(ValueError, match="device map"):
        mapped = torch.nn.Linear(4, 1)
        mapped.hf_device_map = {"": "cpu"}
        accelerator.prepare(mapped)


@pytest.mark.timeout(TIMEOUT + 30)
def test_launch_config_with_distributed_type_fsdp_reaches_the_ranks(tmp_path, monkeypatch):
    from fsdp_targets import from_launch_config

    from notebook_accel import config

    path = tmp_path / "default_config.yaml"
    path.write_text(
        "distributed_type: FSDP\nuse_cpu: true\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: Block\n"
        "  fsdp_reshard_after_forward: false\n  fsdp_state_dict_type: FULL_STATE_DICT\n"
    )
    monkeypatch.setenv(config.CONFIG_ENV, str(path))
    results = notebook_launcher(from_launch_config, use_port="auto", sinks=[ListSink()], timeout=TIMEOUT)
    assert len(results) == 2
    for result in results:
        assert result == {
            "use_fsdp": "true", "distributed_type": "FSDP", "policy": "transformer_based_wrap", "classes": ["Block"],
            "reshard_after_forward": False, "state_dict_type": "FULL_STATE_DICT",
            "sharded": ["", "blocks.0", "blocks.1"],
        }  # fmt: skip


@pytest.mark.timeout(2 * TIMEOUT + 30)
def test_notebook_launcher_fsdp_settings_and_fsdp_false_over_the_config(tmp_path, monkeypatch):
    from fsdp_targets import from_launch_config

    from notebook_accel import config

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    path = tmp_path / "default_config.yaml"
    path.write_text("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\n")
    monkeypatch.setenv(config.CONFIG_ENV, str(path))
    settings = {"fsdp_auto_wrap_policy": "transformer_based_wrap", "fsdp_transformer_layer_cls_to_wrap": ["Block"],
                "fsdp_state_dict_type": "FULL_STATE_DICT"}  # fmt: skip
    results = notebook_launcher(
        from_launch_config, use_port="auto", sinks=[ListSink()], timeout=TIMEOUT, fsdp=settings
    )
    assert [r["distributed_type"] for r in results] == ["FSDP", "FSDP"]
    assert results[0]["classes"] == ["Block"] and results[0]["state_dict_type"] == "FULL_STATE_DICT"
    assert results[0]["sharded"] == ["", "blocks.0", "blocks.1"]
    # fsdp=False wins over a config that says FSDP.
    path.write_text("distributed_type: FSDP\nuse_cpu: true\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n")
    off = notebook_launcher(plain_type, use_port="auto", sinks=[ListSink()], timeout=TIMEOUT, fsdp=False)
    assert off == [("false", "MULTI_CPU"), ("false", "MULTI_CPU")]


def plain_type():
    import os

    from notebook_accel import Accelerator

    return os.environ.get("ACCELERATE_USE_FSDP"), str(Accelerator().distributed_type)


@pytest.mark.timeout(TIMEOUT + 30)
def test_fp16_overflow_in_one_ranks_shard_skips_the_step_on_every_rank():
    from fsdp_targets import fp16_overflow_on_one_rank

    results = on_ranks(fp16_overflow_on_one_rank)
    for result in results:
        assert result["skipped"] == [True, False, False] and result["changed"] == [False, True, True], result
    assert results[0]["scale"] == results[1]["scale"] == 65536.0 / 2  # halved once, on every rank


@pytest.mark.timeout(TIMEOUT + 30)
def test_trigger_sync_in_backward_nests_inside_no_sync():
    from fsdp_targets import sync_nesting

    for seen in on_ranks(sync_nesting):
        assert seen == [False, True, False, True]


@pytest.mark.timeout(TIMEOUT + 30)
def test_save_model_writes_the_full_weights_and_save_state_the_shards(tmp_path):
    from fsdp_targets import make_mlp, save_full_model
    from safetensors.torch import load_file

    paths = on_ranks(save_full_model, str(tmp_path))
    saved = load_file(tmp_path / "model.safetensors")
    torch.testing.assert_close(saved, make_mlp().state_dict(), rtol=0, atol=0)
    assert paths == [str(tmp_path / "state")] * 2  # tests/test_fsdp_checkpoint.py covers save_state in depth
    assert sorted(p.name for p in (tmp_path / "state" / "pytorch_model_fsdp_0").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp",
    ]  # fmt: skip


def test_fsdp1_settings_warn_and_sharding_strategy_maps_to_resharding():
    with pytest.warns(UserWarning, match=r"use_orig_params=\.\.\.\) is an FSDP1 setting"):
        FullyShardedDataParallelPlugin(use_orig_params=True)
    assert FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP").reshard_after_forward is False
    assert FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD").reshard_after_forward is True
    with pytest.raises(ValueError, match=r"sharding_strategy='HYBRID_SHARD' has no FSDP2 equivalent"):
        FullyShardedDataParallelPlugin(sharding_strategy="HYBRID_SHARD")


@pytest.mark.timeout(3 * TIMEOUT + 30)
@pytest.mark.parametrize("world", [2, 4])
def test_cpu_ram_efficient_loading_fills_meta_ranks_from_rank0_and_trains_like_ddp(world):
    """Only rank 0 builds real weights (the others on meta, buffers included, with an optimizer built
    on the meta parameters); the shards and a non-persistent buffer come from rank 0, so training
    matches DDP on a model every rank built for real."""
    fsdp = on_ranks(train, True, "before", 1, None, 2, {"cpu_ram_efficient_loading": True}, 0.5, world=world)
    ddp = on_ranks(train, False, "before", 1, None, 2, None, 0.5, world=world)
    assert fsdp[0]["on_meta_before"] == 0
    assert all(r["on_meta_before"] == 193 for r in fsdp[1:])  # the other ranks never held real weights
    assert all(r["buffers"] == {"scale": 0.5} for r in fsdp)
    fsdp = [{k: v for k, v in r.items() if k not in ("on_meta_before", "buffers")} for r in fsdp]
    assert_matches_ddp(fsdp, ddp)


@pytest.mark.timeout(TIMEOUT + 30)
def test_cpu_ram_efficient_loading_with_rank0_on_meta_fails_on_every_rank_before_any_shard():
    messages = on_ranks(rank0_on_meta)
    assert messages[0] == messages[1]
    assert "rank 0's model has parameters on the meta device (inp.weight, inp.bias, blocks.0.linear.weight)" in messages[0]
    assert "init_empty_weights() only on the other ranks" in messages[0]


def test_cpu_ram_efficient_loading_on_one_process_needs_real_weights(monkeypatch):
    from fsdp_targets import make_mlp

    from notebook_accel import init_empty_weights

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # restored after: the plugin sets it
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True))
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"  # for transformers' from_pretrained
    with init_empty_weights():
        model = make_mlp()
    with pytest.raises(ValueError, match=r"one process's model has parameters on the meta device \(inp.weight"):
        accelerator.prepare(model)
    trained = accelerator.prepare(make_mlp())  # real weights: one process trains unsharded
    assert not any(p.is_meta for p in trained.parameters())


def test_ram_efficient_loading_switches_set_the_variable_the_plugin_and_transformers_read(monkeypatch):
    from notebook_accel.utils import disable_fsdp_ram_efficient_loading, enable_fsdp_ram_efficient_loading

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    enable_fsdp_ram_efficient_loading()
    assert FullyShardedDataParallelPlugin().cpu_ram_efficient_loading is True
    disable_fsdp_ram_efficient_loading()
    assert FullyShardedDataParallelPlugin().cpu_ram_efficient_loading is False


@pytest.mark.timeout(TIMEOUT + 60)
def test_sharded_ranks_hand_freed_host_memory_back_step_after_step():
    """glibc's rising mmap threshold made each step's unsharded parameters and gradients stay in the
    heaps: a rank's memory grew step after step, past DDP's. With the fixed threshold that
    prepare sets on CPU it stays level after the first step (without it, here: +4x the model in 6 steps)."""
    from fsdp_targets import host_memory_per_step

    for rank in on_ranks(host_memory_per_step):
        after, size = rank["after"], rank["model_bytes"]
        assert max(after) - after[0] < 0.25 * size, (after, size)
        # Parameters and AdamW's two states, halved, are 1.5x the model; gradients are freed by zero_grad.
        assert after[-1] < 3 * size, (after, size)
        # The model exists already (1x); the optimizer built before prepare no longer keeps each block's
        # unsharded parameters beside its shards until the whole model is sharded (it did: 1.5x).
        assert rank["prepare_peak"] < 1.3 * size, (rank["prepare_peak"], size)
