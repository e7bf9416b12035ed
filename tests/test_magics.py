"""%%accelerate and %accelerate in a real kernel (nbclient), with the console sink so the ranks'
text lands in the cell's output. One notebook, run once; each test reads its own cells."""

from __future__ import annotations

import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

CELLS = {
    "setup": "%load_ext notebook_accel\nimport os, threading\noffset = 10\n"
    "class Scale:\n    def __init__(self, k):\n        self.k = k\n\n    def apply(self, x):\n        return self.k * x",
    "hello": '%%accelerate -n 2 --port auto\nr = int(os.environ["RANK"])\nprint("hello", r, offset)\nprint("a", 1)',
    "out": "%%accelerate -n 2 --port auto --out losses,world\nimport torch.distributed as dist\n"
    "losses = [1.0, 0.5 * (dist.get_rank() + 1)]\nworld = dist.get_world_size()",
    "use_out": 'print("LOSSES", losses, world)',
    "fail": '%%accelerate -n 2 --port auto\nimport time\nif int(os.environ["RANK"]) == 1:\n'
    '    raise ValueError("bad on rank 1")\ntime.sleep(20)\nopen(f"late-{os.environ[\'RANK\']}", "w").close()',
    "after_fail": 'print("still alive")',
    "spawn": "%%accelerate -n 2 --start-method spawn --port auto --out result\n"
    'result = Scale(3).apply(int(os.environ["RANK"]) + 1)',
    "use_spawn": 'print("RESULT", result)',
    "lock": "lock = threading.Lock()",
    "unpicklable": "%%accelerate -n 2 --start-method spawn --port auto\nprint(lock)",
    "bad_n": "%%accelerate -n zero\npass",
    "missing_out": "%%accelerate -n 2 --port auto --out nowhere\nx = 1",
    "timeout": "%%accelerate -n 2 --port auto --timeout 2\nimport time\ntime.sleep(30)",
    "config": "%accelerate config",
    "hardware": "%accelerate hardware",
    "bad_line": "%accelerate fly",
    "alive": 'print("ALIVE", len(__import__("psutil").Process().children(recursive=True)))',
    "unload": "%unload_ext notebook_accel",
    "after_unload": "%accelerate config",
}


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    folder = tmp_path_factory.mktemp("magics")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in CELLS.values()])
    env = {**os.environ, "NOTEBOOK_ACCEL_WIDGETS": "0", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=120,
        allow_errors=True,
        resources={"metadata": {"path": str(folder)}},
    )
    client.kernel_manager_class = __import__("notebook_accel.demo", fromlist=["x"])._kernel_manager_class()
    client.execute(env=env)
    out = dict(zip(CELLS, nb.cells))
    out["_folder"] = folder
    return out


def _text(cell, stream=None) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and stream in (None, o.name))


def _error(cell):
    errors = [o for o in cell.outputs if o.output_type == "error"]
    return errors[0] if errors else None


@pytest.mark.timeout(200)
def test_cell_runs_on_two_ranks_with_the_notebook_globals(cells):
    assert _error(cells["setup"]) is None and _error(cells["hello"]) is None, cells["hello"].outputs
    text = _text(cells["hello"])
    assert "[rank 0] hello 0 10" in text and "[rank 1] hello 1 10" in text
    assert "[rank 0] a 1" in text  # print's separator survives


def test_out_brings_rank_zero_values_into_the_notebook(cells):
    assert _error(cells["out"]) is None, cells["out"].outputs
    assert "LOSSES [1.0, 0.5] 2" in _text(cells["use_out"])


def test_failing_rank_fails_the_cell_with_its_cell_line_and_the_kernel_goes_on(cells):
    error = _error(cells["fail"])
    assert error is not None and error.ename == "CellFailedError"
    assert "rank 1 raised ValueError: bad on rank 1" in error.evalue
    assert "Cell In[" in error.evalue and 'raise ValueError("bad on rank 1")' in error.evalue
    assert "cells.py" not in error.evalue and "worker.py" not in error.evalue  # no launcher frames
    assert "still alive" in _text(cells["after_fail"])
    assert not list(cells["_folder"].glob("late-*"))  # rank 0 was stopped, not left to finish


def test_spawn_cell_uses_a_class_from_an_earlier_cell(cells):
    assert _error(cells["spawn"]) is None, cells["spawn"].outputs
    assert "RESULT 3" in _text(cells["use_spawn"])


def test_unpicklable_global_is_named_before_anything_starts(cells):
    error = _error(cells["unpicklable"])
    assert error is not None and error.ename == "CellUnpicklableError"
    assert "'lock'" in error.evalue and "--start-method fork" in error.evalue
    assert "[rank" not in _text(cells["unpicklable"])


def test_bad_arguments_and_commands_get_usage_errors(cells):
    assert "must be a whole number, got 'zero'" in _text(cells["bad_n"], "stderr")
    assert "expected one of hardware, env, config, start, stop, restart, status, push, pull, auto, got 'fly'" in _text(cells["bad_line"], "stderr")
    error = _error(cells["missing_out"])
    assert error is not None and "--out names 'nowhere'" in error.evalue


def test_timeout_stops_the_ranks_and_fails_the_cell(cells):
    error = _error(cells["timeout"])
    assert error is not None and error.ename == "CellTimeoutError"
    assert "timed out after 2 s" in error.evalue


def test_line_magic_shows_config_and_hardware(cells):
    assert "No config file at" in _text(cells["config"])
    text = _text(cells["hardware"])
    assert "Hardware report" in text and "Environment" in text and sys.version.split()[0] in text


def test_no_rank_outlives_its_cell(cells):
    assert "ALIVE 0" in _text(cells["alive"]), _text(cells["alive"])


def test_unload_removes_the_magics(cells):
    assert _error(cells["unload"]) is None
    assert "No config file" not in _text(cells["after_unload"])
    assert "Line magic function `%accelerate` not found" in _text(cells["after_unload"], "stderr")
