"""The launch config: accelerate's files read as is, bad files named precisely, and the config as the
default for every launch argument left out (explicit arguments win)."""

from __future__ import annotations

import os

import pytest
import yaml

from notebook_accel import config as cfg
from notebook_accel import notebook_launcher
from notebook_accel.launch import ListSink, make_plan

pytestmark = pytest.mark.timeout(60)

# What `accelerate config` writes for 2 CPU processes, every key as accelerate spells it.
ACCELERATE_FILE = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
ipex_config:
  ipex: false
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: bf16
mpirun_config:
  mpirun_ccl: '1'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    """The default config file, inside tmp_path; written by the test through the returned function."""
    path = tmp_path / "default_config.yaml"
    monkeypatch.setenv(cfg.CONFIG_ENV, str(path))

    def write(text: str):
        path.write_text(text)
        return path

    return write


def test_default_file_honours_the_variable_and_is_none_when_missing(tmp_path, monkeypatch):
    monkeypatch.setenv(cfg.CONFIG_ENV, str(tmp_path / "x.yaml"))
    assert cfg.default_config_file() == str(tmp_path / "x.yaml")
    assert cfg.load_default() is None
    monkeypatch.delenv(cfg.CONFIG_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cfg.default_config_file() == str(tmp_path / ".cache" / "notebook_accel" / "default_config.yaml")


def test_accelerate_file_is_read_as_is(config_file):
    path = config_file(ACCELERATE_FILE)
    config = cfg.load_default()
    assert config.path == str(path)
    assert (config.distributed_type, config.mixed_precision, config.num_processes) == ("MULTI_CPU", "bf16", 2)
    assert config.use_cpu is True and config.cpu and config.processes_per_machine == 2
    assert config.gpu_ids == "all" and config.device_ids is None
    assert config.main_process_ip is None and config.main_process_port is None
    assert config.extra["mpirun_config"] == {"mpirun_ccl": "1"} and config.extra["same_network"] is True
    # Written back, every key accelerate wrote survives with its value.
    out = yaml.safe_load(open(config.save(path.with_name("again.yaml"))))
    assert out == yaml.safe_load(ACCELERATE_FILE)
    assert cfg.load_config(path.with_name("again.yaml")) == config


def test_accelerate_spellings_yaml_turns_into_other_types(config_file):
    config_file("distributed_type: NO\nmixed_precision: no\nnum_processes: -1\ngpu_ids: 0\nfp16: true\n")
    config = cfg.load_default()
    # bare `no` is YAML false, -1 is accelerate's "not set", `gpu_ids: 0` an integer
    assert config.distributed_type == "NO"
    assert config.mixed_precision == "no" and config.num_processes is None and config.gpu_ids == "0"


def test_legacy_fp16_key_means_fp16(config_file):
    config_file("distributed_type: MULTI_GPU\nnum_processes: 2\nfp16: true\n")
    assert cfg.load_default().mixed_precision == "fp16"


@pytest.mark.parametrize(
    "text, key, reason",
    [
        ("num_processes: 2\nnum_procesess: 3\n", "num_procesess", "unknown key"),
        ("num_processes: two\n", "num_processes", "must be an integer, not str 'two'"),
        ("num_processes: true\n", "num_processes", "must be an integer, not bool"),
        ("use_cpu: 'yes please'\n", "use_cpu", "must be true or false"),
        ("main_process_port: 29500.5\n", "main_process_port", "must be an integer, not float"),
        ("fsdp_config: [1, 2]\n", "fsdp_config", "must be a mapping"),
        ("num_machines: 2\nmachine_rank: 3\nmain_process_ip: 10.0.0.1\n", "machine_rank", "must be in 0..1"),
        ("num_machines: 2\nnum_processes: 3\nmain_process_ip: 10.0.0.1\n", "num_processes", "split evenly"),
        ("num_machines: 2\n", "main_process_ip", "needs the address"),
        ("distributed_type: NO\nnum_processes: 2\n", "distributed_type", "single process"),
        ("distributed_type: MULTI_GPU\nuse_cpu: true\n", "use_cpu", "contradicts distributed_type MULTI_GPU"),
        ("distributed_type: DEEPSPEED\n", "distributed_type", "not implemented by notebook_accel; use FSDP"),
        ("distributed_type: FSDP\nfsdp_config:\n  version: 2\n", "fsdp_config", "has keys ['version']"),
        ("distributed_type: MULTI_TPU\n", "distributed_type", "is not one of"),
        ("compute_environment: AMAZON_SAGEMAKER\n", "compute_environment", "not supported"),
        ("mixed_precision: fp32\n", "mixed_precision", "'fp32' is not one of"),
        ("rdzv_backend: zookeeper\n", "rdzv_backend", "'zookeeper' is not one of"),
        ("main_process_port: 70000\n", "main_process_port", "outside 1..65535"),
        ("gpu_ids: '0,x'\n", "gpu_ids", "must be 'all' or device indices"),
        ("gpu_ids: '0'\nnum_processes: 2\n", "gpu_ids", "lists 1 device(s) but each machine runs 2"),
        ("engine: spark\n", "engine", "'spark' is not an engine here: write ray, or leave it out"),
        ("ray_address: auto\n", "ray_address", "only applies with engine: ray"),
        ("placement: spread\n", "placement", "only applies with engine: ray"),
        ("engine: ray\nplacement: diagonal\n", "placement", "'diagonal' is not one of pack, spread"),
        ("engine: ray\nresources_per_rank: 2\n", "resources_per_rank", "must be a mapping"),
        ("engine: ray\nnum_machines: 2\nmain_process_ip: h\n", "num_machines", "engine: ray places the ranks"),
        ("engine: ray\nmax_restarts: 1\n", "max_restarts", "engine: ray places the ranks"),
    ],
)
def test_bad_file_names_file_key_and_reason(config_file, text, key, reason):
    path = config_file(text)
    with pytest.raises(cfg.ConfigError) as info:
        cfg.load_default()
    message = str(info.value)
    assert str(path) in message and repr(key) in message and reason in message, message
    assert info.value.key == key


@pytest.mark.parametrize("text, reason", [("- a\n- b\n", "must be a mapping"), ("a: [\n", "not valid YAML")])
def test_file_that_is_not_a_mapping_names_the_file(config_file, text, reason):
    path = config_file(text)
    with pytest.raises(cfg.ConfigError) as info:
        cfg.load_default()
    assert str(path) in str(info.value) and reason in str(info.value)


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(cfg.ConfigError, match="no such file"):
        cfg.load_config(tmp_path / "nope.yaml")


def test_save_refuses_an_impossible_config_and_writes_nothing(tmp_path):
    bad = cfg.ClusterConfig(num_machines=2, machine_rank=3, main_process_ip="10.0.0.1")
    with pytest.raises(cfg.ConfigError, match="machine_rank"):
        bad.save(tmp_path / "c.yaml")
    assert os.listdir(tmp_path) == []


# -- the config as the default of every launch argument ----------------------------------------


def test_plan_takes_every_left_out_argument_from_the_config(config_file):
    config_file(
        "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 4\nnum_machines: 2\nmachine_rank: 1\n"
        "main_process_ip: 10.1.2.3\nmain_process_port: 29444\nrdzv_backend: c10d\nmixed_precision: bf16\n"
        "debug: true\nmax_restarts: 2\n"
    )
    plan = make_plan()
    assert (plan.num_processes, plan.num_nodes, plan.node_rank) == (2, 2, 1)  # 4 in all = 2 per machine
    assert (plan.master_addr, plan.master_port, plan.rdzv_backend) == ("10.1.2.3", 29444, "c10d")
    assert plan.mixed_precision == "bf16" and plan.max_restarts == 2 and plan.engine == "elastic"
    assert plan.env["ACCELERATE_USE_CPU"] == "1" and plan.env["ACCELERATE_DEBUG_MODE"] == "1"
    assert any("from " in n and "num_processes=2" in n for n in plan.notes)
    # One process: several CPU ranks get ACCELERATE_USE_CPU whatever cpu says (tests/test_real_accelerate.py).
    explicit = make_plan(
        num_processes=1, mixed_precision="no", use_port="auto", master_addr="127.0.0.1", node_rank=0, num_nodes=1,
        rdzv_backend="static", max_restarts=0, cpu=False, debug=False,
    )  # fmt: skip
    assert (explicit.num_processes, explicit.num_nodes, explicit.node_rank, explicit.engine) == (1, 1, 0, "local")
    assert explicit.mixed_precision == "no" and explicit.master_addr == "127.0.0.1"
    assert "ACCELERATE_USE_CPU" not in explicit.env and explicit.env["ACCELERATE_DEBUG_MODE"] == "0"


def test_explicit_value_equal_to_the_documented_default_still_wins(config_file):
    config_file("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\nmixed_precision: bf16\n")
    assert make_plan(use_port="auto").mixed_precision == "bf16"
    assert make_plan(use_port="auto", mixed_precision="no").mixed_precision == "no"


def test_broken_default_config_fails_the_launch_naming_it(config_file):
    path = config_file("num_processes: 2\ncolour: blue\n")
    with pytest.raises(cfg.ConfigError) as info:
        notebook_launcher(print, use_port="auto")
    assert str(path) in str(info.value) and "'colour'" in str(info.value)


def _rank_report():
    from notebook_accel import PartialState

    state = PartialState()
    return (state.process_index, state.num_processes, str(state.distributed_type))


def test_config_makes_notebook_launcher_start_two_cpu_ranks(config_file):
    config_file(ACCELERATE_FILE.replace("mixed_precision: bf16", "mixed_precision: 'no'"))
    results = notebook_launcher(_rank_report, use_port="auto", sinks=[ListSink()])
    assert results == [(0, 2, "MULTI_CPU"), (1, 2, "MULTI_CPU")]
    # An explicit num_processes wins: one process, run here (so no rank's state is asked for).
    assert notebook_launcher(os.getpid, num_processes=1, use_port="auto") == [os.getpid()]


def test_gpu_ids_restrict_the_visible_devices_of_each_family(monkeypatch):
    from notebook_accel.launch import LaunchConfigError
    from notebook_accel.launch.plan import _visible_devices

    for name in ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK"):
        monkeypatch.delenv(name, raising=False)
    assert _visible_devices("cuda", "0,2", 4, False) == ("CUDA_VISIBLE_DEVICES", "0,2")
    assert _visible_devices("xpu", "1", 2, False) == ("ZE_AFFINITY_MASK", "1")
    assert _visible_devices("cuda", "all", 4, False) is None and _visible_devices(None, None, 0, False) is None
    with pytest.raises(LaunchConfigError, match="devices here are 0..1"):
        _visible_devices("cuda", "0,5", 2, False)
    with pytest.raises(LaunchConfigError, match="no accelerator is detected here"):
        _visible_devices(None, "0", 0, False)


def test_default_config_uses_every_gpu_or_one_cpu_process():
    import dataclasses

    from notebook_accel import hardware
    from notebook_accel.commands.config_cmd import default_config
    from notebook_accel.device_probes import AcceleratorDevice

    gpu = AcceleratorDevice(kind="cuda", index=0, name="H100", supports_bf16=True, supports_fp16=True)
    report = hardware.report()
    eight = dataclasses.replace(report, device_family="cuda", accelerators=tuple(
        dataclasses.replace(gpu, index=i) for i in range(8)))  # fmt: skip
    config = default_config(eight)
    assert (config.distributed_type, config.num_processes, config.use_cpu, config.gpu_ids) == ("MULTI_GPU", 8, False, "all")
    one = default_config(dataclasses.replace(eight, accelerators=eight.accelerators[:1]))
    assert (one.distributed_type, one.num_processes) == ("NO", 1)
    cpu = default_config(dataclasses.replace(report, device_family=None, accelerators=()))
    assert (cpu.distributed_type, cpu.num_processes, cpu.use_cpu) == ("NO", 1, True)
