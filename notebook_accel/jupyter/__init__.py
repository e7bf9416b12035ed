"""The Jupyter layer: %%accelerate magics, the hardware panel and the live launch panel.

IPython and ipywidgets are imported only under this package, and only when used.
"""

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


def load_ipython_extension(ipython) -> None:
    """`%load_ext notebook_accel`: register %accelerate and %%accelerate."""
    from .comm import register_comm_target
    from .magics import AccelerateMagics

    ipython.register_magics(AccelerateMagics)
    register_comm_target(ipython)  # the JupyterLab extension's link to this kernel


def unload_ipython_extension(ipython) -> None:
    from .magics import AccelerateMagics

    magics = ipython.magics_manager.registry.pop(AccelerateMagics.__name__, None)
    if magics is not None:
        for kind in ("line", "cell"):
            ipython.magics_manager.magics[kind].pop("accelerate", None)


def hardware_widget():
    """The hardware panel: what this machine has and what a launch here would choose."""
    from .hardware_panel import hardware_widget as build

    return build()
