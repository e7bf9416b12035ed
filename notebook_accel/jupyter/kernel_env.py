"""Where this process runs, as the Jupyter layer asks: inside a kernel, and whether widget panels
are wanted there (NOTEBOOK_ACCEL_WIDGETS). A module of its own so that the package's modules read
it without importing the package's __init__ back."""

from __future__ import annotations

import os
import sys

WIDGETS_ENV = "NOTEBOOK_ACCEL_WIDGETS"


def in_kernel() -> bool:
    """True inside a Jupyter kernel (ipykernel's shell), where display() reaches a front end."""
    if "ipykernel" not in sys.modules or "IPython" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)


def widgets_enabled() -> bool:
    """Show widget panels: in a kernel, with ipywidgets installed, unless NOTEBOOK_ACCEL_WIDGETS=0."""
    if os.environ.get(WIDGETS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not in_kernel():
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True
