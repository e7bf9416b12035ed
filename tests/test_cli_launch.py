"""`notebook-accel launch` and `notebook-accel test` in real processes: ranks, modules, failures, a
config file as the default, and two machines simulated on localhost."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from notebook_accel import config as cfg
from notebook_accel.launch.plan import free_port

SCRIPT = os.path.join(os.path.dirname(sys.executable), "notebook-accel")

# Each rank prints what it is; rank 1 fails when asked to; `--exit0` ends with sys.exit(0).
RANKS_SCRIPT = textwrap.dedent(
    """\
    import sys
    from notebook_accel import PartialState

    state = PartialState()
    print(f"REPORT rank={state.process_index} world={state.num_processes} type={state.distributed_type} "
          f"name={__name__} argv={sys.argv[1:]}")
    if "--fail" in sys.argv and state.process_index == 1:
        raise LookupError("rank one cannot find it")
    if "--exit0" in sys.argv:
        sys.exit(0)
    """
)


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "ranks.py").write_text(RANKS_SCRIPT)
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(RANKS_SCRIPT)
    return tmp_path


def _launch(workdir, *argv, timeout=80, config_text=None):
    # The default config lives in workdir, never in the user's home.
    config = workdir / "default_config.yaml"
    if config_text is not None:
        config.write_text(config_text)
    env = {**os.environ, cfg.CONFIG_ENV: str(config)}
    return subprocess.run([SCRIPT, "launch", *argv], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _reports(text: str) -> dict:
    """rank -> the fields its REPORT line printed, only from lines the launcher prefixed with that rank."""
    out = {}
    for prefix, rest in re.findall(r"^\[rank (\d+)\] REPORT (.*)$", text, re.M):
        fields = dict(part.split("=", 1) for part in rest.split(" ", 4))
        assert fields["rank"] == prefix, text
        out[int(prefix)] = fields
    return out


@pytest.mark.timeout(90)
def test_cpu_two_processes_are_two_multi_cpu_ranks_with_the_script_args(workdir):
    done = _launch(workdir, "--cpu", "--num_processes", "2", "ranks.py", "--lr", "0.1", "--exit0")
    assert done.returncode == 0, done.stderr
    reports = _reports(done.stdout)
    assert sorted(reports) == [0, 1]
    for fields in reports.values():
        assert fields["world"] == "2" and fields["type"] == "MULTI_CPU" and fields["name"] == "__main__"
        assert fields["argv"] == "['--lr', '0.1', '--exit0']"


@pytest.mark.timeout(90)
def test_a_long_line_reaches_the_terminal_whole(workdir):
    """A notebook cell cuts a line past 16 KiB; the command line hands it on as the rank wrote it."""
    (workdir / "long.py").write_text("print('x' * 100_000 + 'END')\n")
    done = _launch(workdir, "--cpu", "--num_processes", "2", "long.py")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("[rank ")]
    assert sorted(lines) == [f"[rank {r}] " + "x" * 100_000 + "END" for r in (0, 1)]


@pytest.mark.timeout(90)
def test_module_launch_runs_the_module_as_main(workdir):
    done = _launch(workdir, "--cpu", "--num_processes", "2", "-m", "mypkg.train", "x")
    assert done.returncode == 0, done.stderr
    reports = _reports(done.stdout)
    assert sorted(reports) == [0, 1] and {f["argv"] for f in reports.values()} == {"['x']"}
    assert {f["name"] for f in reports.values()} == {"__main__"}


@pytest.mark.timeout(90)
def test_failing_rank_exits_non_zero_with_its_traceback(workdir):
    done = _launch(workdir, "--cpu", "--num_processes", "2", "ranks.py", "--fail")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rank 1 raised LookupError: rank one cannot find it" in done.stderr
    assert "Traceback from rank 1" in done.stderr
    assert 'raise LookupError("rank one cannot find it")' in done.stderr  # the script's own source line


@pytest.mark.timeout(90)
def test_config_file_supplies_what_the_command_line_leaves_out(workdir):
    config = "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\nmixed_precision: 'no'\n"
    done = _launch(workdir, "ranks.py", config_text=config)
    assert done.returncode == 0, done.stderr
    assert sorted(_reports(done.stdout)) == [0, 1]
    assert "num_processes=2" in done.stderr  # the launch says where its settings came from
    # A broken config names the file and the key, and nothing starts.
    bad = _launch(workdir, "ranks.py", config_text=config + "num_gpus: 3\n")
    assert bad.returncode == 1 and "'num_gpus'" in bad.stderr and "default_config.yaml" in bad.stderr
    assert "REPORT" not in bad.stdout


@pytest.mark.timeout(90)
def test_two_machines_on_localhost_meet_through_c10d(workdir):
    port = str(free_port())
    env = {**os.environ, cfg.CONFIG_ENV: str(workdir / "none.yaml")}
    nodes = [
        subprocess.Popen(
            [SCRIPT, "launch", "--cpu", "--num_processes", "4", "--num_machines", "2", "--machine_rank", str(rank),
             "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--rdzv_backend", "c10d", "ranks.py"],
            cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            out, err = node.communicate(timeout=80)
            assert node.returncode == 0, err[-3000:]
            outputs.append(out)
    finally:
        for node in nodes:
            node.kill()
    per_node = [_reports(text) for text in outputs]
    assert [len(r) for r in per_node] == [2, 2]  # each machine ran 2 of the 4 ranks and printed them
    merged = {**per_node[0], **per_node[1]}
    assert sorted(merged) == [0, 1, 2, 3]
    assert all(f["world"] == "4" and f["type"] == "MULTI_CPU" for f in merged.values())


@pytest.mark.timeout(90)
def test_self_check_says_success(tmp_path):
    env = {**os.environ, cfg.CONFIG_ENV: str(tmp_path / "none.yaml")}
    done = subprocess.run([SCRIPT, "test"], env=env, capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("success")
    assert "rank 0 of 2: ok" in done.stdout and "rank 1 of 2: ok" in done.stdout


# Each rank prints its distributed type and the FSDP plugin its Accelerator built from the variables.
FSDP_SCRIPT = textwrap.dedent(
    """\
    import torch
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    plugin = accelerator.state.fsdp_plugin
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)))
    sharded = sorted(n or "root" for n, m in model.named_modules() if type(m).__name__.startswith("FSDP"))
    print(f"FSDP rank={accelerator.process_index} type={accelerator.distributed_type} "
          f"policy={plugin and plugin.auto_wrap_policy} min={plugin and plugin.min_num_params} "
          f"reshard={plugin and plugin.reshard_after_forward} "
          f"sdt={plugin and plugin.state_dict_type.name} sharded={','.join(sharded)}")
    """
)


def _fsdp_reports(text: str) -> dict:
    found = re.findall(r"^\[rank (\d+)\] FSDP (.*)$", text, re.M)
    return {int(rank): dict(part.split("=", 1) for part in rest.split(" ")) for rank, rest in found}


@pytest.mark.timeout(120)
def test_use_fsdp_and_fsdp_flags_reach_every_ranks_plugin(workdir, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    (workdir / "fsdp_ranks.py").write_text(FSDP_SCRIPT)
    done = _launch(
        workdir, "--cpu", "--num_processes", "2", "--use_fsdp", "--fsdp_version", "2",
        "--fsdp_auto_wrap_policy", "size_based_wrap", "--fsdp_min_num_params", "30",
        "--fsdp_reshard_after_forward", "false", "--fsdp_state_dict_type", "FULL_STATE_DICT", "fsdp_ranks.py",
        timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    reports = _fsdp_reports(done.stdout)
    assert sorted(reports) == [0, 1], done.stdout
    for fields in reports.values():
        assert fields == {
            "rank": fields["rank"], "type": "FSDP", "policy": "size_based_wrap", "min": "30", "reshard": "False",
            "sdt": "FULL_STATE_DICT", "sharded": "0,root",  # the 40-parameter layer has its own shard
        }  # fmt: skip


@pytest.mark.timeout(120)
def test_fsdp_from_the_config_and_use_fsdp_without_settings(workdir, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    (workdir / "fsdp_ranks.py").write_text(FSDP_SCRIPT)
    config = "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\n"
    done = _launch(workdir, "--use_fsdp", "fsdp_ranks.py", config_text=config, timeout=110)
    assert done.returncode == 0, done.stderr
    reports = _fsdp_reports(done.stdout)
    assert sorted(reports) == [0, 1]
    assert {(f["type"], f["policy"], f["sharded"]) for f in reports.values()} == {("FSDP", "no_wrap", "root")}
    # Without --use_fsdp that config is plain data parallel.
    plain = _launch(workdir, "fsdp_ranks.py", config_text=config, timeout=110)
    assert plain.returncode == 0, plain.stderr
    assert {f["type"] for f in _fsdp_reports(plain.stdout).values()} == {"MULTI_CPU"}


@pytest.mark.timeout(60)
def test_a_bad_fsdp_flag_is_named_before_any_rank_starts(workdir):
    (workdir / "fsdp_ranks.py").write_text(FSDP_SCRIPT)
    done = _launch(workdir, "--cpu", "--num_processes", "2", "--fsdp_auto_wrap_policy", "each_layer",
                   "fsdp_ranks.py")  # fmt: skip
    assert done.returncode == 2
    assert "fsdp_auto_wrap_policy='each_layer'" in done.stderr and "size_based_wrap" in done.stderr
    assert "FSDP rank" not in done.stdout
