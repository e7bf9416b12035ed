"""Issue 29's `stall_after`, every way to set it: the argument, NOTEBOOK_ACCEL_STALL_AFTER, the config
file, else 60 s (0: off); each bad value refused naming the value and where it came from; carried to
LaunchPlan.stall_after and to a session and its cells. (The watch that reads it is tested elsewhere.)"""

from __future__ import annotations

import argparse
import math

import pytest
from IPython.core.error import UsageError
from kernels import kernel_children, run
from orphans import children

from notebook_accel import config as cfg
from notebook_accel.commands import launch_cmd
from notebook_accel.jupyter.magics import cell_parser, start_parser
from notebook_accel.launch import LaunchConfigError, launcher, make_plan
from notebook_accel.launch.plan import LaunchPlan
from notebook_accel.launch.stall_settings import (
    DEFAULT_STALL_AFTER,
    STALL_AFTER_ENV,
    resolve_stall_after,
    seconds,
)
from notebook_accel.session import Session

HOW = "write a number of seconds, 0 to turn the watch off"
# value -> how the refusal words it
BAD = [
    ("1m", "is not a number"),
    ("", "is not a number"),
    ("30s", "is not a number"),
    (-1, "is negative"),
    ("-0.5", "is negative"),
    (math.nan, "is not a finite number"),
    ("inf", "is not a finite number"),
    (True, "is true or false, not a number"),
    ([30], "is a list, not a number"),
]


@pytest.fixture(autouse=True)
def no_stall_variable(monkeypatch):
    monkeypatch.delenv(STALL_AFTER_ENV, raising=False)  # a developer's own setting must not leak in


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    path = tmp_path / "default_config.yaml"
    monkeypatch.setenv(cfg.CONFIG_ENV, str(path))

    def write(text: str):
        path.write_text(text)
        return path

    return write


# -- the resolver ----------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_numbers_and_numeric_strings_are_seconds_and_zero_is_off():
    assert [seconds(v) for v in (30, 2.5, "30", "2.5", " 7 ", 0, "0", -0.0)] == [30, 2.5, 30, 2.5, 7, 0, 0, 0]
    assert all(type(seconds(v)) is float for v in (30, "30", 0))
    assert str(seconds(-0.0)) == "0.0"


@pytest.mark.timeout(30)
def test_precedence_is_argument_then_variable_then_config_then_sixty(monkeypatch):
    config = cfg.ClusterConfig(stall_after=30, path="/somewhere/config.yaml")
    assert resolve_stall_after() == DEFAULT_STALL_AFTER == 60.0
    assert resolve_stall_after(None, cfg.ClusterConfig()) == 60.0  # a config without the key
    assert resolve_stall_after(None, config) == 30.0
    monkeypatch.setenv(STALL_AFTER_ENV, "45")
    assert resolve_stall_after(None, config) == 45.0
    assert resolve_stall_after(5, config) == 5.0
    assert resolve_stall_after(0, config) == 0.0  # 0 given is off, not "not given"
    monkeypatch.setenv(STALL_AFTER_ENV, "0")
    assert resolve_stall_after(None, config) == 0.0
    monkeypatch.setenv(STALL_AFTER_ENV, "")  # an empty variable is not set
    assert resolve_stall_after(None, config) == 30.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value, problem", BAD)
def test_each_bad_value_names_itself_and_its_source(monkeypatch, value, problem):
    with pytest.raises(LaunchConfigError) as caught:
        resolve_stall_after(value)
    assert str(caught.value) == f"stall_after={value!r} {problem}: {HOW}."
    if isinstance(value, str) and value:  # a variable is text; an empty one means "not set"
        monkeypatch.setenv(STALL_AFTER_ENV, value)
        with pytest.raises(LaunchConfigError) as caught:
            resolve_stall_after(None, cfg.ClusterConfig(stall_after=30))
        assert str(caught.value) == f"{STALL_AFTER_ENV}={value!r} {problem}: {HOW}."
        monkeypatch.delenv(STALL_AFTER_ENV)
    # A config made in code is not checked until saved: the resolver names its file.
    with pytest.raises(LaunchConfigError) as caught:
        resolve_stall_after(None, cfg.ClusterConfig(stall_after=value, path="/cfg/accel.yaml"))
    assert str(caught.value) == f"stall_after: {value!r} in the config file /cfg/accel.yaml {problem}: {HOW}."


# -- the config file -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_config_key_is_read_by_the_plan_and_written_only_when_set(config_file, tmp_path, monkeypatch):
    path = config_file("num_processes: 1\nstall_after: 30\n")
    assert cfg.load_default().stall_after == 30
    assert make_plan(use_port="auto").stall_after == 30.0
    assert make_plan(use_port="auto", stall_after=2.5).stall_after == 2.5
    monkeypatch.setenv(STALL_AFTER_ENV, "9")
    assert make_plan(use_port="auto").stall_after == 9.0  # the variable beats the file
    monkeypatch.delenv(STALL_AFTER_ENV)
    config_file("num_processes: 1\nstall_after: 0.5\n")
    assert make_plan(use_port="auto").stall_after == 0.5

    written = cfg.ClusterConfig(num_processes=1).save(tmp_path / "plain.yaml")
    assert "stall_after" not in open(written).read()  # accelerate's reader would refuse the key
    assert cfg.load_config(written).stall_after is None
    off = cfg.ClusterConfig(num_processes=1, stall_after=0).save(tmp_path / "off.yaml")
    assert "stall_after: 0\n" in open(off).read()  # 0 is set: the watch is off
    assert cfg.load_config(off).stall_after == 0
    assert str(path) == cfg.default_config_file()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "text, reason",
    [
        ("stall_after: 1m\n", "must be a number of seconds (0 turns the stall watch off), not str '1m'"),
        ("stall_after: '30'\n", "must be a number of seconds (0 turns the stall watch off), not str '30'"),
        ("stall_after: true\n", "not bool True"),
        ("stall_after: -1\n", "-1 must be a number of seconds, 0 or more (0 turns the stall watch off)"),
        ("stall_after: .nan\n", "nan must be a number of seconds, 0 or more"),
        ("stall_after: .inf\n", "inf must be a number of seconds, 0 or more"),
    ],
)
def test_a_bad_config_value_fails_the_launch_naming_file_key_and_value(config_file, text, reason):
    path = config_file(text)
    with pytest.raises(cfg.ConfigError) as caught:
        make_plan(use_port="auto")
    message = str(caught.value)
    assert str(path) in message and "'stall_after'" in message and reason in message, message


# -- launches --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_plan_and_notebook_launcher_carry_it(monkeypatch):
    assert LaunchPlan(num_processes=1, start_method="fork", engine="local").stall_after == 60.0
    assert make_plan(num_processes=1, use_port="auto").stall_after == 60.0
    assert make_plan(num_processes=1, use_port="auto", stall_after=0).stall_after == 0.0
    assert make_plan(num_processes=1, use_port="auto", stall_after="2.5").stall_after == 2.5
    with pytest.raises(LaunchConfigError, match=r"stall_after='1m' is not a number"):
        make_plan(num_processes=1, use_port="auto", stall_after="1m")

    plans = []
    monkeypatch.setattr(launcher, "run_plan", lambda plan, *rest: plans.append(plan) or [None])
    launcher.notebook_launcher(print, num_processes=1, use_port="auto", stall_after=7, sinks=[])
    launcher.notebook_launcher(print, num_processes=1, use_port="auto", sinks=[])
    assert [p.stall_after for p in plans] == [7.0, 60.0]
    with pytest.raises(LaunchConfigError, match=r"stall_after=-3 is negative"):
        launcher.notebook_launcher(print, num_processes=1, use_port="auto", stall_after=-3, sinks=[])
    assert len(plans) == 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("parser", [cell_parser, start_parser], ids=["cell", "start"])
def test_the_magics_parsers_take_seconds_and_zero_and_refuse_the_rest(parser):
    assert parser().parse_args(["--stall-after", "0"]).stall_after == 0.0
    assert parser().parse_args(["--stall-after", "2.5"]).stall_after == 2.5
    assert parser().parse_args([]).stall_after is None  # not given: the session's, variable's, config's
    for text, problem in [("1m", "is not a number"), ("-1", "is negative"), ("nan", "is not a finite number")]:
        with pytest.raises(UsageError) as caught:
            parser().parse_args(["--stall-after", text])
        assert f"argument --stall-after: {text!r} {problem}: {HOW}" in str(caught.value)


@pytest.mark.timeout(60)
def test_the_cli_flag_in_its_underscore_style(capsys):
    parser = argparse.ArgumentParser(prog="notebook-accel launch")
    launch_cmd.add_arguments(parser)
    for flag in ("--stall_after", "--stall-after"):
        args = parser.parse_args([flag, "0", "train.py"])
        assert args.stall_after == 0.0 and launch_cmd._launch_kwargs(args, None)["stall_after"] == 0.0
    args = parser.parse_args(["--stall_after", "2.5", "train.py"])
    assert make_plan(**launch_cmd._launch_kwargs(args, None)).stall_after == 2.5
    assert "stall_after" not in launch_cmd._launch_kwargs(parser.parse_args(["train.py"]), None)
    for text, problem in [("1m", "is not a number"), ("-1", "is negative")]:
        with pytest.raises(SystemExit) as caught:
            parser.parse_args(["--stall_after", text, "train.py"])
        assert caught.value.code == 2
        assert f"argument --stall_after/--stall-after: {text!r} {problem}: {HOW}" in capsys.readouterr().err


# -- sessions --------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_session_resolves_its_value_and_refuses_a_bad_one_before_any_worker(monkeypatch):
    assert Session(2).stall_after == 60.0
    assert Session(2, stall_after=5).stall_after == 5.0
    assert Session(2, stall_after="0").stall_after == 0.0
    monkeypatch.setenv(STALL_AFTER_ENV, "12")
    assert Session(2).stall_after == 12.0 and Session(2, stall_after=3).stall_after == 3.0
    monkeypatch.delenv(STALL_AFTER_ENV)
    before = set(children())
    with pytest.raises(LaunchConfigError, match=r"stall_after='1m' is not a number"):
        Session(2, stall_after="1m")
    monkeypatch.setenv(STALL_AFTER_ENV, "soon")
    with pytest.raises(LaunchConfigError, match=rf"{STALL_AFTER_ENV}='soon' is not a number"):
        Session(2)
    monkeypatch.delenv(STALL_AFTER_ENV)
    # A cell's own value is checked before anything is sent (this session never started).
    with pytest.raises(LaunchConfigError, match=r"stall_after=-1 is negative"):
        Session(2).run_cell("pass", stall_after=-1)
    assert set(children()) <= before


@pytest.mark.timeout(90)
def test_a_started_session_takes_the_config_files_value(config_file, no_orphans):
    config_file("stall_after: 30\n")
    session = Session(1, cpu=True)
    assert session.stall_after == 60.0  # the file is read when the workers start, as make_plan reads it
    with session:
        assert session.stall_after == 30.0
    with Session(1, cpu=True, stall_after=4) as session:
        assert session.stall_after == 4.0  # the argument beats the file
    no_orphans()


@pytest.mark.timeout(180)
def test_the_start_magic_and_session_cells_in_a_kernel(kernel):
    km, kc = kernel

    def ok(code: str) -> str:
        seen = run(kc, code, timeout=120)
        assert seen["reply"]["status"] == "ok", (code, seen["reply"], seen["text"])
        return seen["text"]

    ok(
        f"import os\nos.environ.pop({STALL_AFTER_ENV!r}, None)\n%load_ext notebook_accel\n"
        "from notebook_accel.jupyter import kernel_session\nfrom notebook_accel.session import manager\n"
        "cells = []\nreal_run_cell = manager.Session.run_cell\n"
        "def recording(self, *args, **kwargs):\n"
        "    cells.append(kwargs.get('stall_after'))\n"
        "    return real_run_cell(self, *args, **kwargs)\n"
        "manager.Session.run_cell = recording"
    )
    refused = run(kc, "%accelerate start -n 1 --cpu --stall-after 1m")
    assert refused["reply"]["status"] == "error" and refused["reply"]["ename"] == "UsageError"
    assert f"'1m' is not a number: {HOW}" in refused["reply"]["evalue"]
    assert kernel_children(km) == []  # refused before any worker started
    ok("%accelerate start -n 1 --cpu --stall-after 5")
    assert ok("print('SESSION', kernel_session.current().session.stall_after)") == "SESSION 5.0\n"
    ok("%%accelerate --stall-after 0\nx = 1")
    ok("%%accelerate\nx = 2")
    assert ok("print('CELLS', cells)") == "CELLS [0.0, None]\n"  # None: the session's own 5.0
    ok("%accelerate stop")
