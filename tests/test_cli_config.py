"""`notebook-accel config` through a real pseudo-terminal, `--default`, `env` with a config, and
argparse conventions on every command."""

from __future__ import annotations

import os
import subprocess
import sys

import pexpect
import pytest

from notebook_accel import config as cfg

SCRIPT = os.path.join(os.path.dirname(sys.executable), "notebook-accel")


def _env(tmp_path, **extra) -> dict:
    # The default config lives in tmp_path, never in the user's home.
    return {**os.environ, cfg.CONFIG_ENV: str(tmp_path / "default_config.yaml"), **extra}


@pytest.mark.timeout(60)
def test_questionnaire_typed_in_a_terminal_with_wrong_answers_asked_again(tmp_path):
    child = pexpect.spawn(SCRIPT, ["config"], env=_env(tmp_path), encoding="utf-8", timeout=40)
    try:
        answers = [
            ("Compute environment", ""),
            ("How many machines", "zero"),
            ("enter a whole number. Try again.", None),
            ("How many machines", "2"),
            ("rank of this machine", "3"),  # only 0 and 1 exist
            ("enter a number from 0 to 1", None),
            ("rank of this machine", "1"),
            ("IP address or host name of the main machine", "not an address!"),
            ("enter an IP address", None),
            ("IP address or host name of the main machine", "127.0.0.1"),
            ("Port on the main machine", "29555"),
            ("Rendezvous backend", "C10D"),
            ("No accelerator found here", None),
            ("How many processes on each machine", "2"),
            ("Mixed precision", "bf16"),
            ("debug mode", "y"),
            ("Use FSDP (fully sharded data parallel)", "n"),
            ("Config saved to", None),
        ]
        for prompt, answer in answers:
            child.expect_exact(prompt)
            if answer is not None:
                child.sendline(answer)
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    config = cfg.load_config(tmp_path / "default_config.yaml")
    assert (config.num_machines, config.machine_rank, config.num_processes) == (2, 1, 4)  # 4 on all machines
    assert (config.main_process_ip, config.main_process_port, config.rdzv_backend) == ("127.0.0.1", 29555, "c10d")
    assert config.distributed_type == "MULTI_CPU" and config.use_cpu and config.mixed_precision == "bf16"
    assert config.debug is True
    assert "fsdp_config" not in config.extra and config.launch_env() == {}


def _answer(child, answers):
    for prompt, answer in answers:
        child.expect_exact(prompt)
        if answer is not None:
            child.sendline(answer)
    child.expect(pexpect.EOF)


@pytest.mark.timeout(60)
def test_questionnaire_writes_fsdp_in_accelerates_schema_and_the_plan_uses_it(tmp_path, monkeypatch):
    child = pexpect.spawn(SCRIPT, ["config"], env=_env(tmp_path), encoding="utf-8", timeout=40)
    try:
        _answer(child, [
            ("Compute environment", ""), ("How many machines", ""), ("How many processes on each machine", "2"),
            ("Mixed precision", ""), ("debug mode", ""), ("Use FSDP (fully sharded data parallel)", "yes"),
            ("FSDP version: 2", None), ("auto wrap policy", "size_based_wrap"),
            ("Parameters a submodule needs for its own shard", "-5"), ("enter 0 or more. Try again.", None),
            ("Parameters a submodule needs for its own shard", "1000"),
            ("Free gathered parameters after forward", "no"), ("How save_state writes the model", "FULL_STATE_DICT"),
            ("Activation checkpointing", "yes"), ("real weights on rank 0 only", "yes"), ("Config saved to", None),
        ])  # fmt: skip
    finally:
        child.close()
    assert child.exitstatus == 0
    path = tmp_path / "default_config.yaml"
    import yaml

    written = yaml.safe_load(path.read_text())
    assert written["distributed_type"] == "FSDP" and written["num_processes"] == 2 and written["use_cpu"] is True
    assert written["fsdp_config"] == {
        "fsdp_version": 2, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1000,
        "fsdp_reshard_after_forward": False, "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_activation_checkpointing": True, "fsdp_cpu_ram_efficient_loading": True, "fsdp_offload_params": False,
    }  # fmt: skip
    from notebook_accel.launch import make_plan

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    plan = make_plan(use_port="auto", config_file=str(path))
    assert plan.fsdp and plan.num_processes == 2
    assert plan.rank_env(1)["ACCELERATE_USE_FSDP"] == "true"
    assert plan.fsdp_settings == {
        "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "size_based_wrap", "FSDP_MIN_NUM_PARAMS": "1000",
        "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
        "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
        "FSDP_OFFLOAD_PARAMS": "false",
    }  # fmt: skip


@pytest.mark.timeout(60)
def test_questionnaire_fsdp_transformer_classes_and_no_question_for_one_process(tmp_path):
    child = pexpect.spawn(SCRIPT, ["config"], env=_env(tmp_path), encoding="utf-8", timeout=40)
    try:
        _answer(child, [
            ("Compute environment", ""), ("How many machines", ""), ("How many processes on each machine", "4"),
            ("Mixed precision", ""), ("debug mode", ""), ("Use FSDP", "y"), ("auto wrap policy", ""),
            ("Transformer layer class names to wrap", "Block, my layer"), ("'my layer' is not a class name", None),
            ("Transformer layer class names to wrap", "Block, Head"), ("Free gathered parameters", ""),
            ("How save_state writes the model", ""), ("Activation checkpointing", ""), ("real weights on rank 0", ""),
            ("Config saved to", None),
        ])  # fmt: skip
    finally:
        child.close()
    assert child.exitstatus == 0
    config = cfg.load_config(tmp_path / "default_config.yaml")
    fsdp = config.extra["fsdp_config"]
    assert config.distributed_type == "FSDP" and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "Block,Head" and "fsdp_min_num_params" not in fsdp
    assert fsdp["fsdp_reshard_after_forward"] is True and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is False
    assert config.launch_env()["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "Block,Head"
    # One process: nothing to shard, so no FSDP question.
    child = pexpect.spawn(SCRIPT, ["config"], env=_env(tmp_path), encoding="utf-8", timeout=40)
    try:
        child.expect_exact("Compute environment")
        child.sendline("")
        child.expect_exact("How many machines")
        child.sendline("")
        child.expect_exact("How many processes on each machine")
        child.sendline("1")
        child.expect_exact("Mixed precision")
        child.sendline("")
        child.expect_exact("debug mode")
        child.sendline("")
        index = child.expect_exact(["Use FSDP", "Config saved to"])
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert index == 1 and cfg.load_config(tmp_path / "default_config.yaml").distributed_type == "NO"


@pytest.mark.timeout(60)
def test_questionnaire_ended_early_writes_nothing(tmp_path):
    child = pexpect.spawn(SCRIPT, ["config"], env=_env(tmp_path), encoding="utf-8", timeout=40)
    try:
        child.expect_exact("Compute environment")
        child.sendline("")
        child.expect_exact("How many machines")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 1
    assert not (tmp_path / "default_config.yaml").exists()


@pytest.mark.timeout(60)
def test_default_writes_a_config_for_this_machine(tmp_path):
    target = tmp_path / "sub" / "mine.yaml"
    done = subprocess.run([SCRIPT, "config", "--default", "--config_file", str(target)], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=50)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert str(target) in done.stdout
    config = cfg.load_config(target)
    from notebook_accel import hardware

    report = hardware.report()
    if report.accelerators:
        assert config.num_processes == len(report.accelerators) and not config.use_cpu
    else:
        assert config.use_cpu and config.num_processes == 1 and config.distributed_type == "NO"
    assert not (tmp_path / "default_config.yaml").exists()  # --config_file wrote elsewhere
    assert "stall_after" not in target.read_text()  # our own key, written only when set


@pytest.mark.timeout(60)
def test_env_shows_the_config_in_use(tmp_path):
    (tmp_path / "default_config.yaml").write_text("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 3\n")
    done = subprocess.run([SCRIPT, "env"], env=_env(tmp_path), capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert f"Config: {tmp_path / 'default_config.yaml'}" in done.stdout
    assert "  num_processes: 3" in done.stdout and "torch" in done.stdout
    (tmp_path / "default_config.yaml").write_text("num_processes: 3\nflavour: mint\n")
    bad = subprocess.run([SCRIPT, "env"], env=_env(tmp_path), capture_output=True, text=True, timeout=50)
    assert bad.returncode == 0 and "is invalid" in bad.stdout and "'flavour'" in bad.stdout


@pytest.mark.timeout(60)
def test_every_command_has_help_and_bad_arguments_exit_2_with_usage(tmp_path):
    for command in ("config", "launch", "env", "test", "merge-weights"):
        done = subprocess.run([SCRIPT, command, "--help"], capture_output=True, text=True, timeout=50)
        assert done.returncode == 0 and done.stdout.startswith(f"usage: notebook-accel {command}"), done.stderr
    cases = [
        ["launch", "--num_processes", "zero", "x.py"],
        ["launch", "--mixed_precision", "fp32", "x.py"],
        ["launch", "--cpu"],  # no script
        ["launch", "--cpu", str(tmp_path / "missing.py")],
        ["config", "--no-such-flag"],
        ["merge-weights", str(tmp_path)],  # no output path
        ["launch", "--fsdp_version", "1", "x.py"],
        ["launch", "--stall_after", "1m", "x.py"],
        ["frobnicate"],
    ]
    for argv in cases:
        done = subprocess.run([SCRIPT, *argv], env=_env(tmp_path), capture_output=True, text=True, timeout=50)
        assert done.returncode == 2 and "usage: notebook-accel" in done.stderr, (argv, done.stderr)
