"""engine="ray" on a real Ray cluster: Ray's own multi-node harness (ray.cluster_utils.Cluster) runs a
head and a second node of one CPU each here, so two ranks with one CPU each land on different nodes.
One cluster serves the module; these tests form the "ray" tier and run alone (tests/tiers.py)."""

import os
import re
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is in the dev set (requirements-dev.txt): install it")
from ray.cluster_utils import Cluster  # noqa: E402

from notebook_accel import notebook_launcher  # noqa: E402
from notebook_accel.launch import events as ev  # noqa: E402
from notebook_accel.launch.errors import (  # noqa: E402
    LaunchConfigError,
    LaunchFailedError,
    LaunchTimeoutError,
)

pytestmark = pytest.mark.timeout(300)


class Recorder:
    def __init__(self):
        self.events = []

    def handle(self, event):
        self.events.append(event)

    def attach(self, control):
        pass

    def close(self):
        pass

    def of(self, kind):
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture(scope="module")
def cluster():
    import cloudpickle

    # The nodes do not have tests/ on their path: this module's functions travel by value, as a
    # notebook's do (test_runtime_env_brings_a_module_to_the_nodes covers importing one).
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _nothing_of_ours_left(seconds: float = 10.0):
    """No placement group pending or created, and every CPU free again (within `seconds`: another
    holder's removal, as a test's own, is not ours to have waited for)."""
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + seconds
    while True:
        alive = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        free = ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU") == 2
        if (alive == [] and free) or time.monotonic() > deadline:
            return alive == [] and free
        time.sleep(0.1)


def _join_and_reduce(x):
    import os

    import ray
    import torch

    from notebook_accel import Accelerator

    accelerator = Accelerator()
    total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]))
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")}
    node = ray.get_runtime_context().get_node_id()
    return {"x": x, "rank": accelerator.process_index, "type": str(accelerator.distributed_type),
            "total": total.item(), "env": env, "node": node, "tensor": torch.arange(3) * accelerator.process_index}  # fmt: skip


def test_ranks_on_two_nodes_join_one_group_and_return_in_rank_order(cluster):
    results = notebook_launcher(_join_and_reduce, (7,), num_processes=2, engine="ray", placement="strict_spread",
                                sinks=[Recorder()])  # fmt: skip
    assert [r["rank"] for r in results] == [0, 1] and {r["x"] for r in results} == {7}
    assert results[0]["node"] != results[1]["node"]  # strict_spread: one rank a node
    assert [r["total"] for r in results] == [3.0, 3.0] and {r["type"] for r in results} == {"MULTI_CPU"}
    for rank, r in enumerate(results):
        assert r["env"] == {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                            "NODE_RANK": str(rank)}  # fmt: skip
        assert r["tensor"].tolist() == [0, rank, 2 * rank]
    assert _nothing_of_ours_left()


def test_ranks_on_one_node_share_it_with_local_ranks(cluster):
    c = cluster.add_node(num_cpus=2)  # a third node, two CPUs: strict_pack puts both ranks there
    cluster.wait_for_nodes()
    try:
        results = notebook_launcher(_join_and_reduce, (0,), num_processes=2, engine="ray",
                                    placement="strict_pack", resources_per_rank={"CPU": 1}, sinks=[Recorder()])  # fmt: skip
        assert results[0]["node"] == results[1]["node"]
        assert [r["env"]["LOCAL_RANK"] for r in results] == ["0", "1"]
        assert {r["env"]["LOCAL_WORLD_SIZE"] for r in results} == {"2"} and results[1]["total"] == 3.0
    finally:
        cluster.remove_node(c)
        cluster.wait_for_nodes()


def _use_helper():
    import ray_test_helper

    return ray_test_helper.ANSWER


def test_runtime_env_brings_a_module_to_the_nodes(cluster, tmp_path):
    package = tmp_path / "ray_test_helper"
    package.mkdir()
    (package / "__init__.py").write_text("ANSWER = 42\n")
    env = {"py_modules": [str(package)]}
    with pytest.raises(LaunchFailedError, match="No module named 'ray_test_helper'"):
        notebook_launcher(_use_helper, num_processes=2, engine="ray", sinks=[Recorder()])
    # Connected by the user (the fixture): Ray uploads a local folder only for a job, so we say where to put it.
    with pytest.raises(LaunchConfigError, match=r"pass the runtime_env to your ray.init\(runtime_env=...\)"):
        notebook_launcher(_use_helper, num_processes=2, engine="ray", runtime_env=env, sinks=[Recorder()])
    ray.shutdown()
    try:  # not connected: the launch connects with it as the job's, and keeps the connection
        results = notebook_launcher(_use_helper, num_processes=2, engine="ray", ray_address=cluster.address,
                                    runtime_env=env, sinks=[Recorder()])  # fmt: skip
        assert results == [42, 42] and ray.is_initialized()
        again = notebook_launcher(_use_helper, num_processes=2, engine="ray", runtime_env=env, sinks=[Recorder()])
        assert again == [42, 42]
        assert _nothing_of_ours_left()
    finally:
        ray.shutdown()
        ray.init(address=cluster.address)


def _flag():
    import os

    return os.environ.get("NOTEBOOK_ACCEL_TEST_FLAG")


def test_a_runtime_env_without_folders_goes_with_the_actors_of_a_users_connection(cluster):
    job = ray.get_runtime_context().get_job_id()  # the fixture's connection: the user's
    env = {"env_vars": {"NOTEBOOK_ACCEL_TEST_FLAG": "on"}}
    assert notebook_launcher(_flag, num_processes=2, engine="ray", runtime_env=env, sinks=[Recorder()]) == ["on", "on"]
    assert notebook_launcher(_flag, num_processes=2, engine="ray", sinks=[Recorder()]) == [None, None]
    assert ray.get_runtime_context().get_job_id() == job  # never closed nor replaced by a launch


def _talk():
    import os
    import sys

    rank = int(os.environ["RANK"])
    print(f"hello from rank {rank}")
    print(f"warning from rank {rank}", file=sys.stderr)
    os.write(1, f"c-level line from rank {rank}\n".encode())
    return rank


def test_each_ranks_output_reaches_the_events_once(cluster, capfd):
    sink = Recorder()
    assert notebook_launcher(_talk, num_processes=2, engine="ray", sinks=[sink]) == [0, 1]
    lines = {(e.rank, e.stream, e.text) for e in sink.of(ev.RankOutput)}
    for rank in (0, 1):
        assert {(rank, "stdout", f"hello from rank {rank}"), (rank, "stderr", f"warning from rank {rank}"),
                (rank, "stdout", f"c-level line from rank {rank}")} <= lines  # fmt: skip
    assert len(sink.of(ev.RankOutput)) == len(lines)  # no line twice
    time.sleep(2)  # Ray's log forwarding to the driver would have printed by now
    printed = capfd.readouterr()
    assert "hello from rank" not in printed.out + printed.err
    started = sink.of(ev.LaunchStarted)[0]
    assert (started.start_method, started.world_size) == ("ray", 2)
    assert [type(e) for e in sink.events][-1] is ev.LaunchFinished and sink.events[-1].ok


def _fail_on_rank_1():
    import os
    import time

    if os.environ["RANK"] == "1":
        raise ValueError("rank one says no")
    time.sleep(60)


def test_a_rank_that_raises_is_named_with_its_node_and_the_others_stop(cluster):
    sink = Recorder()
    started = time.monotonic()
    with pytest.raises(LaunchFailedError) as caught:
        notebook_launcher(_fail_on_rank_1, num_processes=2, engine="ray", sinks=[sink])
    assert time.monotonic() - started < 50  # rank 0 (sleeping 60 s) was stopped, not waited for
    text = str(caught.value)
    assert "rank 1 on node " in text and "raised ValueError: rank one says no" in text
    assert 'raise ValueError("rank one says no")' in text  # the rank's own traceback
    assert [e.rank for e in sink.of(ev.RankStopped)] == [0]
    assert sink.events[-1].ok is False and sink.events[-1].failed_ranks == (1,)
    assert _nothing_of_ours_left()


def _die_on_rank_0():
    import os
    import signal
    import time

    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_a_rank_whose_process_dies_is_named(cluster):
    with pytest.raises(LaunchFailedError, match=r"rank 0 on node .* failed: its Ray actor died"):
        notebook_launcher(_die_on_rank_0, num_processes=2, engine="ray", sinks=[Recorder()])
    assert _nothing_of_ours_left()


def test_the_timeout_ends_every_actor(cluster):
    # The clock starts before the actors do (their start counts: about 4 s here, the ray tier running
    # alone), so both are running when it ends; the test says so if they were not.
    sink = Recorder()
    with pytest.raises(LaunchTimeoutError, match=r"timed out after 15 s"):
        notebook_launcher(_print_then_sleep, num_processes=2, engine="ray", timeout=15, sinks=[sink])
    assert sorted(e.rank for e in sink.of(ev.RankOutput) if e.text == "started") == [0, 1]
    assert sorted(e.rank for e in sink.of(ev.RankStopped)) == [0, 1]
    assert _nothing_of_ours_left()


def test_a_busy_cluster_is_waited_for_with_a_notice_until_the_timeout(cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    busy = placement_group([{"CPU": 1}, {"CPU": 1}])  # someone else's: every CPU taken
    ray.get(busy.ready(), timeout=60)
    sink = Recorder()
    try:
        with pytest.raises(LaunchTimeoutError, match=r"while waiting for the cluster to place the ranks \(CPU 2 wanted, 0 free"):
            notebook_launcher(_talk, num_processes=2, engine="ray", timeout=5, sinks=[sink])
    finally:
        remove_placement_group(busy)
    assert any("waiting for the Ray cluster to place the ranks" in e.text for e in sink.of(ev.LaunchNotice))
    assert _nothing_of_ours_left()


class StopOnOutput(Recorder):
    """The panel's Stop button: asks the launch to stop once a rank has printed."""

    def attach(self, control):
        self.control = control

    def handle(self, event):
        super().handle(event)
        if isinstance(event, ev.RankOutput):
            self.control.request_stop("the Stop button")


def _print_then_sleep():
    import time

    print("started", flush=True)
    time.sleep(120)


def test_stop_ends_every_actor(cluster):
    from notebook_accel.launch.errors import LaunchStoppedError

    sink = StopOnOutput()
    with pytest.raises(LaunchStoppedError, match="the Stop button"):
        notebook_launcher(_print_then_sleep, num_processes=2, engine="ray", sinks=[sink])
    assert sorted(e.rank for e in sink.of(ev.RankStopped)) == [0, 1]
    assert sink.events[-1].stopped == "the Stop button"
    assert _nothing_of_ours_left()


def _mismatch():
    import torch
    import torch.distributed as dist

    from notebook_accel import PartialState

    state = PartialState()
    t = torch.ones(4)
    if state.process_index == 0:
        dist.all_reduce(t)
    else:
        dist.barrier()


class StopOnStall(Recorder):
    """Stops the launch at the watch's first report on ranks past their start (one still importing
    is "starting": a report, but not the stall this test makes)."""

    def attach(self, control):
        self.control = control

    def handle(self, event):
        super().handle(event)
        if isinstance(event, ev.LaunchStalled) and all(r.state != "starting" for r in event.report.ranks):
            self.control.request_stop("the test saw the stall")


def test_the_stall_watch_asks_ray_ranks_through_their_actors(cluster):
    """The driver cannot reach a pid on another node: each rank's actor asks its own process's worker
    server, and the report names each rank's collective and line as for a local launch."""
    from notebook_accel.launch.errors import LaunchStoppedError

    sink = StopOnStall()
    with pytest.raises(LaunchStoppedError) as caught:
        notebook_launcher(_mismatch, num_processes=2, engine="ray", placement="strict_spread", stall_after=2,
                          timeout=120, sinks=[sink])  # fmt: skip
    report = [e.report for e in sink.of(ev.LaunchStalled)][-1]
    assert report.stalled and [r.state for r in report.ranks] == ["waiting", "waiting"], report
    assert "rank 0 waits in all_reduce #" in report.sentence and "(float32[4])" in report.sentence, report.sentence
    assert "rank 1 waits in barrier #" in report.sentence, report.sentence
    assert "test_ray_engine.py, line" in report.sentence and "in _mismatch" in report.sentence, report.sentence
    assert "dist.all_reduce(t)" in report.text() and "dist.barrier()" in report.text(), report.text()
    assert caught.value.stall is report and report.sentence in str(caught.value)
    assert _nothing_of_ours_left()


class AskWhereNow(Recorder):
    """The panel's Stacks button: from another thread, asks where the ranks are until both wait in
    their collectives, keeps that report and stops the launch."""

    def attach(self, control):
        import threading

        self.control, self.report = control, None
        threading.Thread(target=self._ask, daemon=True).start()

    def _ask(self):
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and self.report is None:
            time.sleep(0.5)
            where_now = self.control.where_now
            report = where_now() if where_now is not None else None
            if report is not None and [r.state for r in report.ranks] == ["waiting", "waiting"]:
                self.report = report
        self.control.request_stop("the test asked where the ranks are")


def test_the_stacks_button_asks_ray_ranks_where_they_are_now(cluster):
    from notebook_accel.launch.errors import LaunchStoppedError

    sink = AskWhereNow()
    with pytest.raises(LaunchStoppedError):
        notebook_launcher(_mismatch, num_processes=2, engine="ray", stall_after=600, timeout=120, sinks=[sink])
    report = sink.report
    assert report is not None and not report.stalled  # asked, not a stall (the watch speaks after 600 s)
    assert report.sentence.startswith("where the ranks are now: "), report.sentence
    assert "rank 0 waits in all_reduce #" in report.sentence and "rank 1 waits in barrier #" in report.sentence
    assert "dist.all_reduce(t)" in report.text(), report.text()
    assert _nothing_of_ours_left()


def _one_returns_one_sleeps():
    import os
    import time

    if os.environ["RANK"] == "1":
        return None  # most training functions return nothing
    time.sleep(60)


def test_a_ray_rank_that_returned_none_is_said_to_have_returned(cluster):
    from notebook_accel.launch.errors import LaunchStoppedError

    sink = StopOnStall()
    with pytest.raises(LaunchStoppedError):
        notebook_launcher(_one_returns_one_sleeps, num_processes=2, engine="ray", stall_after=2, timeout=120,
                          sinks=[sink])  # fmt: skip
    report = [e.report for e in sink.of(ev.LaunchStalled)][-1]
    assert [r.state for r in report.ranks] == ["running", "returned"], report
    assert "rank 1 returned from the function" in report.sentence, report.sentence
    assert "in _one_returns_one_sleeps" in report.sentence, report.sentence  # rank 0's line, asked through its actor
    assert _nothing_of_ours_left()


def _hold_memory(mib):
    import os
    import time

    import psutil

    before = psutil.Process().memory_info().rss
    block = bytearray(os.urandom(1 << 20) * mib)  # touched
    time.sleep(2.5)
    return before, len(block)


def test_each_ranks_resources_are_sampled_on_its_node(cluster):
    sink = Recorder()
    results = notebook_launcher(_hold_memory, (512,), num_processes=2, engine="ray", placement="strict_spread",
                                sinks=[sink])  # fmt: skip
    usage = sink.of(ev.RankResources)
    assert {u.rank for u in usage} == {0, 1}
    for rank, (before, held) in enumerate(results):  # the samples saw the rank's own 512 MiB
        assert max(u.rss for u in usage if u.rank == rank) >= before + held * 0.9
    assert all(u.memory_limit and u.cpu_percent >= 0 for u in usage)
    assert all(f.peak_rss and f.peak_rss >= results[f.rank][0] + results[f.rank][1] * 0.9
               for f in sink.of(ev.RankFinished))  # fmt: skip


def _report_node_then_wait(folder):
    import os
    import time

    import ray

    with open(os.path.join(folder, f"node{os.environ['RANK']}"), "w") as f:
        f.write(ray.get_runtime_context().get_node_id())
    time.sleep(120)


def test_a_node_that_goes_away_names_its_ranks(cluster, tmp_path):
    # A third node, the only one with the "doomed" resource: both ranks land there; then it is killed.
    doomed = cluster.add_node(num_cpus=2, resources={"doomed": 2})
    cluster.wait_for_nodes()
    errors = []

    def kill_when_running():
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("node*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.remove_node(doomed, allow_graceful=False)

    import threading

    killer = threading.Thread(target=kill_when_running, daemon=True)
    killer.start()
    try:
        notebook_launcher(_report_node_then_wait, (str(tmp_path),), num_processes=2, engine="ray",
                          resources_per_rank={"CPU": 1, "doomed": 1}, sinks=[Recorder()])  # fmt: skip
    except LaunchFailedError as exc:
        errors.append(str(exc))
    killer.join(timeout=30)
    cluster.wait_for_nodes()
    assert {(tmp_path / "node0").read_text(), (tmp_path / "node1").read_text()} == {doomed.node_id}
    assert errors and re.search(r"rank [01] on node .* failed: its Ray actor died", errors[0]), errors
    assert _nothing_of_ours_left()


def test_a_placement_the_nodes_could_never_satisfy_fails_at_once(cluster):
    third = cluster.add_node(num_cpus=2)  # nodes of 1, 1 and 2 CPUs
    cluster.wait_for_nodes()
    try:
        with pytest.raises(LaunchConfigError, match=r"placement='strict_spread' needs 4 nodes, and 3 hold a rank"):
            notebook_launcher(_talk, num_processes=4, engine="ray", placement="strict_spread", sinks=[Recorder()])
        with pytest.raises(LaunchConfigError, match=r"placement='strict_pack' needs one node for all 3, and a node "
                                                    r"holds at most 2"):  # fmt: skip
            notebook_launcher(_talk, num_processes=3, engine="ray", placement="strict_pack", sinks=[Recorder()])
        with pytest.raises(LaunchConfigError, match=r"its nodes hold 1 such ranks in all \((0, ){2}1 a node\)|"
                                                    r"its nodes hold 1 such ranks in all \(0, 1, 0 a node\)|"
                                                    r"its nodes hold 1 such ranks in all \(1, 0, 0 a node\)"):  # fmt: skip
            notebook_launcher(_talk, num_processes=2, engine="ray", resources_per_rank={"CPU": 2}, sinks=[Recorder()])
    finally:
        cluster.remove_node(third)
        cluster.wait_for_nodes()
    assert _nothing_of_ours_left()


def test_more_than_the_cluster_holds_fails_at_once(cluster):
    with pytest.raises(LaunchConfigError, match=r"CPU: 6 wanted, 2 in the cluster"):
        notebook_launcher(_talk, num_processes=3, engine="ray", resources_per_rank={"CPU": 2}, sinks=[Recorder()])
    with pytest.raises(LaunchConfigError, match=r"GPU: 2 wanted, 0 in the cluster"):
        notebook_launcher(_talk, num_processes=2, engine="ray", resources_per_rank={"CPU": 1, "GPU": 1},
                          sinks=[Recorder()])  # fmt: skip
    with pytest.raises(LaunchConfigError, match=r"no node has \{'CPU': 2\} for one rank"):
        notebook_launcher(_talk, num_processes=1, engine="ray", resources_per_rank={"CPU": 2}, sinks=[Recorder()])
    assert _nothing_of_ours_left()


_NO_CLUSTER = """
from notebook_accel import notebook_launcher
from notebook_accel.launch.errors import LaunchConfigError
try:
    notebook_launcher(print, num_processes=2, engine="ray", ray_address="127.0.0.1:1")
except LaunchConfigError as exc:
    print("REFUSED", exc)
"""


def test_no_cluster_at_the_address_says_how_to_start_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, "-c", _NO_CLUSTER], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)  # fmt: skip
    assert "REFUSED no Ray cluster answers at ray_address='127.0.0.1:1'" in run.stdout, run.stdout + run.stderr
    assert "ray start --head" in run.stdout


_WITHOUT_RAY = """
import sys
sys.modules["ray"] = None  # as if not installed
import notebook_accel
from notebook_accel.launch.errors import LaunchConfigError
try:
    notebook_accel.notebook_launcher(print, num_processes=2, engine="ray")
except LaunchConfigError as exc:
    print("REFUSED", exc)
"""


def test_without_ray_the_error_gives_the_install_line(tmp_path):
    run = subprocess.run([sys.executable, "-c", _WITHOUT_RAY], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)  # fmt: skip
    assert "REFUSED engine='ray' needs Ray, which is not installed here: pip install 'notebook_accel[ray]'" in (
        run.stdout
    ), run.stdout + run.stderr


def test_importing_the_package_does_not_import_ray(tmp_path):
    code = "import sys, notebook_accel, notebook_accel.launch.starters; print('ray' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.stdout.strip() == "False", run.stderr


_SCRIPT = """
import sys
import torch
from notebook_accel import Accelerator

accelerator = Accelerator()
total = accelerator.reduce(torch.tensor([1.0]))
print(f"script rank {accelerator.process_index} of {accelerator.num_processes} says {sys.argv[1]}: {total.item()}")
if len(sys.argv) > 2 and accelerator.process_index == 1:
    raise RuntimeError("told to fail")
"""


def test_the_command_line_launches_a_script_on_the_cluster(cluster, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    cli = [sys.executable, "-m", "notebook_accel.commands.cli", "launch", "--engine", "ray", "--num_processes", "2"]
    run = subprocess.run([*cli, "--placement", "strict_spread", str(script), "hi"], capture_output=True, text=True,
                         timeout=180, env=env, cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] script rank {rank} of 2 says hi: 2.0" in run.stdout
    # The config file's engine: ray and Ray keys, without --engine.
    config = tmp_path / "ray.yaml"
    config.write_text(f"engine: ray\nray_address: {cluster.address}\nplacement: strict_spread\nnum_processes: 2\n")
    from_file = [sys.executable, "-m", "notebook_accel.commands.cli", "launch", "--config_file", str(config)]
    no_address = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}
    failed = subprocess.run([*from_file, str(script), "hi", "fail"], capture_output=True, text=True, timeout=180,
                            env=no_address, cwd=tmp_path)  # fmt: skip
    assert failed.returncode == 1
    assert "rank 1 on node" in failed.stderr and "RuntimeError: told to fail" in failed.stderr
    assert 'raise RuntimeError("told to fail")' in failed.stderr  # the script's line, though the node has no copy
    refused = subprocess.run([*cli, "--num_machines", "2", str(script), "hi"], capture_output=True, text=True,
                             timeout=180, env=env, cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2 and "num_nodes cannot be given with it" in refused.stderr
    local = [sys.executable, "-m", "notebook_accel.commands.cli", "launch", "--num_processes", "2"]
    unsaid = subprocess.run([*local, "--placement", "spread", str(script), "hi"], capture_output=True, text=True,
                            timeout=180, env=env, cwd=tmp_path)  # fmt: skip
    assert unsaid.returncode == 2 and "--placement only apply with --engine ray" in unsaid.stderr
    assert _nothing_of_ours_left()


def test_the_cell_magic_runs_on_ray_and_a_fork_launch_still_works_after(cluster, kernel, tmp_path):
    from kernels import run

    _, kc = kernel
    connect = f"%load_ext notebook_accel\nimport ray\nray.init(address={cluster.address!r})\noffset = 5"
    setup = run(kc, connect, timeout=120)
    assert not setup["errors"], setup["errors"]
    cell = (
        "%%accelerate -n 2 --engine ray --placement strict_spread --out y\n"
        "import os\ny = offset + int(os.environ['RANK'])\nprint('ray cell', os.environ['RANK'])"
    )
    seen = run(kc, cell, timeout=180)
    assert not seen["errors"], seen["errors"]
    assert "[rank 0] ray cell 0" in seen["text"] and "[rank 1] ray cell 1" in seen["text"]
    assert run(kc, "print(y)")["text"].strip() == "5"  # rank 0's y
    # Ray's threads now live in the kernel: a fork launch still works, and its ranks leave Ray's alone.
    forked = run(kc, "%%accelerate -n 2\nimport os\nprint('forked', os.environ['RANK'])", timeout=120)
    assert not forked["errors"], forked["errors"]
    assert "[rank 0] forked 0" in forked["text"] and "[rank 1] forked 1" in forked["text"]
    # ... the kernel's own Ray connection is whole: a forked rank running Ray's atexit shutdown would break it.
    # Now from the config file's engine: ray (the cell travels pickled, not the kernel's namespace).
    config = tmp_path / "ray.yaml"
    config.write_text("engine: ray\nplacement: strict_spread\n")
    run(kc, f"import os\nos.environ['NOTEBOOK_ACCEL_CONFIG_FILE'] = {str(config)!r}")
    parent = "import psutil\nprint('again', psutil.Process().parent().name())"  # raylet starts Ray's workers
    again = run(kc, f"%%accelerate -n 2\n{parent}", timeout=180)
    assert not again["errors"], again["errors"]
    assert "[rank 1] again raylet" in again["text"], again["text"]
    assert _nothing_of_ours_left()


@pytest.mark.timeout(600)
def test_the_ray_cluster_notebook_runs(tmp_path, monkeypatch):
    # It starts and stops its own cluster, in its own kernel: this module's cluster is not needed.
    import shutil

    from notebook_accel.demo import run_notebook

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    work = tmp_path / "ray_cluster.ipynb"
    shutil.copy(os.path.join(root, "notebooks", "ray_cluster.ipynb"), work)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    nb, error = run_notebook(str(work), timeout=300)
    assert error is None, error
    text = "\n".join("".join(o.get("text", "")) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "one rank per node, identical weights" in text and "rank 0 said: rank 0 of 2 on node 0" in text
    assert "cluster stopped" in text
