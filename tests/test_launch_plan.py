"""The plan layer: arguments -> a frozen LaunchPlan, every bad input rejected before a process starts."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
import torch

from notebook_accel import hardware
from notebook_accel.launch import LaunchConfigError, LaunchPlan, make_plan
from notebook_accel.launch import plan as plan_module

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def torch_threads():
    """Set torch's intra-op thread count for one test, and put it back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def plan(**kwargs) -> LaunchPlan:
    kwargs.setdefault("use_port", "auto")
    kwargs.setdefault("num_processes", 2)
    return make_plan(**kwargs)


# -- bad input names the value ---------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"start_method": "threads"}, "'threads'"),
        ({"start_method": "Fork"}, "'Fork'"),
        ({"num_processes": 0}, "num_processes=0"),
        ({"num_processes": -1}, "num_processes=-1"),
        ({"num_processes": "x"}, "num_processes='x'"),
        ({"num_processes": 2.5}, "num_processes=2.5"),
        ({"num_processes": True}, "num_processes=True"),
        ({"num_nodes": 0}, "num_nodes=0"),
        ({"node_rank": 2, "num_nodes": 2}, "node_rank=2"),
        ({"node_rank": -1}, "node_rank=-1"),
        ({"node_rank": 1}, "node_rank=1"),
        ({"max_restarts": -1}, "max_restarts=-1"),
        ({"max_restarts": "many"}, "max_restarts='many'"),
        ({"rdzv_backend": "zookeeper"}, "'zookeeper'"),
        ({"use_port": "http"}, "use_port='http'"),
        ({"use_port": "70000"}, "use_port=70000"),
        ({"use_port": -5}, "use_port=-5"),
    ],
)
def test_bad_arguments_fail_naming_the_value(kwargs, named):
    with pytest.raises(LaunchConfigError) as info:
        plan(**kwargs)
    assert named in str(info.value)


def test_unknown_mixed_precision_names_the_value():
    with pytest.raises(ValueError, match="fp12"):
        plan(mixed_precision="fp12")


def test_busy_explicit_port_is_named_and_auto_is_free():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchConfigError, match=f"Port {port} "):
            plan(use_port=str(port))
        with pytest.raises(LaunchConfigError, match=f"Port {port} "):
            plan(use_port=port)
        for auto in ("auto", "AUTO", "0", 0):
            chosen = plan(use_port=auto).master_port
            assert 1 <= chosen <= 65535 and chosen != port
            with socket.socket() as probe:  # free for a rank's store, which binds as this does
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(("127.0.0.1", chosen))
                probe.listen()


def test_explicit_free_port_is_kept():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert plan(use_port=str(port)).master_port == port
    assert plan(use_port=port).master_port == port


def test_without_a_port_one_machine_picks_a_free_one_and_holds_it_until_dropped(no_config):
    import gc

    p = make_plan(num_processes=2, cpu=True)
    port = p.master_port
    assert p.port_held and port != 29500
    with socket.socket() as other:  # another program binding that port, in the moment before rank 0 does
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    del p
    gc.collect()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))  # a plan dropped unlaunched lets go of its port


def test_an_explicit_port_and_a_multi_node_endpoint_are_kept_as_given(no_config):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    explicit = make_plan(num_processes=2, use_port=port)
    assert (explicit.master_port, explicit.port_held) == (port, False)
    nodes = make_plan(num_processes=1, num_nodes=2, master_addr="10.0.0.7")  # every node must agree
    assert (nodes.master_port, nodes.port_held) == (29500, False)


# -- what a good plan holds ----------------------------------------------------------------
def test_single_node_plan_and_rank_env():
    p = plan(num_processes=4, mixed_precision="BF16", start_method="spawn")
    assert (p.num_processes, p.world_size, p.engine, p.start_method) == (4, 4, "local", "spawn")
    assert p.mixed_precision == "bf16"
    env = p.rank_env(3)
    expected = {
        "RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(p.master_port),
        "ACCELERATE_MIXED_PRECISION": "bf16", "NOTEBOOK_ACCEL_LAUNCHER": "1",
        "OMP_NUM_THREADS": str(p.threads_per_process),
    }  # fmt: skip
    assert {k: env[k] for k in expected} == expected
    assert "FORK_LAUNCHED" not in env  # only forked children are told they were forked
    # Set for several CPU ranks, so Hugging Face's accelerate in them agrees (tests/test_real_accelerate.py).
    assert env.get("ACCELERATE_USE_CPU") == ("1" if hardware.detect_device_family() is None else None)
    assert p.rank_env(0)["RANK"] == "0" and p.rank_env(0)["LOCAL_RANK"] == "0"
    # The plan's own env is not modified by asking for a rank's env.
    assert "RANK" not in p.env


def test_rank_env_on_a_second_node():
    p = plan(num_processes=4, num_nodes=2, node_rank=1, master_addr="10.0.0.7", use_port="29400")
    assert p.engine == "elastic" and p.world_size == 8
    env = p.rank_env(2)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "6",
        "2",
        "8",
        "4",
    )
    assert (env["GROUP_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("1", "10.0.0.7", "29400")


def test_fork_and_cpu_flags_reach_the_env():
    p = plan(start_method="fork", cpu=True)
    assert p.env["FORK_LAUNCHED"] == "1"
    assert p.env["ACCELERATE_USE_CPU"] == "1"


@pytest.mark.parametrize(
    "kwargs, engine",
    [
        ({}, "local"),
        ({"max_restarts": 1}, "elastic"),
        ({"rdzv_backend": "c10d"}, "elastic"),
        ({"num_nodes": 2}, "elastic"),
    ],
)
def test_engine_choice(kwargs, engine):
    assert plan(**kwargs).engine == engine


def test_plan_is_frozen():
    p = plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.num_processes = 3


def test_no_num_processes_without_config_or_devices_means_one_with_a_note(monkeypatch, tmp_path):
    monkeypatch.setenv("NOTEBOOK_ACCEL_CONFIG_FILE", str(tmp_path / "none.yaml"))
    p = make_plan(num_processes=None, use_port="auto", cpu=True)
    assert p.num_processes == 1
    assert any("num_processes=1" in note and "num_processes=N" in note for note in p.notes)


# -- threads per process -------------------------------------------------------------------
def test_threads_per_process_divides_physical_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(plan_module, "_physical_cores", lambda: 8)
    for method in ("spawn", "forkserver"):
        assert plan(num_processes=2, start_method=method).threads_per_process == 4
        assert plan(num_processes=4, start_method=method).threads_per_process == 2
        assert plan(num_processes=16, start_method=method).threads_per_process == 1
    p = plan(num_processes=2, start_method="spawn")
    assert p.env["OMP_NUM_THREADS"] == "4" and p.notes == ()


def test_threads_per_process_respects_omp_num_threads(monkeypatch):
    monkeypatch.setattr(plan_module, "_physical_cores", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    p = plan(num_processes=2, start_method="spawn")
    assert p.threads_per_process == 3 and p.env["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")  # ignored, not a crash
    assert plan(num_processes=2, start_method="spawn").threads_per_process == 4


def test_fork_after_parallel_torch_gives_one_thread_and_says_why(monkeypatch, torch_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(plan_module, "_physical_cores", lambda: 8)
    torch_threads(4)
    p = plan(num_processes=2, start_method="fork")
    assert p.threads_per_process == 1 and p.env["OMP_NUM_THREADS"] == "1"
    assert len(p.notes) == 1
    note = p.notes[0]
    assert "not 4" in note and "start_method='forkserver'" in note
    # The same launch on a spawn-safe start method keeps the threads and says nothing.
    p = plan(num_processes=2, start_method="forkserver")
    assert p.threads_per_process == 4 and p.notes == ()


def test_one_rank_runs_here_so_no_fork_note(monkeypatch, torch_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(plan_module, "_physical_cores", lambda: 8)
    torch_threads(4)
    p = plan(num_processes=1, start_method="fork")  # runs in the caller (starters/here.py): nothing forks
    assert p.notes == () and p.threads_per_process == 8, p.notes


def test_fork_with_a_single_threaded_parent_keeps_the_threads(monkeypatch, torch_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(plan_module, "_physical_cores", lambda: 8)
    torch_threads(1)
    p = plan(num_processes=2, start_method="fork")
    assert p.threads_per_process == 4 and p.notes == ()


def test_fork_with_one_wanted_thread_has_no_note(monkeypatch, torch_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(plan_module, "_physical_cores", lambda: 2)
    torch_threads(2)
    p = plan(num_processes=2, start_method="fork")
    assert p.threads_per_process == 1 and p.notes == ()


@pytest.mark.parametrize(
    "family, nodes, restarts, rdzv, engine",
    [
        ("xla", 1, 0, "static", "xla"),  # a TPU host launches through xmp.spawn, whatever else is asked
        ("xla", 2, 3, "c10d", "xla"),
        (None, 1, 0, "static", "local"),
        ("cuda", 1, 0, "static", "local"),
        ("cuda", 2, 0, "static", "elastic"),
        (None, 1, 1, "static", "elastic"),
        (None, 1, 0, "c10d", "elastic"),
    ],
)
def test_engine_choice_by_family(family, nodes, restarts, rdzv, engine):
    from notebook_accel.launch.plan import choose_engine

    assert choose_engine(family, nodes, restarts, rdzv) == engine


def test_fork_after_cuda_initialisation_is_refused_before_any_process_starts(monkeypatch):
    # CUDA cannot initialise on this machine; the value torch would report after it did is given
    # directly, so the launcher's own decision is what is tested (the device check covers the rest).
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchConfigError, match=r"start_method='spawn'"):
        make_plan(num_processes=2, use_port="auto", start_method="fork")
    assert make_plan(num_processes=2, use_port="auto", start_method="spawn").start_method == "spawn"


def test_after_cuda_initialisation_one_process_still_runs_here(monkeypatch):
    """A single-GPU notebook that already used CUDA: notebook_launcher(fn) runs fn in this process
    (nothing forks), as accelerate does; an elastic launch still runs, its ranks from a fresh forkserver."""
    from notebook_accel import notebook_launcher

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert make_plan(num_processes=1, use_port="auto", start_method="fork").num_processes == 1
    elastic = make_plan(num_processes=2, use_port="auto", max_restarts=1)
    assert (elastic.engine, elastic.start_method) == ("elastic", "forkserver")
    assert any("fresh forkserver" in note for note in elastic.notes)
    assert make_plan(num_processes=2, use_port="auto", max_restarts=1, start_method="spawn").start_method == "spawn"
    with pytest.raises(LaunchConfigError, match="CUDA is already initialised"):
        make_plan(num_processes=2, use_port="auto", start_method="fork")
    assert notebook_launcher(os.getpid, num_processes=1) == [os.getpid()]


@pytest.mark.parametrize("endpoint", ["10.0.0.1:port", ":29400", "node0:70000", "node 0:29400", "node0:"])
def test_a_malformed_rendezvous_endpoint_is_named_before_anything_starts(endpoint):
    with pytest.raises(LaunchConfigError, match=rf"rdzv_endpoint={endpoint!r} is not 'host:port'"):
        make_plan(num_processes=1, num_nodes=2, rdzv_backend="c10d", rdzv_endpoint=endpoint, use_port="auto")


@pytest.mark.parametrize("endpoint", ["10.0.0.1:29400", "node0", "[::1]:29400"])
def test_a_rendezvous_endpoint_is_host_and_optional_port(endpoint):
    plan = make_plan(num_processes=1, num_nodes=2, rdzv_backend="c10d", rdzv_endpoint=endpoint, use_port="auto")
    assert plan.rdzv_endpoint == endpoint


# -- FSDP --------------------------------------------------------------------------------------
FSDP_CONFIG = (
    "distributed_type: FSDP\nuse_cpu: true\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
    "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: [Block, Head]\n"
)


@pytest.fixture
def no_config(monkeypatch, tmp_path):
    monkeypatch.setenv("NOTEBOOK_ACCEL_CONFIG_FILE", str(tmp_path / "none.yaml"))
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)


@pytest.fixture
def fsdp_config(monkeypatch, tmp_path):
    path = tmp_path / "fsdp.yaml"
    path.write_text(FSDP_CONFIG)
    monkeypatch.setenv("NOTEBOOK_ACCEL_CONFIG_FILE", str(path))
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    return path


def test_fsdp_is_off_unless_asked(no_config):
    p = plan()
    assert p.fsdp is False and p.fsdp_settings == {}
    assert "ACCELERATE_USE_FSDP" not in p.env


def test_fsdp_true_turns_it_on_in_every_rank(no_config):
    p = plan(fsdp=True)
    assert p.fsdp is True
    assert p.rank_env(0)["ACCELERATE_USE_FSDP"] == p.rank_env(1)["ACCELERATE_USE_FSDP"] == "true"
    assert p.fsdp_settings == {}  # the plugin's defaults


def test_fsdp_none_follows_the_config_and_true_keeps_its_settings(fsdp_config):
    for p in (plan(), plan(fsdp=True)):
        assert p.fsdp is True
        assert p.fsdp_settings == {
            "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "transformer_based_wrap",
            "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block,Head",
        }  # fmt: skip


def test_fsdp_false_turns_off_what_the_config_says(fsdp_config, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # inherited by the ranks unless the plan says false
    p = plan(fsdp=False)
    assert p.fsdp is False
    assert p.env["ACCELERATE_USE_FSDP"] == "false"
    assert not [k for k in p.env if k.startswith("FSDP_")]


def test_fsdp_settings_dict_overrides_the_config(fsdp_config):
    p = plan(fsdp={"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 100,
                   "fsdp_reshard_after_forward": False, "fsdp_state_dict_type": "full_state_dict"})  # fmt: skip
    assert p.fsdp is True
    assert p.env["FSDP_AUTO_WRAP_POLICY"] == "size_based_wrap"
    assert p.env["FSDP_MIN_NUM_PARAMS"] == "100"
    assert p.env["FSDP_RESHARD_AFTER_FORWARD"] == "false"
    assert p.env["FSDP_STATE_DICT_TYPE"] == "FULL_STATE_DICT"
    assert p.env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "Block,Head"  # from the config, not overridden


@pytest.mark.parametrize(
    "fsdp, named",
    [
        ({"fsdp_wrap_policy": "no_wrap"}, "['fsdp_wrap_policy']"),
        ({"auto_wrap_policy": "no_wrap"}, "['auto_wrap_policy']"),
        ({"fsdp_version": 1}, "fsdp_version=1"),
        ({"fsdp_auto_wrap_policy": "every_layer"}, "fsdp_auto_wrap_policy='every_layer'"),
        ({"fsdp_min_num_params": -3}, "fsdp_min_num_params=-3"),
        ({"fsdp_state_dict_type": "LOCAL_STATE_DICT"}, "fsdp_state_dict_type='LOCAL_STATE_DICT'"),
        ({"fsdp_activation_checkpointing": "sometimes"}, "fsdp_activation_checkpointing='sometimes'"),
        ({"fsdp_transformer_layer_cls_to_wrap": "my block"}, "fsdp_transformer_layer_cls_to_wrap='my block'"),
        ("yes", "fsdp='yes'"),
        (1, "fsdp=1"),
    ],
)
def test_bad_fsdp_settings_fail_naming_them(no_config, fsdp, named):
    with pytest.raises(LaunchConfigError) as info:
        plan(fsdp=fsdp)
    assert named in str(info.value)


def test_config_nulls_and_no_layer_classes_leave_the_plugins_defaults(tmp_path):
    from notebook_accel import config

    path = tmp_path / "fsdp.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_min_num_params: null\n"
                    "  fsdp_transformer_layer_cls_to_wrap: ''\n  fsdp_sync_module_states: true\n")  # fmt: skip
    assert config.load_config(path).launch_env() == {
        "ACCELERATE_USE_FSDP": "true", "FSDP_TRANSFORMER_CLS_TO_WRAP": "", "FSDP_SYNC_MODULE_STATES": "true",
    }  # fmt: skip


def test_a_config_with_a_bad_fsdp_value_is_refused_when_read(tmp_path):
    from notebook_accel import config

    path = tmp_path / "bad.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_state_dict_type: LOCAL\n")
    with pytest.raises(config.ConfigError) as info:
        config.load_config(path)
    assert "fsdp_state_dict_type='LOCAL'" in str(info.value) and str(path) in str(info.value)


def test_notes_reach_the_sink_as_events_and_a_once_per_process_note_comes_once(monkeypatch):
    from notebook_accel.launch import launcher
    from notebook_accel.launch.events import LaunchNotice
    from notebook_accel.launch.plan import ONCE_PER_PROCESS
    from notebook_accel.launch.sinks import ListSink

    monkeypatch.setattr(launcher, "_noted", set())
    once = ONCE_PER_PROCESS[0] + "for this one 2-process job"
    plan = type("Plan", (), {"notes": ("a note for every launch", once)})()
    first, second = ListSink(), ListSink()
    launcher.send_notes(plan, first)
    launcher.send_notes(plan, second)
    assert [e.text for e in first.events if isinstance(e, LaunchNotice)] == ["a note for every launch", once]
    assert [e.text for e in second.events if isinstance(e, LaunchNotice)] == ["a note for every launch"]
