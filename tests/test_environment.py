"""Reading launch variables, and mapping (launch env, device family) to a placement. Pure: no probing."""

from __future__ import annotations

import pytest

from notebook_accel import placement
from notebook_accel.placement import Placement, resolve_placement
from notebook_accel.utils.dataclasses import DistributedType, PrecisionType, parse_mixed_precision
from notebook_accel.utils.environment import LAUNCHER_ENV, LaunchEnv, read_launch_env

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}

# (rank, size, local rank, local size) as each MPI implementation names them.
MPI_SCHEMES = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "intel-mpi/mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "pmix": ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    "mvapich2": ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
}  # fmt: skip


# -- read_launch_env --------------------------------------------------------------------------


def test_torchrun_variables():
    env = read_launch_env(TORCHRUN)
    assert env == LaunchEnv(3, 8, 1, 2, "10.0.0.1", 29500, "torchrun")
    assert env.distributed


def test_our_launcher_marks_its_source():
    assert read_launch_env({**TORCHRUN, LAUNCHER_ENV: "1"}).source == "notebook_accel"


def test_torchrun_without_local_variables_means_one_node():
    env = read_launch_env({"RANK": "2", "WORLD_SIZE": "4"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (2, 4, 2, 4)
    assert (env.master_addr, env.master_port) == (None, None)


def test_local_rank_follows_from_local_world_size():
    env = read_launch_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (env.local_rank, env.local_world_size) == (1, 4)


def test_world_of_one_is_not_distributed():
    env = read_launch_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert env == LaunchEnv(source="torchrun") and not env.distributed


@pytest.mark.parametrize("scheme", sorted(MPI_SCHEMES))
def test_mpi_schemes(scheme):
    rank, size, local_rank, local_size = MPI_SCHEMES[scheme]
    values = {
        rank: "5",
        size: "8",
        local_rank: "1",
        local_size: "4",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "1234",
    }
    assert read_launch_env(values) == LaunchEnv(5, 8, 1, 4, "node0", 1234, "mpi")
    # Without the local pair: one node holding every rank.
    assert read_launch_env({rank: "5", size: "8"}) == LaunchEnv(5, 8, 5, 8, None, None, "mpi")
    # A rank alone (no size) is not a launch.
    assert read_launch_env({rank: "5"}) == LaunchEnv()


def test_torchrun_variables_win_over_mpi():
    env = read_launch_env({**TORCHRUN, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert (env.rank, env.world_size, env.source) == (3, 8, "torchrun")


def test_plain_single_process():
    assert read_launch_env({}) == LaunchEnv(0, 1, 0, 1, None, None, "single")
    assert not read_launch_env({}).distributed
    assert read_launch_env({"RANK": "", "WORLD_SIZE": ""}) == LaunchEnv()  # empty means unset
    env = read_launch_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29501"})
    assert (env.world_size, env.master_addr, env.master_port, env.source) == (1, "127.0.0.1", 29501, "single")


def test_reads_os_environ_by_default(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", LAUNCHER_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert (read_launch_env().rank, read_launch_env().world_size) == (1, 3)


def test_world_size_without_rank():
    with pytest.raises(ValueError, match="WORLD_SIZE=4 is set but RANK is not") as info:
        read_launch_env({"WORLD_SIZE": "4"})
    assert "set RANK" in str(info.value)


def test_rank_without_world_size():
    with pytest.raises(ValueError, match="RANK=1 is set but WORLD_SIZE is not"):
        read_launch_env({"RANK": "1"})


@pytest.mark.parametrize(
    "values, message",
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"RANK=4 is outside 0\.\.3 for WORLD_SIZE=4"),
        ({"RANK": "-1", "WORLD_SIZE": "4"}, r"RANK=-1 is outside 0\.\.3"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
        (
            {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            r"LOCAL_RANK=2 is outside 0\.\.1",
        ),
        ({"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "8"}, r"RANK=9 is outside 0\.\.7"),
    ],
)
def test_rank_out_of_range(values, message):
    with pytest.raises(ValueError, match=message):
        read_launch_env(values)


@pytest.mark.parametrize(
    "values, name",
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2.0"}, "WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK"),
        ({"MASTER_PORT": "port"}, "MASTER_PORT"),
        ({"PMI_RANK": "0", "PMI_SIZE": "two"}, "PMI_SIZE"),
    ],
)
def test_non_integer_value(values, name):
    with pytest.raises(ValueError, match=f"{name}='{values[name]}' is not an integer"):
        read_launch_env(values)


# -- resolve_placement ------------------------------------------------------------------------

# Written out, not read from placement.FAMILIES, so a wrong entry there fails here.
EXPECTED = {
    "cuda": (DistributedType.MULTI_GPU, "nccl"),
    "xpu": (DistributedType.MULTI_XPU, "xccl"),
    "npu": (DistributedType.MULTI_NPU, "hccl"),
    "mlu": (DistributedType.MULTI_MLU, "cncl"),
    "sdaa": (DistributedType.MULTI_SDAA, "tccl"),
    "musa": (DistributedType.MULTI_MUSA, "mccl"),
    "hpu": (DistributedType.MULTI_HPU, "hccl"),
    "neuron": (DistributedType.MULTI_NEURON, "xla"),
    "xla": (DistributedType.XLA, "xla"),
}
SINGLE = LaunchEnv()
RANK1_OF_2 = LaunchEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, source="torchrun")
RANK3_OF_4_ON_2_NODES = LaunchEnv(rank=3, world_size=4, local_rank=1, local_world_size=2, source="torchrun")


def test_every_family_is_covered():
    assert set(placement.FAMILIES) == set(EXPECTED)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_multi_process_placement(family):
    dist_type, backend = EXPECTED[family]
    device = {"xla": "xla", "neuron": "xla"}.get(family, f"{family}:1")
    assert resolve_placement(RANK1_OF_2, family, device_count=2) == Placement(dist_type, backend, device)
    # The device follows the local rank, not the global one.
    assert resolve_placement(RANK3_OF_4_ON_2_NODES, family, device_count=2).device == device
    # An explicit backend wins.
    assert resolve_placement(RANK1_OF_2, family, device_count=2, backend="gloo").backend == "gloo"


@pytest.mark.parametrize("family", sorted(set(EXPECTED) - {"xla"}))
def test_single_process_placement(family):
    device = "xla" if family == "neuron" else f"{family}:0"
    assert resolve_placement(SINGLE, family, device_count=4) == Placement(DistributedType.NO, None, device)


def test_single_process_xla_is_still_xla():
    assert resolve_placement(SINGLE, "xla") == Placement(DistributedType.XLA, "xla", "xla")


@pytest.mark.parametrize("family", sorted(set(EXPECTED) - {"xla"}))
def test_local_rank_beyond_the_devices(family):
    env = LaunchEnv(rank=2, world_size=4, local_rank=2, local_world_size=4)
    with pytest.raises(ValueError, match=f"LOCAL_RANK=2 needs 3 {family} devices but 2 are visible") as info:
        resolve_placement(env, family, device_count=2)
    assert "at most 2 processes per node" in str(info.value) and "cpu=True" in str(info.value)
    # The last device that exists is fine.
    assert (
        resolve_placement(LaunchEnv(1, 4, 1, 4), family, device_count=2).distributed_type
        == EXPECTED[family][0]
    )


def test_cpu_only_machine():
    assert resolve_placement(SINGLE, None) == Placement(DistributedType.NO, None, "cpu")
    # Several processes on a machine without accelerators are MULTI_CPU with no cpu=True needed.
    assert resolve_placement(RANK1_OF_2, None) == Placement(DistributedType.MULTI_CPU, "gloo", "cpu")
    assert resolve_placement(RANK1_OF_2, None, backend="mpi").backend == "mpi"


@pytest.mark.parametrize("family", sorted(EXPECTED) + ["mps"])
def test_cpu_true_overrides_the_family(family):
    assert resolve_placement(SINGLE, family, cpu=True) == Placement(DistributedType.NO, None, "cpu")
    expected = Placement(DistributedType.MULTI_CPU, "gloo", "cpu")
    assert resolve_placement(RANK1_OF_2, family, cpu=True, device_count=0) == expected


def test_mps():
    assert resolve_placement(SINGLE, "mps") == Placement(DistributedType.NO, None, "mps")
    # mps has no collective backend: several processes run on the CPU.
    assert resolve_placement(RANK1_OF_2, "mps") == Placement(DistributedType.MULTI_CPU, "gloo", "cpu")


def test_unknown_family():
    with pytest.raises(ValueError, match="Unknown device family 'tpu'"):
        resolve_placement(SINGLE, "tpu")


# -- parse_mixed_precision --------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, "no"),
        ("no", "no"),
        ("FP16", "fp16"),
        (" bf16 ", "bf16"),
        ("fp8", "fp8"),
        (PrecisionType.BF16, "bf16"),
    ],
)
def test_parse_mixed_precision(value, expected):
    assert parse_mixed_precision(value) == expected


@pytest.mark.parametrize("value", ["fp32x", "fp32", "float16", ""])
def test_parse_mixed_precision_rejects(value):
    with pytest.raises(ValueError) as info:
        parse_mixed_precision(value)
    message = str(info.value)
    assert repr(value) in message
    assert all(choice in message for choice in ("'no'", "'fp16'", "'bf16'", "'fp8'"))
