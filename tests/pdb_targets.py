"""Functions the pdb=True launch tests run on their ranks (importable, for spawn and forkserver)."""

from __future__ import annotations

import os
import time


def nested_failure(bad_ranks=(1,), sleep_s: float = 60.0):
    rank = int(os.environ["RANK"])
    x = 41

    def inner(y):
        if rank in bad_ranks:
            raise ValueError(f"rank {rank} broke at {y}")
        time.sleep(sleep_s)  # a sibling: it must be stopped, or the test runs out of time

    inner(x + 1)
