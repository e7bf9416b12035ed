"""What ranks import is imported once by the process that forks them (issue #28, part 1): a script's
fork launches and a fork session's workers inherit torch._dynamo and the training modules instead of
each rank importing them every launch; forkserver ranks find them preloaded in the server;
NOTEBOOK_ACCEL_PREWARM=0 leaves them to the ranks. Real processes in fresh interpreters (this
test process may have imported any of them already)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from notebook_accel.launch import rank_imports

SCRIPT = r"""
import json, sys, threading
from notebook_accel import notebook_launcher
from notebook_accel.launch import rank_imports

def seen():
    import sys
    return sorted(n for n in rank_imports.names() if n in sys.modules)

before = sorted(n for n in rank_imports.names() if n in sys.modules)
launches = [notebook_launcher(seen, num_processes=2, start_method=sys.argv[1]) for _ in range(2)]
session = None
if sys.argv[1] == "fork":
    from notebook_accel.session import Session
    with Session(2, start_method="fork", cpu=True) as s:
        s.run_cell("import sys\nfound = sorted(n for n in %r if n in sys.modules)" % (rank_imports.names(),), check=True)
        session = [s.pull("found", rank) for rank in (0, 1)]
print(json.dumps({"before": before, "launches": launches, "done": [n for n, _ in rank_imports.done],
                  "names": list(rank_imports.names()), "session": session}))
"""


def run_script(start_method: str, prewarm: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NOTEBOOK_ACCEL_PREWARM"}
    if prewarm:
        env["NOTEBOOK_ACCEL_PREWARM"] = prewarm
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, start_method], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_names_are_torchs_lazy_modules_and_the_training_modules_lent_by_the_package():
    import notebook_accel  # noqa: F401  (the composition root lends the package's names)

    names = rank_imports.names()
    assert "torch._dynamo" in names and "notebook_accel.accelerator" in names, names
    assert "notebook_accel.data_loader" in names and "notebook_accel.optimizer" in names, names
    assert len(set(names)) == len(names), names


@pytest.mark.timeout(300)
def test_fork_ranks_and_session_workers_inherit_what_the_parent_imported_once():
    out = run_script("fork")
    names = sorted(out["names"])
    assert "torch._dynamo" not in out["before"], out  # `import notebook_accel` does not pay for it
    for launch in out["launches"]:
        assert launch == [names, names], out  # every rank, every launch, the first included
    assert sorted(out["done"]) == sorted(set(names) - set(out["before"])), out  # once, in the parent
    assert len(out["done"]) == len(set(out["done"])), out
    assert out["session"] == [names, names], out  # the workers were forked after the same import


@pytest.mark.timeout(300)
def test_forkserver_ranks_find_them_preloaded_in_the_server():
    out = run_script("forkserver")
    names = sorted(out["names"])
    for launch in out["launches"]:
        assert launch == [names, names], out
    assert out["done"] == [], out  # the server imported them, not the launching process


@pytest.mark.timeout(300)
def test_prewarm_off_leaves_the_imports_to_the_ranks():
    out = run_script("fork", prewarm="0")
    assert out["done"] == [], out
    for launch in out["launches"]:
        for rank_seen in launch:
            assert "torch._dynamo" not in rank_seen, out
