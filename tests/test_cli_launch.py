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
