"""matplotlib backend for session workers: Agg rendering; show() hands figures to the cell."""

from matplotlib.backends.backend_agg import FigureCanvas, FigureManager  # noqa: F401


def show(*args, **kwargs) -> None:
    from .display import capture_figures

    capture_figures()
