"""PartialState / AcceleratorState / GradientState: in this process, then on real gloo ranks."""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import threading

import pytest
import torch
from mp import run_ranks

from notebook_accel import state as state_module
from notebook_accel.state import AcceleratorState, GradientState, PartialState, use_thread_local_state
from notebook_accel.utils.dataclasses import DistributedType, PrecisionType

LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "PMIX_SIZE",
    "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DEBUG_MODE",
    "ACCELERATE_USE_CPU", "NOTEBOOK_ACCEL_LAUNCHER",
)  # fmt: skip
TIMEOUT = 60


def _reset_all():
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """Each in-process test starts from a single plain process and leaves no state behind."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    mode = state_module._thread_local_mode
    _reset_all()
    yield
    _reset_all()
    use_thread_local_state(mode)
    _reset_all()


# -- one process ------------------------------------------------------------------------------


def test_single_process_defaults():
    s = PartialState()
    assert s.distributed_type == DistributedType.NO
    assert s.device == torch.device("cpu") and s.default_device == torch.device("cpu")
    assert (s.num_processes, s.process_index, s.local_process_index, s.num_local_processes) == (1, 0, 0, 1)
    assert s.is_main_process and s.is_local_main_process and s.is_last_process
    assert not s.use_distributed and s.backend is None and s.debug is False
    assert "Num processes: 1" in repr(s) and "Device: cpu" in repr(s)
    s.wait_for_everyone()  # a no-op, must not need a process group
    assert not torch.distributed.is_initialized()
    with s.split_between_processes([1, 2, 3], apply_padding=True) as share:
        assert share == [1, 2, 3]
    with s.main_process_first(), s.local_main_process_first():
        pass


def test_accelerate_torch_device_overrides_the_device(monkeypatch):
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu:3")  # accelerate's variable
    assert PartialState().device == torch.device("cpu:3")


def test_instances_share_one_state():
    a, b = PartialState(), PartialState()
    assert a is not b and a.__dict__ is b.__dict__
    a.marker = "set on a"
    assert b.marker == "set on a"


def test_reset_state_resolves_again(monkeypatch):
    first = PartialState()
    assert first.debug is False
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "1")
    assert PartialState().debug is False  # resolved once, not on every instance
    PartialState._reset_state()
    assert not first.initialized and first.__dict__ == {}
    assert PartialState().debug is True


def test_failed_resolution_leaves_no_half_state(monkeypatch):
    # Two nodes and no rendezvous address: refused before any process group is made.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="MASTER_ADDR/MASTER_PORT are not set"):
        PartialState()
    assert PartialState._shared_state == {}
    assert not torch.distributed.is_initialized()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name)
    assert PartialState().distributed_type == DistributedType.NO


def test_thread_local_state():
    use_thread_local_state(True)
    main = PartialState()
    main.marker = "main"
    seen = {}

    def worker():
        try:
            mine = PartialState()
            seen["fresh"] = not hasattr(mine, "marker")
            seen["resolved"] = (mine.process_index, str(mine.device))
            mine.marker = "worker"
            seen["same_dict"] = mine.__dict__ is main.__dict__
        except BaseException as exc:  # surfaced by the asserts below
            seen["error"] = repr(exc)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    assert not thread.is_alive() and "error" not in seen
    assert seen == {"fresh": True, "resolved": (0, "cpu"), "same_dict": False}
    assert PartialState().marker == "main"
    # Back to one state per process: threads share again.
    use_thread_local_state(False)
    PartialState().marker = "shared"
    result = []
    thread = threading.Thread(target=lambda: result.append(PartialState().marker), daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    assert result == ["shared"]


def test_accelerator_state_defaults_and_delegation():
    s = AcceleratorState()
    assert s.mixed_precision == "no"
    assert s.distributed_type == DistributedType.NO and s.device == torch.device("cpu")
    assert s.num_processes == 1 and s.is_main_process and s.debug is False
    assert PartialState().__dict__ is s._partial.__dict__
    assert "Mixed precision type: no" in repr(s)


def test_mixed_precision_from_argument_and_environment(monkeypatch):
    assert AcceleratorState(mixed_precision="bf16").mixed_precision == "bf16"
    AcceleratorState._reset_state()
    assert AcceleratorState(mixed_precision=PrecisionType.FP16).mixed_precision == "fp16"
    AcceleratorState._reset_state()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "FP16")
    assert AcceleratorState().mixed_precision == "fp16"
    AcceleratorState._reset_state()
    assert AcceleratorState(mixed_precision="bf16").mixed_precision == "bf16"  # the argument wins


def test_recreating_with_another_mixed_precision_says_how_to_recover():
    AcceleratorState(mixed_precision="bf16")
    assert AcceleratorState().mixed_precision == "bf16"  # no request: the existing state
    assert AcceleratorState(mixed_precision="bf16").mixed_precision == "bf16"
    with pytest.raises(ValueError, match="mixed_precision='bf16'") as info:
        AcceleratorState(mixed_precision="fp16")
    assert "mixed_precision='fp16'" in str(info.value)
    assert "AcceleratorState._reset_state(reset_partial_state=True)" in str(info.value)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert AcceleratorState(mixed_precision="fp16").mixed_precision == "fp16"


def test_unknown_mixed_precision(monkeypatch):
    with pytest.raises(ValueError, match="Unknown mixed_precision 'fp32x'"):
        AcceleratorState(mixed_precision="fp32x")
    assert AcceleratorState._shared_state == {}
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "half")
    with pytest.raises(ValueError, match="Unknown mixed_precision 'half'"):
        AcceleratorState()
    # Nothing half-made: after fixing the variable, a new state resolves normally.
    assert AcceleratorState._shared_state == {}
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert AcceleratorState().mixed_precision == "bf16"


def test_accelerator_state_after_reset_explains():
    s = AcceleratorState()
    AcceleratorState._reset_state()
    with pytest.raises(AttributeError, match="create a new Accelerator"):
        _ = s.device


class _Plugin:
    def to_kwargs(self):
        return {"num_steps": 4, "adjust_scheduler": True, "sync_each_batch": True}


class _Loader:
    end_of_dataloader = True
    remainder = 3


def test_gradient_state():
    g = GradientState()
    assert g.sync_gradients and g.num_steps == 1 and not g.adjust_scheduler
    assert g.sync_with_dataloader and not g.sync_each_batch
    assert not g.in_dataloader and not g.end_of_dataloader and g.remainder == -1
    g._set_sync_gradients(False)
    assert GradientState().sync_gradients is False  # shared
    GradientState(gradient_accumulation_plugin=_Plugin())
    assert (g.num_steps, g.adjust_scheduler, g.sync_each_batch) == (4, True, True)
    loader = _Loader()
    g._add_dataloader(loader)
    assert g.in_dataloader and g.active_dataloader is loader and g.end_of_dataloader and g.remainder == 3
    g._remove_dataloader(loader)
    assert g.active_dataloader is None and g.remainder == -1
    GradientState._reset_state()
    assert GradientState().sync_gradients is True and GradientState().num_steps == 1


def test_decorators_in_one_process():
    s = PartialState()
    calls = []

    def record(name):
        def fn(value):
            calls.append(name)
            return value

        fn.__name__ = name
        return fn

    assert s.on_main_process(record("main"))(1) == 1
    assert s.on_local_main_process(record("local_main"))(2) == 2
    assert s.on_last_process(record("last"))(3) == 3
    assert s.on_process(record("p0"), process_index=0)(4) == 4
    assert s.on_process(process_index=1)(record("p1"))(5) is None
    assert s.on_local_process(local_process_index=0)(record("l0"))(6) == 6
    assert s.on_local_process(record("l1"), local_process_index=1)(7) is None
    assert calls == ["main", "local_main", "last", "p0", "l0"]
    assert s.on_main_process(record("kept"))(0) == 0 and s.on_main_process(record("kept")).__name__ == "kept"
    with pytest.raises(ValueError, match="process_index=None"):
        s.on_process(record("missing"))
    with pytest.raises(ValueError, match="local_process_index=-1"):
        s.on_local_process(local_process_index=-1)(record("negative"))


def test_print_in_one_process(capsys):
    PartialState().print("hello", "world", sep="-")
    assert capsys.readouterr().out == "hello-world\n"


@pytest.mark.parametrize(
    "n, num, padded, shares",
    [
        (17, 4, False, [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]),
        (17, 4, True, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 8], [9, 10, 11, 12, 12], [13, 14, 15, 16, 16]]),
        (8, 4, True, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (3, 4, False, [[0], [1], [2], []]),
        (3, 4, True, [[0], [1], [2], [2]]),
        (0, 2, True, [[], []]),
    ],
)
def test_split_arithmetic(n, num, padded, shares):
    got = [state_module._split(list(range(n)), num, i, padded) for i in range(num)]
    assert got == shares


def test_split_rejects_what_it_cannot_split():
    with pytest.raises(ValueError, match="equal length"):
        state_module._split({"a": [1, 2], "b": [1]}, 2, 0, False)
    with pytest.raises(TypeError, match="not int"):
        state_module._split(5, 2, 0, False)


# -- real ranks (module-level functions: they run in the children) ----------------------------


def _job(folder):
    """Everything the 2- and 4-rank tests check, in one run: each start of a rank costs imports."""
    import torch.distributed as dist

    s = PartialState(timeout=datetime.timedelta(seconds=TIMEOUT))
    acc = AcceleratorState()
    out = {
        "type": str(s.distributed_type),
        "ranks": (s.process_index, s.num_processes, s.local_process_index, s.num_local_processes),
        "flags": (s.is_main_process, s.is_local_main_process, s.is_last_process, s.use_distributed),
        "backend": s.backend,
        "device": str(s.device),
        "dist": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
        "mixed_precision": acc.mixed_precision,
        "acc_rank": acc.process_index,
        "splits": _splits(s),
        "main_first": _main_first(s, os.path.join(folder, "order.txt")),
        "barrier": _barrier(s, os.path.join(folder, "barrier")),
        "decorated": _decorated(s),
    }
    s.destroy_process_group()
    out["destroyed"] = not dist.is_initialized()
    return out


def _splits(s):
    out = {}
    with s.split_between_processes(list(range(17))) as share:
        out["list"] = share
    with s.split_between_processes(list(range(17)), apply_padding=True) as share:
        out["padded"] = share
    with s.split_between_processes(tuple("abcdefghijklmnopq"), apply_padding=True) as share:
        out["tuple"] = share
    data = {"ids": list(range(17)), "x": torch.arange(34).reshape(17, 2)}
    with s.split_between_processes(data) as share:
        out["dict"] = (share["ids"], share["x"].tolist())
    with s.split_between_processes(torch.arange(17.0), apply_padding=True) as share:
        out["tensor"] = (type(share).__name__, share.tolist())
    return out


def _main_first(s, path):
    with s.main_process_first():
        seen = []
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                seen = f.read().split()
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{s.process_index}\n")
    s.wait_for_everyone()
    with open(path, encoding="utf-8") as f:
        return seen, sorted(f.read().split())


def _barrier(s, folder):
    if s.is_main_process:
        os.makedirs(folder)
    s.wait_for_everyone()
    if not s.is_main_process:
        with open(os.path.join(folder, f"rank{s.process_index}"), "w") as f:
            f.write("done")
    s.wait_for_everyone()
    return sorted(os.listdir(folder))


def _decorated(s):
    ran = []

    @s.on_main_process
    def main():
        ran.append("main")
        return "main result"

    @s.on_last_process
    def last():
        ran.append("last")

    @s.on_process(process_index=1)
    def one():
        ran.append("process 1")

    @s.on_local_process(local_process_index=2)
    def local_two():
        ran.append("local 2")

    @s.on_local_main_process
    def local_main():
        ran.append("local main")

    results = (main(), last(), one(), local_two(), local_main())
    return ran, results[0]


def _destroy_then_drop_ddp(rounds):
    """accelerate's test_sync ends so: destroy_process_group(), then the DDP models go with main()'s
    frame. Each round joins a new group, on a port rank 0 picked; returns whether the group survived each
    destroy (FORK_LAUNCHED: the launcher closes a forked rank's group, as in accelerate)."""
    import gc

    import torch.distributed as dist
    from mp import free_port

    survived = []
    for _ in range(rounds):
        PartialState._reset_state()
        s = PartialState(timeout=datetime.timedelta(seconds=TIMEOUT))
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        for _ in range(3):
            model(torch.randn(4, 2)).sum().backward()
        port = [free_port()]
        dist.broadcast_object_list(port)  # rank 0's pick: the next round's group
        os.environ["MASTER_PORT"] = str(port[0])
        s.destroy_process_group()
        survived.append(dist.is_initialized())
        if survived[-1]:
            dist.destroy_process_group()  # the launcher's part, for the next round
        del model  # the group's last holder but ours: torch 2.13 could deadlock here (utils/peers.keep)
        gc.collect()
    return survived


def test_destroy_then_dropping_ddp_models_does_not_hang():
    assert run_ranks(_destroy_then_drop_ddp, 2, 8, timeout=TIMEOUT) == [[False] * 8] * 2


_DESTROY_THEN_EXIT = """
import torch
from notebook_accel.state import PartialState
from notebook_accel.utils import broadcast, gather, reduce
state = PartialState()
t = torch.tensor([float(state.process_index)])
for _ in range(3):
    gather(t), broadcast(t), reduce(t)
state.destroy_process_group()
open(f"done{state.process_index}", "w").close()
"""


@pytest.mark.timeout(240)
def test_ranks_that_destroy_the_group_and_exit_do_not_abort(tmp_path):
    # accelerate's test_ops ends so under torchrun. The group we hold after the destroy (peers.keep) is let
    # go at exit: freed only during the interpreter's teardown, it aborted 3 runs in 4 on 4 ranks
    # ("terminate called without an active exception").
    import subprocess
    import sys

    script = tmp_path / "destroy_then_exit.py"
    script.write_text(_DESTROY_THEN_EXIT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(3):
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--rdzv_backend=c10d",
             "--rdzv_endpoint=127.0.0.1:0", "--monitor_interval=0.1", str(script)],
            env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path,
        )  # fmt: skip
        assert run.returncode == 0 and "terminate called" not in run.stderr, run.stderr[-3000:]
        assert sorted(p.name for p in tmp_path.glob("done*")) == ["done0", "done1", "done2", "done3"]
        for mark in tmp_path.glob("done*"):
            mark.unlink()


_DDP_THEN_EXIT = """
import atexit, weakref
import torch
import torch.distributed as dist
from notebook_accel import Accelerator
freed = []
atexit.register(lambda: open(f"freed{freed[0]}", "w").write(str(freed[1]() is None)))  # runs after ours
def main():  # as accelerate's test_sync: the models are gone by the exit hooks
    accelerator = Accelerator()
    freed[:] = [accelerator.process_index, weakref.ref(dist.group.WORLD)]
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    accelerator.backward(model(torch.randn(4, 2)).sum())
    accelerator.state.destroy_process_group()
main()
"""


@pytest.mark.timeout(240)
def test_a_ddp_scripts_group_is_freed_before_the_interpreter_ends(tmp_path):
    # torch.distributed.nn, which DDP imports, reads group.WORLD into its functions' defaults at import: first
    # imported after the group exists, it held the group past the exit hooks, and a gloo thread still letting go
    # of a collective once the interpreter was ending aborted a rank (test_sync, 4 ranks, once in CI).
    import subprocess
    import sys

    script = tmp_path / "ddp_then_exit.py"
    script.write_text(_DDP_THEN_EXIT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
         "--rdzv_endpoint=127.0.0.1:0", "--monitor_interval=0.1", str(script)],
        env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert {p.name: p.read_text() for p in tmp_path.glob("freed*")} == {"freed0": "True", "freed1": "True"}


def test_exit_waits_for_a_busy_thread_and_not_for_sleeping_ones():
    # peers._let_go's wait when the group outlives the exit hooks (a DDP model in a global).
    import threading
    import zlib

    from notebook_accel.utils import peers

    stop = threading.Event()
    sleeper = threading.Thread(target=stop.wait, daemon=True)
    sleeper.start()
    assert peers.threads_at_rest(limit=5.0) is True
    data = os.urandom(1 << 24)

    def spin():  # zlib works with the GIL released: the thread stays runnable, as a late gloo thread
        while not stop.is_set():
            zlib.compress(data, 1)

    busy = threading.Thread(target=spin, daemon=True)
    busy.start()
    try:
        assert peers.threads_at_rest(limit=0.3) is False
    finally:
        stop.set()
        busy.join(timeout=30)
        sleeper.join(timeout=30)
    assert peers.threads_at_rest(limit=5.0) is True


def test_a_forked_ranks_group_is_left_to_the_launcher():
    results = run_ranks(_destroy_then_drop_ddp, 2, 1, env={"FORK_LAUNCHED": "1"}, timeout=TIMEOUT)
    assert results == [[True], [True]]


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def job(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"ranks{request.param}")
    env = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    return request.param, run_ranks(_job, request.param, str(folder), env=env, timeout=TIMEOUT)


def test_ranks_are_multi_cpu_without_cpu_true(job):
    world, results = job
    for rank, r in enumerate(results):
        assert r["type"] == "MULTI_CPU" and r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["ranks"] == (rank, world, rank, world)
        assert r["flags"] == (rank == 0, rank == 0, rank == world - 1, True)
        assert r["dist"] == (rank, world, "gloo")
        assert r["mixed_precision"] == "bf16" and r["acc_rank"] == rank
        assert r["destroyed"]


SPLIT_BOUNDS = {2: [(0, 9), (9, 17)], 4: [(0, 5), (5, 9), (9, 13), (13, 17)]}


def test_split_between_processes(job):
    world, results = job
    splits = [r["splits"] for r in results]
    assert [len(r["list"]) for r in splits] == {2: [9, 8], 4: [5, 4, 4, 4]}[world]
    width = SPLIT_BOUNDS[world][0][1]
    letters = "abcdefghijklmnopq"
    for r, (lo, hi) in zip(splits, SPLIT_BOUNDS[world]):
        plain, pad = list(range(lo, hi)), width - (hi - lo)
        assert r["list"] == plain
        # Padding repeats the share's own last item until every share is as long as the first.
        assert r["padded"] == plain + [hi - 1] * pad
        assert r["tuple"] == tuple(letters[lo:hi]) + (letters[hi - 1],) * pad
        assert r["dict"] == (plain, [[2 * i, 2 * i + 1] for i in plain])
        assert r["tensor"] == ("Tensor", [float(i) for i in plain] + [float(hi - 1)] * pad)


def test_main_process_first(job):
    world, results = job
    seen = [r["main_first"][0] for r in results]
    assert seen[0] == []  # rank 0 ran its block before anyone else wrote
    assert all(s[0] == "0" for s in seen[1:])  # the others entered only after rank 0 had finished
    assert all(r["main_first"][1] == [str(i) for i in range(world)] for r in results)


def test_wait_for_everyone(job):
    world, results = job
    # After the barrier every rank, rank 0 included, sees every other rank's file.
    assert [r["barrier"] for r in results] == [[f"rank{i}" for i in range(1, world)]] * world


def test_decorators_pick_the_right_rank(job):
    world, results = job
    expected = {
        2: [["main", "local main"], ["last", "process 1"]],
        4: [["main", "local main"], ["process 1"], ["local 2"], ["last"]],
    }
    assert [r["decorated"][0] for r in results] == expected[world]
    assert [r["decorated"][1] for r in results] == ["main result"] + [None] * (world - 1)


def _two_nodes_of_two(path):
    # Pretend ranks 0-1 and 2-3 sit on two nodes; the rendezvous address is set, so this is valid.
    rank = int(os.environ["RANK"])
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    s = PartialState()
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        s.print(f"hello from rank {rank}")
    with s.local_main_process_first():
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{rank}\n")
    return buffer.getvalue(), (s.local_process_index, s.num_local_processes), s.is_local_main_process


def test_print_once_per_node(tmp_path):
    path = tmp_path / "order.txt"
    path.write_text("")
    results = run_ranks(_two_nodes_of_two, 4, str(path), timeout=TIMEOUT)
    assert [out for out, _, _ in results] == ["hello from rank 0\n", "", "hello from rank 2\n", ""]
    assert [local for _, local, _ in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [main for _, _, main in results] == [True, False, True, False]
    order = path.read_text().split()
    # Each node's local main wrote before that node's other rank.
    assert order.index("0") < order.index("1") and order.index("2") < order.index("3")
