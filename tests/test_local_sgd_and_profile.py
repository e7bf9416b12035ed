"""LocalSGD and Accelerator.profile: in one process, and on 2 real gloo ranks through notebook_launcher."""

import json
import os

import pytest
import surface_targets as targets
import torch

from notebook_accel import Accelerator
from notebook_accel.launch import ListSink, notebook_launcher
from notebook_accel.local_sgd import LocalSGD
from notebook_accel.utils import ProfileKwargs


@pytest.fixture(scope="module", autouse=True)
def _stop_the_warm_server_afterwards():
    yield
    from notebook_accel.launch.warm import WarmServer

    WarmServer.shutdown()


def _launch(function, *args):
    return notebook_launcher(function, args, num_processes=2, use_port="auto", sinks=[ListSink()])


# -- LocalSGD -------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_local_sgd_on_two_ranks_agrees_after_each_sync_and_differs_between():
    results = sorted(_launch(targets.local_sgd_run, 3, 7), key=lambda r: r["rank"])
    zero, one = results
    assert zero["enabled"] and one["enabled"] and zero["num_steps"] == 7
    for step in range(7):
        synced = (step + 1) % 3 == 0
        same = torch.allclose(zero["after"][step], one["after"][step])
        assert same is synced, f"step {step + 1}: ranks {'differ' if synced else 'agree'}"
        if synced:  # the average, not either rank's own parameters
            assert torch.allclose(zero["after"][step], zero["mean_before"][step], atol=1e-6)
    # Leaving the block averages once more (step 7 was not a sync step).
    assert torch.allclose(zero["final"], one["final"])
    assert not torch.allclose(zero["final"], zero["after"][6])


def test_local_sgd_in_one_process_does_nothing():
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    with LocalSGD(accelerator, model, local_sgd_steps=1) as local_sgd:
        local_sgd.step()
    assert local_sgd.enabled is False and local_sgd.num_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("steps", [0, -2, 1.5, True, "4"])
def test_local_sgd_names_a_bad_step_count(steps):
    with pytest.raises(ValueError, match=f"local_sgd_steps={steps!r}"):
        LocalSGD(Accelerator(), torch.nn.Linear(2, 1), local_sgd_steps=steps)


# -- profile --------------------------------------------------------------------------------------


def test_profile_writes_a_chrome_trace_and_yields_the_profiler(tmp_path):
    accelerator = Accelerator(kwargs_handlers=[ProfileKwargs(record_shapes=True, output_trace_dir=str(tmp_path / "t"))])
    with accelerator.profile() as prof:
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    assert "aten::mm" in {e.key for e in prof.key_averages()}
    trace = json.loads((tmp_path / "t" / "profile_0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names


def test_profile_without_a_folder_writes_nothing_and_a_handler_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator()
    with accelerator.profile():
        torch.ones(2) + 1
    assert os.listdir(tmp_path) == []
    ready = []
    schedule = {"wait": 0, "warmup": 1, "active": 1, "repeat": 1}
    handler = ProfileKwargs(schedule_option=schedule, on_trace_ready=ready.append)
    with accelerator.profile(handler) as prof:
        for _ in range(4):
            torch.ones(2) * 2
            prof.step()
    assert ready == [prof]  # the schedule's one cycle ended in one trace


@pytest.mark.parametrize(
    "handler, error",
    [
        (ProfileKwargs(activities=["gpu"]), "'gpu'"),
        (ProfileKwargs(schedule_option={"active": 1, "often": 2}), "schedule_option"),
    ],
)
def test_profile_names_bad_settings(handler, error):
    with pytest.raises(ValueError, match=error):
        with Accelerator().profile(handler):
            pass


def test_profile_refuses_another_kind_of_handler():
    with pytest.raises(TypeError, match="ProfileKwargs"):
        with Accelerator().profile(object()):
            pass


@pytest.mark.timeout(180)
def test_profile_on_two_ranks_writes_one_trace_per_process(tmp_path):
    trace_dir = str(tmp_path / "traces")
    results = sorted(_launch(targets.profile_run, trace_dir), key=lambda r: r["rank"])
    assert [r["saw_mm"] for r in results] == [True, True]
    assert sorted(os.listdir(trace_dir)) == ["profile_0.json", "profile_1.json"]
    for name in ("profile_0.json", "profile_1.json"):
        json.loads((tmp_path / "traces" / name).read_text())


# -- InitProcessGroupKwargs -----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_init_process_group_kwargs_choose_backend_rendezvous_and_timeout(tmp_path):
    from datetime import timedelta

    from mp import run_ranks  # ranks with no process group yet: the Accelerator creates it

    results = run_ranks(targets.init_kwargs_run, 2, str(tmp_path / "rendezvous"), timeout=90)
    for out in results:
        assert out["backend"] == "gloo"
        assert out["file_used"] is True  # the file:// rendezvous, not MASTER_ADDR/PORT
        if out["timeout"] is not None:
            assert out["timeout"] == timedelta(seconds=55)


# -- multi_device, verify_device_map --------------------------------------------------------------


def test_multi_device_means_several_processes_on_accelerator_devices():
    from types import SimpleNamespace

    from notebook_accel.utils import DistributedType

    assert Accelerator(cpu=True).multi_device is False
    ask = Accelerator.multi_device.fget
    assert ask(SimpleNamespace(use_distributed=True, distributed_type=DistributedType.MULTI_GPU)) is True
    assert ask(SimpleNamespace(use_distributed=True, distributed_type=DistributedType.MULTI_NPU)) is True
    assert ask(SimpleNamespace(use_distributed=True, distributed_type=DistributedType.MULTI_CPU)) is False
    assert ask(SimpleNamespace(use_distributed=True, distributed_type=DistributedType.XLA)) is False
    assert ask(SimpleNamespace(use_distributed=False, distributed_type=DistributedType.MULTI_GPU)) is False


def test_verify_device_map_sees_a_model_dispatched_over_several_devices(tmp_path):
    from notebook_accel.big_modeling import dispatch_model

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert accelerator.verify_device_map(model) is False
    dispatch_model(model, device_map={"0": "cpu", "1": "disk"}, offload_dir=str(tmp_path))
    assert accelerator.verify_device_map(model) is True
    one_device = torch.nn.Sequential(torch.nn.Linear(2, 2))
    dispatch_model(one_device, device_map={"": "cpu"})
    assert accelerator.verify_device_map(torch.nn.Sequential(one_device)) is False
