"""The Jupyter layer: %%accelerate magics, the hardware panel and the live launch panel.

IPython and ipywidgets are imported only under this package, and only when used.
"""

from __future__ import annotations

import sys

from .kernel_env import WIDGETS_ENV, in_kernel, widgets_enabled  # noqa: F401  (this package's names)


def launch_sinks(show_after: float = 0.0):
    """The sinks a launch in this process gets by default (see launch/frontend.py): in a kernel,
    the live panel (or rank-prefixed text with NOTEBOOK_ACCEL_WIDGETS=0) plus the JupyterLab
    extension's sink while it is connected; elsewhere None, the console's default."""
    if "ipykernel" not in sys.modules:  # cheap test first: never import IPython outside a kernel
        return None
    from .comm import active_sinks

    if widgets_enabled():
        from .panel import LaunchPanel

        return [LaunchPanel(show_after=show_after), *active_sinks()]
    from ..launch.sinks import ConsoleSink

    return [ConsoleSink(), *active_sinks()]


def label_cells(text: str) -> str:
    """A traceback's notebook files named as IPython names them, `Cell In[N]`, in a kernel."""
    if "ipykernel" not in sys.modules:
        return text
    from .cell_jobs import relabel_cells

    return relabel_cells(text)


def label_cell_paths(text: str) -> str:
    """pdb's paths of notebook files (`/tmp/ipykernel_1/123.py(4)f()`) as `Cell In[N]`, in a kernel."""
    if "ipykernel" not in sys.modules:
        return text
    from .cell_jobs import relabel_cell_paths

    return relabel_cell_paths(text)


def register_frontend() -> None:
    """Lend launches this layer's sinks, cell labels and error rendering; cheap (imports neither
    torch nor IPython)."""
    from ..launch import frontend

    frontend.register(
        sinks=launch_sinks,
        traceback_labeller=label_cells,
        traceback_renderer=render_error,
        path_labeller=label_cell_paths,
    )


def render_error(error: BaseException) -> list:
    """What IPython shows for a launch error raised in a kernel (launch/errors.py): no library frames."""
    from .tracebacks import render

    return render(error)


def prewarm() -> None:
    """In a kernel, start the warm forkserver in the background (launch/prewarm.py): the first
    `forkserver` launch or session then finds it booted; and once this cell ends, import the
    launch path and what ranks import while the kernel is idle (ready.py). NOTEBOOK_ACCEL_PREWARM=0
    turns all of it off."""
    if in_kernel():
        from ..launch import prewarm as early

        if early.start() is not None:
            from IPython import get_ipython

            from .ready import schedule

            schedule(get_ipython())


def load_ipython_extension(ipython) -> None:
    """`%load_ext notebook_accel`: register %accelerate and %%accelerate."""
    from .comm import register_comm_target
    from .magics import AccelerateMagics

    register_frontend()
    prewarm()
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
