"""The conformance run: accelerate 1.15.0's own distributed test scripts against notebook_accel.

    python tests/conformance/run.py [--ranks 2 4] [--scripts test_ops ...]

Each script comes unchanged from the downloaded wheel (wheel.py) and runs with `accelerate` resolved to
notebook_accel (alias/). test_ops, test_sync and test_script run under `torch.distributed.run` on each
rank count; test_notebook runs as one plain process with ACCELERATE_NUM_PROCESSES set, launching its
own ranks. Prints one line per script and rank count; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import wheel  # noqa: E402

DISTRIBUTED = ("test_ops", "test_sync", "test_script")
NOTEBOOK = "test_notebook"
TIMEOUT_S = 420


@dataclass
class Outcome:
    script: str
    ranks: int
    returncode: int
    seconds: float
    calls: list = field(default_factory=list)  # rank 0's recorded test calls
    disagreeing: list = field(default_factory=list)  # ranks whose results differ from rank 0's
    output: str = ""

    @property
    def passed(self) -> int:
        return sum(call["ok"] for call in self.calls)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.calls and self.passed == len(self.calls) and not self.disagreeing

    def line(self) -> str:
        failed = [c["name"] for c in self.calls if not c["ok"]]
        state = "ok" if self.ok else f"FAILED (exit {self.returncode}{', ' + ', '.join(failed) if failed else ''})"
        return f"{self.script:<14} {self.ranks} ranks: {self.passed}/{len(self.calls)} test calls passed " \
               f"in {self.seconds:.1f} s  {state}"


def environment(report_dir: str, ranks: int) -> dict:
    env = dict(os.environ)
    paths = [str(HERE / "alias"), str(HERE.parents[1])]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["ACCELERATE_NUM_PROCESSES"] = str(ranks)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("NOTEBOOK_ACCEL_CONFIG_FILE", None)
    env["NOTEBOOK_ACCEL_CONFIG_FILE"] = os.path.join(report_dir, "no-config.yaml")
    return env


def run_one(name: str, ranks: int, timeout: float = TIMEOUT_S) -> Outcome:
    script = wheel.script(name)
    with tempfile.TemporaryDirectory(prefix=f"conformance-{name}-") as reports:
        observe = [str(HERE / "observe.py"), str(script), reports]
        if name == NOTEBOOK:
            command = [sys.executable, *observe]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                       "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "--monitor_interval=0.1",
                       *observe]
        started = time.monotonic()
        process = subprocess.Popen(command, env=environment(reports, ranks), cwd=reports,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            output += f"\n[conformance] killed after {timeout:.0f} s"
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # nothing the script started outlives it
            except ProcessLookupError:
                pass
        outcome = Outcome(name, ranks, process.returncode, time.monotonic() - started, output=output)
        reports_by_rank = {}
        for path in Path(reports).glob("rank*.json"):
            report = json.loads(path.read_text())
            reports_by_rank[report["rank"]] = report
        if 0 in reports_by_rank:
            outcome.calls = reports_by_rank[0]["calls"]
            expected = [(c["name"], c["ok"]) for c in outcome.calls]
            outcome.disagreeing = [
                r for r, rep in sorted(reports_by_rank.items()) if [(c["name"], c["ok"]) for c in rep["calls"]] != expected
            ]
            if name != NOTEBOOK and len(reports_by_rank) != ranks:
                outcome.disagreeing += [r for r in range(ranks) if r not in reports_by_rank]
        return outcome


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--scripts", nargs="+", default=[*DISTRIBUTED, NOTEBOOK])
    parser.add_argument("--verbose", action="store_true", help="print every script's output")
    args = parser.parse_args(argv)
    failures = 0
    for name in args.scripts:
        for ranks in args.ranks:
            outcome = run_one(name, ranks)
            print(outcome.line(), flush=True)
            if args.verbose or not outcome.ok:
                print(outcome.output[-6000:], flush=True)
                for call in outcome.calls:
                    if not call["ok"]:
                        print(call["error"], flush=True)
            failures += not outcome.ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
