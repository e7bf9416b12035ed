"""Hugging Face's accelerate 1.15 (and transformers' Trainer) inside ranks of our launcher on a machine
without an accelerator: one N-process job, not N separate ones (the plan's ACCELERATE_USE_CPU=1).

The packages are installed with `pip install --target` into build/real-accelerate/ (conformance/installs.py:
cached, one folder per version, never into the dev venv), and only the ranks put that folder on their sys.path.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import real_accelerate_targets as targets
import torch
from conformance import installs, wheel

from notebook_accel import hardware
from notebook_accel.launch import make_plan, notebook_launcher
from notebook_accel.utils import imports

ACCELERATE = wheel.VERSION

no_accelerator = pytest.mark.skipif(
    hardware.detect_device_family() is not None, reason="the ranks run on the CPU only where no accelerator is"
)


@pytest.fixture(scope="module")
def accelerate_folder() -> str:
    return str(installs.install(f"accelerate-{ACCELERATE}", [wheel.wheel_path()]))


@pytest.fixture(scope="module")
def transformers_folder() -> str:
    try:
        return str(installs.transformers())
    except installs.InstallFailed as exc:
        if exc.offline:
            pytest.skip(f"transformers could not be installed (no network): {exc}")
        raise


@pytest.fixture(autouse=True)
def _no_use_cpu_of_the_caller(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)


def _same_weights(results) -> bool:
    first = results[0]["weights"]
    return all(
        r["weights"].keys() == first.keys() and all(torch.equal(r["weights"][k], first[k]) for k in first)
        for r in results[1:]
    )


# -- the plan ----------------------------------------------------------------------------------
def _plan(**kwargs):
    return make_plan(use_port="auto", **kwargs)


@pytest.mark.timeout(30)
@no_accelerator
def test_several_cpu_ranks_get_use_cpu_and_a_note(monkeypatch):
    monkeypatch.setattr(imports, "hf_accelerate_installed", lambda: True)
    plan = _plan(num_processes=2, start_method="spawn")
    assert plan.rank_env(1)["ACCELERATE_USE_CPU"] == "1"
    assert any("ACCELERATE_USE_CPU=1" in n and "one 2-process job" in n for n in plan.notes), plan.notes
    # Two nodes of one rank each are two ranks too.
    plan = _plan(num_processes=1, num_nodes=2, master_addr="127.0.0.1")
    assert plan.env["ACCELERATE_USE_CPU"] == "1"


@pytest.mark.timeout(30)
def test_accelerate_installed_means_its_distribution(monkeypatch, accelerate_folder):
    # The conformance alias (a bare `accelerate` package) is no install; a real one is.
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "conformance" / "alias"))
    assert not imports.hf_accelerate_installed()
    monkeypatch.syspath_prepend(accelerate_folder)
    assert imports.hf_accelerate_installed()


@pytest.mark.timeout(30)
@no_accelerator
def test_no_note_where_accelerate_is_not_installed(monkeypatch):
    monkeypatch.setattr(imports, "hf_accelerate_installed", lambda: False)
    plan = _plan(num_processes=2, start_method="spawn")
    assert plan.env["ACCELERATE_USE_CPU"] == "1"
    assert not any("ACCELERATE_USE_CPU" in n for n in plan.notes)


@pytest.mark.timeout(30)
@no_accelerator
def test_one_rank_gets_no_use_cpu(monkeypatch):
    monkeypatch.setattr(imports, "hf_accelerate_installed", lambda: True)
    plan = _plan(num_processes=1)
    assert "ACCELERATE_USE_CPU" not in plan.env
    assert not any("ACCELERATE_USE_CPU" in n for n in plan.notes)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", ["0", "false", "1", ""])
def test_the_callers_use_cpu_is_kept(monkeypatch, value):
    monkeypatch.setattr(imports, "hf_accelerate_installed", lambda: True)
    monkeypatch.setenv("ACCELERATE_USE_CPU", value)
    plan = _plan(num_processes=2, start_method="spawn")
    assert "ACCELERATE_USE_CPU" not in plan.env  # the ranks inherit the caller's value
    assert not any("ACCELERATE_USE_CPU" in n for n in plan.notes)
    assert _plan(num_processes=2, start_method="spawn", cpu=True).env["ACCELERATE_USE_CPU"] == "1"  # asked for


@pytest.mark.timeout(30)
def test_accelerator_ranks_get_use_cpu_only_where_they_run_on_the_cpu(monkeypatch):
    monkeypatch.setattr(imports, "hf_accelerate_installed", lambda: True)
    monkeypatch.setattr(hardware, "detect_device_family", lambda: "cuda")
    monkeypatch.setattr(hardware, "device_count", lambda family: 2)
    assert "ACCELERATE_USE_CPU" not in _plan(num_processes=2).env  # one rank per GPU
    assert _plan(num_processes=2, cpu=True).env["ACCELERATE_USE_CPU"] == "1"  # CPU ranks on a GPU machine
    # Apple's GPU has no multi-process backend: several ranks run on the CPU (MULTI_CPU), as ours do.
    monkeypatch.setattr(hardware, "detect_device_family", lambda: "mps")
    assert _plan(num_processes=2).env["ACCELERATE_USE_CPU"] == "1"
    assert "ACCELERATE_USE_CPU" not in _plan(num_processes=1).env


# -- every engine gives the ranks the variable, and our own state does not change -------------
@pytest.mark.timeout(120)
@no_accelerator
@pytest.mark.parametrize("engine", ["fork", "elastic"])
def test_our_own_state_is_the_same_with_use_cpu(monkeypatch, engine):
    extra = {"max_restarts": 1} if engine == "elastic" else {}
    given = notebook_launcher(targets.own_state, num_processes=2, use_port="auto", sinks=[], **extra)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "0")  # the caller's choice: kept, and ours ignores it
    kept = notebook_launcher(targets.own_state, num_processes=2, use_port="auto", sinks=[], **extra)
    for rank, (with_it, without) in enumerate(zip(given, kept)):
        assert with_it == ("1", "MULTI_CPU", 2, rank, "gloo", "cpu")
        assert without == ("0", *with_it[1:])


@pytest.mark.timeout(120)
@no_accelerator
def test_session_workers_get_use_cpu():
    from notebook_accel.session import Session

    with Session(2, on_output=lambda *line: None) as session:
        session.run_cell("import os; value = os.environ.get('ACCELERATE_USE_CPU')")
        assert [session.pull("value", rank) for rank in (0, 1)] == ["1", "1"]


# -- accelerate itself ---------------------------------------------------------------------------
@pytest.mark.timeout(240)
@no_accelerator
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_accelerator_is_one_job_of_two_processes(accelerate_folder, start_method):
    results = notebook_launcher(
        targets.accelerator_trains, ([accelerate_folder],), num_processes=2, start_method=start_method,
        use_port="auto", sinks=[],
    )  # fmt: skip
    assert all(r["file"].startswith(accelerate_folder + os.sep) for r in results)
    assert [(r["num_processes"], r["process_index"]) for r in results] == [(2, 0), (2, 1)]
    assert {r["type"] for r in results} == {"DistributedType.MULTI_CPU"}
    assert [r["batches"] for r in results] == [4, 4]  # each its half of 8 batches
    assert _same_weights(results)  # from different starting weights: DDP made them one model


@pytest.mark.timeout(120)
@no_accelerator
def test_the_callers_false_keeps_accelerate_separate(monkeypatch, accelerate_folder):
    # What the variable fixes: without it every rank is a job of its own on the whole data set.
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")
    results = notebook_launcher(
        targets.accelerator_trains, ([accelerate_folder],), num_processes=2, use_port="auto", sinks=[]
    )
    assert [(r["use_cpu"], r["num_processes"], r["type"], r["batches"]) for r in results] == [
        ("false", 1, "DistributedType.NO", 8)
    ] * 2
    assert not _same_weights(results)


@pytest.mark.timeout(120)
@no_accelerator
def test_bare_partial_state_still_sees_one_process(accelerate_folder):
    # accelerate 1.15's PartialState reads only its cpu argument: documented, not patched. Once an
    # Accelerator (AcceleratorState reads ACCELERATE_USE_CPU) has resolved the state, it is shared.
    results = notebook_launcher(
        targets.partial_states, ([accelerate_folder],), num_processes=2, use_port="auto", sinks=[]
    )
    assert [r["bare"] for r in results] == [(1, "DistributedType.NO", 0)] * 2
    assert [r["after_accelerator"] for r in results] == [(2, "DistributedType.MULTI_CPU", i) for i in (0, 1)]


@pytest.mark.timeout(300)
@no_accelerator
def test_transformers_trainer_is_one_job_of_two_processes(accelerate_folder, transformers_folder, tmp_path):
    results = notebook_launcher(
        targets.trainer_trains, ([accelerate_folder, transformers_folder], str(tmp_path)), num_processes=2,
        use_port="auto", sinks=[],
    )  # fmt: skip
    assert [(r["world_size"], r["num_processes"]) for r in results] == [(2, 2), (2, 2)]
    assert _same_weights(results)
