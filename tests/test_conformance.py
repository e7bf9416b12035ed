"""accelerate 1.15.0's own tests run unchanged against notebook_accel (tests/conformance/): its distributed
test scripts, from its downloaded wheel, where every test call passes on 2 and 4 gloo ranks; and its unit
tests, from its downloaded sdist, where every test accelerate itself passes here passes against us."""

import json
import os
import subprocess
import sys

import pytest
from conformance import run as conformance
from conformance import units

HERE = os.path.dirname(__file__)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("script", [*conformance.DISTRIBUTED, conformance.NOTEBOOK])
def test_accelerate_script_passes(script, ranks):
    outcome = conformance.check(script, ranks)
    errors = "\n".join(c["error"] for c in outcome.calls if c["ok"] is False)
    assert outcome.ok, f"{outcome.line()}\n{errors}\n{outcome.output[-6000:]}"
    assert outcome.passed >= 4  # each script makes at least four test calls on every rank count


def _observe(tmp_path, source: str):
    script = tmp_path / "script.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "conformance", "alias"), *sys.path])}
    result = subprocess.run(
        [sys.executable, os.path.join(HERE, "conformance", "observe.py"), str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    return result, json.loads((tmp_path / "rank0.json").read_text())


def test_the_observer_records_passes_and_the_first_failure(tmp_path):
    result, report = _observe(
        tmp_path,
        "def check_helper(x):\n    assert x\n\n"
        "def test_passes():\n    check_helper(True)\n\n"
        "def parity_check():\n    check_helper(False)\n\n"
        "def test_never_reached():\n    pass\n\n"
        "def main():\n    test_passes()\n    parity_check()\n    test_never_reached()\n\n"
        "if __name__ == '__main__':\n    main()\n",
    )
    assert result.returncode == 1
    assert [(c["name"], c["ok"]) for c in report["calls"]] == [("test_passes", True), ("parity_check", False)]
    assert "AssertionError" in report["calls"][1]["error"] and not report["finished"]


def test_the_alias_is_notebook_accel_itself(tmp_path):
    result, report = _observe(
        tmp_path,
        "import accelerate, notebook_accel, notebook_accel.utils.operations as ops\n"
        "from accelerate.utils.operations import gather\n"
        "from accelerate.test_utils import RegressionDataset\n"
        "import accelerate.state\n"
        "def test_same_objects():\n"
        "    assert accelerate is notebook_accel and gather is ops.gather\n"
        "    assert accelerate.state is notebook_accel.state and len(RegressionDataset(length=8)) == 8\n"
        "def test_missing_module_fails_as_it_would():\n"
        "    try:\n        import accelerate.no_such_module\n    except ModuleNotFoundError:\n        return\n"
        "    raise AssertionError('imported a module that does not exist')\n"
        "test_same_objects()\ntest_missing_module_fails_as_it_would()\n",
    )
    assert result.returncode == 0, result.stderr
    assert [(c["name"], c["ok"]) for c in report["calls"]] == [
        ("test_same_objects", True), ("test_missing_module_fails_as_it_would", True)
    ]


@pytest.mark.alone  # accelerate's test_free_memory... compares the machine's free RAM before and after
@pytest.mark.timeout(1200)
def test_accelerate_unit_tests_pass():
    outcome = units.run()
    problems = units.judge(outcome, units.baseline())
    assert not problems, f"{units.table(outcome)}\n" + "\n".join(problems) + f"\n{outcome.output[-3000:]}"
    passed = sum(r.outcome == "passed" for r in outcome.results.values())
    assert passed >= len(units.baseline()) - len(units.UPSTREAM), units.table(outcome)


def _run_of(**outcomes):
    return units.Run(results={i: units.Result(i, o) for i, o in outcomes.items()})


def test_the_unit_judge_names_every_divergence():
    base = ["tests/test_a.py::T::test_ok", "tests/test_a.py::T::test_gone", "tests/test_a.py::T::test_skips",
            "tests/test_a.py::T::test_bug"]
    run = _run_of(**{"tests/test_a.py::T::test_ok": "passed", "tests/test_a.py::T::test_skips": "skipped",
                     "tests/test_a.py::T::test_bug": "passed", "tests/test_a.py::T::test_gpu": "failed",
                     "tests/test_a.py::T::test_gpu_only": "skipped"})
    problems = units.judge(run, base, upstream={"tests/test_a.py::T::test_bug": "accelerate is wrong"}, files=["test_a"])
    assert [p.split(":")[0] + ":" + p.split("::")[2].split(":")[0] for p in problems] == [
        "tests/test_a.py:test_gone", "tests/test_a.py:test_skips", "tests/test_a.py:test_bug",
        "tests/test_a.py:test_gpu"]
    assert "did not run" in problems[0] and "skipped" in problems[1] and "stale" in problems[2]
    assert "does not fail it here" in problems[3]
    fixed = _run_of(**{i: "passed" for i in base[:3]}, **{base[3]: "failed"})
    assert units.judge(fixed, base, upstream={base[3]: "accelerate is wrong"}, files=["test_a"]) == []
    assert "no test ran" in units.judge(units.Run(returncode=4), [], files=["test_a"])[0]
