"""gpu_ids: the devices a launch's ranks see, from notebook_launcher, %%accelerate, %accelerate start,
Session and the CLI, checked against the devices here before anything starts.

There is no GPU here. Where a test needs devices, the machine is described to the probes
(`hardware.detect_device_family` / `device_count`, the seam tests/test_notebook_platforms.py uses);
the plan, the starters and the ranks are the real code, and the ranks only read their environment.
"""

from __future__ import annotations

import os

import pytest
from kernels import kernel, run  # noqa: F401  (kernel is a fixture)

from notebook_accel import hardware, notebook_launcher
from notebook_accel.launch import LaunchConfigError, ListSink, make_plan
from notebook_accel.session import Session

# In the kernel: four GPUs as the launch plan sees them; the ranks (other pids) see none, so they
# meet on gloo as CPU ranks and show what they were given.
FOUR_GPUS = (
    "import os\nfrom notebook_accel import hardware\nkernel_pid = os.getpid()\n"
    "hardware.detect_device_family = lambda: 'cuda' if os.getpid() == kernel_pid else None\n"
    "hardware.device_count = lambda family: 4 if family == 'cuda' and os.getpid() == kernel_pid else 0\n"
)


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(hardware, "detect_device_family", lambda: "cuda")
    monkeypatch.setattr(hardware, "device_count", lambda family: 4 if family == "cuda" else 0)


def visible(tag=None):
    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid()


# -- the plan ----------------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("gpu_ids", ["1,3", "1, 3", [1, 3], (1, 3)])
def test_gpu_ids_set_the_visible_devices_and_the_default_rank_count(four_gpus, gpu_ids):
    plan = make_plan(gpu_ids=gpu_ids)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "1,3" and plan.num_processes == 2 and plan.chooses_devices
    assert plan.rank_env(1)["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert not make_plan().chooses_devices and "CUDA_VISIBLE_DEVICES" not in make_plan(gpu_ids="all").env


@pytest.mark.timeout(30)
def test_indices_count_the_devices_this_process_already_sees(four_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the kernel itself was limited to four
    assert make_plan(gpu_ids="0,3").env["CUDA_VISIBLE_DEVICES"] == "4,7"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"gpu_ids": "0,4"}, "gpu_ids='0,4': cuda devices here are 0..3"),
        ({"gpu_ids": "0,x"}, "gpu_ids='0,x' must be 'all' or device indices"),
        ({"gpu_ids": "1,1"}, "gpu_ids='1,1' must name distinct device indices"),
        ({"gpu_ids": "-1"}, "gpu_ids='-1' must name distinct device indices >= 0"),
        ({"gpu_ids": ","}, "gpu_ids=',' must name distinct device indices"),
        ({"gpu_ids": True}, "gpu_ids=True must be 'all' or device indices"),
        ({"gpu_ids": [0, "a"]}, "gpu_ids=[0, 'a'] must be 'all' or device indices"),
        ({"gpu_ids": "0,1", "num_processes": 3}, "num_processes=3 but only 2 cuda device(s) are visible"),
        ({"gpu_ids": "0", "cpu": True}, "gpu_ids='0' chooses accelerator devices, but cpu=True"),
    ],
)
def test_bad_gpu_ids_are_named_before_anything_starts(four_gpus, kwargs, named):
    sink = ListSink()
    with pytest.raises(LaunchConfigError) as info:
        notebook_launcher(visible, sinks=[sink], **kwargs)
    assert named in str(info.value), str(info.value)
    assert sink.events == []


@pytest.mark.timeout(30)
def test_the_configs_gpu_ids_apply_unless_the_launch_runs_on_the_cpu(four_gpus, monkeypatch, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("distributed_type: MULTI_GPU\nnum_processes: 1\ngpu_ids: '2'\n")
    monkeypatch.setenv("NOTEBOOK_ACCEL_CONFIG_FILE", str(path))
    assert make_plan(use_port="auto").env["CUDA_VISIBLE_DEVICES"] == "2"
    on_cpu = make_plan(num_processes=2, cpu=True)  # an explicit cpu=True wins over the file's devices
    assert "CUDA_VISIBLE_DEVICES" not in on_cpu.env and on_cpu.num_processes == 2
    with pytest.raises(LaunchConfigError, match="gpu_ids='3' chooses accelerator devices, but cpu=True"):
        make_plan(num_processes=2, cpu=True, gpu_ids="3")  # both given here: a contradiction


@pytest.mark.timeout(30)
def test_gpu_ids_without_an_accelerator_say_so():
    with pytest.raises(LaunchConfigError, match=r"gpu_ids='0' but no accelerator is detected here \(CPU only\)"):
        make_plan(num_processes=2, gpu_ids="0")
    assert make_plan(num_processes=2, gpu_ids="all", cpu=True).num_processes == 2  # 'all' chooses nothing


# -- real launches -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_the_ranks_see_only_the_chosen_devices(four_gpus):
    results = notebook_launcher(visible, num_processes=2, gpu_ids="1,3", sinks=[ListSink()])
    assert [r[0] for r in results] == ["1,3", "1,3"]
    assert os.environ.get("CUDA_VISIBLE_DEVICES") is None  # the caller's own environment is untouched


@pytest.mark.timeout(60)
def test_one_rank_with_gpu_ids_runs_in_a_child_so_the_variable_applies(four_gpus):
    assert notebook_launcher(visible, num_processes=1, sinks=[ListSink()]) == [(None, os.getpid())]  # here
    [(seen, pid)] = notebook_launcher(visible, gpu_ids="2", sinks=[ListSink()])
    assert seen == "2" and pid != os.getpid()


@pytest.mark.timeout(60)
def test_a_session_takes_gpu_ids_to_its_plan():
    with pytest.raises(LaunchConfigError, match="gpu_ids='1' but no accelerator is detected"):
        Session(2, gpu_ids="1").start()
    with pytest.raises(LaunchConfigError, match="gpu_ids='0' chooses accelerator devices, but cpu=True"):
        Session(2, cpu=True, gpu_ids="0").start()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spelling", ["--gpu-ids", "--gpu_ids"])
def test_the_cli_takes_both_spellings(tmp_path, spelling):
    import subprocess
    import sys

    (tmp_path / "noop.py").write_text("print('RAN')\n")
    script = os.path.join(os.path.dirname(sys.executable), "notebook-accel")
    done = subprocess.run([script, "launch", "--num_processes", "2", spelling, "0", "noop.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode != 0 and "RAN" not in done.stdout
    assert "gpu_ids='0' but no accelerator is detected here" in done.stderr, done.stderr


# -- the magics, in a real kernel ----------------------------------------------------------------
@pytest.mark.timeout(180)
def test_the_magics_take_gpu_ids(kernel):  # noqa: F811
    _, kc = kernel
    setup = run(kc, "%load_ext notebook_accel\n" + FOUR_GPUS)
    assert not setup["errors"], setup
    cell = run(kc, "%%accelerate -n 2 --gpu-ids 0,2\nimport os\nprint('SEEN', os.environ['CUDA_VISIBLE_DEVICES'])")
    assert not cell["errors"], cell
    assert "[rank 0] SEEN 0,2" in cell["text"] and "[rank 1] SEEN 0,2" in cell["text"], cell["text"]
    bad = run(kc, "%%accelerate -n 2 --gpu-ids 0,9\nprint('RAN')")
    assert "gpu_ids='0,9': cuda devices here are 0..3" in bad["text"] and "RAN" not in bad["text"], bad
    start = run(kc, "%accelerate start -n 2 --cpu --gpu-ids 1")
    assert "%accelerate start: gpu_ids='1' chooses accelerator devices, but cpu=True" in start["text"], start
    status = run(kc, "%accelerate status")
    assert "no session" in status["text"].lower(), status
