"""The unit conformance run: accelerate 1.15.0's own unit tests against notebook_accel.

    python tests/conformance/units.py [--files test_hooks ...] [--against-accelerate [--write-baseline]]

The test files come unchanged from accelerate's source distribution (wheel.sdist_tests()) and run under
pytest with `accelerate` resolved to notebook_accel (alias/) and `accelerate.test_utils` resolved to
accelerate's real test_utils from the wheel (NOTEBOOK_ACCEL_REAL_TEST_UTILS): strict, so a name we lack
fails the import as it would for a user.

The judge: every test that accelerate 1.15.0 itself passes on a machine without an accelerator
(unit_baseline.txt, measured with --against-accelerate --write-baseline) passes against us, except the
cases in UPSTREAM, where accelerate is wrong: those must fail, each proved by a test of ours. A test
accelerate does not pass here (it skips itself: GPU, Hub, bitsandbytes) may skip or pass, never fail.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from conformance import installs, wheel  # noqa: E402
from conformance.run import run_alone  # noqa: E402

FILES = (
    "test_hooks", "test_big_modeling", "test_modeling_utils", "test_offload", "test_data_loader", "test_utils",
    "test_optimizer", "test_scheduler", "test_grad_sync", "test_kwargs_handlers", "test_memory_utils",
    "test_state_checkpointing", "test_accelerator",
)  # fmt: skip
BASELINE = HERE / "unit_baseline.txt"
TIMEOUT_S = 900

# Tests that accelerate 1.15.0 passes where accelerate is wrong (a bug, not a choice): they must fail
# against us, for the reason given, and a test of ours proves accelerate wrong (named in the reason).
UPSTREAM: dict = {}


@dataclass
class Result:
    id: str
    outcome: str  # "passed", "failed", "skipped"
    message: str = ""


@dataclass
class Run:
    results: dict = field(default_factory=dict)  # id -> Result
    returncode: int = 0
    seconds: float = 0.0
    output: str = ""


def _paths(against_accelerate: bool) -> list:
    folders = [str(installs.install("unit-test-deps", installs.UNIT_TEST_DEPS)), str(installs.transformers())]
    if against_accelerate:
        return [str(installs.install(f"accelerate-{wheel.VERSION}", [wheel.wheel_path()])), *folders]
    return [str(HERE / "alias"), str(HERE.parents[1]), *folders]


def environment(against_accelerate: bool, scratch: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(_paths(against_accelerate))
    env["NOTEBOOK_ACCEL_REAL_TEST_UTILS"] = str(wheel.unpacked() / "accelerate")
    env["NOTEBOOK_ACCEL_CONFIG_FILE"] = os.path.join(scratch, "no-config.yaml")  # no user config leaks in
    env["HF_HUB_OFFLINE"] = "1"  # nothing here reaches the Hub; a test that needs it skips itself
    for name in [n for n in env if n.startswith(("ACCELERATE_", "NOTEBOOK_ACCEL_TEST"))]:
        del env[name]
    return env


def _test_id(root: Path, case) -> str:
    """pytest's id (`tests/test_x.py::Class::name`) from a junit testcase."""
    parts = [p for p in (case.get("classname") or "").split(".") if p]
    for cut in range(len(parts), 0, -1):
        module = Path(*parts[:cut]).with_suffix(".py")
        if (root / module).exists():
            return "::".join([module.as_posix(), *parts[cut:], case.get("name")])
    return "::".join([*parts, case.get("name")])


def parse(root: Path, junit: Path) -> dict:
    results = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "") + "\n" + (child.text or "")
            elif child.tag == "skipped" and outcome == "passed":
                outcome, message = "skipped", child.get("message") or ""
        result = Result(_test_id(root, case), outcome, message.strip())
        results[result.id] = result
    return results


def run(files=FILES, against_accelerate: bool = False, timeout: float = TIMEOUT_S, extra=()) -> Run:
    root = wheel.sdist_tests()
    with tempfile.TemporaryDirectory(prefix="unit-conformance-") as scratch:
        junit = Path(scratch) / "junit.xml"
        config = Path(scratch) / "pytest.ini"  # accelerate's tests under pytest's defaults, not our repo's settings
        config.write_text("[pytest]\n")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(config),
                   "--rootdir", str(root),
                   "--timeout", "300", "--junitxml", str(junit), *extra, *[f"tests/{name}.py" for name in files]]
        started = time.monotonic()
        returncode, output = run_alone(command, environment(against_accelerate, scratch), root, timeout)
        outcome = Run(returncode=returncode, seconds=time.monotonic() - started, output=output)
        if junit.exists():
            outcome.results = parse(root, junit)
        return outcome


def baseline() -> list:
    return [line for line in BASELINE.read_text().splitlines() if line and not line.startswith("#")]


def judge(outcome: Run, expected_passes, upstream=UPSTREAM, files=FILES) -> list:
    """What is wrong with a run against notebook_accel, one line each; empty when it conforms."""
    problems = []
    wanted = [i for i in expected_passes if i.split("::")[0] in {f"tests/{name}.py" for name in files}]
    for test_id in wanted:
        result = outcome.results.get(test_id)
        if result is None:
            problems.append(f"{test_id}: did not run (accelerate passes it)")
        elif test_id in upstream:
            if result.outcome != "failed":
                problems.append(f"{test_id}: {result.outcome}, but it is listed as failing because accelerate is wrong "
                                f"({upstream[test_id]}); the list is stale?")
        elif result.outcome != "passed":
            problems.append(f"{test_id}: {result.outcome} (accelerate passes it): {result.message[:1500]}")
    for test_id, result in sorted(outcome.results.items()):
        if test_id not in wanted and result.outcome == "failed":
            problems.append(f"{test_id}: failed (accelerate does not fail it here): {result.message[:1500]}")
    if not outcome.results:
        problems.append(f"no test ran (exit {outcome.returncode}):\n{outcome.output[-4000:]}")
    return problems


def table(outcome: Run, files=FILES) -> str:
    rows = []
    for name in files:
        mine = [r for r in outcome.results.values() if r.id.startswith(f"tests/{name}.py::")]
        counts = {kind: sum(r.outcome == kind for r in mine) for kind in ("passed", "failed", "skipped")}
        rows.append(f"{name:<26} {counts['passed']:>4} passed {counts['failed']:>4} failed {counts['skipped']:>4} skipped")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=list(FILES))
    parser.add_argument("--against-accelerate", action="store_true", help="run accelerate 1.15.0 itself instead")
    parser.add_argument("--write-baseline", action="store_true", help="with --against-accelerate: record its passes")
    args = parser.parse_args(argv)
    outcome = run(args.files, against_accelerate=args.against_accelerate)
    print(table(outcome, args.files))
    print(f"{len(outcome.results)} tests in {outcome.seconds:.0f} s")
    if args.against_accelerate:
        passes = sorted(r.id for r in outcome.results.values() if r.outcome == "passed")
        if args.write_baseline:
            BASELINE.write_text(
                f"# Tests accelerate {wheel.VERSION} passes on a machine without an accelerator, measured by\n"
                "# `python tests/conformance/units.py --against-accelerate --write-baseline` (one id a line).\n"
                + "\n".join(passes) + "\n")
            print(f"wrote {len(passes)} ids to {BASELINE}")
        return 0
    problems = judge(outcome, baseline(), files=args.files)
    for problem in problems:
        print(problem)
    for test_id, why in UPSTREAM.items():
        print(f"    {test_id} fails: accelerate {wheel.VERSION} is wrong there: {why}")
    print(f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
