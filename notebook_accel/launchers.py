"""accelerate's `accelerate.launchers` path: the launchers of `launch/`, and `test_launch`."""

from __future__ import annotations

from .launch.launcher import debug_launcher, notebook_launcher

__all__ = ["debug_launcher", "notebook_launcher", "test_launch"]


def test_launch():
    """Resolve this process's distributed state (a launched function's smallest check); returns it."""
    from .state import PartialState

    return PartialState()


test_launch.__test__ = False  # a library function, not a test for pytest to collect
