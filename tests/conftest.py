import os
import sys

# Children started by the tests import helpers from here.
sys.path.insert(0, os.path.dirname(__file__))

# No test may read a developer's own launch config (~/.cache/notebook_accel): point at a missing file.
# Tests that need a config set NOTEBOOK_ACCEL_CONFIG_FILE themselves.
os.environ["NOTEBOOK_ACCEL_CONFIG_FILE"] = os.path.join(os.path.dirname(__file__), "no-such-config.yaml")

# The suite starts many kernels; each would boot a forkserver on import (about 4.5 s of a core and
# 230 MiB) that few of them use. Off here; tests/test_prewarm.py turns it back on for its own tests.
os.environ["NOTEBOOK_ACCEL_PREWARM"] = "0"

import multiprocessing.util  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import tiers  # noqa: E402
from kernels import kernel  # noqa: E402, F401  (a fixture: a real kernel over jupyter_client)
from orphans import children, long_lived_helpers  # noqa: E402


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(tiers.tier(item.module.__name__.rpartition(".")[2]))


class UnitTierStartedAProcess(AssertionError):
    pass


@pytest.fixture(autouse=True)
def _unit_tier_starts_no_process(request, monkeypatch):
    """A test of the unit tier (tests/tiers.py) that starts a process fails, naming the list to fix."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return

    def refuse(*args, **kwargs):
        raise UnitTierStartedAProcess(
            f"{request.node.nodeid} started a process: its file belongs to the process tier (tests/tiers.py)")

    for owner, name in ((os, "fork"), (os, "posix_spawn"), (os, "posix_spawnp"),
                        (subprocess.Popen, "_execute_child"), (multiprocessing.util, "spawnv_passfds")):
        monkeypatch.setattr(owner, name, refuse)
    yield

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Every test starts and ends with no resolved state and no launcher variables in the environment."""
    from notebook_accel.state import AcceleratorState, GradientState

    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def no_orphans():
    """Yields a check that every process started since the test began has gone (after reaping)."""
    before = set(children())

    def check(wait_s: float = 5.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            left = {pid: cmd for pid, cmd in children().items() if pid not in before | long_lived_helpers()}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert not left, f"processes survived the launch: {left}"

    return check
