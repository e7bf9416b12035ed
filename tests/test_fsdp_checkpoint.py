"""save_state / load_state in an FSDP run (issue #17, sharded checkpoints): 2 real gloo ranks
(notebook_launcher) train, save and keep training; a fresh run loads and trains the same steps and
must end bit for bit where the first did; resharding on load; failed saves leave the last one."""

import pickle

import pytest
import torch
from fsdp_checkpoint_targets import failing_saves, load_continue, train_save_continue

from notebook_accel import Accelerator, AcceleratorState, GradientState, notebook_launcher
from notebook_accel.launch.sinks import ListSink

TIMEOUT = 120


def on_ranks(function, *args, world=2):
    return notebook_launcher(
        function, args, num_processes=world, use_port="auto", cpu=True, sinks=[ListSink()], timeout=TIMEOUT
    )


def assert_identical(a, b):
    """Nested dicts / lists of tensors and numbers, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_identical(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_identical(x, y)
    else:
        assert a == b


SHARDED_FILES = {
    "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp",
    "optimizer_0/.metadata", "optimizer_0/__0_0.distcp", "optimizer_0/__1_0.distcp",
    "scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl",
}  # fmt: skip
FULL_FILES = {
    "model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl",
    "random_states_1.pkl",
}  # fmt: skip


@pytest.mark.timeout(2 * TIMEOUT + 30)
@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_resumed_run_ends_bit_identical(tmp_path, kind):
    folder = str(tmp_path / "ckpt")
    first = on_ranks(train_save_continue, folder, kind)
    assert set(first[0]["listing"]) == (SHARDED_FILES if kind == "SHARDED_STATE_DICT" else FULL_FILES)
    resumed = on_ranks(load_continue, folder, kind)
    # The weights right after load_state are the ones saved (gathered on rank 0).
    assert resumed[0]["loaded"] and list(resumed[0]["loaded"]) == list(first[0]["saved"])
    assert_identical(resumed[0]["loaded"], first[0]["saved"])
    for rank in (0, 1):  # each rank's shards of the parameters and of AdamW's state, and the rest
        mine, theirs = resumed[rank]["after"], first[rank]["after"]
        assert (
            set(mine["optim"]) == set(mine["params"]) and mine["optim"]["inp.weight"]["exp_avg"].numel() > 0
        )
        assert_identical(mine, theirs)
    # The scheduler steps once per process per step (accelerate's rule): 6 steps on 2 ranks, 12 of StepLR's.
    assert first[0]["after"]["counter"] == 6 and first[0]["after"]["lr"] == [0.01 * 0.5**6]
    # The shards are halves: neither rank holds the whole of inp.weight (8 x 4).
    assert [r["after"]["params"]["inp.weight"].shape for r in first] == [torch.Size([4, 4])] * 2


@pytest.mark.timeout(TIMEOUT + 30)
def test_sharded_checkpoint_from_2_ranks_loads_on_1(tmp_path):
    """Resharding on load: 2 ranks' shards into one unsharded process (no process group)."""
    from fsdp_targets import _plugin, make_mlp

    folder = str(tmp_path / "ckpt")
    first = on_ranks(train_save_continue, folder, "SHARDED_STATE_DICT")
    accelerator = Accelerator(fsdp_plugin=_plugin())
    model = make_mlp(seed=11)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    from fsdp_checkpoint_targets import Counter

    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.load_state(folder)
    assert_identical(model.state_dict(), first[0]["saved"])
    assert counter.steps == 3 and sched.get_last_lr() == [0.01 * 0.5**3]  # 3 steps on 2 ranks: 6 of StepLR's
    state = opt.optimizer.state[model.inp.weight]
    assert int(state["step"]) == 3 and state["exp_avg"].shape == (8, 4)


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_failed_saves_leave_the_previous_checkpoint(tmp_path, kind):
    folder = tmp_path / "ckpt"
    results = on_ranks(failing_saves, str(folder), kind)
    for result in results:
        hook_error, writer_error, load_hook_error = result["errors"]
        assert load_hook_error.startswith("CheckpointError: load_state's pre-hooks failed")
        assert "rank 1: OSError: injected: rank 1 cannot read" in load_hook_error
        assert (
            "CheckpointError" in hook_error and "rank 1: OSError: injected: rank 1 cannot write" in hook_error
        )
        assert "CheckpointError" in writer_error and "injected failure while writing" in writer_error
        assert "previous checkpoint there is untouched" in writer_error
    assert results[0]["good"] and list(results[0]["loaded"]) == list(results[0]["good"])
    assert_identical(results[0]["loaded"], results[0]["good"])
    assert set(results[0]["listing"]) == (SHARDED_FILES if kind == "SHARDED_STATE_DICT" else FULL_FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging or probe left behind


def test_metadata_is_read_without_running_code(tmp_path, capsys):
    """A .metadata that names anything but torch's checkpoint records is refused before unpickling it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from notebook_accel.utils.dcp_plain import PlainLoadPlanner, PlainReader

    good = tmp_path / "good"
    dcp.save({"w": torch.arange(6.0), "n": 3, "s": "text"}, checkpoint_id=str(good))
    target = {"w": torch.zeros(6), "n": 0, "s": ""}
    dcp.load(target, storage_reader=PlainReader(str(good)), planner=PlainLoadPlanner())
    assert torch.equal(target["w"], torch.arange(6.0)) and target["n"] == 3 and target["s"] == "text"

    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointException) as caught:
        dcp.load(
            {"w": torch.zeros(6)},
            storage_reader=PlainReader(str(tmp_path / "evil")),
            planner=PlainLoadPlanner(),
        )
    # torch wraps each rank's error; ours names what the file asked for, and nothing ran.
    assert "The checkpoint's .metadata names builtins.print" in str(caught.value.failures)
    assert "code ran" not in capsys.readouterr().out


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_a_file_one_rank_cannot_read_fails_the_load_on_every_rank(tmp_path, kind):
    """Rank 1's own RNG file is damaged: both ranks raise, naming it, before rank 0 goes on into the
    load's collectives alone (it would wait there for rank 1 forever, in a session)."""
    from fsdp_checkpoint_targets import load_with_one_rank_file_corrupt

    results = on_ranks(load_with_one_rank_file_corrupt, str(tmp_path / "ckpt"), kind)
    for rank, result in enumerate(results):
        assert result["outcome"].startswith("CheckpointError: reading the checkpoint failed:"), (rank, result)
        assert "rank 1: CheckpointError" in result["outcome"] and "random_states_1.pkl" in result["outcome"]
        assert "rank 0:" not in result["outcome"]
        assert result["after"] == 2.0


@pytest.mark.timeout(TIMEOUT + 30)
def test_a_sharded_checkpoint_needs_one_folder_every_rank_sees(tmp_path):
    from fsdp_checkpoint_targets import unshared_folders

    for different, blind in on_ranks(unshared_folders, str(tmp_path)):
        assert different.startswith("ValueError: An FSDP checkpoint is one folder that every rank writes")
        assert (
            "rank 0: " + str(tmp_path / "rank0") in different
            and "rank 1: " + str(tmp_path / "rank1") in different
        )
        assert blind.startswith(
            "CheckpointError: An FSDP checkpoint needs a folder every rank sees, and rank(s) [1]"
        )
    assert list(tmp_path.iterdir()) == []  # nothing written, no probe left


@pytest.mark.timeout(2 * TIMEOUT + 30)
def test_sharded_checkpoint_from_2_ranks_loads_on_4(tmp_path):
    """Resharding on load: halves saved by 2 ranks become quarters on 4, the same numbers exactly."""
    from fsdp_checkpoint_targets import load_only, save_only

    folder = str(tmp_path / "ckpt")
    saved = on_ranks(save_only, folder)[0]
    loaded = on_ranks(load_only, folder, world=4)
    assert [r["inp_rows"] for r in loaded] == [2, 2, 2, 2] and all(r["counter"] == 3 for r in loaded)
    assert loaded[0]["loaded"] and saved["optim"]["inp.weight"]["exp_avg"].shape == (8, 4)
    assert_identical(loaded[0]["loaded"], saved["saved"])
    assert_identical(loaded[0]["optim"], saved["optim"])
    # accelerate's layout inside the folders: entries under "model" / "optimizer".
    from notebook_accel.utils.dcp_plain import PlainReader

    for name, top in (("pytorch_model_fsdp_0", "model"), ("optimizer_0", "optimizer")):
        keys = PlainReader(str(tmp_path / "ckpt" / name)).read_metadata().state_dict_metadata
        assert keys and all(k.startswith(top + ".") for k in keys), list(keys)
    assert (
        "model.inp.weight"
        in PlainReader(str(tmp_path / "ckpt" / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
    )
    # accelerate's merge_fsdp_weights: the sharded model folder as one full file, in this process.
    from safetensors.torch import load_file

    from notebook_accel.utils import merge_fsdp_weights

    path = merge_fsdp_weights(tmp_path / "ckpt" / "pytorch_model_fsdp_0", str(tmp_path / "merged"))
    assert path == str(tmp_path / "merged" / "model.safetensors")
    assert_identical(dict(sorted(load_file(path).items())), dict(sorted(saved["saved"].items())))
    with pytest.raises(
        ValueError, match=r"no \.metadata\); it holds pytorch_model_fsdp_0, optimizer_0: pass"
    ):
        merge_fsdp_weights(folder, str(tmp_path / "merged"))


@pytest.mark.timeout(TIMEOUT + 30)
def test_automatic_naming_and_rotation_in_an_fsdp_run(tmp_path):
    from fsdp_checkpoint_targets import automatic_naming

    for result in on_ranks(automatic_naming, str(tmp_path)):
        assert result == {"folders": ["checkpoint_1", "checkpoint_2"], "restored": True, "iteration": 3}


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_accelerates_fsdp_save_and_load_helpers(tmp_path, kind):
    from fsdp_checkpoint_targets import fsdp_helpers

    results = on_ranks(fsdp_helpers, str(tmp_path / "out"), kind)
    files = (
        ["optimizer_0", "pytorch_model_fsdp_0"]
        if kind == "SHARDED_STATE_DICT"
        else ["optimizer.bin", "pytorch_model_fsdp.bin"]
    )
    for result in results:
        assert result["files"] == files
        for part in ("params", "optim"):
            assert result["after"][part] and list(result["after"][part]) == list(result["before"][part])
            assert_identical(result["after"][part], result["before"][part])


@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_one_process_fsdp_run_saves_and_loads_the_same_layout(tmp_path, kind):
    """FSDP on one process (nothing sharded) writes the layout its state_dict_type names, and loads it."""
    from fsdp_checkpoint_targets import _setup, _snapshot, _steps

    run = _setup(kind, seed=3)
    _steps(*run, 0, 2)
    run[0].save_state(str(tmp_path / "ckpt"))
    saved = _snapshot(*run)
    model_entry = "pytorch_model_fsdp_0" if kind == "SHARDED_STATE_DICT" else "model.safetensors"
    assert (tmp_path / "ckpt" / model_entry).exists()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    fresh = _setup(kind, seed=11)
    fresh[0].load_state(str(tmp_path / "ckpt"))
    loaded = _snapshot(*fresh)
    for part in ("params", "optim", "lr", "counter"):
        assert_identical(loaded[part], saved[part])


@pytest.mark.timeout(2 * TIMEOUT + 30)
def test_a_ddp_checkpoint_resumes_in_an_fsdp_run(tmp_path):
    """A DDP run's checkpoint (model.safetensors, optimizer.bin with numbered parameters) loads into an
    FSDP run: the weights and AdamW's state are the saved ones, exactly, each rank holding its shard."""
    from fsdp_checkpoint_targets import ddp_train_save, load_only

    folder = str(tmp_path / "ddp")
    ddp = on_ranks(ddp_train_save, folder)[0]
    loaded = on_ranks(load_only, folder)
    assert_identical(loaded[0]["loaded"], ddp["saved"])
    assert set(loaded[0]["optim"]) == set(ddp["optim"]) == set(ddp["saved"])
    for name, state in ddp["optim"].items():
        assert_identical(loaded[0]["optim"][name], state)
    assert [r["inp_rows"] for r in loaded] == [4, 4] and loaded[0]["counter"] == 3
