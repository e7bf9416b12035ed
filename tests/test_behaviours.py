"""Behaviours accelerate users rely on (issue #16 part 3), each on 2 real gloo ranks started by
notebook_launcher: join_uneven_inputs overriding even_batches, pickling an Accelerator, save_state /
load_state with a folder per rank and stateful loaders, and DDP communication hooks by name."""

import pickle
import warnings

import pytest
import torch
from behaviour_targets import (
    hook_errors,
    join_with_override,
    per_rank_folders,
    pickle_round_trip,
    train_with_hook,
)

from notebook_accel import Accelerator, notebook_launcher
from notebook_accel.launch.sinks import ListSink
from notebook_accel.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

TIMEOUT = 120


def on_two_ranks(function, *args):
    return notebook_launcher(
        function, args, num_processes=2, use_port="auto", cpu=True, sinks=[ListSink()], timeout=TIMEOUT
    )


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- 1. join_uneven_inputs ------------------------------------------------------------------------


@pytest.mark.timeout(TIMEOUT + 30)
def test_join_uneven_inputs_overrides_even_batches_inside_the_block_only():
    results = on_two_ranks(join_with_override)
    assert results[0]["loader_types"] == ["DataLoaderShard", "DataLoaderDispatcher", "DataLoaderShard"]
    # 5 batches: even gives each rank 3 (one repeated), the override 3 and 2, and the steps follow it.
    assert [r["train_len_before"] for r in results] == [3, 3]
    assert [r["train_len_inside"] for r in results] == [3, 2]
    assert [r["steps"] for r in results] == [3, 2]
    assert [r["train_len_after"] for r in results] == [3, 3]
    for r in results:
        assert (r["even_before"], r["even_inside"], r["even_after"]) == (True, False, True)
        assert r["accelerator_even_after"] is True
    # Joined: the rank with the extra batch did not hang, and both hold the same weights.
    assert _same(results[0]["params"], results[1]["params"])
    # The iterable loaders kept their even batching and were read without failing.
    seen = sorted(i for r in results for batch in r["dispatched"] for row in batch for i in row)
    assert seen == list(range(8))
    assert [len(r["sharded"]) for r in results] == [2, 2]
    for r in results:
        messages = [m for category, m in r["warnings"] if category == "UserWarning"]
        iterable = [m for m in messages if "map-style" in m]
        assert len(iterable) == 1, r["warnings"]
        assert "loader 1 (DataLoaderDispatcher" in iterable[0] and "loader 2 (DataLoaderShard over IterableDatasetShard" in iterable[0]
        assert "loader 0" not in iterable[0]
        not_ddp = [m for m in messages if "not DDP-wrapped" in m]
        assert len(not_ddp) == 1 and "joinables[1] (Sequential)" in not_ddp[0], r["warnings"]
        assert r["non_ddp_block_ran"] is True
        [(category, message)] = r["non_ddp_warnings"]
        assert category == "UserWarning" and "distributed_type=FSDP" in message and "no effect" in message


@pytest.mark.timeout(60)
def test_join_uneven_inputs_in_one_process_runs_the_block_without_warnings():
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    ran = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=False):
            ran.append(True)
    assert ran == [True]
    assert [str(w.message) for w in caught if "join" in str(w.message).lower()] == []


# -- 2. pickling an Accelerator -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_pickled_accelerator_has_the_same_state_in_one_process():
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=4))
    restored = pickle.loads(pickle.dumps(accelerator))
    assert restored is not accelerator
    assert accelerator.state.__dict__ == restored.state.__dict__
    # It is this process's one state, not a private copy that later changes would miss.
    assert restored.state.__dict__ is accelerator.state.__dict__
    assert restored.gradient_state.__dict__ is accelerator.gradient_state.__dict__
    assert [b.tolist() for b in restored._dataloaders[0]] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.timeout(TIMEOUT + 30)
def test_a_pickled_accelerator_has_the_same_state_on_two_ranks():
    results = on_two_ranks(pickle_round_trip)
    for rank, r in enumerate(results):
        assert r["equal"] and r["shared"] and r["gradient_shared"], r
        assert (r["process_index"], r["num_processes"], r["distributed_type"]) == (rank, 2, "MULTI_CPU")
        assert r["batches"] == r["original_batches"] and len(r["batches"]) == 4
    assert results[0]["batches"] != results[1]["batches"]  # each rank's own shard


# -- 3. save_state / load_state with a folder per rank --------------------------------------------


@pytest.mark.timeout(TIMEOUT + 30)
def test_each_rank_saves_to_and_resumes_from_its_own_folder(tmp_path):
    stop_after = 7  # 5 steps an epoch: mid-epoch 2 of 2
    results = on_two_ranks(per_rank_folders, str(tmp_path), stop_after)
    for rank, r in enumerate(results):
        assert r["saved_path"] == str(tmp_path / f"rank{rank}")
        # Every rank wrote a complete checkpoint of its own: the shared pieces and its own positions.
        assert {"model.safetensors", "optimizer.bin", f"random_states_{rank}.pkl"} <= set(r["files"]), r["files"]
        own = [f for f in r["files"] if f.startswith("dl_state_dict") or f.startswith("random_states")]
        suffix = "" if rank == 0 else "_rank1"
        assert sorted(own) == sorted(
            [f"dl_state_dict{suffix}.bin", f"dl_state_dict_1{suffix}.bin", f"dl_state_dict_2{suffix}.bin", f"random_states_{rank}.pkl"]
        )
        # The new Accelerator loaded the model and optimizer as they were at the save.
        assert _same(r["after_load"]["params"], r["at_save"]["params"])
        assert _optimizer_states_equal(r["after_load"]["optimizer"], r["at_save"]["optimizer"])
        # The remaining batches are the uninterrupted run's, and so is where training ends.
        full, first, second = r["full"], r["first_part"], r["second_part"]
        assert len(full) == 10 and len(first) == stop_after and len(second) == 10 - stop_after
        assert all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(first + second, full)), f"rank {rank}"
        assert _same(r["resumed_end"]["params"], r["full_end"]["params"])
        assert _optimizer_states_equal(r["resumed_end"]["optimizer"], r["full_end"]["optimizer"])
        # Iterable datasets (dispatched and sharded) resumed mid-epoch too.
        for head, rest, whole in zip(r["stream_head"], r["stream_rest"], r["stream_full"]):
            assert len(head) == 2 and head + rest == whole, (head, rest, whole)
    assert not _same(results[0]["full_end"]["params"], results[0]["at_save"]["params"])  # it trained on
    assert results[0]["stream_full"][1] != results[1]["stream_full"][1]  # sharded: each rank its own items


def _optimizer_states_equal(a, b) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        a["state"][k].keys() == b["state"][k].keys()
        and all(torch.equal(torch.as_tensor(a["state"][k][n]), torch.as_tensor(b["state"][k][n])) for n in a["state"][k])
        for k in a["state"]
    )


# -- 4. DDP communication hooks -------------------------------------------------------------------

HOOKS = {
    "fp16": dict(comm_hook=DDPCommunicationHookType.FP16),
    "power_sgd": dict(
        comm_hook=DDPCommunicationHookType.POWER_SGD,
        comm_state_option={"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
    ),
    "power_sgd_fp16_wrapper": dict(
        comm_hook="power_sgd",
        comm_wrapper=DDPCommunicationHookType.FP16,
        comm_state_option={"matrix_approximation_rank": 2, "start_powerSGD_iter": 3},
    ),
    "no": dict(comm_hook=DDPCommunicationHookType.NO, comm_wrapper=DDPCommunicationHookType.FP16),
}


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("name", sorted(HOOKS))
def test_a_named_comm_hook_trains_and_keeps_ranks_in_agreement(name):
    results = on_two_ranks(train_with_hook, HOOKS[name])
    for r in results:
        assert r["loss_after"] < 0.8 * r["loss_before"], (r["loss_before"], r["loss_after"])
        for gathered in r["grads"]:
            assert torch.equal(gathered[0], gathered[1])  # every step, both ranks apply the same gradient
        assert not torch.equal(r["grads"][0][0], torch.zeros_like(r["grads"][0][0]))
    hooks = results[0]["hooks"]
    if name == "no":
        assert hooks == []  # a wrapper alone wraps nothing, as in accelerate
    elif name == "fp16":
        assert hooks == [("fp16_compress_hook", "NoneType", None, None)]
    elif name == "power_sgd":
        assert hooks == [("powerSGD_hook", "PowerSGDState", 1, 2)]
        assert results[0]["compressed_numel"] > 0  # compression did start (from iteration 2)
    else:
        assert hooks == [("fp16_compress_wrapper_hook", "PowerSGDState", 2, 3)]
        assert results[0]["compressed_numel"] > 0


@pytest.mark.timeout(TIMEOUT + 30)
def test_hooks_that_cannot_run_on_gloo_say_what_they_need():
    cases = [
        dict(comm_hook=DDPCommunicationHookType.BF16),
        dict(comm_hook=DDPCommunicationHookType.POWER_SGD, comm_wrapper=DDPCommunicationHookType.BF16),
        dict(comm_hook=DDPCommunicationHookType.BATCHED_POWER_SGD),
        dict(comm_hook="power_sgd", comm_state_option={"no_such_option": 1}),
    ]
    results = on_two_ranks(hook_errors, cases)
    assert results[0] == results[1]
    bf16, bf16_wrapper, batched, bad_option = results[0]
    for error, name in ((bf16, "comm_hook"), (bf16_wrapper, "comm_wrapper")):
        assert error[0] == "ValueError"
        assert f"{name}=DDPCommunicationHookType.BF16" in error[1] and "nccl" in error[1]
        assert "backend='gloo'" in error[1] and "FP16" in error[1]
    assert batched[0] == "ValueError" and "BATCHED_POWER_SGD" in batched[1] and torch.__version__ in batched[1]
    assert "POWER_SGD" in batched[1].replace("BATCHED_POWER_SGD", "")
    assert bad_option[0] == "ValueError" and "no_such_option" in bad_option[1] and "PowerSGDState" in bad_option[1]


def test_hook_settings_are_checked_when_the_handler_is_made():
    with pytest.raises(ValueError, match=r"comm_hook='fp32'.*\['no', 'fp16', 'bf16', 'power_sgd', 'batched_power_sgd'\]"):
        DistributedDataParallelKwargs(comm_hook="fp32")
    with pytest.raises(ValueError, match=r"comm_wrapper=<DDPCommunicationHookType.POWER_SGD.*\['no', 'fp16', 'bf16'\]"):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper=DDPCommunicationHookType.POWER_SGD)
    with pytest.raises(ValueError, match="comm_state_option configures the PowerSGD hooks"):
        DistributedDataParallelKwargs(comm_hook=lambda state, bucket: None, comm_state_option={"a": 1})
    handler = DistributedDataParallelKwargs(comm_hook="FP16", find_unused_parameters=True)
    assert handler.comm_hook is DDPCommunicationHookType.FP16
    assert handler.ddp_kwargs() == {"find_unused_parameters": True}  # hook fields never reach DDP


def test_ddp_communication_hook_type_is_exported_where_accelerate_has_it():
    import notebook_accel.utils as utils
    import notebook_accel.utils.dataclasses as dataclasses

    assert utils.DDPCommunicationHookType is dataclasses.DDPCommunicationHookType
    assert "DDPCommunicationHookType" in utils.__all__
    assert DDPCommunicationHookType.list() == ["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"]
    assert DDPCommunicationHookType.POWER_SGD == "power_sgd"
