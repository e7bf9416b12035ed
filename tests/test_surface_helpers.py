"""Small helpers that complete accelerate's public surface: versions, environment flags, module and
tensor queries, state odds and ends, tracker registration, hooks, samplers, `launchers`."""

import os
import socket
import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from notebook_accel import AcceleratorState, GradientState, PartialState
from notebook_accel import state as state_module
from notebook_accel.utils import (
    clear_environment,
    compare_versions,
    convert_bytes,
    get_int_from_env,
    get_module_children_bottom_up,
    get_pretty_name,
    id_tensor_storage,
    is_compiled_module,
    is_port_in_use,
    is_torch_version,
    merge_dicts,
    parse_choice_from_env,
    parse_flag_from_env,
    patch_environment,
    recursive_getattr,
    str_to_bool,
    wait_for_everyone,
)

# -- versions -------------------------------------------------------------------------------------


def test_compare_versions_by_distribution_name_or_version():
    assert compare_versions("torch", "==", torch.__version__)
    assert compare_versions("1.10.0", ">", "1.9.1")  # numbers, not strings
    assert not compare_versions("2.0.0rc1", ">=", "2.0.0")
    assert is_torch_version(">=", "2.1") and not is_torch_version("<", "2.1")


@pytest.mark.parametrize("args, fragment", [(("torch", "~=", "2"), "'~='"), (("no-such-dist", ">", "1"), "'no-such-dist'")])
def test_compare_versions_names_bad_input(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        compare_versions(*args)


# -- environment flags ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("YES", 1), ("on", 1), ("1", 1), ("False", 0), ("n", 0), ("off", 0)])
def test_str_to_bool(text, value):
    assert str_to_bool(text) == value
    assert str_to_bool(text, to_bool=True) is bool(value)


def test_str_to_bool_names_a_bad_value():
    with pytest.raises(ValueError, match="'maybe'"):
        str_to_bool("maybe")


def test_flags_choices_and_ints_from_the_environment(monkeypatch):
    monkeypatch.setenv("NA_TEST_FLAG", "true")
    monkeypatch.delenv("NA_TEST_MISSING", raising=False)
    assert parse_flag_from_env("NA_TEST_FLAG") is True
    assert parse_flag_from_env("NA_TEST_MISSING") is False
    assert parse_flag_from_env("NA_TEST_MISSING", default=True) is True
    assert parse_choice_from_env("NA_TEST_FLAG") == "true"
    assert parse_choice_from_env("NA_TEST_MISSING", "fp16") == "fp16"
    monkeypatch.setenv("NA_TEST_A", "-1")
    monkeypatch.setenv("NA_TEST_B", "3")
    assert get_int_from_env(["NA_TEST_MISSING", "NA_TEST_A", "NA_TEST_B"], 7) == 3
    assert get_int_from_env(["NA_TEST_MISSING"], 7) == 7
    monkeypatch.setenv("NA_TEST_A", "x")
    with pytest.raises(ValueError, match="NA_TEST_A='x'"):
        get_int_from_env(["NA_TEST_A"], 0)


def test_patch_environment_sets_and_restores(monkeypatch):
    monkeypatch.setenv("NA_TEST_KEEP", "before")
    monkeypatch.delenv("NA_TEST_NEW", raising=False)
    with patch_environment(na_test_keep="during", NA_TEST_NEW=5):
        assert os.environ["NA_TEST_KEEP"] == "during"
        assert os.environ["NA_TEST_NEW"] == "5"
    assert os.environ["NA_TEST_KEEP"] == "before"
    assert "NA_TEST_NEW" not in os.environ


def test_clear_environment_empties_then_restores(monkeypatch):
    monkeypatch.setenv("NA_TEST_KEEP", "before")
    with clear_environment():
        assert dict(os.environ) == {}
        os.environ["NA_TEST_INSIDE"] = "x"
    assert os.environ["NA_TEST_KEEP"] == "before"
    assert "NA_TEST_INSIDE" not in os.environ


# -- general helpers ------------------------------------------------------------------------------


def test_is_port_in_use_sees_a_listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert is_port_in_use(port) is True
    assert is_port_in_use(port) is False
    with pytest.raises(ValueError, match="port=70000"):
        is_port_in_use(70000)


def test_small_helpers():
    assert get_pretty_name(torch.nn.Linear) == "Linear"
    assert get_pretty_name(torch.nn.Linear(1, 1)) == "Linear"
    assert get_pretty_name(test_small_helpers) == "test_small_helpers"
    target = {"a": {"x": 1}, "b": 2}
    assert merge_dicts({"a": {"y": 3}, "c": 4}, target) is target
    assert target == {"a": {"x": 1, "y": 3}, "b": 2, "c": 4}
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.ReLU()))
    assert recursive_getattr(model, "1.0") is model[1][0]
    assert recursive_getattr(model, "0.weight").shape == (3, 2)
    assert convert_bytes(512) == "512 bytes"
    assert convert_bytes(1536) == "1.5 KB"
    assert convert_bytes(3 * 1024**3) == "3.0 GB"


def test_children_bottom_up():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
    order = get_module_children_bottom_up(model)
    assert order[-1] is model
    assert len(order) == 5
    for parent in (model, model[1]):
        for child in parent.children():
            assert order.index(child) < order.index(parent)
    names = [name for name, _ in get_module_children_bottom_up(model, return_fqns=True)]
    assert names[-1] == "" and set(names) == {"", "0", "1", "1.0", "1.1"}


def test_id_tensor_storage_is_equal_exactly_for_shared_memory():
    base = torch.arange(10.0)
    assert id_tensor_storage(base) == id_tensor_storage(base[2:5])
    assert id_tensor_storage(base) != id_tensor_storage(base.clone())
    linear = torch.nn.Linear(2, 2)
    tied = torch.nn.Linear(2, 2)
    tied.weight = linear.weight
    assert id_tensor_storage(tied.weight) == id_tensor_storage(linear.weight)
    assert id_tensor_storage(tied.bias) != id_tensor_storage(linear.bias)


def test_is_compiled_module():
    model = torch.nn.Linear(2, 2)
    assert is_compiled_module(model) is False
    assert is_compiled_module(torch.compile(model, backend="eager")) is True


def test_wait_for_everyone_alone_returns():
    PartialState()
    assert wait_for_everyone() is None


# -- state ----------------------------------------------------------------------------------------


def test_accelerator_state_lists_the_partial_state_surface_on_its_class():
    for name in ("is_main_process", "wait_for_everyone", "split_between_processes", "print", "fork_launched"):
        assert isinstance(getattr(AcceleratorState, name), property), name
    blank = AcceleratorState.__new__(AcceleratorState)  # never initialised: nothing to forward to
    with pytest.raises(AttributeError, match="create a new Accelerator"):
        blank.is_main_process  # noqa: B018
    assert state_module.is_initialized() is False
    state = AcceleratorState()
    assert state_module.is_initialized() is True
    assert state.is_main_process is True and state.num_processes == 1
    with state.split_between_processes([1, 2, 3]) as share:
        assert share == [1, 2, 3]
    assert state_module.do_nothing(1, key=2) is None


def test_gradient_state_dataloader_attributes_are_shared_properties():
    assert isinstance(GradientState.active_dataloader, property)
    first, second = GradientState(), GradientState()
    loader = object()
    first._add_dataloader(loader)
    assert second.active_dataloader is loader
    assert second.dataloader_references == [None, loader]
    first._remove_dataloader(loader)
    assert second.active_dataloader is None and not second.in_dataloader


# -- trackers -------------------------------------------------------------------------------------


def test_a_registered_tracker_is_usable_by_name(tmp_path):
    from notebook_accel import Accelerator, tracking

    class Recording(tracking.GeneralTracker):
        name = "na_test_recording"
        requires_logging_directory = False
        logged = []

        def __init__(self, run_name, logging_dir=None, **kwargs):
            self.run_name = run_name

        def log(self, values, step=None, **kwargs):
            Recording.logged.append((values, step))

    before = dict(tracking.TRACKERS)
    try:
        assert "na_test_recording" not in tracking.get_available_trackers()
        tracking.register_tracker_class(Recording)
        assert "na_test_recording" in tracking.get_available_trackers()
        accelerator = Accelerator(log_with="na_test_recording")
        accelerator.init_trackers("run")
        accelerator.log({"loss": 1.5}, step=3)
        assert Recording.logged == [({"loss": 1.5}, 3)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tracking.register_tracker_class(Recording)
        assert any("registered already" in str(w.message) for w in caught)
    finally:
        tracking.TRACKERS.clear()
        tracking.TRACKERS.update(before)


def test_register_tracker_class_names_bad_input():
    from notebook_accel import tracking

    with pytest.raises(ValueError, match="GeneralTracker subclass"):
        tracking.register_tracker_class(object)

    class Nameless(tracking.GeneralTracker):
        pass

    with pytest.raises(ValueError, match="'general'"):
        tracking.register_tracker_class(Nameless)


def test_on_main_process_runs_a_method_only_where_asked(monkeypatch):
    from notebook_accel import tracking

    calls = []

    class Thing:
        main_process_only = True

        @tracking.on_main_process
        def act(self):
            calls.append("ran")
            return "done"

    assert Thing().act() == "done"
    monkeypatch.setattr(tracking, "_is_main_process", lambda: False)
    assert Thing().act() is None
    Thing.main_process_only = False
    assert Thing().act() == "done"
    assert calls == ["ran", "ran"]


# -- hooks, samplers, launchers -------------------------------------------------------------------


def test_remove_hook_from_submodules_detaches_every_hook():
    from notebook_accel.hooks import ModelHook, add_hook_to_module, remove_hook_from_submodules

    calls = []

    class Count(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(module)
            return args, kwargs

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    x = torch.ones(1, 2)
    plain = model(x)
    for module in (model, model[0], model[1][0]):
        add_hook_to_module(module, Count())
    assert torch.equal(model(x), plain)
    assert len(calls) == 3
    remove_hook_from_submodules(model)
    assert torch.equal(model(x), plain)
    assert len(calls) == 3
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())


def test_get_sampler_finds_the_sampler_behind_the_batches():
    from notebook_accel.data_loader import get_sampler

    data = list(range(10))
    shuffled = DataLoader(data, batch_size=2, shuffle=True)
    assert isinstance(get_sampler(shuffled), RandomSampler)
    batches = BatchSampler(SequentialSampler(data), batch_size=3, drop_last=False)
    assert get_sampler(DataLoader(data, batch_sampler=batches)) is batches.sampler
    assert get_sampler(DataLoader(data, sampler=batches, batch_size=None)) is batches.sampler
    with pytest.raises(TypeError, match="list"):
        get_sampler(data)


def test_launchers_path_and_test_launch():
    from notebook_accel import launchers
    from notebook_accel.launch import notebook_launcher

    assert launchers.notebook_launcher is notebook_launcher
    state = launchers.test_launch()
    assert isinstance(state, PartialState) and state.num_processes == 1


# -- environment files, purging, CPU ranks --------------------------------------------------------


def test_convert_dict_to_env_variables_keeps_safe_entries_and_names_the_rest(caplog):
    from notebook_accel.utils import convert_dict_to_env_variables

    with caplog.at_level("WARNING", logger="accelerate.utils.environment"):  # accelerate's logger, as it logs
        lines = convert_dict_to_env_variables({"A": "1", "B": "<x", "C": "", "D": "two words", "E": "ok"})
    assert lines == ["A=1\n", "E=ok\n"]
    text = " ".join(r.getMessage() for r in caplog.records if r.name == "accelerate.utils.environment")
    assert "B='<x'" in text and "C=''" in text and "D='two words'" in text


def test_purge_accelerate_environment_restores_accelerate_variables(monkeypatch):
    from notebook_accel.utils import purge_accelerate_environment

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.delenv("ACCELERATE_DEBUG_MODE", raising=False)

    @purge_accelerate_environment
    def sets_some():
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
        os.environ["ACCELERATE_DEBUG_MODE"] = "1"
        os.environ["NA_TEST_OTHER"] = "kept"
        return "result"

    try:
        assert sets_some() == "result"
        assert os.environ["ACCELERATE_MIXED_PRECISION"] == "no"
        assert "ACCELERATE_DEBUG_MODE" not in os.environ
        assert os.environ["NA_TEST_OTHER"] == "kept"  # only ACCELERATE_* is purged
    finally:
        os.environ.pop("NA_TEST_OTHER", None)


def test_purge_accelerate_environment_on_a_class_and_its_subclasses(monkeypatch):
    from notebook_accel.utils import purge_accelerate_environment

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)

    @purge_accelerate_environment
    class Base:
        def test_sets(self):
            os.environ["ACCELERATE_USE_CPU"] = "1"

        def helper(self):
            os.environ["ACCELERATE_USE_CPU"] = "1"

    class Child(Base):
        def test_child_sets(self):
            os.environ["ACCELERATE_USE_CPU"] = "yes"

    Base().test_sets()
    Child().test_child_sets()
    assert "ACCELERATE_USE_CPU" not in os.environ
    Base().helper()  # not a test method: left alone
    assert os.environ.pop("ACCELERATE_USE_CPU") == "1"
    with pytest.raises(TypeError, match="function or class"):
        purge_accelerate_environment(3)


def test_cpu_distributed_information_reads_torchrun_or_mpi_variables(monkeypatch):
    from notebook_accel.utils import get_cpu_distributed_information

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    info = get_cpu_distributed_information()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    monkeypatch.setenv("RANK", "0")  # torchrun's variable comes first
    assert get_cpu_distributed_information().rank == 0


def test_check_os_kernel_warns_only_on_an_old_linux(monkeypatch, caplog):
    import platform

    from notebook_accel.utils import check_os_kernel

    def uname(system, release):
        return platform.uname_result(system, "host", release, "#1", "x86_64")

    for system, release, warns in [("Linux", "4.19.0-generic", True), ("Linux", "6.1.0", False), ("Darwin", "1.0.0", False)]:
        monkeypatch.setattr(platform, "uname", lambda s=system, r=release: uname(s, r))
        caplog.clear()
        with caplog.at_level("WARNING"):  # logged, as accelerate's is
            check_os_kernel()
        assert any("4.19.0" in r.msg and "5.5.0" in r.msg for r in caplog.records) is warns, (system, release)


# -- module queries, sizes ------------------------------------------------------------------------


def test_compiled_regions_and_offloaded_params():
    from notebook_accel.hooks import AlignDevicesHook, add_hook_to_module
    from notebook_accel.utils import has_compiled_regions, has_offloaded_params

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert has_compiled_regions(model) is False
    model[1] = torch.compile(model[1], backend="eager")
    assert has_compiled_regions(model) is True
    layer = torch.nn.Linear(2, 2)
    assert has_offloaded_params(layer) is False
    add_hook_to_module(layer, AlignDevicesHook(execution_device="cpu", offload=False))
    assert has_offloaded_params(layer) is False
    other = torch.nn.Linear(2, 2)
    add_hook_to_module(other, AlignDevicesHook(execution_device="cpu", offload=True))
    assert has_offloaded_params(other) is True


def test_calculate_maximum_sizes_gives_total_and_largest_layer():
    from notebook_accel.utils import calculate_maximum_sizes

    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))
    total, (largest, names) = calculate_maximum_sizes(model)
    assert total == sum(p.numel() * 4 for p in model.parameters())
    assert largest == (10 * 10 + 10) * 4 and names == ["0"]


# -- main-process saving and progress bars --------------------------------------------------------


def test_save_with_safetensors_drops_tied_duplicates(tmp_path, caplog):
    from safetensors.torch import load_file

    from notebook_accel.utils import save

    PartialState()
    shared = torch.arange(6.0).reshape(2, 3)
    state = {"a.weight": shared, "b.weight": shared, "c.bias": torch.ones(3)}
    with caplog.at_level("WARNING"):  # logged, as accelerate does
        save(state, tmp_path / "m.safetensors", safe_serialization=True)
    loaded = load_file(tmp_path / "m.safetensors")
    assert sorted(loaded) == ["a.weight", "c.bias"]
    assert torch.equal(loaded["a.weight"], shared)
    assert [r.getMessage() for r in caplog.records if "b.weight" in r.getMessage()]
    save({"x": [1, 2]}, tmp_path / "plain.pt")
    assert torch.load(tmp_path / "plain.pt") == {"x": [1, 2]}
    with pytest.raises(TypeError, match="dict of tensors"):
        save({"x": [1, 2]}, tmp_path / "bad.safetensors", safe_serialization=True)


def test_save_and_tqdm_do_nothing_off_the_main_process(tmp_path, monkeypatch):
    from notebook_accel import main_process
    from notebook_accel.utils import save, tqdm

    monkeypatch.setattr(main_process, "_ranks", lambda: (False, False))
    save({"x": 1}, tmp_path / "nothing.pt")
    assert not (tmp_path / "nothing.pt").exists()
    assert tqdm(range(3)).disable is True
    assert tqdm(range(3), main_process_only=False).disable is False
    monkeypatch.setattr(main_process, "_ranks", lambda: (False, True))
    save({"x": 1}, tmp_path / "node.pt", save_on_each_node=True)
    assert (tmp_path / "node.pt").exists()
    assert tqdm(range(3)).disable is False
    with pytest.raises(ValueError, match="main_process_only"):
        tqdm(True, range(3))


# -- devices, tied weights, scalers, regional compilation, alignment ------------------------------


@pytest.mark.parametrize(
    "a, b, same",
    [("cpu", "cpu", True), ("cuda", "cuda:0", True), ("cuda:1", "cuda", False), ("cuda:0", "xpu:0", False),
     (torch.device("meta"), "meta", True)],
)
def test_check_device_same(a, b, same):
    from notebook_accel.utils.modeling import check_device_same

    assert check_device_same(a, b) is same


def test_check_tied_parameters_in_config_reads_a_transformers_like_model():
    from types import SimpleNamespace

    from notebook_accel.utils import check_tied_parameters_in_config

    class PreTrainedModel(torch.nn.Module):  # named like transformers' base class, which is what counts
        def __init__(self, **config):
            super().__init__()
            self.config = SimpleNamespace(**config)
            self.head = torch.nn.Linear(2, 2)

        def get_output_embeddings(self):
            return self.head

    assert check_tied_parameters_in_config(PreTrainedModel(tie_word_embeddings=True)) is True
    assert check_tied_parameters_in_config(PreTrainedModel(tie_word_embeddings=False)) is False
    assert check_tied_parameters_in_config(PreTrainedModel(is_encoder_decoder=True, tie_encoder_decoder=True)) is True
    assert check_tied_parameters_in_config(torch.nn.Linear(2, 2)) is False


def test_get_grad_scaler_is_for_this_processs_device():
    from notebook_accel.utils import get_grad_scaler

    PartialState(cpu=True)
    scaler = get_grad_scaler(init_scale=8.0)
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler._device == "cpu" and scaler._init_scale == 8.0
    with pytest.raises(NotImplementedError, match="FSDP"):
        get_grad_scaler("FSDP")


def test_compile_regions_compiles_each_repeated_block_and_keeps_the_original():
    from notebook_accel.utils import compile_regions, has_compiled_regions, is_compiled_module

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x):
            for block in self.blocks:
                x = torch.relu(block(x))
            return self.head(x)

    model = Net()
    x = torch.randn(2, 4)
    expected = model(x)
    compiled = compile_regions(model, backend="eager")
    assert compiled is not model and compiled._orig_mod is model
    assert all(is_compiled_module(b) for b in compiled.blocks)
    assert is_compiled_module(compiled.head)
    assert has_compiled_regions(compiled) and not has_compiled_regions(model)
    assert torch.allclose(compiled(x), expected)
    assert compiled.blocks[0]._orig_mod.weight is model.blocks[0].weight  # parameters are shared
    plain = torch.nn.Linear(2, 2)
    assert is_compiled_module(compile_regions(plain, backend="eager"))


def test_align_module_device_loads_offloaded_weights_for_the_block():
    from notebook_accel.big_modeling import cpu_offload
    from notebook_accel.utils import align_module_device

    layer = torch.nn.Linear(3, 3)
    weight = layer.weight.detach().clone()
    cpu_offload(layer, execution_device="cpu")
    assert layer.weight.device.type == "meta"
    with align_module_device(layer):
        assert layer.weight.device.type == "cpu"
        assert torch.equal(layer.weight, weight)
    assert layer.weight.device.type == "meta"



def test_align_module_device_moves_plain_parameters_there_and_back(monkeypatch):
    from notebook_accel.big_model import align
    from notebook_accel.utils import align_module_device

    moves = []
    monkeypatch.setattr(align, "set_module_tensor_to_device", lambda m, name, device: moves.append((name, str(device))))
    layer = torch.nn.Linear(2, 2)  # one CPU here: the moves are recorded, not made
    with align_module_device(layer, execution_device="cuda:1"):
        assert sorted(moves) == [("bias", "cuda:1"), ("weight", "cuda:1")]
    assert sorted(moves[2:]) == [("bias", "cpu"), ("weight", "cpu")]
    with align_module_device(layer):
        pass
    assert len(moves) == 4  # nothing asked: nothing moves


def test_get_gpu_info_lists_the_cuda_devices(monkeypatch):
    from notebook_accel import hardware
    from notebook_accel.device_probes import AcceleratorDevice
    from notebook_accel.utils import get_gpu_info

    names, count = get_gpu_info()
    assert count == len(names) == sum(d.kind == "cuda" for d in hardware.accelerators())
    fake = [AcceleratorDevice("cuda", 0, "GPU A"), AcceleratorDevice("xpu", 0, "Other"), AcceleratorDevice("cuda", 1, "GPU B")]
    monkeypatch.setattr(hardware, "accelerators", lambda: fake)
    assert get_gpu_info() == (["GPU A", "GPU B"], 2)


def test_load_reads_plain_data_and_numpy_states_and_refuses_objects(tmp_path):
    import pickle

    import numpy as np

    from notebook_accel.utils import load

    saved = {"weights": torch.ones(2), "numpy_rng": np.random.RandomState(0).get_state(), "array": np.arange(3)}
    torch.save(saved, tmp_path / "plain.pt")
    loaded = load(tmp_path / "plain.pt")
    assert torch.equal(loaded["weights"], torch.ones(2))
    assert np.array_equal(loaded["numpy_rng"][1], saved["numpy_rng"][1])
    assert np.array_equal(loaded["array"], np.arange(3))
    torch.save({"object": Unpicklable()}, tmp_path / "object.pt")
    with pytest.raises(pickle.UnpicklingError, match="Unpicklable"):
        load(tmp_path / "object.pt")
    assert isinstance(load(tmp_path / "object.pt", weights_only=False)["object"], Unpicklable)


class Unpicklable:
    """A user class: plain-data loading must refuse to build it."""


# -- Accelerator.autocast with AutocastKwargs -----------------------------------------------------


def test_autocast_kwargs_reach_accelerator_autocast():
    from notebook_accel import Accelerator
    from notebook_accel.utils import AutocastKwargs

    a, b = torch.ones(4, 4), torch.ones(4, 4)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    with accelerator.autocast():
        assert torch.mm(a, b).dtype == torch.bfloat16
    with accelerator.autocast(AutocastKwargs(enabled=False)):
        assert torch.mm(a, b).dtype == torch.float32
    AcceleratorState._reset_state(reset_partial_state=True)
    off = Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[AutocastKwargs(enabled=False)])
    with off.autocast():
        assert torch.mm(a, b).dtype == torch.float32
